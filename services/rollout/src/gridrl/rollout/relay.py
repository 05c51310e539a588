"""Relay fan-out on the node: hold an adapter's verified pieces, serve them to the peers the
trainer listed, and fetch a version from peers that hold it.

    buffer = relays.open(manifest, plan)          # a push with a relay plan, or a fetch
    buffer.write(offset, data)                     # the writer: checks each piece's sha256
    for offset, piece in buffer.pieces(0, ...):    # ReadAdapter: verified pieces, as they come
    fetch_pieces(buffer, sources, read, deadline)  # FetchAdapter: from peers, in order

The trainer uploads an adapter once (to the chain's head, ``PushAdapter`` with a ``RelayPlan``)
and tells every other node to fetch it from the node before it (``FetchAdapter``). A node keeps
a piece only once its sha256 matches the trainer's plan and serves only kept pieces, so a relay
cannot alter what it forwards; pieces flow on as soon as they are kept, so a chain of n nodes
takes about the time of one transfer plus n piece times (a pipeline, as in chain replication),
while the trainer's egress stays one adapter. A reader whose source fails mid-stream resumes at
its first missing piece from the next source the trainer gave (earlier holders in the chain);
when none can deliver, FetchAdapter fails and the trainer pushes to that node itself.

Buffers live in memory: the newest :data:`KEEP_VERSIONS` versions per node (a restarted node
holds none and serves none: its readers fall back to other sources).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from gridrl.common.errors import Kind, StatusError, failed_precondition, invalid_argument
from gridrl.common.transport import check_relay_plan
from gridrl.v1 import common_pb2, rollout_pb2

# Versions whose pieces a node keeps in memory to serve (each as large as the adapter).
KEEP_VERSIONS = 2
# Longest a ReadAdapter waits for a version to start arriving at this node (the trainer's
# FetchAdapter to it may land after its reader's call): then NOT_FOUND, and the reader tries
# its next source.
ARRIVAL_WAIT_S = 10.0
# A source that sends no piece for this long (or a quarter of the fetch's time left, if less,
# but at least 1 s) is abandoned for the next one: a relay whose link was cut silently
# would otherwise hold the fetch until its deadline.
STALL_S = 5.0


class RelayBuffer:
    """One adapter version's files as they arrive (written in manifest order, as one stream of
    bytes), with how much of them is verified against the trainer's piece digests.

    One writer (the push or fetch receiving it) calls :meth:`write`; any number of readers
    call :meth:`pieces`. A piece becomes readable only once its sha256 matches. The bytes go
    straight into the files' buffers, allocated once at the manifest's sizes: readers are
    served views of them and :meth:`files` returns them, so every byte is copied once on its
    way in and hashed twice while it is still in cache (its piece's sha256, then its file's,
    fed piece by piece as pieces are verified).

    Args:
        manifest: the adapter's manifest, every file's sha256 given.
        plan: its relay plan (piece size, piece digests, readers).
    Raises:
        StatusError: INVALID_ARGUMENT when the plan does not fit the manifest.
    """

    def __init__(self, manifest: common_pb2.AdapterManifest, plan: rollout_pb2.RelayPlan) -> None:
        self.total = check_relay_plan(manifest, plan)
        self.manifest = manifest
        self.piece_bytes = plan.piece_bytes
        self.digests = list(plan.piece_sha256)
        self.readers = tuple(plan.readers)
        self.verify_s = 0.0
        # the files' bytes (the total was checked against the node's limit before the plan)
        self._files = [bytearray(f.size_bytes) for f in manifest.files]
        self._starts = list(itertools.accumulate((f.size_bytes for f in manifest.files),
                                                 initial=0))[:-1]  # each file's first byte
        self._file_sha256 = [hashlib.sha256() for _ in manifest.files]  # verified bytes only
        self._written = 0  # bytes from 0 written (verified, then at most part of a piece)
        self._verified = 0  # bytes from 0 whose pieces all matched
        self._failed: str | None = None
        self._cond = threading.Condition()

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def verified(self) -> int:
        """Bytes from the start that are verified (a piece boundary, or the total)."""
        with self._cond:
            return self._verified

    @property
    def complete(self) -> bool:
        with self._cond:
            return self._verified == self.total

    def same_plan(self, manifest: common_pb2.AdapterManifest,
                  plan: rollout_pb2.RelayPlan) -> bool:
        """Whether ``manifest`` and ``plan`` describe the bytes this buffer holds."""
        return (plan.piece_bytes == self.piece_bytes and list(plan.piece_sha256) == self.digests
                and [(f.path, f.sha256) for f in manifest.files]
                == [(f.path, f.sha256) for f in self.manifest.files])

    def _piece_end(self, start: int) -> int:
        return min(start + self.piece_bytes, self.total)

    def _segments(self, start: int, end: int) -> list[tuple[int, memoryview]]:
        """(file index, view) of the bytes ``start``..``end`` of the concatenated files."""
        out = []
        i = bisect.bisect_right(self._starts, start) - 1
        while start < end:
            while self._starts[i] + len(self._files[i]) <= start:  # empty files included
                i += 1
            first = start - self._starts[i]
            take = min(end - start, len(self._files[i]) - first)
            out.append((i, memoryview(self._files[i])[first:first + take]))
            start += take
        return out

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Write ``data`` (any bytes-like object) at ``offset`` (the end of what was written),
        checking every piece it completes against the plan; a piece that does not match is
        dropped (what was verified before stays, so another source can resume at
        :attr:`verified`).

        Raises:
            StatusError: INVALID_ARGUMENT (not contiguous, or past the end), DATA_LOSS (a
                piece's sha256 does not match the plan).
        """
        view = memoryview(data).cast("B")
        if offset != self._written:
            raise invalid_argument("offset", f"expected byte {self._written}, got {offset}")
        if offset + len(view) > self.total:
            raise invalid_argument("data", f"past the adapter's {self.total} bytes")
        t = time.perf_counter()
        try:
            at = 0
            for _, target in self._segments(offset, offset + len(view)):
                target[:] = view[at:at + len(target)]
                at += len(target)
            self._written = offset + len(view)
            while (end := self._piece_end(start := self._verified)) <= self._written \
                    and start < self.total:
                segments = self._segments(start, end)
                hasher = hashlib.sha256()
                for _, segment in segments:
                    hasher.update(segment)  # releases the GIL: gRPC keeps receiving meanwhile
                index = start // self.piece_bytes
                if (digest := hasher.hexdigest()) != self.digests[index]:
                    self._written = start  # the bad piece is dropped
                    raise StatusError(Kind.DATA_LOSS,
                                      f"piece {index} (bytes {start}-{end}) of {self.name} "
                                      f"v{self.version}: sha256 {digest} does not match the "
                                      f"trainer's {self.digests[index]}")
                for i, segment in segments:
                    self._file_sha256[i].update(segment)
                with self._cond:
                    self._verified = end
                    self._cond.notify_all()
        finally:
            self.verify_s += time.perf_counter() - t

    def rewind(self) -> None:
        """Drop written bytes past :attr:`verified` (a source failed mid-piece)."""
        self._written = self._verified

    def fail(self, reason: str) -> None:
        """The writer gave up: readers waiting for more get ABORTED (they try another
        source). A complete buffer cannot fail."""
        with self._cond:
            if self._verified < self.total:
                self._failed = reason
                self._cond.notify_all()

    def _piece(self, start: int) -> bytes | memoryview:
        """The verified piece at ``start``: a read-only view of its file, or, for a piece
        that spans files, its bytes joined."""
        segments = self._segments(start, self._piece_end(start))
        if len(segments) == 1:
            return segments[0][1].toreadonly()
        return b"".join(segment for _, segment in segments)

    def pieces(self, offset: int, until: float | None,
               active: Callable[[], bool] = lambda: True
               ) -> Iterator[tuple[int, bytes | memoryview]]:
        """Yield ``(offset, piece)`` from ``offset`` on, each once verified (a read-only
        bytes-like object), waiting for more until ``until`` (``time.monotonic()`` seconds;
        None: no limit) while ``active()``.

        Raises:
            StatusError: INVALID_ARGUMENT (``offset`` not on a piece boundary or past the
                end), ABORTED (the writer failed before the end), DEADLINE_EXCEEDED (no new
                piece before ``until``).
        """
        if offset % self.piece_bytes or offset > self.total:
            raise invalid_argument("offset", f"{offset} is not a piece boundary (pieces of "
                                             f"{self.piece_bytes} bytes) within the adapter's "
                                             f"{self.total} bytes")
        while offset < self.total:
            with self._cond:
                while self._verified <= offset and self._failed is None and active():
                    left = None if until is None else until - time.monotonic()
                    if left is not None and left <= 0:
                        raise StatusError(Kind.DEADLINE_EXCEEDED,
                                          f"{self.name} v{self.version}: no piece past byte "
                                          f"{offset} arrived in time")
                    self._cond.wait(timeout=1.0 if left is None else min(left, 1.0))
                if self._verified <= offset:
                    if self._failed is not None:
                        raise StatusError(Kind.ABORTED, f"{self.name} v{self.version}: this "
                                                        f"node's transfer failed: {self._failed}")
                    return  # the reader left
                ready = self._verified  # verified bytes never change
            while offset < ready:
                piece = self._piece(offset)
                yield offset, piece
                offset += len(piece)

    def files(self) -> dict[str, bytearray]:
        """path -> contents of every manifest file, each file's sha256 (computed as its
        pieces were verified) checked against the manifest. Call once complete. The buffers
        are the ones readers are served from: view them, never modify them.

        Raises:
            StatusError: FAILED_PRECONDITION (not complete), DATA_LOSS naming the file whose
                sha256 does not match.
        """
        if not self.complete:
            raise failed_precondition(f"{self.name} v{self.version}: {self.verified} of "
                                      f"{self.total} bytes verified")
        t = time.perf_counter()
        for f, hasher in zip(self.manifest.files, self._file_sha256, strict=True):
            if (digest := hasher.hexdigest()) != f.sha256:
                raise StatusError(Kind.DATA_LOSS, f"{f.path}: sha256 {digest} does not match "
                                                  f"the manifest's {f.sha256}")
        self.verify_s += time.perf_counter() - t
        return {f.path: buffer for f, buffer in zip(self.manifest.files, self._files,
                                                    strict=True)}


class RelayTable:
    """The versions this node holds or receives for relaying, newest :data:`KEEP_VERSIONS`
    kept; readers wait (bounded) for a version that is about to arrive."""

    def __init__(self, keep: int = KEEP_VERSIONS) -> None:
        self.keep = keep
        self._buffers: OrderedDict[tuple[str, int], RelayBuffer] = OrderedDict()
        self._cond = threading.Condition()

    def open(self, manifest: common_pb2.AdapterManifest,
             plan: rollout_pb2.RelayPlan) -> RelayBuffer:
        """A new buffer for the manifest's version, replacing an earlier one (its readers
        keep the old object); older versions beyond ``keep`` are dropped.

        Raises:
            StatusError: INVALID_ARGUMENT when the plan does not fit the manifest.
        """
        buffer = RelayBuffer(manifest, plan)
        key = (manifest.name, manifest.version)
        with self._cond:
            self._buffers.pop(key, None)
            self._buffers[key] = buffer
            while len(self._buffers) > self.keep:
                self._buffers.popitem(last=False)
            self._cond.notify_all()
        return buffer

    def held(self, name: str, version: int) -> RelayBuffer | None:
        """The buffer of ``name`` v``version`` if it is here and complete."""
        with self._cond:
            buffer = self._buffers.get((name, version))
        return buffer if buffer is not None and buffer.complete else None

    def wait_for(self, name: str, version: int, timeout: float) -> RelayBuffer | None:
        """The buffer of ``name`` v``version``, waiting up to ``timeout`` seconds for it to be
        opened; None if it was not."""
        until = time.monotonic() + timeout
        with self._cond:
            while (name, version) not in self._buffers:
                left = until - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._buffers[(name, version)]

    def drop(self, buffer: RelayBuffer) -> None:
        """Forget ``buffer`` (its transfer failed) if it is still the one held."""
        with self._cond:
            key = (buffer.name, buffer.version)
            if self._buffers.get(key) is buffer:
                del self._buffers[key]


@dataclass
class FetchOutcome:
    """How a fetch went: the source that sent the last piece and the sources that failed
    (address -> why)."""

    source: str = ""
    failures: dict[str, str] = field(default_factory=dict)
    receive_s: float = 0.0


ReadFn = Callable[[str, rollout_pb2.ReadAdapterRequest, float],
                  Iterator[rollout_pb2.ReadAdapterResponse]]


def stall_limit(left_s: float | None) -> float:
    """Seconds without a piece after which a source is abandoned (:data:`STALL_S`, a quarter
    of the time left if less, at least 1 s)."""
    return STALL_S if left_s is None else max(1.0, min(STALL_S, left_s / 4))


def fetch_pieces(buffer: RelayBuffer, sources: Sequence[str], read: ReadFn,
                 until: float | None, active: Callable[[], bool] = lambda: True
                 ) -> FetchOutcome:
    """Fill ``buffer`` from ``sources`` in order: each is asked for the pieces from the first
    one missing (``read(address, request, timeout_s)``: a ReadAdapter stream, a gRPC call
    that can be cancelled); a source that fails, ends early, sends a piece that does not
    match or sends nothing for :func:`stall_limit` seconds moves on to the next.

    Returns:
        the outcome, once the buffer is complete.
    Raises:
        StatusError: DATA_LOSS when a source sent a piece that does not match and no later
            source completed it; UNAVAILABLE when no source could deliver the rest (the
            message names each failure); DEADLINE_EXCEEDED past ``until``; CANCELLED when
            ``active()`` turned False. The buffer is then failed (its readers get ABORTED).
    """
    outcome = FetchOutcome()
    start = time.perf_counter()
    stall_s = stall_limit(None if until is None else until - time.monotonic())
    tampered = False
    try:
        for address in sources:
            if buffer.complete:
                break
            if not active():
                raise StatusError(Kind.CANCELLED, "the caller left before the fetch ended")
            left = None if until is None else until - time.monotonic()
            if left is not None and left <= 0:
                raise StatusError(Kind.DEADLINE_EXCEEDED,
                                  f"fetch of {buffer.name} v{buffer.version}: deadline passed "
                                  f"at byte {buffer.verified} of {buffer.total}; sources "
                                  f"failed: {_said(outcome.failures)}")
            request = rollout_pb2.ReadAdapterRequest(name=buffer.name, version=buffer.version,
                                                     offset=buffer.verified)
            watch = _Watchdog(stall_s)
            try:
                call = read(address, request, left if left is not None else 3600.0)
                watch.start(call)
                for message in call:
                    buffer.write(message.offset, message.data)
                    watch.progress()
                if not buffer.complete:
                    raise StatusError(Kind.UNAVAILABLE,
                                      f"stream ended at byte {buffer.verified} of {buffer.total}")
            except grpc.RpcError as e:
                buffer.rewind()
                outcome.failures[address] = (
                    f"no piece for {stall_s:.1f}s (stalled)" if watch.fired
                    else f"ReadAdapter {e.code().name}: {e.details()}")
            except StatusError as e:
                buffer.rewind()
                tampered |= e.kind is Kind.DATA_LOSS
                outcome.failures[address] = f"{e.kind.name}: {e.message}"
            else:
                outcome.source = address
            finally:
                watch.stop()
        if not buffer.complete:
            raise StatusError(Kind.DATA_LOSS if tampered else Kind.UNAVAILABLE,
                              f"fetch of {buffer.name} v{buffer.version}: no source delivered "
                              f"it (byte {buffer.verified} of {buffer.total}): "
                              f"{_said(outcome.failures)}")
    except StatusError as e:
        buffer.fail(e.message)
        raise
    outcome.receive_s = time.perf_counter() - start
    return outcome


class _Watchdog:
    """Cancels a ReadAdapter call that delivers no piece for ``stall_s`` seconds."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.fired = False
        self._last = time.monotonic()
        self._stopped = threading.Event()

    def start(self, call) -> None:
        def watch() -> None:
            while not self._stopped.wait(min(0.25, self.stall_s / 4)):
                if time.monotonic() - self._last > self.stall_s:
                    self.fired = True
                    call.cancel()
                    return

        threading.Thread(target=watch, name="relay-watchdog", daemon=True).start()

    def progress(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()


def _said(failures: dict[str, str]) -> str:
    return "; ".join(f"{a}: {why}" for a, why in failures.items()) or "none tried"
