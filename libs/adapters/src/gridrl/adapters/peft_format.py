"""peft's LoRA layout: ``adapter_config.json`` + ``adapter_model.safetensors``.

Tensors (``PeftModel.save_pretrained``, adapter name stripped) for a module at ``<path>``:

    base_model.model.<path>.lora_A.weight          (r, in)
    base_model.model.<path>.lora_B.weight          (out, r)
    base_model.model.<path>.lora_magnitude_vector  (out,)       DoRA only

``<path>`` is a module inside the blocks or the output head ``lm_head``
(:data:`gridrl.adapters.adapter.HEAD_MODULE`, ``target_modules`` naming ``"lm_head"``).

Scale (peft ``tuners/lora/layer.py`` ``update_layer``): ``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora`` (Kalajdzievski 2023); per module, ``r`` and
``lora_alpha`` come from ``rank_pattern`` / ``alpha_pattern`` when a pattern matches
(``re.match(rf"(.*\\.)?({key})$", module_path)``, peft ``utils.other.get_pattern_key``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping

import numpy as np

from gridrl.adapters import tensors as st
from gridrl.adapters._common import (
    CONFIG,
    block_grid,
    config_keys,
    embedding_message,
    is_adaptable,
    outside_blocks_message,
    parse_config,
    refuse_unsupported,
    uniform_dora,
    uniform_rank_and_scale,
)
from gridrl.adapters.adapter import HEAD_MODULE, LoraAdapter, LoraModule
from gridrl.adapters.errors import AdapterError

WEIGHTS = "adapter_model.safetensors"
PICKLE_WEIGHTS = "adapter_model.bin"
PREFIX = "base_model.model."
# With lm_head in target_modules, save_pretrained's save_embedding_layers="auto" also saves
# the frozen base weight of the head as ``base_model.model.lm_head.base_layer.weight``
# (peft utils/save_and_load.py, get_peft_model_state_dict: the "embedding layers" lm_head and
# embed_tokens are saved whenever targeted, in case the vocabulary was resized). It is the
# base model's head, which the base model the adapter is loaded on supplies (a resized
# vocabulary shows as lora_B rows not matching it), so it is read past and not converted.
_HEAD_BASE = f"{HEAD_MODULE}.base_layer.weight"
_SUFFIXES = {
    ".lora_A.weight": "a",
    ".lora_B.weight": "b",
    ".lora_magnitude_vector": "m",
    ".lora_embedding_A": "embedding",
    ".lora_embedding_B": "embedding",
    ".lora_B.bias": "lora_bias",
}


def peft_scale(lora_alpha: float, r: int, use_rslora: bool) -> float:
    """peft's scaling: ``lora_alpha / sqrt(r)`` under rsLoRA, else ``lora_alpha / r``."""
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def alpha_for_scale(scale: float, r: int) -> int | float:
    """A ``lora_alpha`` whose peft scaling ``lora_alpha / r`` is the mlx-lm ``scale``.

    Exact in float64 when some alpha divides back exactly (an int when one does: 20.0 with
    r=16 gives 320); otherwise (about 1 in 10 random scales, since ``r * ulp(scale)`` can be
    smaller than ``ulp(r * scale)``) ``scale * r``, whose quotient is within one float64 ulp
    and identical in float32, the precision torch and mlx multiply activations by the scale.

    Raises:
        AdapterError: not even float32 agreement (never seen in practice).
    """
    alpha = scale * r
    candidates = [alpha]
    lo = hi = alpha
    for _ in range(8):
        lo, hi = math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)
        candidates += [lo, hi]
    for c in candidates:
        if c / r == scale:
            return int(c) if c.is_integer() and abs(c) < 2**53 else c
    if np.float32(alpha / r) == np.float32(scale):
        return alpha
    raise AdapterError(f"no lora_alpha gives scale {scale!r} with r={r} exactly")


def _pattern_value(patterns: Mapping[str, object], path: str, default: object) -> object:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default


def _some(names: list[str]) -> str:
    return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def read(files: Mapping[str, bytes],
         tensors: Mapping[str, st.Tensor] | None = None) -> LoraAdapter:
    """Read a peft LoRA adapter (file name -> bytes); with ``tensors``, those stand for the
    weights file (already parsed; no metadata, no layout).

    What mlx-lm cannot express is listed in ``unsupported`` rather than raised, so the
    manifest of any peft LoRA adapter can still be built.

    Raises:
        AdapterError: missing files, pickled weights, a peft_type other than LORA, or broken
            tensors (half of a pair, ranks not matching the config).
    """
    if WEIGHTS not in files and tensors is None:
        if PICKLE_WEIGHTS in files:
            raise AdapterError(f"{PICKLE_WEIGHTS}: pickled torch weights are not supported; save "
                               f"with safe_serialization=True to get {WEIGHTS}")
        raise AdapterError(f"peft adapter: {WEIGHTS} is missing")
    cfg, raw_cfg = parse_config(files, "peft")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{CONFIG}: peft_type {cfg.get('peft_type')!r} is not LORA")
    try:
        r = int(cfg.get("r", 8))
        lora_alpha = float(cfg.get("lora_alpha", 8))
    except (TypeError, ValueError) as e:
        raise AdapterError(f"{CONFIG}: r / lora_alpha must be numbers: {e}") from e
    rslora = bool(cfg.get("use_rslora", False))
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    use_dora = bool(cfg.get("use_dora", False))

    if tensors is None:
        data = files[WEIGHTS]  # parsed in place (tensors view it)
        parsed = st.load(data, WEIGHTS)
        layout = st.detect_writer(data, parsed)
    else:
        parsed, layout = st.SafetensorsFile(dict(tensors), None, list(tensors)), None
    prefix = PREFIX if any(n.startswith(PREFIX) for n in parsed.tensors) else ""
    unsupported: list[str] = []
    if cfg.get("modules_to_save"):
        unsupported.append(f"modules_to_save {cfg['modules_to_save']} (full trained copies of "
                           f"modules) cannot be expressed in an mlx-lm LoRA adapter")
    if cfg.get("lora_bias"):
        unsupported.append("lora_bias=true trains a bias on lora_B; mlx-lm LoRA has no bias")
    parts: dict[str, dict[str, st.Tensor]] = {}
    biases: list[str] = []
    strays: list[str] = []
    for name, t in parsed.tensors.items():
        bare = name[len(prefix):] if prefix and name.startswith(prefix) else name
        for suffix, kind in _SUFFIXES.items():
            if bare.endswith(suffix):
                parts.setdefault(bare[: -len(suffix)], {})[kind] = t
                break
        else:
            if bare == _HEAD_BASE:
                continue  # the base model's own head (see _HEAD_BASE): not part of the LoRA
            if bare.endswith(".bias"):
                biases.append(name)
            elif not cfg.get("modules_to_save"):
                strays.append(name)
    if biases:
        unsupported.append(f"trained biases {_some(biases)} (bias={cfg.get('bias')!r}) cannot be "
                           "expressed in an mlx-lm LoRA adapter")
    if strays:
        unsupported.append(f"tensors {_some(strays)} are not LoRA A/B/magnitude tensors")

    modules: dict[str, LoraModule] = {}
    other: list[str] = []
    for path, kinds in parts.items():
        if "embedding" in kinds:
            unsupported.append(embedding_message(path))
            other.append(path)
            continue
        if "lora_bias" in kinds and not cfg.get("lora_bias"):
            unsupported.append(f"trained bias {prefix}{path}.lora_B.bias cannot be expressed "
                               "in an mlx-lm LoRA adapter")
        if "a" not in kinds or "b" not in kinds:
            if set(kinds) <= {"lora_bias"}:
                continue
            raise AdapterError(f"{WEIGHTS}: {prefix}{path} has "
                               f"{sorted(k for k in kinds if k in 'abm')} but needs both "
                               "lora_A.weight and lora_B.weight")
        a, b = kinds["a"], kinds["b"]
        if len(a.shape) != 2 or len(b.shape) != 2:
            unsupported.append(f"LoRA on {path} has {len(a.shape)}-D lora_A (a convolution); "
                               "mlx-lm adapts linear layers only")
            other.append(path)
            continue
        if a.shape[0] != b.shape[1]:
            raise AdapterError(f"{WEIGHTS}: {path}: lora_A {list(a.shape)} and lora_B "
                               f"{list(b.shape)} disagree on the rank")
        rank = int(_pattern_value(rank_pattern, path, r))
        if a.shape[0] != rank:
            raise AdapterError(f"{WEIGHTS}: {path}: lora_A has rank {a.shape[0]} but the config "
                               f"gives r={rank}")
        alpha = float(_pattern_value(alpha_pattern, path, lora_alpha))
        m = kinds.get("m")
        if m is not None and not use_dora:
            raise AdapterError(f"{WEIGHTS}: {path} has a DoRA magnitude but use_dora is false")
        if m is not None and m.shape != (b.shape[0],):
            raise AdapterError(f"{WEIGHTS}: {path}: lora_magnitude_vector {list(m.shape)} does "
                               f"not match the output size {b.shape[0]}")
        if not is_adaptable(path):
            unsupported.append(outside_blocks_message(path))
            other.append(path)
            continue
        modules[path] = LoraModule(path, a, b, peft_scale(alpha, rank, rslora), m)

    targets = cfg.get("target_modules")
    all_layers = (not cfg.get("layers_to_transform") and not cfg.get("exclude_modules")
                  and (targets is None or isinstance(targets, list) or targets == "all-linear"))
    return LoraAdapter(
        format="peft", modules=modules, rank=r, scale=peft_scale(lora_alpha, r, rslora),
        dora=use_dora, dropout=float(cfg.get("lora_dropout", 0.0) or 0.0),
        base_model_path=str(cfg.get("base_model_name_or_path") or ""), all_layers=all_layers,
        config=cfg, config_bytes=raw_cfg, metadata=parsed.metadata,
        layout=layout, key_prefix=prefix, unsupported=unsupported,
        other_modules=other,
        extra_files={k: bytes(v) for k, v in files.items() if k not in (CONFIG, WEIGHTS)},
    )


def tensors_of(adapter: LoraAdapter, key_prefix: str = PREFIX) -> dict[str, st.Tensor]:
    """The peft tensors of ``adapter``'s modules, named with ``key_prefix``."""
    out: dict[str, st.Tensor] = {}
    for path, m in adapter.modules.items():
        out[f"{key_prefix}{path}.lora_A.weight"] = m.a
        out[f"{key_prefix}{path}.lora_B.weight"] = m.b
        if m.magnitude is not None:
            out[f"{key_prefix}{path}.lora_magnitude_vector"] = m.magnitude
    return out


def render(adapter: LoraAdapter, key_prefix: str = PREFIX) -> tuple[dict, dict[str, st.Tensor]]:
    """A fresh peft config and tensors for ``adapter`` (read from mlx).

    ``r`` = the rank; ``lora_alpha`` = :func:`alpha_for_scale` (``use_rslora`` false);
    ``target_modules`` = the keys inside a block; ``layers_to_transform`` = the adapted blocks
    unless they are all blocks from 0 (an mlx-lm adapter adapts a suffix of the blocks, so one
    that reaches block 0 covers them all).

    Raises:
        AdapterError: anything in ``unsupported``, non-uniform rank/scale/DoRA, or blocks that
            adapt different modules.
    """
    refuse_unsupported(adapter, "peft")
    rank, scale = uniform_rank_and_scale(adapter, "peft")
    dora = uniform_dora(adapter, "peft")
    layers, keys = block_grid(adapter, "peft")
    every_block = layers == list(range(len(layers)))
    if adapter.head() is not None and not every_block:
        raise AdapterError(f"cannot convert to peft: the adapter adapts blocks {layers} and "
                           f"{HEAD_MODULE}; peft's layers_to_transform would leave "
                           f"{HEAD_MODULE} (no block index) out")
    cfg = {
        "alpha_pattern": {},
        "base_model_name_or_path": adapter.base_model_path or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None if every_block else layers,
        "lora_alpha": alpha_for_scale(scale, rank),
        "lora_dropout": adapter.dropout,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "target_modules": config_keys(adapter, keys),
        "task_type": "CAUSAL_LM",
        "use_dora": dora,
        "use_rslora": False,
    }
    return cfg, tensors_of(adapter, key_prefix)


def encode_config(cfg: dict) -> bytes:
    """peft's own serialization: ``json.dumps(cfg, indent=2, sort_keys=True)``."""
    return json.dumps(cfg, indent=2, sort_keys=True).encode()
