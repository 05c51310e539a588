"""mlx-lm's LoRA layout: ``adapter_config.json`` + ``adapters.safetensors``.

Tensors (``mlx_lm/tuner/lora.py`` ``LoRALinear``, ``tuner/dora.py`` ``DoRALinear``) for a
module at ``<path>`` (mlx-lm module paths mirror the Hugging Face ones for llama-like models):

    <path>.lora_a   (in, r)
    <path>.lora_b   (r, out)
    <path>.m        (out,)        DoRA only (fine_tune_type "dora")

Forward: ``y = linear(x) + scale * ((x @ lora_a) @ lora_b)``, so ``lora_a = A.T``,
``lora_b = B.T`` and ``scale`` is peft's ``lora_alpha / r`` (or ``/ sqrt(r)``) itself.

Config read by ``mlx_lm.tuner.utils.load_adapters`` / ``linear_to_lora_layers``:
``fine_tune_type`` ("lora" | "dora" | "full"), ``num_layers`` (LoRA goes into
``model.layers[-max(num_layers, 0):]``: the last N blocks, all of them when <= 0) and
``lora_parameters`` = {``rank``, ``scale``, ``dropout``, ``keys``}: ``keys`` are module paths
inside a block (``self_attn.q_proj``; None: every linear in the block), also matched against
the model's top-level module paths: the output head is ``lm_head`` (key ``"lm_head"``,
tensors ``lm_head.lora_a`` / ``lm_head.lora_b``; :data:`gridrl.adapters.adapter.HEAD_MODULE`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from gridrl.adapters import tensors as st
from gridrl.adapters._common import (
    CONFIG,
    block_grid,
    config_keys,
    outside_blocks_message,
    parse_config,
    refuse_unsupported,
    uniform_dora,
    uniform_rank_and_scale,
)
from gridrl.adapters.adapter import HEAD_MODULE, LoraAdapter, LoraModule, split_module_path
from gridrl.adapters.errors import AdapterError

WEIGHTS = "adapters.safetensors"
_SUFFIXES = {".lora_a": "a", ".lora_b": "b", ".m": "m"}


def read(files: Mapping[str, bytes],
         tensors: Mapping[str, st.Tensor] | None = None) -> LoraAdapter:
    """Read an mlx-lm LoRA/DoRA adapter (file name -> bytes); with ``tensors``, those stand for
    the weights file (already parsed; no metadata, no layout).

    Tensors are transposed to peft's orientation (A (r, in), B (out, r)) bit for bit.

    Raises:
        AdapterError: missing files or config fields mlx-lm requires (``num_layers``,
            ``lora_parameters.rank`` / ``scale``), ``fine_tune_type`` "full" (not an adapter),
            or tensors mlx-lm itself would refuse (half a pair, rank not matching, a
            magnitude without DoRA, a key outside ``lora_parameters.keys``).
    """
    if WEIGHTS not in files and tensors is None:
        raise AdapterError(f"mlx adapter: {WEIGHTS} is missing")
    cfg, raw_cfg = parse_config(files, "mlx")
    fine_tune_type = cfg.get("fine_tune_type", "lora")
    if fine_tune_type not in ("lora", "dora"):
        raise AdapterError(f"{CONFIG}: fine_tune_type {fine_tune_type!r} is not a LoRA adapter "
                           "('lora' or 'dora'); full fine-tuned weights cannot be converted")
    if "num_layers" not in cfg:
        raise AdapterError(f"{CONFIG}: num_layers is missing (mlx-lm requires it)")
    lp = cfg.get("lora_parameters")
    if not isinstance(lp, dict):
        raise AdapterError(f"{CONFIG}: lora_parameters is missing or not an object")
    for key in ("rank", "scale"):
        if key not in lp:
            hint = " (mlx-lm uses 'scale', not 'alpha')" if key == "scale" and "alpha" in lp else ""
            raise AdapterError(f"{CONFIG}: lora_parameters.{key} is missing{hint}")
    try:
        rank, scale = int(lp["rank"]), float(lp["scale"])
        num_layers = int(cfg["num_layers"])
    except (TypeError, ValueError) as e:
        raise AdapterError(f"{CONFIG}: num_layers / rank / scale must be numbers: {e}") from e
    keys = lp.get("keys")
    dora = fine_tune_type == "dora"

    if tensors is None:
        data = files[WEIGHTS]  # parsed in place (tensors view it)
        parsed = st.load(data, WEIGHTS)
        layout = st.detect_writer(data, parsed)
    else:
        parsed, layout = st.SafetensorsFile(dict(tensors), None, list(tensors)), None
    unsupported: list[str] = []
    parts: dict[str, dict[str, st.Tensor]] = {}
    for name, t in parsed.tensors.items():
        for suffix, kind in _SUFFIXES.items():
            if name.endswith(suffix):
                parts.setdefault(name[: -len(suffix)], {})[kind] = t
                break
        else:
            unsupported.append(f"tensor {name} is not a LoRA tensor (lora_a, lora_b, m)")
    modules: dict[str, LoraModule] = {}
    other: list[str] = []
    for path, kinds in parts.items():
        if "a" not in kinds or "b" not in kinds:
            raise AdapterError(f"{WEIGHTS}: {path} has {sorted(kinds)} but needs lora_a and "
                               "lora_b")
        a, b, m = kinds["a"], kinds["b"], kinds.get("m")
        if len(a.shape) != 2 or len(b.shape) != 2:
            unsupported.append(f"LoRA on {path} has {len(a.shape)}-D lora_a (a mixture-of-"
                               "experts SwitchLinear); peft has no equivalent layer")
            other.append(path)
            continue
        if a.shape[1] != rank or b.shape[0] != rank:
            raise AdapterError(f"{WEIGHTS}: {path}: lora_a {list(a.shape)} / lora_b "
                               f"{list(b.shape)} do not have rank {rank} from the config")
        if m is not None and not dora:
            raise AdapterError(f"{WEIGHTS}: {path}.m is a DoRA magnitude but fine_tune_type is "
                               f"{fine_tune_type!r}")
        if m is not None and m.shape != (b.shape[1],):
            raise AdapterError(f"{WEIGHTS}: {path}.m {list(m.shape)} does not match the output "
                               f"size {b.shape[1]}")
        split = split_module_path(path)
        if keys is not None and (path if split is None else split[2]) not in keys:
            raise AdapterError(f"{WEIGHTS}: {path} is not addressed by lora_parameters.keys "
                               f"{keys}; mlx-lm would refuse to load it")
        if split is None and path != HEAD_MODULE:
            unsupported.append(outside_blocks_message(path))
            other.append(path)
            continue
        modules[path] = LoraModule(path, st.transpose(a), st.transpose(b), scale, m)
    return LoraAdapter(
        format="mlx", modules=modules, rank=rank, scale=scale, dora=dora,
        dropout=float(lp.get("dropout", 0.0) or 0.0), base_model_path=str(cfg.get("model") or ""),
        all_layers=num_layers <= 0, config=cfg, config_bytes=raw_cfg, metadata=parsed.metadata,
        layout=layout, mlx_num_layers=num_layers, unsupported=unsupported,
        other_modules=other,
        extra_files={k: bytes(v) for k, v in files.items() if k not in (CONFIG, WEIGHTS)},
    )


def tensors_of(adapter: LoraAdapter) -> dict[str, st.Tensor]:
    """The mlx-lm tensors of ``adapter``'s modules: ``lora_a = A.T``, ``lora_b = B.T``, ``m``."""
    out: dict[str, st.Tensor] = {}
    for path, m in adapter.modules.items():
        out[f"{path}.lora_a"] = st.transpose(m.a)
        out[f"{path}.lora_b"] = st.transpose(m.b)
        if m.magnitude is not None:
            out[f"{path}.m"] = m.magnitude
    return out


def mlx_num_layers(adapter: LoraAdapter, layers: list[int], num_layers: int | None) -> int:
    """mlx-lm's ``num_layers`` (adapt the last N blocks) for an adapter adapting ``layers``.

    ``num_layers`` is the base model's block count. It is not needed when the source config
    says every block is adapted (then the adapter's blocks are 0..N-1 of N).

    Raises:
        AdapterError: the block count is needed and missing, a block index is out of range,
            or the blocks are not the last N of the model (mlx-lm cannot express that).
    """
    n = len(layers)
    if adapter.all_layers and layers == list(range(n)):
        if num_layers is not None and num_layers != n:
            raise AdapterError(f"num_layers={num_layers} does not match the adapter, which "
                               f"adapts every block: 0..{n - 1} ({n} blocks)")
        return n
    if num_layers is None:
        raise AdapterError(
            f"cannot convert to mlx: the adapter adapts blocks {layers} (layers_to_transform="
            f"{adapter.config.get('layers_to_transform')}); mlx-lm's num_layers counts blocks "
            "from the end, so the base model's number of blocks is needed (num_layers / "
            "--num-layers)")
    if layers[-1] >= num_layers:
        raise AdapterError(f"block {layers[-1]} is out of range for a base model of "
                           f"num_layers={num_layers} blocks")
    if layers != list(range(num_layers - n, num_layers)):
        raise AdapterError(
            f"cannot convert to mlx: the adapter adapts blocks {layers} of {num_layers}, which "
            f"are not the last {n}; mlx-lm's num_layers adapts only the last N blocks")
    return n


def render(adapter: LoraAdapter, num_layers: int | None) -> tuple[dict, dict[str, st.Tensor]]:
    """A fresh mlx-lm config and tensors for ``adapter`` (read from peft).

    ``lora_parameters`` = {rank: r, scale: the effective peft scale, dropout, keys: the module
    paths inside a block, sorted}; ``fine_tune_type`` "dora" when every module has a magnitude;
    ``num_layers`` from :func:`mlx_num_layers`; ``model`` = peft ``base_model_name_or_path``.

    Raises:
        AdapterError: anything in ``unsupported``; non-uniform rank (rank_pattern), scale
            (alpha_pattern) or DoRA; blocks adapting different modules; blocks that are not
            the last N.
    """
    refuse_unsupported(adapter, "mlx")
    rank, scale = uniform_rank_and_scale(adapter, "mlx")
    dora = uniform_dora(adapter, "mlx")
    layers, keys = block_grid(adapter, "mlx")
    cfg: dict = {
        "fine_tune_type": "dora" if dora else "lora",
        "lora_parameters": {"dropout": adapter.dropout, "keys": config_keys(adapter, keys),
                            "rank": rank,
                            "scale": scale},
        "num_layers": mlx_num_layers(adapter, layers, num_layers),
    }
    if adapter.base_model_path:
        cfg["model"] = adapter.base_model_path
    return cfg, tensors_of(adapter)


def encode_config(cfg: dict) -> bytes:
    """Serialized like mlx-lm's ``save_config``: 4-space indent (keys sorted here throughout)."""
    return json.dumps(cfg, indent=4, sort_keys=True).encode()
