"""peft <-> mlx-lm conversion of whole adapters, in memory and between directories.

Exactness: tensors are transposed bit for bit (dtype kept unless ``dtype`` is given), the
scale is carried exactly (peft ``lora_alpha / r`` == mlx ``scale`` in float64, see
:func:`gridrl.adapters.peft_format.alpha_for_scale`), and nothing is dropped: whatever the
target cannot express is refused with an :class:`AdapterError`.

Round trips are bitwise: the converted weights file records, in its safetensors metadata under
``"gridrl.source"``, the source's config bytes, weights metadata and writer layout. Converting
back restores them when the config still says the same thing (the restored source config,
converted forward again, equals the config being converted); otherwise a fresh config is
written. The key lives in the weights' metadata, not in the config, because peft warns about
unknown config keys while both loaders ignore safetensors metadata.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from gridrl.adapters import mlx_format, peft_format
from gridrl.adapters import tensors as st
from gridrl.adapters._common import CONFIG, refuse_unsupported
from gridrl.adapters.adapter import FORMATS, Format, LoraAdapter
from gridrl.adapters.base_model import local_identity
from gridrl.adapters.errors import AdapterError
from gridrl.adapters.io import read_dir, write_dir

PROVENANCE_KEY = "gridrl.source"
WEIGHTS = {"peft": peft_format.WEIGHTS, "mlx": mlx_format.WEIGHTS}
_FILE_FORMAT = {"peft": "pt", "mlx": "mlx"}  # the "format" metadata each library writes


def detect_format(names: Iterable[str]) -> Format:
    """The format of an adapter from its file names (a directory listing or the keys of an
    in-memory mapping): "peft" with ``adapter_model.safetensors``, "mlx" with
    ``adapters.safetensors``.

    Raises:
        AdapterError: neither or both weight files are present (the message lists the names).
    """
    names = set(names)
    found = [fmt for fmt, weights in WEIGHTS.items() if weights in names]
    if len(found) == 1:
        return found[0]  # type: ignore[return-value]
    if found:
        raise AdapterError(f"ambiguous adapter: both {WEIGHTS['peft']} and {WEIGHTS['mlx']} "
                           "are present")
    hint = (f"; {peft_format.PICKLE_WEIGHTS} (pickled) is not supported, save safetensors"
            if peft_format.PICKLE_WEIGHTS in names else "")
    raise AdapterError(f"not a peft or mlx-lm adapter: expected {WEIGHTS['peft']} or "
                       f"{WEIGHTS['mlx']} next to {CONFIG}, found {sorted(names)}{hint}")


def read_adapter(files: Mapping[str, bytes]) -> LoraAdapter:
    """Parse an adapter of either format (file name -> bytes).

    Raises:
        AdapterError: see :func:`detect_format`, :func:`peft_format.read`, :func:`mlx_format.read`.
    """
    fmt = detect_format(files)
    return peft_format.read(files) if fmt == "peft" else mlx_format.read(files)


def _render(adapter: LoraAdapter, to: str,
            num_layers: int | None) -> tuple[dict, dict[str, st.Tensor]]:
    if to == "peft":
        return peft_format.render(adapter)
    return mlx_format.render(adapter, num_layers)


def _encode_config(cfg: dict, fmt: str) -> bytes:
    return (peft_format if fmt == "peft" else mlx_format).encode_config(cfg)


def _block_count_of_mlx(adapter: LoraAdapter) -> int | None:
    """An mlx-lm adapter adapts the last N blocks, so its last block is the model's last."""
    layers = adapter.layers()
    if adapter.format == "mlx" and layers and (adapter.mlx_num_layers or 0) > 0:
        return layers[-1] + 1
    return None


def _restore(adapter: LoraAdapter, to: str, num_layers: int | None) -> dict[str, bytes] | None:
    """The exact source files recorded under ``gridrl.source``, if they still apply: the
    recorded config with the current tensors, converted forward again, must give the config
    being converted."""
    raw = (adapter.metadata or {}).get(PROVENANCE_KEY)
    if raw is None:
        return None
    try:
        source = json.loads(raw)
        if source.get("format") != to:
            return None
        config_bytes = str(source["config"]).encode()
        if to == "peft":
            tensors = peft_format.tensors_of(adapter, str(source.get("key_prefix",
                                                                     peft_format.PREFIX)))
        else:
            tensors = mlx_format.tensors_of(adapter)
        module = peft_format if to == "peft" else mlx_format
        candidate = module.read({CONFIG: config_bytes}, tensors=tensors)
        again, _ = _render(candidate, adapter.format,
                           num_layers if num_layers is not None else _block_count_of_mlx(adapter))
    except (AdapterError, ValueError, TypeError, KeyError):
        return None
    if again != adapter.config:
        return None
    weights = st.dump_like(tensors, source.get("metadata"), source.get("layout"))
    return {**adapter.extra_files, CONFIG: config_bytes, WEIGHTS[to]: weights}


def _cast_file(data: bytes, name: str, dtype: str) -> bytes:
    parsed = st.load(data, name)
    cast = {k: st.cast(t, dtype) if t.dtype in ("F64", "F32", "F16", "BF16") else t
            for k, t in parsed.tensors.items()}
    return st.dump_like(cast, parsed.metadata, st.detect_writer(data, parsed))


def _dtype_code(dtype: str | None) -> str | None:
    if dtype is None:
        return None
    if dtype not in st.DTYPE_CODES:
        raise AdapterError(f"dtype {dtype!r} is not one of {sorted(st.DTYPE_CODES)}")
    return st.DTYPE_CODES[dtype]


def convert_files(files: Mapping[str, bytes], to: Format, num_layers: int | None = None, *,
                  dtype: str | None = None) -> dict[str, bytes]:
    """Convert a whole adapter in memory (file name -> bytes) to ``to`` ("peft" or "mlx").

    peft -> mlx: ``lora_a = lora_A.T`` (in, r), ``lora_b = lora_B.T`` (r, out),
    ``lora_magnitude_vector -> m``; ``scale = lora_alpha / r`` (``/ sqrt(r)`` with use_rslora);
    ``keys`` = target module paths inside a block; ``num_layers`` = how many of the last
    blocks are adapted. mlx -> peft: the inverse, with ``lora_alpha = scale * r`` (exact) and
    ``layers_to_transform`` = the adapted blocks. Other files (README.md...) are carried over
    unchanged. Converting to the format it already is returns the files unchanged (with
    ``dtype``: only the tensors are cast).

    Args:
        files: the adapter's files, e.g. {"adapter_config.json": ..., "adapter_model.safetensors": ...}.
        to: target format.
        num_layers: the BASE model's number of transformer blocks; needed for peft -> mlx when
            the config does not itself say that every block is adapted.
        dtype: "float32", "float16" or "bfloat16" to cast the tensors (round to nearest even);
            None keeps each tensor's dtype.

    Raises:
        AdapterError: unknown format, a broken adapter, ``num_layers`` needed and missing, or
            something the target cannot express (DoRA on only some modules, non-uniform
            rank_pattern / alpha_pattern, modules_to_save, trained biases, embedding LoRA,
            blocks that are not the last N for mlx).
    """
    if to not in FORMATS:
        raise AdapterError(f"unknown target format {to!r}; expected one of {FORMATS}")
    code = _dtype_code(dtype)
    fmt = detect_format(files)
    if fmt == to:
        out = dict(files)
        if code is not None:
            out[WEIGHTS[fmt]] = _cast_file(bytes(files[WEIGHTS[fmt]]), WEIGHTS[fmt], code)
        return out
    adapter = read_adapter(files)
    if code is not None:
        for m in adapter.modules.values():
            m.a, m.b = st.cast(m.a, code), st.cast(m.b, code)
            if m.magnitude is not None:
                m.magnitude = st.cast(m.magnitude, code)
    refuse_unsupported(adapter, to)
    restored = _restore(adapter, to, num_layers)
    if restored is not None:
        return restored
    cfg, tensors = _render(adapter, to, num_layers)
    source = {"format": fmt, "config": adapter.config_bytes.decode("utf-8"),
              "metadata": adapter.metadata, "layout": adapter.layout}
    if fmt == "peft":
        source["key_prefix"] = adapter.key_prefix
    metadata = {"format": _FILE_FORMAT[to],
                PROVENANCE_KEY: json.dumps(source, sort_keys=True, separators=(",", ":"))}
    return {**adapter.extra_files, CONFIG: _encode_config(cfg, to),
            WEIGHTS[to]: st.dump(tensors, metadata)}


def convert_dir(src: Path | str, dst: Path | str, to: Format | None = None,
                num_layers: int | None = None, *, dtype: str | None = None,
                only_adapter: bool = False) -> Path:
    """Convert the adapter directory ``src`` into ``dst`` (see :func:`convert_files`).

    ``only_adapter`` leaves behind every file of ``src`` but the adapter's config and weights
    (e.g. the optimizer and trainer state of a gridrl checkpoint directory).

    ``to`` None means the other format. Without ``num_layers``, a local base model directory
    named by the adapter config (peft ``base_model_name_or_path``, mlx ``model``) is asked
    for its ``num_hidden_layers`` when it has a config.json. ``dst`` is written atomically
    (a temporary sibling directory renamed into place; an existing ``dst`` is replaced).
    Returns ``dst``.

    Raises:
        AdapterError: as :func:`convert_files`; ``src`` and ``dst`` are the same directory.
        OSError: reading or writing failed.
    """
    src, dst = Path(src), Path(dst)
    if dst.exists() and src.resolve() == dst.resolve():
        raise AdapterError(f"{dst}: source and destination are the same directory")
    files = read_dir(src)
    fmt = detect_format(files)
    if only_adapter:
        files = {k: v for k, v in files.items() if k in (CONFIG, WEIGHTS[fmt])}
    target: str = to or ("mlx" if fmt == "peft" else "peft")
    if num_layers is None and fmt == "peft" and target == "mlx":
        base = local_identity(read_adapter(files).base_model_path)
        if base is not None and base.num_layers:
            num_layers = base.num_layers
    write_dir(convert_files(files, target, num_layers, dtype=dtype), dst)  # type: ignore[arg-type]
    return dst
