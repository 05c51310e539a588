"""The pool's node set: which rollout nodes there are and which are in rotation, fed by the
master's watch, ``GetNodeInfo`` probes, adapter pushes and the trainer's flags.

    nodes = NodeSet(master="master:50050", addresses=[], model_identity=identity)
    nodes.start()                      # follows WatchNodes; probes static addresses
    nodes.wait_for_nodes(1, timeout_s=60)

This is the feed of :mod:`gridrl.trainer.fleet.membership` (the pure state machine that decides
who is a member and who is in rotation: healthy, usable, not benched, flagged or syncing): each
event is applied under the lock (:meth:`NodeSet._apply`), its effects (metrics, channels to
replace or close, listeners) done outside it. :class:`gridrl.trainer.fleet.pool.NodePool` adds
the sampling (Generate calls over the nodes in rotation) to it.

Threads and what they own:

- the ``node-prober`` thread probes unreachable / benched nodes (on ``node-probe-*`` threads,
  each on a fresh channel) and expires orphans;
- the ``master-watch`` thread follows WatchNodes;
- :mod:`gridrl.trainer.fleet.sync`'s push threads feed push outcomes; the node monitor and
  probation feed flags.

Locks: ``NodeSet._lock`` guards the :class:`~gridrl.trainer.fleet.membership.Membership` (its
``_changed`` condition wakes batches and waiters); it is held only while an event is applied
or the scheduler runs over the in-memory table, never during an RPC, a listener call, a
channel close or a metrics export. ``Channels._lock`` (:mod:`~gridrl.trainer.fleet.channels`)
guards the channels. Readers (:meth:`NodeSet.nodes`) therefore never wait behind a call.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc

from gridrl.common.rpc.channel import Keepalive, dial
from gridrl.common.security.policy import Security
from gridrl.models import ModelIdentity
from gridrl.trainer.fleet import metrics
from gridrl.trainer.fleet.batch import NodeWait
from gridrl.trainer.fleet.channels import Channels
from gridrl.trainer.fleet.membership import Membership
from gridrl.trainer.fleet.nodes import NodeState
from gridrl.trainer.fleet.watch import MasterWatch
from gridrl.v1 import common_pb2, registry_pb2, rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

# Seconds between on_wait reports while a wait for nodes lasts.
WAIT_REPORT_S = 0.5


class NodeSet:
    """Rollout nodes from the master and/or static addresses, and their rotation.

    Args:
        master: host:port of the master to follow, or None.
        addresses: static rollout node addresses (host:port).
        model_identity: the trainer's base model (nodes of another are excluded).
        security: TLS files and token for the nodes and the master
            (:class:`gridrl.common.security.policy.Security`), if any.
        request_timeout_s: deadline of one Generate call, seconds (a probe's is the smaller
            of 5 s and this).
        max_consecutive_failures: failed Generate calls in a row that bench a node.
        probe_interval_s: seconds between GetNodeInfo probes of unreachable or benched nodes.
        on_wait: called with a :class:`NodeWait` about every half second while a wait for
            nodes lasts, and with None when it ends; from the waiting thread, so it must
            return quickly.
        clock: monotonic seconds of the events fed to the membership (when a call started, a
            push answered, a probe was sent; tests advance a fake one); waits and latencies
            are measured in real time.
        keepalive: HTTP/2 keepalive of the channels (None: the project's default,
            :class:`gridrl.common.rpc.channel.Keepalive`).

    Raises:
        ValueError: naming the argument, when neither a master nor addresses are given, a
            model_identity key is missing, or a number is out of range.
    """

    def __init__(self, *, master: str | None, addresses: Sequence[str],
                 model_identity: ModelIdentity, security: Security | None = None,
                 request_timeout_s: float = 120.0, max_consecutive_failures: int = 3,
                 probe_interval_s: float = 5.0,
                 on_wait: Callable[[NodeWait | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 keepalive: Keepalive | None = None) -> None:
        if not master and not addresses:
            raise ValueError("master / addresses: give a master or at least one rollout address")
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {request_timeout_s}")
        self._members = Membership(model_identity,
                                   max_consecutive_failures=max_consecutive_failures,
                                   probe_interval_s=probe_interval_s)
        self.identity = self._members.identity
        self.master = master
        self.security = security
        self.request_timeout_s = request_timeout_s
        self.max_consecutive_failures = max_consecutive_failures
        self.probe_interval_s = probe_interval_s
        self._on_wait = on_wait
        self._clock = clock
        self.keepalive = keepalive
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._channels = Channels(security, keepalive)
        self._listeners: list[Callable[[NodeState], None]] = []
        self._closed = threading.Event()
        self._probe_now = threading.Event()  # a probe fell due (Effects.probe) or closing
        self._prober = futures.ThreadPoolExecutor(8, thread_name_prefix="node-probe")
        self._probe_thread = threading.Thread(target=self._probe_loop, name="node-prober",
                                              daemon=True)
        self._watch = (MasterWatch(master, on_event=self._on_master_event,
                                   on_connect=self._on_master_connect, security=security,
                                   keepalive=keepalive)
                       if master else None)
        for address in dict.fromkeys(addresses):
            self._members.add_static(address)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Follow the master's WatchNodes (when a master is set) and probe the static addresses
        with GetNodeInfo; returns at once (see :meth:`wait_for_nodes`)."""
        if self._watch is not None:
            self._watch.start()
        self._probe_thread.start()

    def close(self) -> None:
        """Stop discovery and probing, wake every waiter, close channels. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._probe_now.set()
        if self._watch is not None:
            self._watch.stop()
        if self._probe_thread.is_alive():
            self._probe_thread.join()
        with self._lock:
            self._changed.notify_all()
        self._channels.close()
        self._prober.shutdown(wait=True, cancel_futures=True)

    # -------------------------------------------------------------------- queries

    def nodes(self) -> list[NodeState]:
        """Copies of every known node's state, ordered by address."""
        with self._lock:
            return self._members.states()

    def node(self, address: str) -> NodeState | None:
        """A copy of one node's state, or None when unknown."""
        with self._lock:
            return self._members.state(address)

    def add_listener(self, fn: Callable[[NodeState], None]) -> None:
        """Call ``fn(state)`` whenever a node joins or comes back into rotation, or waits for
        the current adapter before it may (it joined or restarted after a push). Called from
        the pool's threads (master watch, prober, batches, pushes): ``fn`` must return
        quickly."""
        with self._lock:
            self._listeners.append(fn)

    def wait_for_nodes(self, min_nodes: int = 1, timeout_s: float = 60.0,
                       stop: Callable[[], bool] | None = None) -> list[NodeState]:
        """Block until at least ``min_nodes`` nodes are in rotation, or ``stop()`` is true
        (looked at every half second: the run was asked to stop); returns :meth:`nodes`.
        Reports the wait to ``on_wait`` (:class:`NodeWait` with ``starting``) while it lasts.

        Raises:
            TimeoutError: after ``timeout_s`` seconds, naming every known node and its state
                (and the master's connection state).
        """
        started = time.monotonic()
        deadline = started + timeout_s
        last: NodeWait | None = None  # the wait's last report (None: not reported)
        gave_up = False
        try:
            with self._lock:
                while len(self._members.in_rotation()) < min_nodes:
                    if stop is not None and stop():
                        break
                    now = time.monotonic()
                    left = deadline - now
                    if left <= 0 or self._closed.is_set():
                        gave_up = True
                        raise TimeoutError(f"{len(self._members.in_rotation())} of {min_nodes} "
                                           f"rollout node(s) in rotation after "
                                           f"{timeout_s:.1f}s (--start-wait-s): "
                                           f"{self._describe()}")
                    last = NodeWait(now - started, left, self._describe(), starting=True,
                                    needed=min_nodes,
                                    in_rotation=len(self._members.in_rotation()))
                    self._report_wait(last)
                    self._changed.wait(min(left, WAIT_REPORT_S))
                return self._members.states()
        finally:
            if last is not None:
                self._report_wait(dataclasses.replace(
                    last, waited_s=time.monotonic() - started, left_s=0.0, gave_up=True)
                    if gave_up else None)

    def _report_wait(self, wait: NodeWait | None) -> None:
        metrics.record_node_wait(wait.waited_s if wait else 0.0, wait.left_s if wait else 0.0)
        if self._on_wait is not None:
            try:
                self._on_wait(wait)
            except Exception:
                log.exception("on_wait failed")

    # ------------------------------------------------------- sync bookkeeping (AdapterSync)

    def channel(self, address: str, *, lease: bool = False) -> grpc.Channel:
        """The pool's channel to ``address`` (dialled on first use, shared by every caller);
        with ``lease``, counted busy until released (internal: Generate calls).

        Raises:
            KeyError: ``address`` is not a known node.
        """
        with self._lock:
            if address not in self._members:
                raise KeyError(address)
        return self._channels.lease(address) if lease else self._channels.get(address)

    def set_target(self, name: str, version: int) -> None:
        """The adapter being pushed (``name`` v``version``): a node entering rotation from now
        on must serve it first (it is synced, then let in)."""
        with self._lock:
            self._members.set_target(name, version)

    def note_synced(self, address: str, version: int, serving: common_pb2.AdapterRef,
                    sequence: int = 0) -> None:
        """Record a successful push of ``version``; ``serving`` is what the node answered,
        ``sequence`` the answer's report number (``PushAdapterResponse.sequence``)."""
        self._apply(lambda: self._members.push_succeeded(address, version, serving,
                                                         self._clock(), sequence))

    def note_sync_failed(self, address: str, version: int, reason: str) -> None:
        """Bench a node a push of ``version`` failed on: it would sample a stale policy. It
        comes back (and gets the newest adapter) like any benched node."""
        self._apply(lambda: self._members.push_failed(address, version, reason,
                                                      self._clock()))

    # ------------------------------------------------------------- the trainer's flags

    def flag(self, address: str, reason: str) -> None:
        """Bench a node whose samples the trainer found stale or mismatched (the node
        monitor's verdict): no new groups until :meth:`unflag`."""
        self._apply(lambda: self._members.flag(address, reason))

    def unflag(self, address: str) -> None:
        """A flagged node passed a fresh check: back in rotation (when otherwise eligible)."""
        self._apply(lambda: self._members.unflag(address))

    def flags(self) -> dict[str, str]:
        """Every flagged node -> why (:meth:`Membership.flags`)."""
        with self._lock:
            return self._members.flags()

    def benched_flags(self) -> dict[str, str]:
        """The flagged nodes of the pool -> why (:meth:`Membership.benched_flags`)."""
        with self._lock:
            return self._members.benched_flags()

    def flagged_ever(self) -> dict[str, str]:
        """Every node flagged during the run -> why (:meth:`Membership.flagged_ever`)."""
        with self._lock:
            return self._members.flagged_ever()

    # ------------------------------------------------------------------ membership feed

    def _apply(self, event: Callable[[], Any]) -> Any:
        """Apply a membership event under the lock, then (outside it) do its effects:
        export the touched nodes' metrics, replace or close channels, tell listeners.
        ``event`` returns :class:`Effects` or ``(value, Effects)``; returns the value."""
        with self._lock:
            out = event()
            value, effects = out if isinstance(out, tuple) else (None, out)
            states = [s for a in effects.touched if (s := self._members.state(a)) is not None]
            listeners = list(self._listeners) if effects.notify else []
            self._changed.notify_all()
        if effects.probe:
            self._probe_now.set()
        for s in states:
            metrics.record_node(s.address, in_rotation=s.in_rotation,
                                adapter_version=s.adapter_version,
                                synced_version=s.synced_version, group_s=s.group_s,
                                flagged=bool(s.flagged))
        for address in effects.redial:
            self._channels.retire(address)
        for address in effects.forgotten:
            self._channels.close(address)
            metrics.forget_node(address)
        for state in effects.notify:
            for fn in listeners:
                try:
                    fn(state)
                except Exception:
                    log.exception("node listener failed for %s", state.address)
        return value

    def _on_master_connect(self) -> None:
        with self._lock:
            self._members.master_connected()

    def _on_master_event(self, event: registry_pb2.WatchNodesResponse) -> None:
        self._apply(lambda: self._members.master_event(event, self._clock()))

    def _probe_loop(self) -> None:
        while True:
            self._probe_now.clear()  # a verdict or close() from here on wakes the wait below
            if self._closed.is_set():
                return
            now = self._clock()
            self._apply(functools.partial(self._members.expire_orphans, now))
            with self._lock:
                due = self._members.probes_due(now)
            try:
                probes = [self._prober.submit(self._probe, a) for a in due]
            except RuntimeError:  # shut down meanwhile
                return
            futures.wait(probes)
            self._probe_now.wait(self.probe_interval_s)

    def _probe(self, address: str) -> None:
        """GetNodeInfo on a fresh channel (no reconnect backoff); feed the answer."""
        started = self._clock()
        channel = dial(address, self.security, keepalive=self.keepalive)
        try:
            info = rollout_pb2_grpc.RolloutServiceStub(channel).GetNodeInfo(
                rollout_pb2.GetNodeInfoRequest(), timeout=min(5.0, self.request_timeout_s)).info
        except grpc.RpcError as e:
            code, detail = e.code().name, e.details()
            self._apply(lambda: self._members.probe_failed(address, code, detail))
            return
        finally:
            channel.close()
        self._apply(lambda: self._members.probe_answered(address, info, started))

    def _describe(self) -> str:
        """Every node and why it is (out of) rotation, and the master's connection. Lock
        held."""
        parts = [self._members.describe()] if self._members.states() else []
        if self._watch is not None:
            watch = self._watch
            state = "connected" if watch.connected else watch.last_error or "connecting"
            parts.append(f"master {self.master} ({state})")
        return "; ".join(parts) or "no nodes known"
