"""A fingerprint of a checkpoint's weights: tells two fine-tunes of one architecture apart.

The base-model identity in config.json (architecture, sizes) is the same for every fine-tune
of a model; an adapter trained on one of them and served on another samples from a policy
nobody trained. :func:`weights_fingerprint` hashes, for every tensor of the safetensors files
(sorted by name): its name, its kind (floating point or the exact dtype otherwise), its shape,
and 3 x 64 of its elements (first, middle, last). A fine-tune changes essentially every element
of the tensors it touches (a full fine-tune, a merged LoRA's dense ``B @ A``), so any tensor it
touches changes the fingerprint, at the cost of reading a few pages per tensor (milliseconds
for a 135M model, a 7B model alike).

Floating-point elements are hashed as bfloat16 (float32 rounded to nearest even, as torch
does), so a float32 checkpoint and its bfloat16 copy agree; the sharding and the file layout
(offsets, ``__metadata__``) do not enter. Quantized or integer tensors are hashed as raw bytes
(a quantized copy is other weights).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

SCHEME = "wfp1"
SAMPLE = 64  # elements hashed at each of a tensor's start, middle and end

_FLOATS = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
           "F64": np.dtype("<f8")}
_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
          "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def weights_fingerprint(model_dir: Path | str) -> str:
    """``"wfp1:"`` and 32 hex digits (128 bits of sha256) over the checkpoint's tensors (module
    docstring); ``""`` when ``model_dir`` holds no ``*.safetensors`` file (unknown: callers do
    not compare it).

    Raises:
        ValueError: a safetensors file whose header cannot be parsed (the message names it).
        OSError: a file cannot be read.
    """
    tensors: dict[str, tuple[Path, str, list[int], int, int]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for name, entry in _header(path).items():
            tensors[name] = (path, *entry)
    if not tensors:
        return ""
    digest = hashlib.sha256(SCHEME.encode())
    handles: dict[Path, object] = {}
    try:
        for name in sorted(tensors):
            path, dtype, shape, start, end = tensors[name]
            f = handles.get(path) or handles.setdefault(path, path.open("rb"))
            kind = "float" if dtype in _FLOATS else dtype
            digest.update(json.dumps([name, kind, shape]).encode())
            digest.update(_sample(f, dtype, start, end))
    finally:
        for f in handles.values():
            f.close()
    return f"{SCHEME}:{digest.hexdigest()[:32]}"


def _header(path: Path) -> dict[str, tuple[str, list[int], int, int]]:
    """name -> (dtype, shape, absolute start, absolute end) of each tensor in a file."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        base = 8 + size
        return {name: (str(e["dtype"]), [int(d) for d in e["shape"]],
                       base + int(e["data_offsets"][0]), base + int(e["data_offsets"][1]))
                for name, e in header.items() if name != "__metadata__"}
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path}: not a readable safetensors header ({e})") from e


def _sample(f, dtype: str, start: int, end: int) -> bytes:
    """The elements hashed for one tensor: bfloat16 bits for floats, raw bytes otherwise."""
    item = _SIZES.get(dtype, 1)
    count = (end - start) // item
    picks = sorted({0, max(0, count // 2 - SAMPLE // 2), max(0, count - SAMPLE)})
    chunks = []
    for first in picks:
        n = min(SAMPLE, count - first)
        f.seek(start + first * item)
        chunks.append(f.read(n * item))
    raw = b"".join(chunks)
    if dtype not in _FLOATS:
        return raw
    values = np.frombuffer(raw, _FLOATS[dtype])
    if dtype == "BF16":
        return values.astype("<u2").tobytes()
    bits = values.astype("<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even, like torch
    return rounded.astype("<u2").tobytes()
