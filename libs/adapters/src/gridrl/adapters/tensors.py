"""A byte-exact safetensors codec on raw bytes (no torch, no mlx; bf16 included).

The format (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length
``n``, ``n`` bytes of JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}``, then the data buffer; tensors are little-endian, row-major.

Two writers exist in practice and are reproduced exactly, so a converted adapter can be turned
back into the very bytes it came from:

- ``"safetensors"``: the Rust library (``safetensors.torch.save_file``, hence peft): entries in
  data order, sorted by dtype (descending, in the library's ``Dtype`` enum order) then name;
  fields ``dtype, shape, data_offsets``; compact JSON; header padded with spaces to a multiple
  of 8 bytes; ``__metadata__`` first and only when given.
- ``"mlx"``: ``mx.save_safetensors`` (hence mlx-lm): keys sorted, fields sorted, compact JSON,
  no padding, ``"__metadata__": null`` when there is none, data in hash-map order (recorded
  as a permutation).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gridrl.adapters.errors import AdapterError

# Bytes per element of the dtypes this codec handles.
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "C64": 8,
    "I64": 8, "U64": 8, "F64": 8,
}
# Declaration order of the Rust ``safetensors::Dtype`` enum (checked against the library in
# tests for every dtype torch can build); the Rust writer sorts by it, descending.
_RUST_DTYPE_ORDER = [
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
]
_RUST_RANK = {d: i for i, d in enumerate(_RUST_DTYPE_ORDER)}
WRITERS = ("safetensors", "mlx")
# Floating dtype names (torch's and numpy's spelling) -> safetensors dtype codes: every
# floating dtype this codec decodes (:func:`to_float64`) and writes from a framework tensor.
FLOAT_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
# User-facing dtype names -> safetensors dtype codes, for casts.
DTYPE_CODES = {k: v for k, v in FLOAT_CODES.items() if k != "float64"}


@dataclass(frozen=True)
class Tensor:
    """One tensor as stored: safetensors ``dtype`` code (e.g. "F32", "BF16"), ``shape`` and
    the raw little-endian row-major bytes (``len(data) == prod(shape) * itemsize``): ``bytes``,
    or a flat unsigned-byte ``memoryview`` (a view of a file :func:`load` parsed, or of a
    tensor's memory) that stays valid while the tensor is used."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]


@dataclass
class SafetensorsFile:
    """A parsed file: ``tensors`` in header order, ``metadata`` (None when absent or null)
    and ``data_order`` (names in the order of their bytes in the data buffer)."""

    tensors: dict[str, Tensor]
    metadata: dict[str, str] | None
    data_order: list[str]


def load(data: bytes, what: str = "safetensors file") -> SafetensorsFile:
    """Parse safetensors ``data``; ``what`` names the file in errors. The tensors' ``data``
    are views into ``data`` (no copy), so parsing a 20 MB adapter costs its header only.

    Raises:
        AdapterError: truncated file, bad header JSON, unknown dtype, offsets outside the data
            or not matching the shape.
    """
    if len(data) < 8:
        raise AdapterError(f"{what}: {len(data)} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise AdapterError(f"{what}: header length {n} exceeds the file size {len(data)}")
    try:
        header = json.loads(bytes(data[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{what}: header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise AdapterError(f"{what}: header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise AdapterError(f"{what}: __metadata__ must map strings to strings")
    buf = memoryview(data).cast("B")[8 + n:]
    tensors: dict[str, Tensor] = {}
    spans: list[tuple[int, str]] = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise AdapterError(f"{what}: tensor {name!r}: malformed header entry {info!r}") from e
        if dtype not in ITEMSIZE:
            raise AdapterError(f"{what}: tensor {name!r}: unsupported dtype {dtype!r}")
        size = math.prod(shape) * ITEMSIZE[dtype]
        if not 0 <= begin <= end <= len(buf) or end - begin != size:
            raise AdapterError(f"{what}: tensor {name!r}: data_offsets [{begin}, {end}] do not "
                               f"hold {dtype}{list(shape)} ({size} bytes) within {len(buf)} bytes")
        tensors[name] = Tensor(dtype, shape, buf[begin:end])  # a view: no copy
        spans.append((begin, name))
    return SafetensorsFile(tensors, metadata, [name for _, name in sorted(spans)])


def canonical_order(tensors: Mapping[str, Tensor]) -> list[str]:
    """Data order of the Rust writer: dtype descending in ``Dtype`` enum order, then name."""
    return sorted(tensors, key=lambda k: (-_RUST_RANK.get(tensors[k].dtype, -1), k))


def header(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None,
           writer: str = "safetensors", order: Sequence[str] | None = None) -> bytes:
    """The first bytes :func:`dump` writes: 8-byte length, then the JSON header (padded)."""
    if writer not in WRITERS:
        raise AdapterError(f"unknown safetensors writer {writer!r}; expected one of {WRITERS}")
    order = list(order) if order is not None else canonical_order(tensors)
    if sorted(order) != sorted(tensors):
        raise AdapterError("safetensors data order is not a permutation of the tensor names")
    entries: dict[str, dict] = {}
    offset = 0
    for name in order:
        t = tensors[name]
        end = offset + len(t.data)
        if writer == "mlx":
            entries[name] = {"data_offsets": [offset, end], "dtype": t.dtype, "shape": list(t.shape)}
        else:
            entries[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    if writer == "mlx":
        header_obj = {"__metadata__": dict(metadata) if metadata is not None else None, **entries}
        text = json.dumps(header_obj, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode()
    else:
        header_obj = {"__metadata__": dict(metadata), **entries} if metadata else entries
        text = json.dumps(header_obj, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def dump(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None,
         writer: str = "safetensors", order: Sequence[str] | None = None) -> bytes:
    """Serialize ``tensors`` exactly as ``writer`` ("safetensors" or "mlx") would.

    ``order`` is the data order (names); default: the Rust writer's order. Returns the bytes.

    Raises:
        AdapterError: unknown writer, or ``order`` not a permutation of the names.
    """
    order = list(order) if order is not None else canonical_order(tensors)
    head = header(tensors, metadata, writer, order)
    return b"".join([head, *(tensors[name].data for name in order)])


def detect_writer(data: bytes, parsed: SafetensorsFile) -> dict | None:
    """How to reproduce ``data`` byte for byte with :func:`dump`.

    Returns ``{"writer": "safetensors"}``, ``{"writer": "mlx", "order": [i, ...]}`` (data order
    as indices into the sorted tensor names), or None when neither writer reproduces the file.
    Only headers are compared: ``parsed`` holds the data at the offsets the header gives, so a
    matching header over a file with no trailing bytes reproduces the file.
    """
    size = sum(len(t.data) for t in parsed.tensors.values())
    candidates = [("safetensors", None), ("mlx", parsed.data_order)]
    for writer, order in candidates:
        head = header(parsed.tensors, parsed.metadata, writer, order)
        if len(head) + size == len(data) and data[:len(head)] == head:
            if writer == "safetensors":
                return {"writer": writer}
            index = {name: i for i, name in enumerate(sorted(parsed.tensors))}
            return {"writer": writer, "order": [index[name] for name in parsed.data_order]}
    return None


def dump_like(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None,
              layout: Mapping | None) -> bytes:
    """:func:`dump` with a layout from :func:`detect_writer` (None: the Rust writer).

    A layout whose permutation does not fit ``tensors`` falls back to the Rust writer's order.
    """
    if not layout:
        return dump(tensors, metadata)
    order = None
    if "order" in layout:
        names = sorted(tensors)
        perm = list(layout["order"])
        if sorted(perm) == list(range(len(names))):
            order = [names[i] for i in perm]
    return dump(tensors, metadata, str(layout.get("writer", "safetensors")), order)


def _uint_view(t: Tensor) -> np.ndarray:
    return np.frombuffer(t.data, dtype=f"<u{t.itemsize}" if t.itemsize > 1 else "u1")


def transpose(t: Tensor) -> Tensor:
    """Transpose a 2-D tensor bit for bit (any dtype): shape (a, b) -> (b, a).

    Raises:
        AdapterError: ``t`` is not 2-D.
    """
    if len(t.shape) != 2:
        raise AdapterError(f"cannot transpose a {len(t.shape)}-D tensor of shape {t.shape}")
    arr = _uint_view(t).reshape(t.shape)
    return Tensor(t.dtype, (t.shape[1], t.shape[0]), np.ascontiguousarray(arr.T).tobytes())


def to_float64(t: Tensor) -> np.ndarray:
    """Decode a floating tensor (F64, F32, F16, BF16) to float64, exactly, with ``t.shape``.

    Raises:
        AdapterError: another dtype.
    """
    return to_float(t, np.float64)


def to_float(t: Tensor, dtype: type[np.floating] = np.float32) -> np.ndarray:
    """Decode a floating tensor (F64, F32, F16, BF16) to a new ``dtype`` array (float32 or
    float64) with ``t.shape``; exact except F64 -> float32, which rounds to nearest.

    Raises:
        AdapterError: another dtype.
    """
    if t.dtype == "BF16":
        values = (_uint_view(t).astype(np.uint32) << 16).view("<f4")
    elif t.dtype in ("F64", "F32", "F16"):
        values = np.frombuffer(t.data, dtype={"F64": "<f8", "F32": "<f4", "F16": "<f2"}[t.dtype])
    else:
        raise AdapterError(f"cannot decode dtype {t.dtype} as floating point")
    return values.astype(dtype).reshape(t.shape)


def cast(t: Tensor, dtype: str) -> Tensor:
    """Convert a floating tensor to ``dtype`` ("F32", "F16", "BF16" or "F64").

    Rounds to nearest, ties to even, like torch: F16 via numpy; BF16 from the float32 value
    (``(u + 0x7FFF + ((u >> 16) & 1)) >> 16`` on its bits; NaN -> 0x7FC0), as in c10's
    ``round_to_nearest_even``. Same dtype: returned unchanged.

    Raises:
        AdapterError: a non-floating source or target dtype.
    """
    if dtype == t.dtype:
        return t
    values = to_float64(t)
    with np.errstate(over="ignore", invalid="ignore"):  # out of range -> inf, as torch does
        if dtype == "F64":
            out = values.astype("<f8")
        elif dtype == "F32":
            out = values.astype("<f4")
        elif dtype == "F16":
            out = values.astype("<f2")
        elif dtype == "BF16":
            f32 = values.astype("<f4")
            bits = f32.view("<u4").astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
            rounded[np.isnan(f32)] = 0x7FC0
            out = rounded
        else:
            raise AdapterError(f"cannot cast to dtype {dtype!r}; expected one of F64, F32, F16, "
                               "BF16")
    return Tensor(dtype, t.shape, np.ascontiguousarray(out).tobytes())
