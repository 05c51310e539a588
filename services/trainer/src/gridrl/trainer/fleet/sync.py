"""Weight sync: stream the trainer's LoRA adapter to every rollout node with ``PushAdapter``.

    sync = AdapterSync(pool, name="run-1", base_model=identity, deadline_s=30)
    report = sync.push(version, files)               # every --sync-every steps
    report.synced, report.skipped                    # addresses; address -> reason
    sync.lagging_nodes(version)                      # nodes still behind: warn loudly

Each node gets the adapter in the format it declared: peft files as they are (torch, vLLM),
converted once per version with ``gridrl.adapters.convert_files(..., "mlx")`` for MLX nodes
(the files per format, their manifests and relay plans: :mod:`.payloads`),
each with its manifest (:class:`gridrl.adapters.AdapterManifest`, built from the files,
the run name, the version and the base model; converted to the wire's message only by the
push stream, ``gridrl.common.transport.push_requests``).
Pushes go to all nodes concurrently, each with its own deadline, so a push takes about the
slowest node's time, never the sum. A node that fails or misses the deadline is reported in
``skipped`` and benched by the pool (it would sample a stale policy); nodes out of rotation are
skipped without a call. The newest (version, files) is remembered and made the pool's target
(:meth:`NodePool.set_target`): a node that joins or comes back, or reports serving an older
version than it was pushed (restarted), waits out of rotation (*syncing*) and gets it in the
background first thing; once it serves it, the pool lets it in. :meth:`AdapterSync.repush`
pushes it again to one node on demand (a flagged node's way back, ``probation.py``).

Relay fan-out (``relay=True``, the default): the trainer's upload per push does not grow with
the fleet. The nodes of one adapter format form a chain (fastest last sync first, then by
address, so a node behind a slow link sits at the end and feeds no one): the trainer
pushes to the first only, with a relay plan (the sha256 of every 256 KiB piece and the nodes
allowed to read it: the other nodes of the chain, as the pool lists them from the master),
and tells each other node to fetch it (``FetchAdapter``) from the node before it, then from
the ones before that. Pieces flow on as soon as each hop has checked them, so the chain
takes about one transfer plus a piece time per node; each node checks every piece and every
file against the trainer's digests, then swaps atomically as a push does. A node whose fetch
fails (its sources died, a piece did not match, an old node without FetchAdapter, a
credential without the relay capability) or has not finished within half of ``deadline_s``
is pushed to by the trainer directly, within what is left of its one ``deadline_s``. :attr:`SyncReport.sent_bytes` is what the trainer uploaded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container, Mapping
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from gridrl.common.faults import pause_in_stream
from gridrl.common.transport import PIECE_BYTES, push_requests
from gridrl.models import ModelIdentity
from gridrl.trainer.fleet import metrics
from gridrl.trainer.fleet.outcomes import PushResult, PushStatus
from gridrl.trainer.fleet.payloads import AdapterVersion, Payloads
from gridrl.trainer.fleet.pool import NodePool, NodeState
from gridrl.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

# Nodes pushed to at the same time; beyond this, pushes queue (and their deadline starts late).
MAX_CONCURRENT_PUSHES = 256


@dataclass
class SyncReport:
    """Outcome of one push.

    Attributes:
        seconds: wall-clock seconds of the whole push (conversion included).
        synced: addresses that now serve the pushed version, sorted.
        skipped: address -> why it did not take the adapter (failed call, deadline, out of
            rotation, conversion unavailable).
        relayed: addresses (among ``synced``) that fetched it from a peer, sorted.
        sent_bytes: adapter bytes the trainer uploaded for this push (every format, direct
            fallbacks included): the adapter's size once per format when relaying works.
            A node whose fetch was refused for good (UNIMPLEMENTED: an older node;
            PERMISSION_DENIED: its credential may not read from peers, e.g. minted without
            ``--address``) is pushed to directly at every later push.
    """

    seconds: float
    synced: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    relayed: list[str] = field(default_factory=list)
    sent_bytes: int = 0


def _counted(requests, sent: list[int]):
    """``requests`` (a PushAdapter stream), adding each chunk's bytes to ``sent[0]``."""
    for message in requests:
        if message.WhichOneof("payload") == "chunk":
            sent[0] += len(message.chunk.data)
        yield message


class AdapterSync:
    """Pushes adapters to the nodes of a :class:`NodePool` and keeps late nodes caught up.

    Args:
        pool: the node pool (its nodes, channels and bookkeeping).
        name: adapter name (the run name); [A-Za-z0-9._-]+.
        base_model: the trainer's base model (the manifests' ``base_model``; its
            ``num_layers`` drives the MLX conversion).
        deadline_s: seconds one node's push may take (per node; nodes run concurrently).
        known_versions: returns the versions of this run's weights (its lineage; version 0 is
            the base model). Before the first push, a node serving ``name`` at a version
            outside them (an earlier run under the same name) is reset like another run's
            adapter. Default: only version 0.
        relay: relay fan-out (module docstring): the trainer uploads each push once per
            adapter format and the nodes pass it on; False: it pushes to every node.
        piece_bytes: relay piece size in bytes (> 0).
    """

    def __init__(self, pool: NodePool, *, name: str, base_model: ModelIdentity,
                 deadline_s: float = 30.0,
                 known_versions: Callable[[], Container[int]] | None = None,
                 relay: bool = True, piece_bytes: int = PIECE_BYTES) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s: must be > 0, got {deadline_s}")
        self.pool = pool
        self.name = name
        self.base_model = base_model
        self.deadline_s = deadline_s
        self.relay = relay
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes: must be > 0, got {piece_bytes}")
        self.piece_bytes = piece_bytes
        self._known_versions = known_versions or (lambda: (0,))
        self._lock = threading.Lock()
        self._node_locks: dict[str, threading.Lock] = {}
        self._newest: AdapterVersion | None = None
        self._no_relay: set[str] = set()  # nodes a relay was refused to (pushed directly)
        # seconds each node's last successful push or fetch took: a chain starts with the
        # fastest, so a node behind a slow link never feeds the others (unknown nodes last)
        self._sync_s: dict[str, float] = {}
        self._payloads = Payloads(name=name, base_model=base_model, piece_bytes=piece_bytes)
        # One thread per node pushed to at once (threads are started lazily, as needed).
        self._executor = futures.ThreadPoolExecutor(MAX_CONCURRENT_PUSHES,
                                                    thread_name_prefix="adapter-sync")
        self._closed = False
        pool.add_listener(self._on_node)

    def push(self, version: int, files: Mapping[str, bytes]) -> SyncReport:
        """Push policy ``version`` to every node concurrently, each within ``deadline_s``.

        Args:
            version: the policy version (>= 1, not older than the last push).
            files: the peft adapter files in memory, path -> bytes. Their manifest names
                this sync's adapter and ``version`` and gives no digests: each push hashes the
                bytes as they stream and sends the digests last.
        Returns:
            who took it and who was skipped, and why.
        Raises:
            ValueError: naming the field, when ``files`` are not a peft adapter or ``version``
                is older than the last push.
        """
        start = time.perf_counter()
        adapter = AdapterVersion(version, {"peft": (self._payloads.manifest(files, version),
                                                    dict(files))})
        if adapter.payloads["peft"][0].format != "peft":
            raise ValueError(f"files: a {adapter.payloads['peft'][0].format} adapter; pushes "
                             "start from peft files")
        with self._lock:
            if self._newest is not None and version < self._newest.version:
                raise ValueError(f"version: {version} is older than the last push "
                                 f"({self._newest.version})")
            self._newest = adapter
        self.pool.set_target(self.name, version)
        report = SyncReport(seconds=0.0)
        targets = []
        for node in self.pool.nodes():
            if node.excluded:
                continue
            if node.in_rotation or node.syncing:
                targets.append(node)
            else:
                report.skipped[node.address] = node.why_out()
        unconvertible = {}
        for fmt in sorted({n.adapter_format for n in targets}):  # outside the per-node deadlines
            try:
                self._payloads.payload(adapter, fmt)
            except Exception as e:
                log.exception("could not convert policy version %d to %s", version, fmt)
                unconvertible[fmt] = f"conversion to {fmt} failed: {e!r}"
        jobs: dict[futures.Future, str] = {}
        chains: dict[str, list[NodeState]] = {}
        for node in targets:
            if node.adapter_format in unconvertible:
                report.skipped[node.address] = self._failed(
                    node.address, version, unconvertible[node.adapter_format]).reason
            else:
                chains.setdefault(node.adapter_format, []).append(node)
        for fmt, chain in sorted(chains.items()):
            with self._lock:
                chain.sort(key=lambda n: (self._sync_s.get(n.address, float("inf")), n.address))
            with self._lock:  # nodes that cannot relay (old nodes, unbound credentials)
                direct = [n for n in chain if n.address in self._no_relay] \
                    if self.relay and len(chain) >= 2 else chain
            chain = [n for n in chain if n not in direct]
            if len(chain) < 2:
                direct, chain = direct + chain, []
            for node in direct:
                jobs[self._executor.submit(self._push_node, node, adapter)] = node.address
            if not chain:
                continue
            plan = self._payloads.relay_plan(adapter, fmt, [n.address for n in chain[1:]])
            jobs[self._executor.submit(self._push_node, chain[0], adapter, plan)] = \
                chain[0].address
            for i, node in enumerate(chain[1:], start=1):
                sources = [n.address for n in reversed(chain[max(0, i - 3):i])]
                if chain[0].address not in sources:
                    sources.append(chain[0].address)
                jobs[self._executor.submit(self._fetch_node, node, adapter, plan,
                                           sources)] = node.address
        waves = -(-len(jobs) // MAX_CONCURRENT_PUSHES) if jobs else 1
        # a relayed node's fetch and fallback push share its one deadline
        budget = waves * self.deadline_s + 5.0
        done, late = futures.wait(jobs, timeout=budget)
        for future in done:
            result = future.result()
            report.sent_bytes += result.sent_bytes
            if result.synced:
                report.synced.append(jobs[future])
                if result.relayed:
                    report.relayed.append(jobs[future])
            else:
                report.skipped[jobs[future]] = result.reason
        for future in late:  # a call outliving its own deadline: should not happen
            report.skipped[jobs[future]] = f"no answer within {self.deadline_s:.1f}s"
            self.pool.note_sync_failed(jobs[future], version, report.skipped[jobs[future]])
        report.synced.sort()
        report.relayed.sort()
        report.seconds = time.perf_counter() - start
        for address, why in sorted(report.skipped.items()):
            log.warning("sync of policy version %d: SKIPPED node %s: %s", version, address, why)
        log.debug("synced policy version %d to %d node(s) in %.2fs (%d relayed, %d skipped, "
                  "%d bytes uploaded)", version, len(report.synced), report.seconds,
                  len(report.relayed), len(report.skipped), report.sent_bytes)
        return report

    def lagging_nodes(self, current_version: int) -> list[str]:
        """Addresses of usable nodes (base model matching) whose served or last-synced policy
        version is below ``current_version`` (the version last pushed), sorted. Includes nodes
        out of rotation: they hold stale weights too."""
        return sorted(n.address for n in self.pool.nodes() if not n.excluded
                      and min(n.adapter_version, n.synced_version) < current_version)

    @property
    def newest_version(self) -> int:
        """The policy version of the newest push (0 before the first)."""
        with self._lock:
            return self._newest.version if self._newest is not None else 0

    def repush(self, address: str) -> PushResult:
        """Push the newest adapter to one node now, whatever it reports serving (a flagged
        node: its weights are suspect). A failed push benches the node; NOT_PUSHED before
        the first push or when the node is not in the pool."""
        with self._lock:
            adapter = self._newest
        if adapter is None:
            return PushResult(PushStatus.NOT_PUSHED, "no adapter pushed yet")
        node = self.pool.node(address)
        if node is None:
            return PushResult(PushStatus.NOT_PUSHED, "not in the pool")
        return self._push_node(node, adapter)

    def close(self) -> None:
        """Wait for background catch-up pushes and stop the worker threads. Idempotent."""
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    # -------------------------------------------------------------------- per node

    def _push_node(self, node: NodeState, adapter: AdapterVersion,
                   relay: rollout_pb2.RelayPlan | None = None,
                   deadline: float | None = None) -> PushResult:
        """Push ``adapter`` to one node (a failure benches it); with ``relay``, as the head
        of a relay chain (its manifest then gives every sha256). ``deadline`` (a
        ``time.monotonic()`` instant) defaults to ``deadline_s`` from now."""
        start = time.monotonic()
        deadline = start + self.deadline_s if deadline is None else deadline
        lock = self._node_lock(node.address)
        if not lock.acquire(timeout=max(0.0, deadline - start)):
            return self._failed(node.address, adapter.version,
                                f"an earlier push was still running after {self.deadline_s:.1f}s")
        try:
            # A catch-up that waited for this node's lock behind a newer push must not roll the
            # node back to the older version (it would sample a stale policy in rotation).
            if (newest := self.newest_version) > adapter.version:
                return PushResult(PushStatus.SUPERSEDED,
                                  f"superseded by policy version {newest}")
            fmt = node.adapter_format
            try:
                manifest, files = self._payloads.payload(adapter, fmt)
                if relay is not None:
                    manifest = adapter.relays[fmt][0]
            except Exception as e:
                return self._failed(node.address, adapter.version,
                                    f"conversion to {fmt} failed: {e}")
            left = deadline - time.monotonic()
            if left <= 0:
                return self._failed(node.address, adapter.version,
                                    f"deadline of {self.deadline_s:.1f}s spent converting")
            stub = rollout_pb2_grpc.RolloutServiceStub(self.pool.channel(node.address))
            sent = [0]
            try:  # the manifest becomes the wire's message in the stream's header
                requests = pause_in_stream(_counted(push_requests(manifest, files, relay=relay),
                                                    sent), "trainer.push")
                response = stub.PushAdapter(requests, timeout=left)
            except grpc.RpcError as e:
                result = self._failed(node.address, adapter.version,
                                      f"PushAdapter {e.code().name}: {e.details()}")
                return PushResult(result.status, result.reason, sent_bytes=sent[0])
            except KeyError as e:  # the node left the pool meanwhile
                return PushResult(PushStatus.NOT_PUSHED, f"left the pool: {e}",
                                  sent_bytes=sent[0])
            serving = response.serving
            if serving.name != self.name or serving.version != adapter.version:
                result = self._failed(node.address, adapter.version,
                                      f"node serves {serving.name!r} v{serving.version} after "
                                      f"the push of v{adapter.version}")
                return PushResult(result.status, result.reason, sent_bytes=sent[0])
            self.pool.note_synced(node.address, adapter.version, serving, response.sequence)
            with self._lock:
                self._sync_s[node.address] = time.monotonic() - start
            log.debug("pushed policy version %d (%s) to %s", adapter.version, fmt, node.address)
            return PushResult(PushStatus.SYNCED, sent_bytes=sent[0])
        finally:
            lock.release()

    def _fetch_node(self, node: NodeState, adapter: AdapterVersion, plan: rollout_pb2.RelayPlan,
                    sources: list[str]) -> PushResult:
        """Have one node fetch ``adapter`` from ``sources`` (relay fan-out); if it cannot
        within half of ``deadline_s`` (its sources may sit behind a slow link), push it to the
        node directly within what is left (whose failure benches it): the node's whole sync
        stays within one ``deadline_s``."""
        start = time.monotonic()
        deadline = start + self.deadline_s
        lock = self._node_lock(node.address)
        if not lock.acquire(timeout=self.deadline_s / 2):
            return self._failed(node.address, adapter.version,
                                f"an earlier push was still running after {self.deadline_s:.1f}s")
        try:
            if (newest := self.newest_version) > adapter.version:
                return PushResult(PushStatus.SUPERSEDED,
                                  f"superseded by policy version {newest}")
            manifest = adapter.relays[node.adapter_format][0]
            request = rollout_pb2.FetchAdapterRequest(manifest=manifest.to_proto(), relay=plan,
                                                      sources=sources)
            try:
                stub = rollout_pb2_grpc.RolloutServiceStub(self.pool.channel(node.address))
                response = stub.FetchAdapter(
                    request, timeout=max(0.01, start + self.deadline_s / 2 - time.monotonic()))
            except grpc.RpcError as e:
                why = f"FetchAdapter {e.code().name}: {e.details()}"
                if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED) \
                        or "PERMISSION_DENIED" in (e.details() or ""):
                    with self._lock:  # it never will: push to it directly from now on
                        self._no_relay.add(node.address)
                    why += "; pushing to it directly from now on"
            except KeyError as e:
                return PushResult(PushStatus.NOT_PUSHED, f"left the pool: {e}")
            else:
                serving = response.serving
                if serving.name == self.name and serving.version == adapter.version:
                    self.pool.note_synced(node.address, adapter.version, serving,
                                          response.sequence)
                    with self._lock:
                        self._sync_s[node.address] = time.monotonic() - start
                    log.debug("node %s fetched policy version %d from %s", node.address,
                              adapter.version, response.source)
                    return PushResult(PushStatus.SYNCED, relayed=True)
                why = (f"node serves {serving.name!r} v{serving.version} after fetching "
                       f"v{adapter.version}")
        finally:
            lock.release()
        metrics.SYNC_FAILURES.labels(node.address).inc()
        log.warning("relay of policy version %d to node %s failed (%s); pushing it directly",
                    adapter.version, node.address, why)
        return self._push_node(node, adapter, deadline=deadline)

    def _failed(self, address: str, version: int, reason: str) -> PushResult:
        metrics.SYNC_FAILURES.labels(address).inc()
        self.pool.note_sync_failed(address, version, reason)
        return PushResult(PushStatus.FAILED, reason)

    def _node_lock(self, address: str) -> threading.Lock:
        with self._lock:
            return self._node_locks.setdefault(address, threading.Lock())

    # ------------------------------------------------------------------- catch-up

    def _on_node(self, node: NodeState) -> None:
        """Pool listener: a node joined, came back, or lost its adapter; catch it up. Before
        the first push, a node serving another run's adapter is reset to the base model."""
        with self._lock:
            adapter = self._newest
        if self._closed or node.excluded:
            return
        if adapter is None:
            if node.adapter_name not in ("", self.name):
                self._submit(self._reset_to_base, node.address,
                             f"another run's adapter {node.adapter_name!r}")
            elif (node.adapter_name == self.name
                  and node.adapter_version not in self._known_versions()):
                self._submit(self._reset_to_base, node.address,
                             f"{node.adapter_name!r} v{node.adapter_version}, a version this "
                             "run's checkpoint does not hold (steps after it, or an earlier "
                             "run of the same name)")
            return
        if node.synced_version >= adapter.version and node.adapter_version >= adapter.version:
            return
        self._submit(self._catch_up, node.address, adapter)

    def _submit(self, fn, *args) -> None:
        try:
            self._executor.submit(fn, *args)
        except RuntimeError:  # shut down meanwhile
            pass

    def _reset_to_base(self, address: str, serving: str) -> None:
        """Make a node that serves weights other than this run's (``serving``, in words)
        serve the base model (version 0)."""
        log.warning("node %s serves %s, not this run's weights; switching it to the base "
                    "model until the first sync", address, serving)
        try:
            response = rollout_pb2_grpc.RolloutServiceStub(self.pool.channel(address)).ReloadAdapter(
                rollout_pb2.ReloadAdapterRequest(base_model=True), timeout=self.deadline_s)
        except (grpc.RpcError, KeyError) as e:
            reason = (f"ReloadAdapter {e.code().name}: {e.details()}"
                      if isinstance(e, grpc.RpcError) else "left the pool")
            log.warning("node %s: could not switch to the base model: %s", address, reason)
            self.pool.note_sync_failed(address, 0, f"serves {serving} "
                                                   f"and {reason}")
            return
        self.pool.note_synced(address, 0, response.serving)

    def _catch_up(self, address: str, adapter: AdapterVersion) -> None:
        """Give a late node the newest adapter, unless it already serves it."""
        with self._lock:
            if self._newest is not adapter:  # a newer push reaches it (or skips it) anyway
                return
        node = self.pool.node(address)
        if node is None or not (node.in_rotation or node.syncing):
            return
        try:
            info = rollout_pb2_grpc.RolloutServiceStub(self.pool.channel(address)).GetNodeInfo(
                rollout_pb2.GetNodeInfoRequest(), timeout=self.deadline_s).info
            held = [ref for ref in (info.adapter, *info.resident_adapters)
                    if ref.name == self.name and ref.version == adapter.version]
            if held:  # serving, or resident beside other runs' adapters
                self.pool.note_synced(address, adapter.version, held[0])
                return
        except (grpc.RpcError, KeyError):
            pass  # the push below reports the problem
        result = self._push_node(node, adapter)
        if result.synced:
            log.info("caught up node %s to policy version %d", address, adapter.version)
        elif result.status is PushStatus.FAILED:
            log.warning("catch-up of node %s to policy version %d failed: %s", address,
                        adapter.version, result.reason)
        else:
            log.debug("catch-up of node %s to policy version %d: %s", address, adapter.version,
                      result.reason)

