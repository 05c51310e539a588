"""The pool of rollout nodes: who can sample, and the spreading of a step's groups over them.

    pool = NodePool(master="master:50050", addresses=[], model_identity=identity)
    pool.start()                       # follows WatchNodes; probes static addresses
    pool.wait_for_nodes(1, timeout_s=60)
    groups = pool.generate_groups(prompts, group_size=8, max_tokens=128, temperature=1.0)

Membership: nodes come from the master (``WatchNodes``, reconnecting if the master restarts)
and/or from static ``--rollout`` addresses (probed with ``GetNodeInfo``). A node whose base
model (architecture, hidden_size, num_layers, vocab_size, and the weights' fingerprint when
both sides know it: another fine-tune of the same architecture) differs from
``model_identity`` is logged loudly and excluded from rollouts and sync.

Rotation: a node takes groups while it is healthy (master status HEALTHY, or its last probe
answered), usable (base model matches) and not benched. It is benched after
``max_consecutive_failures`` failed or timed-out Generate calls in a row, or when an adapter
push to it failed (it would sample a stale policy). It comes back when the master reports it
healthy again (a JOINED / CHANGED event) or a ``GetNodeInfo`` probe answers (every
``probe_interval_s``, doubling each time the node is benched again before a Generate
succeeds on it, so a node that answers probes but fails every Generate does not flap); listeners (:meth:`NodePool.add_listener`, the adapter sync) are
told, so it gets the newest adapter first thing. They are also told when a node reports serving
an older policy than was pushed to it (it restarted).

Scheduling: one ``Generate`` per group (the group stays on one node: prompt-prefix locality);
the groups of a call are in flight concurrently over every node in rotation, a node holding at
most ``max(1, capacity // group_size)`` groups at a time, the least loaded (in-flight groups /
slots) first. A failed group is retried on a node it has not failed on if one is in rotation,
on the same node only when no other is.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from typing import Any

import grpc

from gridrl.common.channel import dial
from gridrl.common.security import Security
from gridrl.trainer import metrics
from gridrl.trainer.rollouts import Group, group_seed, sample_from_proto
from gridrl.trainer.watch import MasterWatch
from gridrl.v1 import common_pb2, registry_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

IDENTITY_KEYS = ("architecture", "hidden_size", "num_layers", "vocab_size")
_BACKENDS = {common_pb2.BACKEND_TORCH: "torch", common_pb2.BACKEND_MLX: "mlx",
             common_pb2.BACKEND_VLLM: "vllm"}
_FORMATS = {common_pb2.ADAPTER_FORMAT_PEFT: "peft", common_pb2.ADAPTER_FORMAT_MLX: "mlx"}
# Seconds the scheduler sleeps between looks at the pool while groups are in flight.
_POLL_S = 0.1
# Seconds a node missing from the snapshot of a reconnected master stays in the pool (a master
# restarted without its store learns the nodes again as they re-register, within a heartbeat).
ORPHAN_GRACE_S = 30.0
# A node given no group for REEXPLORE_AFTER times its group latency (and at least
# REEXPLORE_MIN_S) is tried again as if unmeasured: a slow node is not starved forever.
REEXPLORE_AFTER = 20.0
REEXPLORE_MIN_S = 120.0
# Weight of the newest call in a node's moving-average group latency.
LATENCY_EWMA = 0.3
# Most seconds between probes of a node benched again and again (answers GetNodeInfo but keeps
# failing Generate): the probe interval doubles at each benching, up to this.
MAX_PROBE_BACKOFF_S = 60.0


@dataclass
class NodeState:
    """What the pool knows about one rollout node (a copy; mutating it changes nothing).

    Attributes:
        address: host:port.
        backend: ``"torch"``, ``"mlx"`` or ``"vllm"`` ("" before the node was reached).
        adapter_format: adapter layout the node loads natively, ``"peft"`` or ``"mlx"``.
        capacity: sequences the node decodes together in one batch.
        healthy: master status HEALTHY (master nodes) or last probe answered (static nodes).
        in_rotation: healthy, base model matches, not benched: it is given groups.
        adapter_version: policy version the node last reported serving (0 = base model).
        synced_version: policy version last pushed to it successfully (0 = none).
        failures: consecutive failed or timed-out Generate calls.
        adapter_name: name of the adapter it last reported serving ("" = base model).
        source: ``"master"`` or ``"static"``.
        excluded: why the node is never used (base model mismatch); "" when usable.
        benched: why it left rotation (failures, failed push); "" when not benched.
        last_error: the last failure seen on it.
        max_n, max_tokens, max_context: the node's request bounds (0 = unknown).
        dtype: the node's compute dtype, e.g. ``"float32"``, ``"bfloat16"`` ("" = unknown).
        in_flight: groups being sampled on it now.
        group_s: moving average of its Generate calls' seconds (a group's latency there,
            queueing included; 0 = not measured yet). Groups go where they are expected to
            finish first (see :meth:`NodePool.generate_groups`).
    """

    address: str
    backend: str = ""
    adapter_format: str = "peft"
    capacity: int = 1
    dtype: str = ""
    healthy: bool = False
    in_rotation: bool = False
    adapter_version: int = 0
    synced_version: int = 0
    failures: int = 0
    adapter_name: str = ""
    source: str = "static"
    excluded: str = ""
    benched: str = ""
    last_error: str = ""
    max_n: int = 0
    max_tokens: int = 0
    max_context: int = 0
    in_flight: int = 0
    group_s: float = 0.0


@dataclass
class _Batch:
    """The bookkeeping of one ``generate_groups`` call."""

    prompts: list[list[int]]
    sampling: common_pb2.SamplingParams  # seed set per group
    seed: int
    results: list[Group | None] = field(default_factory=list)
    tried: list[list[str]] = field(default_factory=list)  # nodes each group failed on
    rejected: list[dict[str, str]] = field(default_factory=list)  # INVALID_ARGUMENT per node
    pending: deque[int] = field(default_factory=deque)
    in_flight: dict[futures.Future, tuple[int, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.prompts)
        self.tried = [[] for _ in self.prompts]
        self.rejected = [{} for _ in self.prompts]
        self.pending = deque(range(len(self.prompts)))


class _Node:
    """A node's state plus what only the pool touches (channel, timestamps)."""

    def __init__(self, address: str, source: str) -> None:
        self.state = NodeState(address=address, source=source)
        self.static = source == "static"
        self.from_master = source == "master"
        self.channel: grpc.Channel | None = None
        self.retired: list[grpc.Channel] = []  # replaced channels, closed once calls drain
        self.synced_at = 0.0  # monotonic time of the last successful push
        self.last_assigned = 0  # scheduler tick of the last group given to it
        self.reached = False  # answered at least once (probe or master record)
        self.orphan_since: float | None = None  # missing from the master's last snapshot
        self.strikes = 0  # benchings since its last successful Generate
        self.probe_after = 0.0  # monotonic time before which it is not probed
        self.last_call_at = 0.0  # monotonic time the last Generate on it was started


class NodePool:
    """Rollout nodes from the master and/or static addresses; implements ``RolloutSource``.

    Args:
        master: host:port of the master to follow, or None.
        addresses: static rollout node addresses (host:port).
        model_identity: the trainer's base model: a mapping (or dataclass such as
            ``gridrl.models.ModelIdentity``) with architecture, hidden_size, num_layers,
            vocab_size, and optionally weights_fingerprint (compared when both are known).
        security: TLS files and token for the nodes and the master
            (:class:`gridrl.common.security.Security`), if any.
        request_timeout_s: deadline of one Generate call, seconds.
        max_consecutive_failures: failed Generate calls in a row that bench a node.
        probe_interval_s: seconds between GetNodeInfo probes of unreachable or benched nodes.
        max_workers: threads issuing Generate calls (bounds groups in flight over all nodes).

    Raises:
        ValueError: naming the argument, when neither a master nor addresses are given, a
            model_identity key is missing, or a number is out of range.
    """

    def __init__(self, *, master: str | None, addresses: Sequence[str],
                 model_identity: Mapping[str, Any] | Any, security: Security | None = None,
                 request_timeout_s: float = 120.0, max_consecutive_failures: int = 3,
                 probe_interval_s: float = 5.0, max_workers: int = 64) -> None:
        if not master and not addresses:
            raise ValueError("master / addresses: give a master or at least one rollout address")
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {request_timeout_s}")
        if max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures: must be >= 1, got "
                             f"{max_consecutive_failures}")
        identity = asdict(model_identity) if is_dataclass(model_identity) else dict(model_identity)
        missing = [k for k in IDENTITY_KEYS if k not in identity]
        if missing:
            raise ValueError(f"model_identity: missing {', '.join(missing)}")
        self.identity = {k: identity[k] for k in IDENTITY_KEYS}
        self.weights_fingerprint = str(identity.get("weights_fingerprint") or "")
        self.master = master
        self.security = security
        self.request_timeout_s = request_timeout_s
        self.max_consecutive_failures = max_consecutive_failures
        self.probe_interval_s = probe_interval_s
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._nodes: dict[str, _Node] = {}
        self._listeners: list[Callable[[NodeState], None]] = []
        self._snapshot: set[str] | None = None  # addresses seen in the master snapshot so far
        self._tick = 0
        self._closed = threading.Event()
        self._executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="rollout")
        self._prober = futures.ThreadPoolExecutor(8, thread_name_prefix="node-probe")
        self._probe_thread = threading.Thread(target=self._probe_loop, name="node-prober",
                                              daemon=True)
        self._watch = (MasterWatch(master, on_event=self._on_master_event,
                                   on_connect=self._on_master_connect, security=security)
                       if master else None)
        for address in dict.fromkeys(addresses):
            self._nodes[address] = _Node(address, "static")

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Follow the master's WatchNodes (when a master is set) and probe the static addresses
        with GetNodeInfo; returns at once (see :meth:`wait_for_nodes`)."""
        if self._watch is not None:
            self._watch.start()
        self._probe_thread.start()

    def close(self) -> None:
        """Stop discovery and probing, cancel calls in flight, close channels. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._watch is not None:
            self._watch.stop()
        if self._probe_thread.is_alive():
            self._probe_thread.join()
        with self._lock:
            channels = [c for n in self._nodes.values() for c in [n.channel, *n.retired]
                        if c is not None]
            for n in self._nodes.values():
                n.channel = None
                n.retired.clear()
            self._changed.notify_all()
        for channel in channels:
            channel.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._prober.shutdown(wait=True, cancel_futures=True)

    # -------------------------------------------------------------------- queries

    def nodes(self) -> list[NodeState]:
        """Copies of every known node's state, ordered by address."""
        with self._lock:
            return [replace(self._nodes[a].state) for a in sorted(self._nodes)]

    def node(self, address: str) -> NodeState | None:
        """A copy of one node's state, or None when unknown."""
        with self._lock:
            node = self._nodes.get(address)
            return replace(node.state) if node else None

    def add_listener(self, fn: Callable[[NodeState], None]) -> None:
        """Call ``fn(state)`` whenever a node joins or comes back into rotation, or reports
        serving an older policy version than was pushed to it. Called from the pool's threads
        (master watch, prober, scheduler): ``fn`` must return quickly."""
        with self._lock:
            self._listeners.append(fn)

    def wait_for_nodes(self, min_nodes: int = 1, timeout_s: float = 60.0) -> list[NodeState]:
        """Block until at least ``min_nodes`` nodes are in rotation; returns :meth:`nodes`.

        Raises:
            TimeoutError: after ``timeout_s`` seconds, naming every known node and its state
                (and the master's connection state).
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while sum(n.state.in_rotation for n in self._nodes.values()) < min_nodes:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    raise TimeoutError(f"{self._count_in_rotation()} of {min_nodes} rollout "
                                       f"node(s) in rotation after {timeout_s:.1f}s: "
                                       f"{self._describe()}")
                self._changed.wait(min(left, 0.5))
            return self.nodes()

    # ------------------------------------------------------------------ rollouts

    def generate_groups(self, prompts: Sequence[Sequence[int]], *, group_size: int,
                        max_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
                        seed: int = 0, stop_token_ids: Sequence[int] = ()) -> list[Group]:
        """Sample one group of ``group_size`` completions per prompt over the nodes in rotation.

        Group ``i`` is one ``Generate(prompt_token_ids=prompts[i], sampling.n=group_size,
        sampling.seed=group_seed(seed, i))`` on one node; the groups run concurrently.

        Each group goes to the node where it is expected to finish first (earliest finish
        time, as list schedulers such as HEFT do, Topcuoglu et al. 2002): a node with a free
        slot (``capacity // group_size`` groups at a time) finishes it in its measured group
        latency (``NodeState.group_s``); a full node in ``1 + (in_flight + waiting) // slots``
        times that, ``waiting`` being the groups of this batch already waiting ahead (a full
        node not measured yet is not waited for).
        So a node several times slower than another (an MLX node on a Linux CPU beside a torch
        one) gets groups only while the fast node is that far behind, instead of holding every
        step back by its own latency. A node not measured yet counts as instant (it is tried),
        and one left idle for ``REEXPLORE_AFTER`` latencies (at least ``REEXPLORE_MIN_S``) is
        tried again, in case it got faster.

        Returns:
            one :class:`Group` per prompt, in the order of ``prompts``.
        Raises:
            ValueError: naming the argument when group_size / max_tokens < 1, or when every
                node in rotation rejected a prompt as INVALID_ARGUMENT (message from the node).
            RuntimeError: when no node in rotation is left to serve a group (every node dead,
                benched, unhealthy or excluded), naming each node and why; or when a group
                failed on every node ``max_consecutive_failures`` times.
        """
        if group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {group_size}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
        if self._closed.is_set():
            raise RuntimeError("the node pool is closed")
        sampling = common_pb2.SamplingParams(
            n=group_size, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, stop_token_ids=list(stop_token_ids))
        batch = _Batch([list(p) for p in prompts], sampling, seed)
        try:
            self._schedule(batch)
        finally:  # on an error, groups not started yet are dropped; running ones drain
            for future in batch.in_flight:
                future.cancel()
        return [g for g in batch.results if g is not None]

    def _schedule(self, batch: _Batch) -> None:
        """The scheduling loop of :meth:`generate_groups` (fills ``batch.results``)."""
        prompts, results, tried, rejected = batch.prompts, batch.results, batch.tried, batch.rejected
        pending, in_flight = batch.pending, batch.in_flight
        group_size, max_tokens = batch.sampling.n, batch.sampling.max_tokens
        while pending or in_flight:
            waiting = 0  # groups ahead of the next one that wait for a node this round
            for i in list(pending):
                address = self._assign(len(prompts[i]), group_size, max_tokens, tried[i],
                                       rejected[i], ahead=waiting)
                if address is None:
                    waiting += 1
                    continue
                pending.remove(i)
                request = rollout_pb2.GenerateRequest(
                    prompt_token_ids=prompts[i], request_id=f"group-{i}-try-{len(tried[i])}",
                    sampling=batch.sampling)
                request.sampling.seed = group_seed(batch.seed, i)
                future = self._executor.submit(self._call_generate, address, request)
                future.add_done_callback(functools.partial(self._call_done, address))
                in_flight[future] = (i, address)
            if pending and not in_flight:
                if self._wait_for_busy_node():  # busy with calls of another batch
                    continue
                i = pending[0]
                raise self._cannot_serve(i, len(prompts[i]), group_size, max_tokens, rejected[i])
            done, _ = futures.wait(in_flight, timeout=_POLL_S,
                                   return_when=futures.FIRST_COMPLETED)
            for future in done:
                i, address = in_flight.pop(future)
                group, error = self._finish(future, address, i, prompts[i], group_size)
                if group is not None:
                    results[i] = group
                    continue
                code, detail = error
                if code == grpc.StatusCode.INVALID_ARGUMENT.name:
                    rejected[i][address] = detail
                else:
                    tried[i].append(address)
                    if len(tried[i]) >= self.max_consecutive_failures * max(1, self._usable()):
                        raise RuntimeError(
                            f"prompt {i}: Generate failed {len(tried[i])} times on "
                            f"{', '.join(sorted(set(tried[i])))}; last ({address}): "
                            f"{code}: {detail}")
                pending.appendleft(i)

    def _assign(self, prompt_len: int, group_size: int, max_tokens: int, tried: list[str],
                rejected: Mapping[str, str], ahead: int = 0) -> str | None:
        """Pick the node for a group and count it in flight, or None to wait: no node is free,
        or a busy one is still expected to finish the group before any free one would (see
        :meth:`generate_groups`), counting the ``ahead`` groups of this batch already waiting
        for a node as queued before it."""
        with self._lock:
            usable = [n for n in self._nodes.values() if n.state.in_rotation
                      and n.state.address not in rejected
                      and _fits(n.state, prompt_len, group_size, max_tokens)]
            candidates = [n for n in usable if n.state.address not in tried] or usable
            now = time.monotonic()
            free = [n for n in candidates if n.state.in_flight < _slots(n.state, group_size)]
            if not free:
                return None

            def expected_s(n: _Node, queued: int = 0) -> float:
                return _expected_finish_s(n.state, group_size, now - n.last_call_at, queued)

            node = min(free, key=lambda n: (expected_s(n),
                                            n.state.in_flight / _slots(n.state, group_size),
                                            tried.count(n.state.address),
                                            -_slots(n.state, group_size), n.last_assigned))
            best_busy = min((expected_s(n, ahead) for n in candidates  # measured busy only
                             if n not in free and n.state.group_s), default=float("inf"))
            if best_busy < expected_s(node):
                return None  # queueing on a faster busy node beats this free one
            self._tick += 1
            node.last_assigned = self._tick
            node.last_call_at = now
            node.state.in_flight += 1
            return node.state.address

    def _wait_for_busy_node(self) -> bool:
        """When a node in rotation has calls in flight that are not this batch's (another
        ``generate_groups`` call's, or calls left running by one that raised), wait up to a
        poll interval for one to end and return True; False when none is busy."""
        with self._lock:
            if not any(n.state.in_rotation and n.state.in_flight for n in self._nodes.values()):
                return False
            self._changed.wait(_POLL_S)
            return True

    def _call_generate(self, address: str, request: rollout_pb2.GenerateRequest):
        started = time.monotonic()
        response = rollout_pb2_grpc.RolloutServiceStub(self._channel(address)).Generate(
            request, timeout=self.request_timeout_s)
        return response, started, time.monotonic() - started

    def _finish(self, future: futures.Future, address: str, index: int, prompt: list[int],
                group_size: int) -> tuple[Group | None, tuple[str, str]]:
        """Turn a finished Generate into a Group, or record the node's failure."""
        try:
            response, started, seconds = future.result()
            if len(response.samples) != group_size:
                raise ValueError(f"samples: {len(response.samples)} samples for "
                                 f"sampling.n={group_size}")
            if response.prompt_token_ids and list(response.prompt_token_ids) != prompt:
                raise ValueError("prompt_token_ids: differ from the prompt sent")
            samples = [sample_from_proto(s, address) for s in response.samples]
        except grpc.RpcError as e:
            code, detail = e.code().name, e.details() or ""
        except ValueError as e:
            code, detail = "MALFORMED_RESPONSE", str(e)
        except KeyError:
            code, detail = "NODE_LEFT", "the node left the pool before the call"
        else:
            served = max(s.policy_version for s in samples)
            name = response.samples[0].adapter_name if response.samples else ""
            notify = None
            with self._lock:
                node = self._nodes.get(address)
                if node is not None:
                    node.state.failures = 0
                    node.strikes = 0
                    node.state.group_s = seconds if not node.state.group_s else (
                        (1 - LATENCY_EWMA) * node.state.group_s + LATENCY_EWMA * seconds)
                    metrics.NODE_GROUP_SECONDS.labels(address).set(node.state.group_s)
                    notify = self._observe_served(node, name, served, started)
                    self._changed.notify_all()
            self._notify(notify)
            return Group(prompt_index=index, prompt_ids=prompt, samples=samples, node=address,
                         seconds=seconds), ("", "")
        self._generate_failed(address, index, code, detail)
        return None, (code, detail)

    def _generate_failed(self, address: str, index: int, code: str, detail: str) -> None:
        metrics.GENERATE_FAILURES.labels(address, code).inc()
        with self._lock:
            node = self._nodes.get(address)
            if node is None:
                return
            node.state.last_error = f"Generate: {code}: {detail}"
            if code == grpc.StatusCode.INVALID_ARGUMENT.name:
                log.warning("node %s rejected prompt %d: %s", address, index, detail)
                return
            node.state.failures += 1
            log.warning("node %s: Generate of prompt %d failed (%d in a row): %s: %s; "
                        "retrying the group elsewhere", address, index, node.state.failures,
                        code, detail)
            if node.state.failures >= self.max_consecutive_failures and not node.state.benched:
                self._bench(node, f"{node.state.failures} consecutive Generate failures, "
                                  f"last {code}: {detail}")

    def _cannot_serve(self, index: int, prompt_len: int, group_size: int, max_tokens: int,
                      rejected: Mapping[str, str]) -> Exception:
        with self._lock:
            live = [n.state for n in self._nodes.values() if n.state.in_rotation]
            if live and all(s.address in rejected for s in live):
                return ValueError(f"prompt {index}: rejected by every node in rotation: "
                                  + "; ".join(f"{a}: {d}" for a, d in sorted(rejected.items())))
            if live and not any(_fits(s, prompt_len, group_size, max_tokens) for s in live):
                return ValueError(
                    f"prompt {index}: {prompt_len} prompt tokens + max_tokens {max_tokens}, "
                    f"n={group_size} exceed every node's bounds: " + "; ".join(
                        f"{s.address} (max_n {s.max_n}, max_tokens {s.max_tokens}, max_context "
                        f"{s.max_context})" for s in live))
            return RuntimeError(f"no rollout node can serve prompt {index} "
                                f"({len(live)} in rotation): {self._describe()}")

    # ------------------------------------------------------- sync bookkeeping (AdapterSync)

    def channel(self, address: str) -> grpc.Channel:
        """The pool's channel to ``address`` (dialled on first use, shared by every caller).

        Raises:
            KeyError: ``address`` is not a known node.
        """
        return self._channel(address)

    def note_synced(self, address: str, version: int, serving: common_pb2.AdapterRef) -> None:
        """Record a successful push of ``version``; ``serving`` is what the node answered."""
        with self._lock:
            node = self._nodes.get(address)
            if node is None:
                return
            node.state.synced_version = version
            node.synced_at = time.monotonic()
            node.state.adapter_version = int(serving.version)
            node.state.adapter_name = serving.name
            self._publish(node)

    def note_sync_failed(self, address: str, version: int, reason: str) -> None:
        """Bench a node a push of ``version`` failed on: it would sample a stale policy. It
        comes back (and gets the newest adapter) like any benched node."""
        with self._lock:
            node = self._nodes.get(address)
            if node is None:
                return
            node.state.last_error = f"PushAdapter v{version}: {reason}"
            self._bench(node, f"adapter push of policy version {version} failed: {reason}")

    # ------------------------------------------------------------------ membership

    def _on_master_connect(self) -> None:
        with self._lock:
            self._snapshot = set()

    def _on_master_event(self, event: registry_pb2.WatchNodesResponse) -> None:
        kind = event.type
        notify = None
        with self._lock:
            if kind == registry_pb2.NODE_EVENT_TYPE_SNAPSHOT_END:
                seen, self._snapshot = self._snapshot or set(), None
                for address, node in self._nodes.items():
                    if node.from_master and address not in seen and node.orphan_since is None:
                        node.orphan_since = time.monotonic()
                        log.warning("node %s is missing from the master's snapshot; kept for "
                                    "%.0fs in case the master lost its registry", address,
                                    ORPHAN_GRACE_S)
                return
            record = event.node
            address = record.info.address
            if not address or record.info.role != common_pb2.NODE_ROLE_ROLLOUT:
                return
            if kind == registry_pb2.NODE_EVENT_TYPE_REMOVED:
                if address in self._nodes:
                    self._forget(self._nodes[address], "removed by the master")
                return
            if kind == registry_pb2.NODE_EVENT_TYPE_SNAPSHOT and self._snapshot is not None:
                self._snapshot.add(address)
            node = self._nodes.get(address)
            if node is None:
                node = self._nodes[address] = _Node(address, "master")
                log.info("rollout node %s joined (master)", address)
            node.from_master = True
            node.orphan_since = None
            if not node.static:
                node.state.source = "master"
            healthy = record.status == common_pb2.NODE_STATUS_HEALTHY
            if not healthy and node.state.healthy:
                log.warning("node %s is %s (master); out of rotation", address,
                            common_pb2.NodeStatus.Name(record.status))
            node.state.healthy = healthy
            returning = kind in (registry_pb2.NODE_EVENT_TYPE_JOINED,
                                 registry_pb2.NODE_EVENT_TYPE_CHANGED)
            if healthy and returning and node.state.benched:
                log.info("node %s heartbeats healthy again (master); back in rotation", address)
                node.state.benched = ""
                node.state.failures = 0
            notify = self._apply_info(node, record.info, time.monotonic())
        self._notify(notify)

    def _probe_loop(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                now = time.monotonic()
                for node in list(self._nodes.values()):
                    if node.orphan_since is not None and now - node.orphan_since > ORPHAN_GRACE_S:
                        node.orphan_since = None
                        self._forget(node, "the master did not list it again")
                due = [a for a, n in self._nodes.items() if not n.state.excluded
                       and now >= n.probe_after
                       and ((n.static and not n.state.healthy) or n.state.benched)]
            probes = [self._prober.submit(self._probe, a) for a in due]
            futures.wait(probes)
            self._closed.wait(self.probe_interval_s)

    def _probe(self, address: str) -> None:
        """GetNodeInfo on a fresh channel (no reconnect backoff); update the node."""
        started = time.monotonic()
        channel = dial(address, self.security)
        try:
            info = rollout_pb2_grpc.RolloutServiceStub(channel).GetNodeInfo(
                rollout_pb2.GetNodeInfoRequest(), timeout=min(5.0, self.request_timeout_s)).info
        except grpc.RpcError as e:
            with self._lock:
                node = self._nodes.get(address)
                if node is not None and node.static:
                    if node.state.healthy or not node.reached:
                        log.warning("rollout node %s does not answer GetNodeInfo: %s: %s",
                                    address, e.code().name, e.details())
                    node.reached = True
                    node.state.healthy = False
                    node.state.last_error = f"GetNodeInfo: {e.code().name}: {e.details()}"
                    self._publish(node)
            return
        finally:
            channel.close()
        with self._lock:
            node = self._nodes.get(address)
            if node is None:
                return
            if node.static:
                node.state.healthy = True
            if node.state.benched and node.state.healthy:
                log.info("node %s answers GetNodeInfo again; back in rotation", address)
                node.state.benched = ""
                node.state.failures = 0
            notify = self._apply_info(node, info, started)
        self._notify(notify)

    def _apply_info(self, node: _Node, info: common_pb2.NodeInfo,
                    observed_at: float) -> list[NodeState]:
        """Update a node from its NodeInfo; returns listener notifications. Lock held."""
        s = node.state
        node.reached = True
        s.backend = _BACKENDS.get(info.backend, "")
        s.adapter_format = _FORMATS.get(info.adapter_format, "peft")
        s.capacity = max(1, int(info.capacity))
        s.dtype = info.dtype
        s.max_n, s.max_tokens, s.max_context = int(info.max_n), int(info.max_tokens), int(
            info.max_context)
        problem = self._identity_problem(info.base_model)
        if problem and problem != s.excluded:
            log.error("EXCLUDED rollout node %s: its base model %r differs from the trainer's "
                      "(%s); it gets no rollouts and no adapters", s.address,
                      info.base_model.model_id, problem)
        s.excluded = problem
        return self._observe_served(node, info.adapter.name, int(info.adapter.version),
                                    observed_at)

    def _identity_problem(self, base: common_pb2.BaseModel) -> str:
        got = {"architecture": base.architecture, "hidden_size": base.hidden_size,
               "num_layers": base.num_layers, "vocab_size": base.vocab_size}
        problems = [f"{k} {got[k]!r} != {self.identity[k]!r}" for k in IDENTITY_KEYS
                    if got[k] != self.identity[k]]
        mine, theirs = self.weights_fingerprint, base.weights_fingerprint
        if mine and theirs and mine != theirs:
            problems.append(f"weights_fingerprint {theirs!r} != the trainer's {mine!r} (another "
                            "checkpoint of this architecture: start the node on the trainer's "
                            "--model)")
        return ", ".join(problems)

    def _observe_served(self, node: _Node, name: str, version: int,
                        observed_at: float) -> list[NodeState]:
        """Record the adapter a node reported serving at ``observed_at`` (monotonic seconds).
        Observations from before the last push are ignored. A node now serving less than it was
        pushed (it restarted) is announced to the listeners. Lock held."""
        s = node.state
        if observed_at < node.synced_at:
            return self._publish(node)
        caught_up = s.adapter_version >= s.synced_version
        s.adapter_version, s.adapter_name = version, name
        notify = self._publish(node)
        if caught_up and version < s.synced_version and s.in_rotation:
            log.warning("node %s serves policy version %d but was pushed %d (restarted?); "
                        "catching it up", s.address, version, s.synced_version)
            notify = notify or [replace(s)]
        return notify

    def _bench(self, node: _Node, reason: str) -> None:
        """Take a node out of rotation until a probe or the master says it is back. Lock held."""
        node.state.benched = reason
        node.strikes += 1
        backoff = min(MAX_PROBE_BACKOFF_S, self.probe_interval_s * 2 ** (node.strikes - 1))
        node.probe_after = time.monotonic() + backoff
        log.warning("node %s leaves rotation: %s (probed again in %.1fs)", node.state.address,
                    reason, backoff)
        if node.channel is not None:  # a fresh channel later skips gRPC's reconnect backoff
            node.retired.append(node.channel)
            node.channel = None
            _close_retired(node)
        self._publish(node)

    def _call_done(self, address: str, _future: futures.Future) -> None:
        """A Generate call ended (answered, failed or cancelled before it started): free its
        slot on the node."""
        with self._lock:
            node = self._nodes.get(address)
            if node is not None:
                node.state.in_flight = max(0, node.state.in_flight - 1)
                _close_retired(node)
                self._changed.notify_all()

    def _forget(self, node: _Node, why: str) -> None:
        address = node.state.address
        if node.static:  # also a --rollout address: keep it, probed as usual
            node.from_master = False
            node.state.source = "static"
            return
        log.warning("rollout node %s left the pool: %s", address, why)
        del self._nodes[address]
        for channel in [node.channel, *node.retired]:
            if channel is not None:
                channel.close()
        metrics.forget_node(address)
        self._changed.notify_all()

    def _publish(self, node: _Node) -> list[NodeState]:
        """Recompute rotation, export metrics, wake waiters; returns the notification due when
        the node (re)enters rotation. Lock held."""
        s = node.state
        was = s.in_rotation
        s.in_rotation = s.healthy and not s.excluded and not s.benched
        metrics.record_node(s.address, in_rotation=s.in_rotation,
                            adapter_version=s.adapter_version, synced_version=s.synced_version,
                            group_s=s.group_s)
        self._changed.notify_all()
        if s.in_rotation and not was:
            log.info("node %s in rotation (%s, %s adapters, capacity %d, serving policy "
                     "version %d)", s.address, s.backend, s.adapter_format, s.capacity,
                     s.adapter_version)
            return [replace(s)]
        return []

    def _notify(self, states: list[NodeState] | None) -> None:
        if not states:
            return
        with self._lock:
            listeners = list(self._listeners)
        for state in states:
            for fn in listeners:
                try:
                    fn(state)
                except Exception:
                    log.exception("node listener failed for %s", state.address)

    # --------------------------------------------------------------------- helpers

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            node = self._nodes[address]
            if node.channel is None:
                node.channel = dial(address, self.security)
            return node.channel

    def _usable(self) -> int:
        with self._lock:
            return sum(not n.state.excluded for n in self._nodes.values())

    def _count_in_rotation(self) -> int:
        return sum(n.state.in_rotation for n in self._nodes.values())

    def _describe(self) -> str:
        parts = []
        for address in sorted(self._nodes):
            s = self._nodes[address].state
            if s.in_rotation:
                why = "in rotation"
            elif s.excluded:
                why = f"excluded: {s.excluded}"
            elif s.benched:
                why = f"benched: {s.benched}"
            elif not s.healthy:
                why = f"unhealthy{': ' + s.last_error if s.last_error else ''}"
            else:
                why = "not in rotation"
            parts.append(f"{address} ({why})")
        if self._watch is not None:
            parts.append(f"master {self.master} ("
                         f"{'connected' if self._watch.connected else self._watch.last_error or 'connecting'})")
        return "; ".join(parts) or "no nodes known"


def _close_retired(node: _Node) -> None:
    """Close a node's replaced channels once no Generate call is in flight on it."""
    if not node.state.in_flight:
        for channel in node.retired:
            channel.close()
        node.retired.clear()


def _slots(state: NodeState, group_size: int) -> int:
    """Groups a node may hold at once: about its capacity worth of sequences, at least 1."""
    return max(1, state.capacity // group_size)


def _expected_finish_s(state: NodeState, group_size: int, idle_s: float,
                       queued: int = 0) -> float:
    """Seconds until a group given to the node now, behind ``queued`` other groups, would be
    done: its measured latency, times the batches ahead of it when its slots are full; 0 when
    not measured yet or when it sat idle long enough to be worth trying again."""
    if not state.group_s or (not state.in_flight
                             and idle_s > max(REEXPLORE_MIN_S, REEXPLORE_AFTER * state.group_s)):
        return 0.0
    return state.group_s * (1 + (state.in_flight + queued) // _slots(state, group_size))


def _fits(state: NodeState, prompt_len: int, group_size: int, max_tokens: int) -> bool:
    """Whether a request fits the node's declared bounds (0 = unknown, assumed to fit)."""
    return ((not state.max_n or group_size <= state.max_n)
            and (not state.max_tokens or max_tokens <= state.max_tokens)
            and (not state.max_context or prompt_len + max_tokens <= state.max_context))
