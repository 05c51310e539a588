"""The adapter transport: one streaming format for ``PushAdapter``, both ends.

Sender (trainer, ``gridrl-rollout push-adapter``)::

    stub.PushAdapter(push_requests(manifest_dict, files), timeout=30)

Receiver (rollout node)::

    pushed = receive_push(request_iterator, max_bytes=256 << 20)   # raises StatusError

Wire layout: first message ``header`` (manifest + stage_only), then ``chunk`` messages carrying
the files' bytes in manifest order, each file split into pieces of at most ``chunk_size``
bytes, offsets contiguous from 0. 1 MiB chunks stream 19.6 MB in ~30 ms on loopback (64 KiB:
~70 ms), so 1 MiB is the default.

Digests go in the header's manifest (every file's ``sha256`` set) or, when the manifest leaves
every ``sha256`` empty, in a ``trailer`` after the last chunk: the sender then hashes each chunk
as it sends it, and the receiver hashes it as it arrives, both overlapping the transfer,
instead of the sender hashing everything before its first byte goes out (~14 ms for 19.6 MB
here). A trainer pushing a fresh version uses the trailer; a stored adapter with a known
manifest uses the header.

The receiver checks as bytes arrive (declared sizes, order, offsets, total against
``max_bytes``) and at the end (sizes, sha256). Nothing is written to disk here: the result is
in memory, and the caller stores it atomically only once it is complete and verified.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from google.protobuf import json_format

from gridrl.common.errors import Kind, StatusError, invalid_argument
from gridrl.v1 import common_pb2, rollout_pb2
from gridrl.v1.enums import enum_value

CHUNK_SIZE = 1 << 20
# the adapter formats a node takes (gridrl.adapters.wire converts the domain's names)
_FORMATS = (common_pb2.ADAPTER_FORMAT_PEFT, common_pb2.ADAPTER_FORMAT_MLX)


def _message(manifest: Any) -> common_pb2.AdapterManifest:
    """The manifest message of ``manifest``: the message itself, or the domain type's
    ``to_proto()`` (:class:`gridrl.adapters.AdapterManifest`). A plain dict (the JSON form of
    ``AdapterManifest.to_dict()``, format "peft"/"mlx") is still read, for callers that have
    not moved to passing the manifest itself."""
    if isinstance(manifest, common_pb2.AdapterManifest):
        return manifest
    if hasattr(manifest, "to_proto"):
        return manifest.to_proto()
    d = dict(manifest)
    fmt = d.pop("format", "")
    msg = json_format.ParseDict(d, common_pb2.AdapterManifest(), ignore_unknown_fields=False)
    msg.format = enum_value(common_pb2.AdapterFormat, fmt)
    return msg


def push_requests(manifest: Any,
                  files: Mapping[str, bytes], *, stage_only: bool = False,
                  chunk_size: int = CHUNK_SIZE, relay: rollout_pb2.RelayPlan | None = None
                  ) -> Iterator[rollout_pb2.PushAdapterRequest]:
    """Yield the PushAdapter stream: the header, then every file of ``manifest.files`` in
    order, then, when the manifest gives no digests, the trailer with the sha256 of each file
    computed while its chunks were yielded.

    Args:
        manifest: the adapter's manifest (:class:`gridrl.adapters.AdapterManifest`, or the
            message);
            its ``files`` must describe ``files`` (path, size_bytes) and give every sha256 or
            none (``build_manifest(..., hash_files=False)``).
        files: file path -> bytes (any bytes-like object), as listed in the manifest.
        chunk_size: bytes per chunk message (> 0).
        relay: a relay plan for the header (:func:`relay_plan`; the manifest must then give
            every sha256): the receiver serves the pieces to the plan's readers as they come.
    Raises:
        KeyError: a manifest file is missing from ``files``.
        ValueError: the manifest gives the sha256 of some files but not of others.
    """
    msg = _message(manifest)
    deferred = _digests_deferred(msg)
    if deferred is None:
        raise ValueError("manifest.files: give the sha256 of every file or of none")
    yield rollout_pb2.PushAdapterRequest(
        header=rollout_pb2.PushAdapterHeader(manifest=msg, stage_only=stage_only, relay=relay))
    digests = []
    for entry in msg.files:
        data = memoryview(files[entry.path]).cast("B")
        hasher = hashlib.sha256() if deferred else None
        for offset in range(0, len(data), chunk_size):
            piece = bytes(data[offset:offset + chunk_size])
            if hasher is not None:
                hasher.update(piece)  # releases the GIL: gRPC keeps sending meanwhile
            yield rollout_pb2.PushAdapterRequest(chunk=rollout_pb2.AdapterChunk(
                path=entry.path, offset=offset, data=piece))
        if hasher is not None:
            digests.append(hasher.hexdigest())
    if deferred:
        yield rollout_pb2.PushAdapterRequest(
            trailer=rollout_pb2.PushAdapterTrailer(file_sha256=digests))


def _digests_deferred(m: common_pb2.AdapterManifest) -> bool | None:
    """False: every file has a sha256 (or there are no files); True: none has (they come in
    the trailer); None: some have, some not."""
    given = [bool(f.sha256) for f in m.files]
    if all(given):
        return False
    return True if not any(given) else None


@dataclass
class ReceivedAdapter:
    """A complete, verified push.

    Attributes:
        manifest: the header's manifest, every file's sha256 filled in (from the trailer when
            the header left them out).
        stage_only: the header's flag.
        files: path -> contents (``bytearray``: writable, so tensors can be viewed in place),
            every manifest file, sizes and sha256 checked.
        bytes_received: total payload bytes.
        receive_s: seconds from the header to the last chunk, hashing excluded.
        verify_s: seconds spent hashing (while receiving) and comparing digests.
    """

    manifest: common_pb2.AdapterManifest
    stage_only: bool
    files: dict[str, bytearray] = field(default_factory=dict)
    bytes_received: int = 0
    receive_s: float = 0.0
    verify_s: float = 0.0


def _check_path(path: str, field_name: str) -> None:
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in parts):
        raise invalid_argument(field_name, f"{path!r} is not a relative path inside the adapter")


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
ADAPTER_NAME_RULE = "1-128 characters of [A-Za-z0-9._-], starting with a letter or digit"


def validate_manifest(m: common_pb2.AdapterManifest, max_bytes: int) -> None:
    """Check a manifest before any byte is accepted.

    Raises:
        StatusError: INVALID_ARGUMENT naming the field (``header.manifest.<field>``), or
            RESOURCE_EXHAUSTED when the declared total exceeds ``max_bytes``.
    """
    prefix = "header.manifest"
    if not ADAPTER_NAME.fullmatch(m.name):  # ASCII only: it names store directories
        raise invalid_argument(f"{prefix}.name", f"{m.name!r} must be {ADAPTER_NAME_RULE}")
    if m.version < 1:
        raise invalid_argument(f"{prefix}.version", "must be >= 1")
    if m.format not in _FORMATS:
        raise invalid_argument(f"{prefix}.format", "must be ADAPTER_FORMAT_PEFT or ADAPTER_FORMAT_MLX")
    if not m.files:
        raise invalid_argument(f"{prefix}.files", "is empty")
    seen: set[str] = set()
    deferred = _digests_deferred(m)
    for i, f in enumerate(m.files):
        _check_path(f.path, f"{prefix}.files[{i}].path")
        if f.path in seen:
            raise invalid_argument(f"{prefix}.files[{i}].path", f"{f.path!r} is listed twice")
        seen.add(f.path)
        if deferred is None and not f.sha256:
            raise invalid_argument(f"{prefix}.files[{i}].sha256",
                                   "is empty while other files give theirs: give every "
                                   "file's sha256, or none (then the trailer gives them)")
        if not deferred and not _is_sha256(f.sha256):
            raise invalid_argument(f"{prefix}.files[{i}].sha256", "must be 64 lower-case hex digits")
    total = sum(f.size_bytes for f in m.files)
    if total > max_bytes:
        raise StatusError(Kind.RESOURCE_EXHAUSTED,
                          f"{prefix}.files: adapter is {total} bytes, over the node's limit of "
                          f"{max_bytes} bytes")


def _is_sha256(digest: str) -> bool:
    return len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)


class PushSink(Protocol):
    """Where :func:`receive_push` writes a push's bytes instead of buffers of its own: a relay
    buffer (``gridrl.rollout.relay.RelayBuffer``), which checks each piece as it completes and
    serves it to peers meanwhile."""

    verify_s: float  # seconds spent writing and verifying so far

    def write(self, offset: int, data: bytes) -> None:
        """Append ``data`` at ``offset`` in the manifest's files concatenated in order."""

    def files(self) -> dict[str, bytearray]:
        """Once every byte is written: path -> contents, each file's sha256 checked against
        the manifest (StatusError DATA_LOSS otherwise)."""


def receive_push(requests: Iterable[rollout_pb2.PushAdapterRequest],
                 max_bytes: int, into: PushSink | None = None) -> ReceivedAdapter:
    """Read and verify a whole PushAdapter stream into memory.

    Args:
        requests: the stream.
        max_bytes: the largest adapter accepted (bytes).
        into: write the bytes there (it hashes them) instead of into buffers of this
            function's own; the header's manifest must then give every sha256 (no trailer),
            and be the manifest ``into`` was made for.
    Raises:
        StatusError: INVALID_ARGUMENT (missing or repeated header, chunk for an unknown file,
            out-of-order offset, more bytes than declared, manifest problems, a trailer that is
            missing, unexpected, not last or malformed), DATA_LOSS (a file shorter than
            declared, i.e. a truncated stream, or a sha256 mismatch),
            RESOURCE_EXHAUSTED (over ``max_bytes``). A cancelled stream surfaces as the
            ``grpc.RpcError`` / iterator error of the caller's request iterator.
    """
    it = iter(requests)
    first = next(it, None)
    if first is None or first.WhichOneof("payload") != "header":
        raise invalid_argument("header", "the first PushAdapter message must be the header")
    start = time.perf_counter()
    manifest = common_pb2.AdapterManifest()
    manifest.CopyFrom(first.header.manifest)  # its digests get filled in; the caller's stay
    validate_manifest(manifest, max_bytes)
    expected = {f.path: f for f in manifest.files}
    order = [f.path for f in manifest.files]
    # Each chunk is hashed as it arrives (hashlib releases the GIL, so gRPC keeps receiving
    # meanwhile) and copied into its file's buffer, allocated at the declared size (the total
    # is checked against max_bytes above). The buffers are writable, so a backend can view the
    # tensors in them without another copy. With ``into``, the bytes go there instead and it
    # does the hashing.
    deferred = _digests_deferred(manifest)
    if into is not None and deferred:
        raise invalid_argument("header.manifest.files", "a relayed adapter's manifest must "
                                                        "give every file's sha256 (no trailer)")
    buffers = {f.path: bytearray(f.size_bytes) for f in manifest.files} if into is None else {}
    starts = dict(zip(order, itertools.accumulate(
        (f.size_bytes for f in manifest.files), initial=0), strict=False))
    sizes = dict.fromkeys(order, 0)
    hashers = {p: hashlib.sha256() for p in order}
    hash_s = 0.0
    current = 0  # index into order of the file being received
    total = 0
    trailer: list[str] | None = None
    for msg in it:
        kind = msg.WhichOneof("payload")
        if trailer is not None:
            raise invalid_argument("trailer", "must be the last message of the stream")
        if kind == "trailer":
            trailer = _check_trailer(msg.trailer, len(order), deferred)
            continue
        if kind != "chunk":
            raise invalid_argument("header", "only the first message may be a header")
        chunk = msg.chunk
        if chunk.path not in expected:
            raise invalid_argument("chunk.path", f"{chunk.path!r} is not in the manifest")
        idx = order.index(chunk.path)
        if idx < current:
            raise invalid_argument("chunk.path", f"{chunk.path!r} arrived after a later file")
        for skipped in order[current:idx]:  # earlier files must be complete
            if sizes[skipped] != expected[skipped].size_bytes:
                raise invalid_argument("chunk.path", f"{chunk.path!r} arrived before {skipped!r} "
                                       f"was complete ({sizes[skipped]} of "
                                       f"{expected[skipped].size_bytes} bytes)")
        current = idx
        size = sizes[chunk.path]
        if chunk.offset != size:
            raise invalid_argument("chunk.offset", f"{chunk.path}: expected offset {size}, "
                                                   f"got {chunk.offset}")
        data = chunk.data  # a copy of the message's bytes at each access: take it once
        if size + len(data) > expected[chunk.path].size_bytes:
            raise invalid_argument("chunk.data", f"{chunk.path}: more bytes than the declared "
                                                 f"{expected[chunk.path].size_bytes}")
        if into is not None:
            into.write(starts[chunk.path] + size, data)
        else:
            t = time.perf_counter()
            hashers[chunk.path].update(data)
            hash_s += time.perf_counter() - t
            buffers[chunk.path][size:size + len(data)] = data
        sizes[chunk.path] = size + len(data)
        total += len(data)
    if into is not None:
        hash_s = into.verify_s
    receive_s = time.perf_counter() - start - hash_s
    t = time.perf_counter()
    for path in order:
        want = expected[path]
        if sizes[path] != want.size_bytes:
            raise StatusError(Kind.DATA_LOSS,
                              f"{path}: received {sizes[path]} of {want.size_bytes} bytes "
                              "(truncated stream)")
    if into is not None:  # it hashed every file as its pieces were verified
        files = into.files()
        return ReceivedAdapter(manifest=manifest, stage_only=first.header.stage_only,
                               files=files, bytes_received=total, receive_s=receive_s,
                               verify_s=into.verify_s)
    if deferred and trailer is None:
        raise invalid_argument("trailer", "missing: the header's manifest left every sha256 "
                                          "empty, so the stream must end with a trailer giving "
                                          "them")
    for i, path in enumerate(order):
        want = expected[path]
        claimed, source = (trailer[i], "trailer's") if trailer is not None else (
            want.sha256, "manifest's")
        digest = hashers[path].hexdigest()
        if digest != claimed:
            raise StatusError(Kind.DATA_LOSS,
                              f"{path}: sha256 {digest} does not match the {source} {claimed}")
        want.sha256 = digest
    return ReceivedAdapter(manifest=manifest, stage_only=first.header.stage_only, files=buffers,
                           bytes_received=total, receive_s=receive_s,
                           verify_s=hash_s + time.perf_counter() - t)


def _check_trailer(trailer: rollout_pb2.PushAdapterTrailer, n_files: int,
                   deferred: bool | None) -> list[str]:
    """The trailer's digests, checked against the header (``deferred``: it left them out)."""
    if not deferred:
        raise invalid_argument("trailer", "unexpected: the header's manifest already gave every "
                                          "file's sha256")
    digests = list(trailer.file_sha256)
    if len(digests) != n_files:
        raise invalid_argument("trailer.file_sha256", f"has {len(digests)} digests for the "
                                                      f"manifest's {n_files} files")
    for i, digest in enumerate(digests):
        if not _is_sha256(digest):
            raise invalid_argument(f"trailer.file_sha256[{i}]", "must be 64 lower-case hex digits")
    return digests


# -- relay fan-out (FetchAdapter / ReadAdapter) ------------------------------------------------
#
# Nodes that hold a version forward it to nodes that do not. The trainer cuts the adapter's
# files, concatenated in manifest order, into pieces of ``piece_bytes`` and gives every node the
# sha256 of each piece (``RelayPlan``) together with the manifest's file digests; each hop checks
# every piece against them before keeping it, so a relay cannot alter what it forwards (the
# BitTorrent piece-hash scheme). 256 KiB pieces keep a 16-hop chain's pipeline delay at
# ~0.35 s over 100 Mbit/s links (16 x 21 ms) with ~300 digests for a 74 MB adapter.
PIECE_BYTES = 256 << 10


def ordered_files(manifest: Any, files: Mapping[str, bytes]) -> list[memoryview]:
    """The bytes of ``manifest``'s files in manifest order, as byte views (no copies)."""
    return [memoryview(files[f.path]).cast("B") for f in _message(manifest).files]


def relay_plan(manifest: Any, files: Mapping[str, bytes], readers: Iterable[str] = (),
               piece_bytes: int = PIECE_BYTES) -> rollout_pb2.RelayPlan:
    """The relay plan of an adapter: its pieces' sha256 and the nodes that may read it.

    Args:
        manifest: the adapter's manifest (domain type or message); its files, in order, are
            ``files``.
        files: path -> bytes of every manifest file.
        readers: host:port of the nodes allowed to read it from a holder (ReadAdapter).
        piece_bytes: bytes per piece (> 0).
    Returns:
        ``RelayPlan`` with ``ceil(total / piece_bytes)`` lower-case hex digests.
    Raises:
        ValueError: ``piece_bytes`` <= 0.
        KeyError: a manifest file is missing from ``files``.
    """
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes: must be > 0, got {piece_bytes}")
    digests = []
    hasher, left = hashlib.sha256(), piece_bytes  # the piece being hashed, its bytes to come
    for view in ordered_files(manifest, files):  # pieces span files: no joined copy
        at = 0
        while at < len(view):
            take = min(left, len(view) - at)
            hasher.update(view[at:at + take])
            at, left = at + take, left - take
            if not left:
                digests.append(hasher.hexdigest())
                hasher, left = hashlib.sha256(), piece_bytes
    if left < piece_bytes:  # the last piece, shorter
        digests.append(hasher.hexdigest())
    return rollout_pb2.RelayPlan(piece_bytes=piece_bytes, piece_sha256=digests,
                                 readers=list(readers))


# ReadAdapterResponse on the wire, encoded and decoded here rather than by protobuf: a relay
# forwards ~300 pieces per adapter and hop, and protobuf would copy each piece twice to send it
# (into the message, then into its serialization) and twice to receive it (parse, then
# ``.data``). Field numbers as in rollout.proto: 1 offset (varint), 2 data (bytes).
_OFFSET_TAG, _DATA_TAG = b"\x08", b"\x12"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_read_response(offset: int, piece: bytes | memoryview) -> bytes:
    """``ReadAdapterResponse(offset=offset, data=piece).SerializeToString()``, copying
    ``piece`` once (a server's response serializer passes ``bytes`` through:
    ``gridrl.common.rpc.interceptor``).

    Args:
        offset: the piece's byte offset in the concatenated files (>= 0).
        piece: its bytes (any bytes-like object).
    """
    head = ((_OFFSET_TAG + _varint(offset) if offset else b"")  # proto3 leaves out defaults
            + (_DATA_TAG + _varint(len(piece)) if len(piece) else b""))
    return b"".join((head, piece))


@dataclass(frozen=True)
class ReadPiece:
    """A decoded ReadAdapterResponse: ``offset`` and ``data``, a view into the received bytes
    (no copy)."""

    offset: int
    data: memoryview


def decode_read_response(raw: bytes) -> ReadPiece:
    """Parse a serialized ReadAdapterResponse (any valid encoding: fields in any order or
    repeated, the last one winning, unknown fields skipped) without copying its data.

    Raises:
        ValueError: the bytes are not a ReadAdapterResponse (truncated, a group, a field of
            the wrong wire type).
    """
    view = memoryview(raw).cast("B")
    offset, data, at, end = 0, view[0:0], 0, len(view)

    def varint() -> int:
        nonlocal at
        value = shift = 0
        while True:
            if at >= end or shift > 63:
                raise ValueError("ReadAdapterResponse: truncated or overlong varint")
            byte = view[at]
            at += 1
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7

    while at < end:
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value = varint()
            if number == 1:
                offset = value & 0xFFFFFFFFFFFFFFFF
            elif number == 2:
                raise ValueError("ReadAdapterResponse.data: a varint, not bytes")
        elif wire == 2:
            size = varint()
            if at + size > end:
                raise ValueError("ReadAdapterResponse: a field runs past the message's end")
            if number == 2:
                data = view[at:at + size]
            elif number == 1:
                raise ValueError("ReadAdapterResponse.offset: length-delimited, not a varint")
            at += size
        elif wire in (1, 5) and number not in (1, 2):
            at += 8 if wire == 1 else 4
            if at > end:
                raise ValueError("ReadAdapterResponse: a field runs past the message's end")
        else:
            raise ValueError(f"ReadAdapterResponse: field {number} has wire type {wire}")
    return ReadPiece(offset=offset, data=data)


def check_relay_plan(manifest: common_pb2.AdapterManifest, plan: rollout_pb2.RelayPlan,
                     field_name: str = "relay") -> int:
    """Check that ``plan`` fits ``manifest`` (which must give every file's sha256).

    Returns:
        the adapter's total size in bytes.
    Raises:
        StatusError: INVALID_ARGUMENT naming the field (``<field_name>.piece_bytes``,
            ``<field_name>.piece_sha256``, ``header.manifest.files``).
    """
    if _digests_deferred(manifest) is not False:
        raise invalid_argument("header.manifest.files",
                               "a relayed adapter's manifest must give every file's sha256 "
                               "(no trailer)")
    if plan.piece_bytes <= 0:
        raise invalid_argument(f"{field_name}.piece_bytes", "must be > 0")
    total = sum(f.size_bytes for f in manifest.files)
    pieces = -(-total // plan.piece_bytes)
    if len(plan.piece_sha256) != pieces:
        raise invalid_argument(f"{field_name}.piece_sha256",
                               f"has {len(plan.piece_sha256)} digests; {total} bytes in pieces "
                               f"of {plan.piece_bytes} make {pieces}")
    for i, digest in enumerate(plan.piece_sha256):
        if not _is_sha256(digest):
            raise invalid_argument(f"{field_name}.piece_sha256[{i}]",
                                   "must be 64 lower-case hex digits")
    return total
