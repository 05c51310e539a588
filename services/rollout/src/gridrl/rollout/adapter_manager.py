"""PushAdapter and ReloadAdapter: receive -> verify -> convert -> load -> swap -> store.

A push is checked against the node's base model as soon as its header arrives, received into
memory and verified (sizes, sha256 while receiving: ``gridrl.common.transport.receive_push``),
checked again against the base model by what its tensors say and converted to the backend's
format when needed (both :mod:`.adapter_intake`'s), loaded by
the backend from memory next to the serving adapter and made the serving adapter between two
batches on the engine's scheduler thread; then the reply goes out. Storing the files
(``pushed/<name>/v<version>``, for ReloadAdapter and retries) happens after the reply, in the
background, still holding the manager's lock, so the next push, reload or stored-adapter listing
waits for it and always sees a complete store; writing 20 MB costs ~50 ms on a VM's page cache,
half the sync budget. A ``stage_only`` push is stored before its reply. Any failure before the
swap changes nothing: the previous adapter keeps serving and nothing is written.

Bounded time: loading and swapping preempt the batch in progress (``BatchScheduler.call_between_batches``
with ``preempt=True``: it stops at its next decode step and its requests decode again on the new
adapter), so a push takes effect within a decode step of a generation of any length. A push or
reload carries its caller's deadline (:class:`~.apply_deadline.ApplyDeadline`); when the adapter cannot be
swapped in before it (the lock held by another push, a decode step or a load slower than the
time left), the call fails with DEADLINE_EXCEEDED and the adapter is never applied later: the
queued command is withdrawn, or, if the load already ran, the swap is skipped and the adapter
unloaded. The swap is the last thing before the reply, so the reply names what the node serves.

Snapshots: :meth:`AdapterManager.stored_refs` reads a snapshot of the store, replaced under the
lock as each push or reload answers (with what the store holds once its background write and
pruning are done), so GetNodeInfo and heartbeats never wait on a push.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from gridrl.adapters import (
    AdapterError,
    AdapterManifest,
    check_fits,
    convert_files,
    detect_format,
    read_dir,
)
from gridrl.common.errors import Kind, StatusError, failed_precondition, invalid_argument
from gridrl.common.sequence import ReportSequence
from gridrl.common.transport import ReceivedAdapter, receive_push, validate_manifest
from gridrl.engine.contract import AdapterLoadError, Backend
from gridrl.models import ModelIdentity
from gridrl.rollout import metrics
from gridrl.rollout.adapter_intake import check_and_convert, check_header
from gridrl.rollout.adapter_store import AdapterStore, StoredAdapter
from gridrl.rollout.apply_deadline import NO_DEADLINE, ApplyDeadline
from gridrl.rollout.jobs import BASE_MODEL, ServingAdapter
from gridrl.rollout.relay import (
    FetchOutcome,
    ReadFn,
    RelayBuffer,
    RelayTable,
    fetch_pieces,
)
from gridrl.rollout.scheduler import BatchScheduler
from gridrl.v1 import common_pb2, rollout_pb2

log = logging.getLogger(__name__)


@dataclass
class _Applied:
    serving: ServingAdapter
    apply_s: float


class AdapterManager:
    """The node's adapter operations over an engine, its backend and an adapter store.

    Args:
        engine: the engine whose serving adapter is swapped.
        store: where adapters live on disk.
        identity: the base model (what pushed adapters must fit).
        max_bytes: largest push accepted, in bytes.
        keep: pushed versions kept per name, newest first (0: all); older ones are deleted
            after each successful push, except the one serving.
        keep_names: adapter names (runs) kept on disk, by latest push (0: all); after each
            push, other names keep only their newest version and names beyond this many are
            deleted, except the one serving. Disk use stays under
            ``(keep + keep_names - 1)`` adapters.
        reports: the node's report numbers (``PushAdapterResponse.sequence``); default: its
            own.
    """

    def __init__(self, engine: BatchScheduler, store: AdapterStore, identity: ModelIdentity,
                 max_bytes: int, keep: int = 8, keep_names: int = 4,
                 reports: ReportSequence | None = None) -> None:
        self.engine = engine
        self.reports = reports or ReportSequence()
        self.keep = keep
        self.keep_names = keep_names
        self.backend: Backend = engine.backend
        self.store = store
        self.identity = identity
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # one push / reload applies at a time
        self._keys = itertools.count(1)
        self._stored = self._listing()  # replaced under the lock, read without it
        self.relays = RelayTable()  # versions held for relaying to peers (relay.py)

    def stored_refs(self) -> list[common_pb2.AdapterRef]:
        """Every stored push as an AdapterRef, by name then version, as the store holds them
        once the pushes answered so far are written (a snapshot: never waits on a push)."""
        return [common_pb2.AdapterRef(name=n, version=v) for n, v in self._stored]

    def _listing(self) -> tuple[tuple[str, int], ...]:
        return tuple((s.name, s.version) for s in self.store.pushed())

    def _lock_until(self, deadline: ApplyDeadline, what: str) -> None:
        """Take the lock, waiting at most until the deadline.

        Raises:
            StatusError: DEADLINE_EXCEEDED (the lock stayed held: another push or reload).
        """
        left = deadline.left()
        if not self._lock.acquire(timeout=-1 if left is None else left):
            raise deadline.expired(what)

    def _call(self, fn: Callable[[], object], deadline: ApplyDeadline, what: str,
              scope: str | None = None):
        """Run ``fn`` between two decode steps (preempting the batch in progress; between two
        batches on a backend whose interruption is not synchronous, vLLM's) if it can start
        before the deadline. ``scope``: the adapter name it replaces (only that name's rows,
        and those following the serving adapter, restart; None: every row).

        Raises:
            StatusError: DEADLINE_EXCEEDED when it could not start in time (it never will).
        """
        try:
            return self.engine.call_between_batches(fn, timeout=deadline.left(),
                                                    preempt=self.backend.interrupt_is_synchronous,
                                                    scope=scope)
        except TimeoutError:
            raise deadline.expired(what) from None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every push is stored on disk; False if ``timeout`` (s) passed first."""
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._lock.release()
        return True

    # -- PushAdapter -------------------------------------------------------------------------

    def push(self, requests: Iterable[rollout_pb2.PushAdapterRequest],
             deadline: ApplyDeadline = NO_DEADLINE) -> rollout_pb2.PushAdapterResponse:
        """Receive, verify, convert, store and (unless stage_only) serve a pushed adapter,
        interrupting the batch in progress at its next decode step (module docstring).

        Returns:
            the adapter serving afterwards, whether the files were converted, bytes received
            and the phase timings (seconds).
        Raises:
            StatusError: INVALID_ARGUMENT (malformed stream or manifest, files that are not the
                declared format or do not parse, an adapter that cannot be converted), DATA_LOSS (truncated
                stream, sha256 mismatch), RESOURCE_EXHAUSTED (over ``max_bytes``),
                FAILED_PRECONDITION (made for another base model, or tensors that do not fit
                it), ALREADY_EXISTS (that name and version is stored with other contents),
                CANCELLED (the client cancelled the stream), DEADLINE_EXCEEDED (it could not
                be applied before ``deadline``: it never will be). Nothing changes on any
                error.
        """
        start = time.perf_counter()
        stream = iter(requests)
        buffer: RelayBuffer | None = None
        try:
            first = next(stream, None)
            if first is not None and first.WhichOneof("payload") == "header":
                check_header(first.header.manifest, self.identity)
                if first.header.HasField("relay"):  # relay fan-out: serve pieces as they come
                    validate_manifest(first.header.manifest, self.max_bytes)
                    buffer = self.relays.open(first.header.manifest, first.header.relay)
            # a relayed push is received into its relay buffer: its pieces are served to the
            # plan's readers as they are verified, and its files are the buffer's
            received = receive_push(_chain(first, stream), self.max_bytes, into=buffer)
        except grpc.RpcError as e:
            if buffer is not None:
                buffer.fail("the push stream ended early")
            raise StatusError(Kind.CANCELLED,
                              "push stream ended by the client before it was complete; "
                              "nothing changed") from e
        except StatusError as e:
            if buffer is not None:
                buffer.fail(e.message)
            raise
        return self._apply_received(received, start, deadline)

    def fetch(self, request: rollout_pb2.FetchAdapterRequest, read: ReadFn,
              deadline: ApplyDeadline = NO_DEADLINE) -> rollout_pb2.FetchAdapterResponse:
        """Fetch an adapter from the peers in ``request.sources`` (relay fan-out), checking
        every piece and file against the trainer's digests, then apply it as :meth:`push`
        does. Its verified pieces are served to ``request.relay.readers`` meanwhile.

        Args:
            request: the manifest (every sha256 given), the relay plan and the sources.
            read: ``read(address, ReadAdapterRequest, timeout_s)`` -> the ReadAdapter stream
                of that peer.
            deadline: by when it must be applied (also bounds the fetch).
        Raises:
            StatusError: as :meth:`push`; INVALID_ARGUMENT (no sources, a plan that does not
                fit the manifest); UNAVAILABLE (no source delivered the whole adapter);
                DATA_LOSS (a source sent a piece whose sha256 does not match and none
                completed it). Nothing changes on any error.
        """
        start = time.perf_counter()
        manifest = request.manifest
        validate_manifest(manifest, self.max_bytes)
        check_header(manifest, self.identity)
        if not request.sources:
            raise invalid_argument("sources", "give at least one node that holds the adapter")
        held = self.relays.held(manifest.name, manifest.version)
        if held is not None and held.same_plan(manifest, request.relay):
            buffer, outcome = held, FetchOutcome(source="(held)")  # a retry: already here
            files = buffer.files()
        else:
            buffer = self.relays.open(manifest, request.relay)
            try:
                outcome = fetch_pieces(buffer, list(request.sources), read, deadline.at,
                                       deadline.caller_active)
                files = buffer.files()  # each file's sha256 checked against the manifest
            except StatusError as e:
                buffer.fail(e.message)
                self.relays.drop(buffer)
                raise
        received = ReceivedAdapter(manifest=manifest, stage_only=False, files=files,
                                   bytes_received=buffer.total, receive_s=outcome.receive_s,
                                   verify_s=buffer.verify_s)
        pushed = self._apply_received(received, start, deadline)
        log.info("fetched %s v%d from %s (%d source(s) failed: %s)", manifest.name,
                 manifest.version, outcome.source, len(outcome.failures),
                 "; ".join(f"{a}: {w}" for a, w in outcome.failures.items()) or "-")
        return rollout_pb2.FetchAdapterResponse(
            serving=pushed.serving, bytes_received=received.bytes_received,
            timings=pushed.timings, sequence=pushed.sequence, source=outcome.source,
            source_failures=len(outcome.failures))

    def _apply_received(self, received: ReceivedAdapter, start: float,
                        deadline: ApplyDeadline) -> rollout_pb2.PushAdapterResponse:
        """Check a received adapter's files against the base model, convert, store and swap
        (the rest of :meth:`push` and :meth:`fetch`)."""
        metrics.PUSH_BYTES.inc(received.bytes_received)
        ready = check_and_convert(received, self.identity, self.backend.adapter_format)
        name, version, pushed_format = ready.name, ready.version, ready.pushed_format
        converted, verify_s, convert_s = ready.converted, ready.verify_s, ready.convert_s
        applied = self._store_and_apply(ready.files, ready.meta, received.stage_only, deadline)
        total = time.perf_counter() - start
        for phase, seconds in (("receive", received.receive_s), ("verify", verify_s),
                               ("convert", convert_s), ("apply", applied.apply_s),
                               ("total", total)):
            metrics.PUSH_DURATION.labels(phase).observe(seconds)
        log.info("push %s v%d (%s%s, %d bytes): receive %.3fs verify %.3fs convert %.3fs "
                 "apply %.3fs%s", name, version, pushed_format,
                 f" -> {self.backend.adapter_format}" if converted else "",
                 received.bytes_received, received.receive_s, verify_s, convert_s,
                 applied.apply_s, " (staged only)" if received.stage_only else "")
        return rollout_pb2.PushAdapterResponse(
            serving=_ref(applied.serving), converted=converted,
            sequence=self.reports.next(),  # after the swap: later than any report before it
            bytes_received=received.bytes_received,
            timings=rollout_pb2.PushTimings(receive_s=received.receive_s, verify_s=verify_s,
                                            convert_s=convert_s, apply_s=applied.apply_s))

    def _store_and_apply(self, files: dict[str, bytes], meta: dict, stage_only: bool,
                         deadline: ApplyDeadline) -> _Applied:
        name, version = meta["name"], meta["version"]
        what = f"push {name} v{version}"
        self._lock_until(deadline, what)
        storing = False  # True once a background thread owns the lock
        try:
            existing = self.store.get(name, version)
            if existing is not None:
                if existing.file_digests != {f["path"]: f["sha256"]
                                             for f in meta["manifest"]["files"]}:
                    raise StatusError(Kind.ALREADY_EXISTS,
                                      f"header.manifest.version: {name} v{version} is already "
                                      "stored with different files; push a new version")
                # The same push again (a retry): serve what is stored.
                if stage_only:
                    return _Applied(self.engine.serving, 0.0)
                return self._switch(existing, deadline)
            t = time.perf_counter()
            nbytes = sum(len(data) for data in files.values())
            self.engine.check_fits(name, nbytes)
            if stage_only:  # check that it loads, store it, keep serving what serves
                self._call(lambda: self.backend.unload_adapter(
                    self._load_files(files, name, version)), deadline, what, scope=name)
                self._store(files, meta)
                serving = self.engine.serving
            else:
                after = self.store.after_push(name, version, self.keep, self.keep_names)
                serving = self._call(
                    lambda: self._load_swap(files, name, version, deadline, what, after,
                                            nbytes),
                    deadline, what, scope=name)
                threading.Thread(target=self._store_in_background, args=(files, meta),
                                 name=f"store-{name}-v{version}", daemon=True).start()
                storing = True
            apply_s = time.perf_counter() - t
            metrics.ADAPTER_APPLY_DURATION.observe(apply_s)
            return _Applied(serving, apply_s)
        finally:
            if not storing:
                self._lock.release()

    def _load_swap(self, files: dict[str, bytes], name: str, version: int,
                   deadline: ApplyDeadline, what: str,
                   stored_after: list[tuple[str, int]], nbytes: int = 0) -> ServingAdapter:
        """On the scheduler thread: load ``files`` from memory and, if still in time, serve
        them (the stored-adapters snapshot becomes ``stored_after``)."""
        handle = self._load_files(files, name, version)
        self._swap_in_time(ServingAdapter(name=name, version=version, handle=handle,
                                          nbytes=nbytes), deadline, what, stored_after)
        return self.engine.serving

    def _swap_in_time(self, adapter: ServingAdapter, deadline: ApplyDeadline, what: str,
                      stored_after: list[tuple[str, int]] | None = None) -> None:
        """On the scheduler thread: serve a loaded ``adapter`` unless the deadline passed (then
        unload it and raise DEADLINE_EXCEEDED / CANCELLED: nothing changed)."""
        try:
            deadline.check(what)
        except StatusError:
            if adapter.handle is not None:
                self.backend.unload_adapter(adapter.handle)
            raise
        self._swap(adapter)
        if stored_after is not None:
            self._stored = tuple(stored_after)

    def _key(self, name: str, version: int) -> str:
        """A backend key never used before by this node, naming the adapter (a vLLM backend
        serves it under this name): ``<name>-v<version>-<n>``, characters other than letters,
        digits, '-' and '_' replaced by '_'."""
        return f"{re.sub(r'[^A-Za-z0-9_-]', '_', name)}-v{version}-{next(self._keys)}"

    def _load_files(self, files: dict[str, bytes], name: str, version: int):
        try:
            return self.backend.load_adapter_files(files, self._key(name, version))
        except AdapterLoadError as e:
            raise failed_precondition(f"adapter: {e}") from e
        except ConnectionError as e:  # the backend's server (vLLM) is unreachable
            raise StatusError(Kind.UNAVAILABLE, f"adapter: {e}") from e

    def _store(self, files: dict[str, bytes], meta: dict) -> None:
        """Write a push into the store (staging directory, then renamed) and prune old
        versions. Caller holds the lock.

        Raises:
            OSError: the disk refused (nothing is left behind).
        """
        name, version = meta["name"], meta["version"]
        staged = self.store.stage(files, meta)
        try:
            self.store.commit(staged, name, version)
        finally:
            self.store.discard(staged)  # no-op once renamed into the store
        current = self.engine.serving
        pruned = self.store.prune(name, self.keep, protect=(current.name, current.version))
        if pruned:
            log.info("deleted %s versions %s (--keep-adapters %d)", name, pruned, self.keep)
        pruned_names = self.store.prune_names(name, self.keep_names,
                                              protect=(current.name, current.version))
        if pruned_names:
            log.info("deleted %s (older runs: their newest version kept, %s names at most; "
                     "--keep-runs)", ", ".join(pruned_names), self.keep_names or "all")
        self._stored = self._listing()

    def _store_in_background(self, files: dict[str, bytes], meta: dict) -> None:
        """:meth:`_store` after the reply, then release the lock the push acquired."""
        try:
            self._store(files, meta)
        except Exception:
            log.exception("storing %s v%d failed: it serves, but ReloadAdapter and retries "
                          "cannot find it on disk", meta["name"], meta["version"])
            self._stored = self._listing()
        finally:
            self._lock.release()

    def _load(self, directory: Path, name: str, version: int):
        try:
            return self.backend.load_adapter(directory, self._key(name, version))
        except AdapterLoadError as e:
            raise failed_precondition(f"adapter: {e}") from e
        except ConnectionError as e:  # the backend's server (vLLM) is unreachable
            raise StatusError(Kind.UNAVAILABLE, f"adapter: {e}") from e

    def _swap(self, adapter: ServingAdapter) -> None:
        """On the scheduler thread: serve ``adapter``; the scheduler keeps it resident with
        the other runs' adapters and unloads the version it replaces (and the least recently
        used past its bounds) once no batch uses them."""
        self.engine.set_serving(adapter)
        log.info("serving %s", f"{adapter.name} v{adapter.version}" if adapter.handle is not None
                 else "the base model")

    # -- ReloadAdapter -----------------------------------------------------------------------

    def reload(self, request: rollout_pb2.ReloadAdapterRequest,
               deadline: ApplyDeadline = NO_DEADLINE) -> rollout_pb2.ReloadAdapterResponse:
        """Serve a stored push (by version), a directory under the adapter root (by path), or
        the base model, interrupting the batch in progress at its next decode step.

        A directory without gridrl metadata is served under its relative path as the name and
        version 0. A directory in the other adapter format is converted in memory.

        Raises:
            StatusError: INVALID_ARGUMENT (no target; ``path`` empty, absolute or leaving the
                root; ``version`` 0 or ambiguous), NOT_FOUND (no such version or directory),
                FAILED_PRECONDITION (the adapter does not fit the base model or cannot be
                read), DEADLINE_EXCEEDED (not applied before ``deadline``: it never will be).
                Nothing changes on any error.
        """
        target = request.WhichOneof("target")
        start = time.perf_counter()
        what = f"reload {target}"
        self._lock_until(deadline, what)
        try:
            if target == "base_model":
                if not request.base_model:
                    raise invalid_argument("base_model", "must be true to select the base model")
                self._call(lambda: self._swap_in_time(BASE_MODEL, deadline, what), deadline,
                           what, scope="")
            elif target == "version":
                if request.version < 1:
                    raise invalid_argument("version", "must be >= 1 (use base_model for the "
                                                      "base model)")
                stored = self.store.by_version(request.version, self.engine.serving.name)
                self._switch(stored, deadline)
            elif target == "path":
                stored = self.store.describe(self.store.resolve(request.path))
                self._switch(stored, deadline)
            else:
                raise invalid_argument("target", "set one of version, path or base_model")
        finally:
            self._lock.release()
        apply_s = time.perf_counter() - start
        metrics.ADAPTER_APPLY_DURATION.observe(apply_s)
        return rollout_pb2.ReloadAdapterResponse(serving=_ref(self.engine.serving),
                                                 apply_s=apply_s)

    def _switch(self, stored: StoredAdapter, deadline: ApplyDeadline) -> _Applied:
        """Load a stored directory (converting a foreign format through a staging copy) and
        serve it; a no-op when it is already serving."""
        serving = self.engine.serving
        if serving.handle is not None and (serving.name, serving.version) == (
                stored.name, stored.version) and stored.version > 0:
            return _Applied(serving, 0.0)
        t = time.perf_counter()
        staged = None
        directory = stored.path
        recorded = stored.meta.get("manifest", {}).get("base_model")
        if isinstance(recorded, dict):  # what it was pushed for: refuse another checkpoint
            try:
                check_fits(AdapterManifest(base_model=ModelIdentity.from_any(recorded)),
                           self.identity)
            except AdapterError as e:
                raise failed_precondition(f"adapter: {e}") from e
        try:
            fmt = detect_format(p.name for p in directory.iterdir())
        except AdapterError as e:
            raise failed_precondition(f"path: {e}") from e
        if fmt != self.backend.adapter_format:
            try:
                files = convert_files(read_dir(directory), self.backend.adapter_format,
                                      num_layers=self.identity.num_layers)
                check_fits(files, self.identity)
            except AdapterError as e:
                raise failed_precondition(f"adapter: {e}") from e
            staged = directory = self.store.stage(files, stored.meta)
        try:
            what = f"{stored.name} v{stored.version}"

            nbytes = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
            self.engine.check_fits(stored.name, nbytes)

            def apply() -> None:
                handle = self._load(directory, stored.name, stored.version)
                self._swap_in_time(ServingAdapter(name=stored.name, version=stored.version,
                                                  handle=handle, nbytes=nbytes), deadline, what)

            self._call(apply, deadline, what, scope=stored.name)
        finally:
            if staged is not None:
                self.store.discard(staged)
        return _Applied(self.engine.serving, time.perf_counter() - t)


def _chain(first: rollout_pb2.PushAdapterRequest | None,
           rest: Iterator[rollout_pb2.PushAdapterRequest]
           ) -> Iterator[rollout_pb2.PushAdapterRequest]:
    if first is not None:
        yield first
        yield from rest


def _ref(adapter: ServingAdapter) -> common_pb2.AdapterRef:
    return common_pb2.AdapterRef(name=adapter.name, version=adapter.version)
