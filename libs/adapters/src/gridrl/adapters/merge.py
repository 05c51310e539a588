"""Fold a LoRA adapter into its base model: a full Hugging Face model directory.

For every adapted linear layer ``W`` (out, in) (Hu et al. 2021, eq. 3; peft
``LoraLayer.get_delta_weight``):

    W' = W + scale * (B @ A)        A: (r, in), B: (out, r)

with ``scale = lora_alpha / r`` (peft), ``lora_alpha / sqrt(r)`` under ``use_rslora`` (per
module with ``rank_pattern`` / ``alpha_pattern``), or mlx-lm's ``lora_parameters.scale``, as
:mod:`gridrl.adapters.peft_format` / :mod:`gridrl.adapters.mlx_format` read them. The adapter may
be in either layout.

Precision: the fold is computed in float32 (float64 for a float64 base weight) from the exact
values of ``W``, ``A`` and ``B`` and rounded once, to nearest even, back to the dtype ``W`` is
stored in; every other tensor is copied bit for bit, so the merged model keeps the base's
dtypes. (peft's ``merge_and_unload`` does the same with its default float32 LoRA factors; with
16-bit factors it rounds the delta to 16 bits before adding it, one rounding more.)

Everything else of the base directory (tokenizer, generation config, chat template, the
safetensors index) is copied unchanged, and ``config.json`` with the top-level keys older readers
need (:mod:`gridrl.models.portable`: ``rope_theta`` beside ``rope_parameters``...);
weights in other formats (``*.bin``, ``*.pt``, ``*.gguf``...) and safetensors files the model does not load are left out, since they would
still hold the unmerged weights. Adapters this cannot fold exactly are refused, naming the
config field: DoRA (a per-row magnitude that rescales ``W'``), LoRA variants, trained biases or
tokens, ``modules_to_save``, initialisations that changed the base weights (PiSSA, OLoRA...),
LoRA outside the transformer blocks' linear layers, quantized base weights.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gridrl.adapters import tensors as st
from gridrl.adapters.adapter import HEAD_MODULE, Format, LoraAdapter, LoraModule
from gridrl.adapters.base_model import identity_from_config
from gridrl.adapters.convert import read_adapter
from gridrl.adapters.errors import AdapterError
from gridrl.adapters.io import read_dir, write_dir
from gridrl.adapters.manifest import check_fits
from gridrl.models import portable_config_text

SINGLE_FILE = "model.safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
# Weights in formats other than safetensors: never copied (they would be the unmerged base).
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx",
                         ".npz", ".bin.index.json")
# peft LoRA variants: config field -> what it does that a weight fold cannot reproduce.
_PEFT_VARIANTS = {
    "alora_invocation_tokens": "activated LoRA applies the adapter only after the invocation "
                               "tokens",
    "use_qalora": "QA-LoRA pools the input in groups before A",
    "use_bdlora": "BD-LoRA stores block-diagonal factors",
    "kasa_config": "KaSA truncates singular components of the base weights and scales by a "
                   "learned diagonal",
    "monteclora_config": "MonteCLoRA samples its factors",
    "arrow_config": "Arrow routes between several adapters per token",
    "layer_replication": "layer replication changes the model's stack of blocks",
    "target_parameters": "LoRA on nn.Parameters (MoE experts) is not a linear layer's weight",
    "trainable_token_indices": "trained embedding rows are not a LoRA product",
    "modules_to_save": "modules_to_save are full trained copies of modules",
    "lora_bias": "a bias on lora_B",
    "fan_in_fan_out": "fan_in_fan_out layers (GPT-2 Conv1D) store W transposed",
}
# Initialisations that subtract their initial product from the base weights, so the adapter is
# relative to a modified base (peft ``LoraLayer.pissa_init`` / ``olora_init`` / ...).
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclass
class MergeResult:
    """What :func:`merge_dir` wrote.

    Attributes:
        out: the merged model directory.
        adapter_format: "peft" or "mlx".
        modules: adapted module paths folded in, in file order.
        weight_files: the safetensors files written (the base's shards, same names).
        dtypes: dtypes of the folded weights, those the base stores them in ("bfloat16"...).
        compute_dtype: "float32", or "float64" when some base weight is F64.
        skipped: base files left out (weights in other formats, unused safetensors).
    """

    out: Path
    adapter_format: Format
    modules: list[str]
    weight_files: list[str]
    dtypes: list[str]
    compute_dtype: str
    skipped: list[str] = field(default_factory=list)


def check_mergeable(adapter: LoraAdapter) -> None:
    """Refuse an adapter whose effect is not ``W + scale * B @ A`` on linear weights.

    Raises:
        AdapterError: ``"cannot merge this peft adapter: use_dora=true ..."`` naming the config
            field (peft) or key (mlx-lm) and why.
    """
    cfg = adapter.config
    reasons: list[str] = []
    if adapter.dora or any(m.magnitude is not None for m in adapter.modules.values()):
        field_ = "use_dora=true" if adapter.format == "peft" else "fine_tune_type='dora'"
        reasons.append(f"{field_}: DoRA rescales every row of W + scale * B @ A by a learned "
                       "magnitude over its norm, which is not a LoRA fold (merge it with peft's "
                       "merge_and_unload instead)")
    if adapter.format == "peft":
        for key, why in _PEFT_VARIANTS.items():
            if cfg.get(key):
                reasons.append(f"{key}={json.dumps(cfg[key])}: {why}")
        if cfg.get("bias", "none") != "none":
            reasons.append(f"bias={cfg['bias']!r}: the adapter trains biases of the base model")
        init = cfg.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
            reasons.append(f"init_lora_weights={init!r}: this initialisation subtracted its "
                           "initial product from the base weights, so the adapter is relative "
                           "to a modified base (convert it with peft's "
                           "path_initial_model_for_weight_conversion first)")
    # the output head (train_unembed) stays out too: a head tied to the embeddings would
    # change them as well
    outside = [HEAD_MODULE] * (adapter.head() is not None) + adapter.other_modules
    if outside:
        reasons.append(f"LoRA on {outside[0]}"
                       + (f" and {len(outside) - 1} more" if len(outside) > 1 else "")
                       + ": only linear layers inside the transformer blocks are folded")
    if not reasons and adapter.unsupported:
        reasons += adapter.unsupported  # e.g. tensors that are not LoRA factors
    if not reasons and not adapter.modules:
        reasons.append("the adapter holds no LoRA modules")
    if reasons:
        raise AdapterError(f"cannot merge this {adapter.format} adapter: " + "; ".join(reasons))


def weight_files(base: Path) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files a Hugging Face model directory loads, and its index's weight map
    (tensor name -> file) when it is sharded (None for a single ``model.safetensors``).

    Raises:
        AdapterError: no safetensors weights, several indexes, or an unreadable index.
    """
    indexes = sorted(p.name for p in base.glob(f"*{INDEX_SUFFIX}"))
    if len(indexes) > 1:
        raise AdapterError(f"{base}: several safetensors indexes {indexes}; expected one")
    if indexes:
        try:
            weight_map = json.loads((base / indexes[0]).read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise AdapterError(f"{base / indexes[0]}: not a safetensors index: {e}") from e
        missing = [s for s in shards if not (base / s).is_file()]
        if missing:
            raise AdapterError(f"{base}: shards {missing} named by {indexes[0]} are missing")
        return shards, dict(weight_map)
    if (base / SINGLE_FILE).is_file():
        return [SINGLE_FILE], None
    found = sorted(p.name for p in base.iterdir() if p.is_file())
    raise AdapterError(f"{base}: no {SINGLE_FILE} or *{INDEX_SUFFIX}: the base model's weights "
                       f"must be safetensors (found {found})")


def _read_base_config(base: Path) -> dict:
    try:
        cfg = json.loads((base / "config.json").read_text())
    except OSError as e:
        raise AdapterError(f"{base}: not a Hugging Face model directory (config.json: "
                           f"{e.strerror})") from e
    except ValueError as e:
        raise AdapterError(f"{base / 'config.json'}: not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{base / 'config.json'}: must be a JSON object")
    quant = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get(
        "quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise AdapterError(f"{base / 'config.json'}: quantization_config ({method}): quantized "
                           "base weights cannot hold W + scale * B @ A exactly; merge into the "
                           "unquantized model")
    return cfg


def _open(path: Path) -> tuple[mmap.mmap, st.SafetensorsFile]:
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            raise AdapterError(f"{path}: empty file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return mm, st.load(mm, str(path))  # type: ignore[arg-type]


def _fold(w: st.Tensor, m: LoraModule) -> bytes:
    """``W + scale * (B @ A)`` in float32 (float64 for an F64 ``W``), back in ``W``'s dtype."""
    compute = np.float64 if w.dtype == "F64" else np.float32
    a, b = st.to_float(m.a, compute), st.to_float(m.b, compute)
    merged = st.to_float(w, compute)
    merged += (b @ a) * compute(m.scale)
    code = "F64" if compute is np.float64 else "F32"
    return st.cast(st.Tensor(code, w.shape, merged.tobytes()), w.dtype).data


def _shard_chunks(parsed: st.SafetensorsFile,
                  folds: Mapping[str, LoraModule]) -> Iterator[bytes | memoryview]:
    """The bytes of a safetensors file holding ``parsed``'s tensors, with the tensors named in
    ``folds`` replaced by their fold (computed one at a time, as they are written). Data order
    and ``__metadata__`` are kept; dtypes and shapes are unchanged, so are all sizes."""
    yield st.header(parsed.tensors, parsed.metadata, "safetensors", order=parsed.data_order)
    for name in parsed.data_order:
        t = parsed.tensors[name]
        yield _fold(t, folds[name]) if name in folds else t.data


def _is_other_weights(rel: str) -> bool:
    return rel.endswith(OTHER_WEIGHT_SUFFIXES)


def merge_dir(base: Path | str, adapter: Path | str, out: Path | str) -> MergeResult:
    """Write ``out``: the Hugging Face model directory ``base`` with the LoRA adapter in
    ``adapter`` (peft or mlx-lm layout) folded into its weights (see the module docstring).

    Every check runs before anything is written, and ``out`` is written atomically (a temporary
    sibling directory renamed into place, replacing an existing ``out``), so a refused or failed
    merge leaves nothing behind. The base's shards are read through mmap and written one
    tensor at a time: memory use is about one weight matrix, not the model.

    Args:
        base: local model directory (config.json + safetensors weights, single or sharded).
        adapter: adapter directory (``adapter_config.json`` + ``adapter_model.safetensors`` or
            ``adapters.safetensors``).
        out: directory to write; must differ from ``base`` and ``adapter``.
    Returns:
        a :class:`MergeResult`.
    Raises:
        AdapterError: ``out`` is ``base`` or ``adapter`` or inside ``base``; not a model
            directory or not safetensors; an adapter this cannot fold (see :func:`check_mergeable`), made for
            another model (:func:`gridrl.adapters.check_fits`), or naming a weight the base
            lacks or has in another shape or a non-float dtype.
        OSError: reading or writing failed.
    """
    base, adapter_dir, out = Path(base), Path(adapter), Path(out)
    for other, what in ((base, "the base model"), (adapter_dir, "the adapter")):
        if out.resolve() == other.resolve():
            raise AdapterError(f"{out}: the output directory is {what}'s directory")
    if out.resolve().is_relative_to(base.resolve()):
        raise AdapterError(f"{out}: the output directory is inside the base model's directory "
                           f"{base}")
    if not base.is_dir():
        raise AdapterError(f"{base}: not a directory")
    cfg = _read_base_config(base)
    files = read_dir(adapter_dir)
    lora = read_adapter(files)
    check_mergeable(lora)
    check_fits(files, identity_from_config(cfg))
    shards, weight_map = weight_files(base)

    opened = {name: _open(base / name) for name in shards}
    folds: dict[str, dict[str, LoraModule]] = {name: {} for name in shards}
    for path, module in lora.modules.items():
        tensor_name = f"{path}.weight"
        shard = weight_map.get(tensor_name) if weight_map is not None else shards[0]
        w = opened[shard][1].tensors.get(tensor_name) if shard in opened else None
        if w is None:
            raise AdapterError(f"the adapter adapts {path}, but the base model has no tensor "
                               f"{tensor_name}" + (f" (looked in {shard})" if shard else ""))
        want = (module.out_features, module.in_features)
        if w.shape != want:
            raise AdapterError(f"{tensor_name}: base weight {list(w.shape)}, but the adapter's "
                               f"B @ A is {list(want)} (out, in)")
        if w.dtype not in ("F64", "F32", "F16", "BF16"):
            raise AdapterError(f"{tensor_name}: base weight dtype {w.dtype} is not a float: "
                               "quantized weights cannot be folded exactly")
        folds[shard][tensor_name] = module

    out_files: dict[str, bytes | Iterator[bytes | memoryview]] = {}
    skipped: list[str] = []
    for p in sorted(base.rglob("*")):
        rel = p.relative_to(base).as_posix()
        if not p.is_file() or any(part.startswith(".") for part in p.relative_to(base).parts):
            continue
        if rel in opened:
            out_files[rel] = _shard_chunks(opened[rel][1], folds[rel])
        elif _is_other_weights(rel) or rel.endswith(".safetensors"):
            skipped.append(rel)
        elif rel == "config.json":  # with the top-level keys mlx-lm and llama.cpp read
            out_files[rel] = portable_config_text(cfg).encode()
        else:
            out_files[rel] = p.read_bytes()
    write_dir(out_files, out)
    folded = [w for shard in folds.values() for w in shard]
    names = {code: name for name, code in st.FLOAT_CODES.items()}
    dtypes = sorted({names[opened[s][1].tensors[w].dtype] for s in shards for w in folds[s]})
    # The shards stay mapped while tensor views into them live; an mmap object unmaps itself
    # when it is collected.
    return MergeResult(out=out, adapter_format=lora.format,
                       modules=[n.removesuffix(".weight") for n in folded],
                       weight_files=shards, dtypes=dtypes,
                       compute_dtype="float64" if "float64" in dtypes else "float32",
                       skipped=skipped)
