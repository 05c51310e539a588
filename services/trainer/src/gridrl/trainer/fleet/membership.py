"""Who is in the pool and who is in rotation: a pure state machine over rollout nodes.

    members = Membership(identity, max_consecutive_failures=3, probe_interval_s=5.0)
    members.add_static("10.0.0.5:50051")
    effects = members.probe_answered("10.0.0.5:50051", info, observed_at=now)
    members.candidates()          # the nodes in rotation, as the scheduler sees them

Events come in — the master's ``WatchNodes`` messages, ``GetNodeInfo`` probe answers and
failures, ``Generate`` successes and failures, adapter pushes, the trainer's flags — each with
the time it happened (``time.monotonic()`` seconds, or any clock a test fakes); every event
returns :class:`Effects`, what the RPC layer (:mod:`gridrl.trainer.fleet.pool`) must do about it
(tell listeners, re-export metrics, replace or close a channel). No threads, no RPC, no
locks: the pool serialises events under its lock.

Rotation: a node takes groups while it is

- healthy (master status HEALTHY, or its last probe answered, for a ``--rollout`` address;
  a node the master declares unhealthy leaves rotation and is probed by the trainer itself:
  if it answers — a partial cut, the master lost it but the trainer still reaches it — it is
  back in rotation on that evidence, until a probe or a Generate on it fails),
- usable (its base model — architecture, hidden_size, num_layers, vocab_size, and the
  weights' fingerprint when both sides know it: another fine-tune of the same architecture —
  matches the trainer's; otherwise it is *excluded*, loudly, for good),
- not *benched*: after ``max_consecutive_failures`` failed or timed-out Generate calls in a
  row, or a failed adapter push (it would sample a stale policy). It comes back when the
  master reports it healthy again (JOINED / CHANGED) or a probe answers; probes of a node
  benched again and again before a Generate succeeds on it back off (``probe_interval_s``
  doubling up to ``MAX_PROBE_BACKOFF_S``), so a node that answers probes but fails every
  Generate does not flap,
- not *flagged*: the trainer found its samples stale or mismatched (the node monitor,
  ``monitor.py``, sends :meth:`Membership.flag`); it stays out until it serves the current
  version again and passes a fresh mismatch check (``probation.py`` sends
  :meth:`Membership.unflag`),
- not *syncing*: once an adapter was pushed (the :attr:`Membership.target`), a node entering
  rotation (joining, returning, restarted) that does not serve the target version waits for
  it; and a node whose own answers (a probe, a Generate started after its last push) show it
  serving less than it was pushed (it restarted) goes back to waiting. The listeners
  (``AdapterSync``) are told, push the newest adapter, and :meth:`Membership.push_succeeded`
  lets it in. So no group is ever sampled by a node on the base model while the run is at a
  later version.

Nodes of the master missing from the snapshot of a reconnected master stay for
``orphan_grace_s`` (a master restarted without its store learns them again as they
re-register, within a heartbeat); a REMOVED event drops a node at once (and its flag: a node
that comes back is a new member), except a node the master expired (missed heartbeats past
its ``--expire-after``) that the trainer reached since the master's UNHEALTHY verdict and has
not benched: that partial cut keeps it as a member until a probe of it fails (it is then
dropped) or it registers with the master again. ``--rollout`` addresses are never dropped.

Flags: :class:`Membership` is the one owner of the trainer's verdicts on nodes (address -> why
it is flagged, and every node flagged during the run). A flag benches a member; a flagged
address that is not a member (a run sampling from another source, ``--rollout local`` included)
is only recorded: nothing is benched, and its samples go on being judged. The monitor and
probation send events (:class:`NodeFlags`: the pool forwards them under its lock).
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace

from gridrl.common.sequence import newer
from gridrl.models import ModelIdentity
from gridrl.trainer.fleet.backoff import Backoff
from gridrl.trainer.fleet.nodes import AdapterTarget, Effects, NodeState
from gridrl.trainer.fleet.outcomes import GenerateFailure
from gridrl.trainer.fleet.scheduling import Candidate
from gridrl.trainer.fleet.wire import base_model_problem
from gridrl.v1 import common_pb2, registry_pb2
from gridrl.v1.enums import enum_word

log = logging.getLogger("gridrl.trainer.fleet.pool")

# The base model's fields a node must match (and a trainer's identity must give).
_MATCHED = ("architecture", "hidden_size", "num_layers", "vocab_size")
# Seconds a node missing from the snapshot of a reconnected master stays in the pool.
ORPHAN_GRACE_S = 30.0
# Most seconds between probes of a node benched again and again.
MAX_PROBE_BACKOFF_S = 60.0
# Weight of the newest call in a node's moving-average group latency.
LATENCY_EWMA = 0.3


class _Member:
    """A node's state plus what only membership touches."""

    def __init__(self, address: str, source: str) -> None:
        self.state = NodeState(address=address, source=source)
        self.static = source == "static"
        self.from_master = source == "master"
        self.reached = False  # answered at least once (probe or master record)
        self.orphan_since: float | None = None  # missing from the master's last snapshot
        self.master_unhealthy = False  # the master's last verdict: UNHEALTHY (missed heartbeats)
        self.kept = False  # expired by the master, kept because the trainer reaches it
        self.strikes = 0  # benchings since its last successful Generate
        self.probe_after = 0.0  # time before which it is not probed
        self.synced_at = float("-inf")  # time of the last successful push
        self.sequence = 0  # newest report number seen from the node (NodeInfo.sequence)
        self.last_call_at = 0.0  # time the last Generate on it was started
        self.last_assigned = 0  # scheduler tick of the last group given to it


class Membership:
    """The pool's members and their rotation (see the module docstring). Not thread-safe:
    one owner (the pool, under its lock) feeds it events.

    Args:
        identity: the trainer's base model (its ``weights_fingerprint`` compared when both
            sides know it).
        max_consecutive_failures: failed Generate calls in a row that bench a node (>= 1).
        probe_interval_s: seconds between probes of a benched or unreachable node; doubled
            at each benching since the node's last successful Generate.
        orphan_grace_s: seconds a master node missing from a reconnected master's snapshot
            is kept.

    Raises:
        ValueError: naming the argument, for an identity without an architecture or a size,
            or a bad number.
    """

    def __init__(self, identity: ModelIdentity, *, max_consecutive_failures: int = 3,
                 probe_interval_s: float = 5.0, orphan_grace_s: float = ORPHAN_GRACE_S) -> None:
        missing = [f.name for f in fields(identity) if f.name in _MATCHED
                   and not getattr(identity, f.name)]
        if missing:
            raise ValueError(f"model_identity: missing {', '.join(missing)}")
        if max_consecutive_failures < 1:
            raise ValueError(f"max_consecutive_failures: must be >= 1, got "
                             f"{max_consecutive_failures}")
        self.identity = identity
        self.max_consecutive_failures = max_consecutive_failures
        self.probe_interval_s = probe_interval_s
        self._probe_backoff = Backoff(probe_interval_s, MAX_PROBE_BACKOFF_S)
        self.orphan_grace_s = orphan_grace_s
        self.target = AdapterTarget()
        self._members: dict[str, _Member] = {}
        self._flags: dict[str, str] = {}  # flagged address -> why (members or not)
        self._flagged_ever: dict[str, str] = {}
        self._snapshot: set[str] | None = None  # addresses of the master's snapshot so far
        self._tick = 0

    # ------------------------------------------------------------------ queries

    def states(self) -> list[NodeState]:
        """Copies of every member's state, ordered by address."""
        return [replace(self._members[a].state) for a in sorted(self._members)]

    def state(self, address: str) -> NodeState | None:
        """A copy of one member's state, or None when unknown."""
        m = self._members.get(address)
        return replace(m.state) if m else None

    def __contains__(self, address: str) -> bool:
        return address in self._members

    def in_rotation(self) -> list[NodeState]:
        """Copies of the states of the nodes in rotation, ordered by address."""
        return [s for s in self.states() if s.in_rotation]

    def usable(self) -> int:
        """Members whose base model matches (excluded ones never count)."""
        return sum(not m.state.excluded for m in self._members.values())

    def busy(self) -> bool:
        """Whether a node in rotation has a Generate call in flight."""
        return any(m.state.in_rotation and m.state.in_flight for m in self._members.values())

    def candidates(self) -> list[Candidate]:
        """The nodes in rotation as the scheduler sees them (load, latency, bounds)."""
        return [Candidate(address=s.address, capacity=s.capacity, in_flight=s.in_flight,
                          group_s=s.group_s, last_call_at=m.last_call_at,
                          last_assigned=m.last_assigned, max_n=s.max_n,
                          max_tokens=s.max_tokens, max_context=s.max_context,
                          kv_cache_tokens=s.kv_cache_tokens,
                          sequence_overhead_tokens=s.sequence_overhead_tokens)
                for m in self._members.values() if (s := m.state).in_rotation]

    def describe(self) -> str:
        """Every member and why it is (out of) rotation, e.g. ``"a:1 (in rotation); b:2
        (benched: 3 consecutive Generate failures, ...)"``."""
        return "; ".join(f"{a} ({self._members[a].state.why_out()})"
                         for a in sorted(self._members))

    def probes_due(self, now: float) -> list[str]:
        """Addresses to probe with GetNodeInfo now: usable ``--rollout`` nodes not answering,
        and benched nodes whose backoff has passed."""
        return [a for a, m in self._members.items() if not m.state.excluded
                and now >= m.probe_after
                and (((m.static or m.master_unhealthy) and not m.state.healthy)
                     or m.state.benched)]

    # ------------------------------------------------------------------ membership events

    def add_static(self, address: str) -> None:
        """A ``--rollout`` address: a member for good (probed until it answers)."""
        if address not in self._members:
            self._members[address] = _Member(address, "static")

    def master_connected(self) -> None:
        """A new WatchNodes stream began: its snapshot follows."""
        self._snapshot = set()

    def master_event(self, event: registry_pb2.WatchNodesResponse, now: float) -> Effects:
        """One WatchNodes message (SNAPSHOT, SNAPSHOT_END, JOINED, CHANGED, REMOVED)."""
        kind = event.type
        effects = Effects()
        if kind == registry_pb2.NODE_EVENT_TYPE_SNAPSHOT_END:
            seen, self._snapshot = self._snapshot or set(), None
            for address, m in self._members.items():
                if m.from_master and address not in seen and m.orphan_since is None:
                    m.orphan_since = now
                    log.warning("node %s is missing from the master's snapshot; kept for "
                                "%.0fs in case the master lost its registry", address,
                                self.orphan_grace_s)
            return effects
        record = event.node
        address = record.info.address
        if not address or record.info.role != common_pb2.NODE_ROLE_ROLLOUT:
            return effects
        if kind == registry_pb2.NODE_EVENT_TYPE_REMOVED:
            m = self._members.get(address)
            if m is None:
                return effects
            if (record.status == common_pb2.NODE_STATUS_UNHEALTHY and m.master_unhealthy
                    and m.state.healthy and not m.state.benched):
                # expired by the master (missed heartbeats) while the trainer still reaches
                # it since the master's verdict: a partial cut, kept while it answers
                log.warning("node %s expired from the master but answers the trainer; kept "
                            "until a probe of it fails or it registers again", address)
                m.from_master, m.kept = False, True
                effects.touched.add(address)
                return effects
            self._forget(m, "removed by the master", effects)
            return effects
        if kind == registry_pb2.NODE_EVENT_TYPE_SNAPSHOT and self._snapshot is not None:
            self._snapshot.add(address)
        m = self._members.get(address)
        if m is None:
            m = self._members[address] = _Member(address, "master")
            log.info("rollout node %s joined (master)", address)
        m.from_master, m.kept = True, False
        m.orphan_since = None
        s = m.state
        if not m.static:
            s.source = "master"
        healthy = record.status == common_pb2.NODE_STATUS_HEALTHY
        if not healthy and s.healthy:
            log.warning("node %s is %s (master); out of rotation until it answers the "
                        "trainer's own probe", address, common_pb2.NodeStatus.Name(record.status))
        # missed heartbeats (not DRAINING, which is the node's own word): probe it now, the
        # master may have lost a node the trainer still reaches
        lost = record.status == common_pb2.NODE_STATUS_UNHEALTHY
        if lost and not m.master_unhealthy:
            m.probe_after = now
            effects.probe = True
        m.master_unhealthy = lost
        s.healthy = healthy
        returning = kind in (registry_pb2.NODE_EVENT_TYPE_JOINED,
                             registry_pb2.NODE_EVENT_TYPE_CHANGED)
        if healthy and returning and s.benched:
            log.info("node %s heartbeats healthy again (master); back in rotation", address)
            s.benched = ""
            s.failures = 0
        # The master's copy of the adapter may be a heartbeat old: it never sends the node
        # back to syncing by itself (the node's own answers do), but a node it reports
        # serving less than it was pushed is handed to the listeners, who check and catch
        # it up.
        self._apply_info(m, record.info, now, direct=False)
        self._update(m, effects)
        if s.in_rotation and s.adapter_version < s.synced_version and not effects.notify:
            log.warning("node %s serves policy version %d but was pushed %d (master; "
                        "restarted?); catching it up", address, s.adapter_version,
                        s.synced_version)
            effects.notify.append(replace(s))
        return effects

    def expire_orphans(self, now: float) -> Effects:
        """Drop master nodes missing from the reconnected master for ``orphan_grace_s``."""
        effects = Effects()
        for m in list(self._members.values()):
            if m.orphan_since is not None and now - m.orphan_since > self.orphan_grace_s:
                m.orphan_since = None
                self._forget(m, "the master did not list it again", effects)
        return effects

    def probe_answered(self, address: str, info: common_pb2.NodeInfo,
                       observed_at: float) -> Effects:
        """``GetNodeInfo`` answered ``info``; the call started at ``observed_at``."""
        effects = Effects()
        m = self._members.get(address)
        if m is None:
            return effects
        s = m.state
        if m.master_unhealthy and not s.healthy:
            log.warning("node %s answers the trainer although the master lists it unhealthy "
                        "(a partial cut?); back in rotation", address)
        if m.static or m.master_unhealthy:
            s.healthy = True
        if s.benched and s.healthy:
            log.info("node %s answers GetNodeInfo again; back in rotation", address)
            s.benched = ""
            s.failures = 0
        lost = self._apply_info(m, info, observed_at, direct=True)
        return self._update(m, effects, lost=lost)

    def probe_failed(self, address: str, code: str, detail: str) -> Effects:
        """``GetNodeInfo`` failed with status ``code``: a ``--rollout`` node, or one the master
        lists unhealthy, is unhealthy."""
        effects = Effects()
        m = self._members.get(address)
        if m is None or not (m.static or m.master_unhealthy):
            return effects
        s = m.state
        if m.kept:  # neither the master nor the trainer reaches it now
            self._forget(m, f"expired from the master and GetNodeInfo fails: {code}", effects)
            return effects
        if s.healthy or not m.reached:
            log.warning("rollout node %s does not answer GetNodeInfo: %s: %s", address, code,
                        detail)
        m.reached = True
        s.healthy = False
        s.last_error = f"GetNodeInfo: {code}: {detail}"
        return self._update(m, effects)

    # ------------------------------------------------------------------ rollout events

    def assign(self, address: str, now: float) -> None:
        """A group was given to the node (the scheduler's choice): count it in flight."""
        m = self._members.get(address)
        if m is None:
            return
        self._tick += 1
        m.last_assigned = self._tick
        m.last_call_at = now
        m.state.in_flight += 1

    def call_done(self, address: str) -> Effects:
        """A Generate call on the node ended (answered, failed or cancelled)."""
        effects = Effects()
        m = self._members.get(address)
        if m is not None:
            m.state.in_flight = max(0, m.state.in_flight - 1)
            effects.touched.add(address)
        return effects

    def generate_succeeded(self, address: str, adapter_name: str, served_version: int,
                           started_at: float, seconds: float) -> tuple[bool, Effects]:
        """A Generate started at ``started_at`` answered after ``seconds`` with samples of
        ``served_version`` (the highest among them).

        Returns:
            ``(usable, effects)``: ``usable`` is False when the samples show the node lost the
            adapter it was pushed (it restarted; they are of an older policy than it was given
            after the push): the group must be sampled again, and the node waits for the
            adapter (syncing).
        """
        effects = Effects()
        m = self._members.get(address)
        if m is None:
            return True, effects
        s = m.state
        s.failures = 0
        m.strikes = 0
        s.group_s = seconds if not s.group_s else (
            (1 - LATENCY_EWMA) * s.group_s + LATENCY_EWMA * seconds)
        lost = self._apply_served(m, adapter_name, served_version, started_at, direct=True)
        self._update(m, effects, lost=lost)
        return not lost, effects

    def generate_failed(self, address: str, failure: GenerateFailure, now: float) -> Effects:
        """A Generate failed (:class:`~gridrl.trainer.fleet.outcomes.GenerateFailure`). A
        rejected request is the request's fault and does not count against the node."""
        effects = Effects()
        m = self._members.get(address)
        if m is None:
            return effects
        s = m.state
        code, detail = failure.label, failure.detail
        s.last_error = f"Generate: {code}: {detail}"
        if not failure.nodes_fault:
            return effects
        s.failures += 1
        log.warning("node %s: Generate failed (%d in a row): %s: %s; retrying the group "
                    "elsewhere", address, s.failures, code, detail)
        if s.failures >= self.max_consecutive_failures and not s.benched:
            self._bench(m, f"{s.failures} consecutive Generate failures, last {code}: {detail}",
                        now, effects)
        return self._update(m, effects)

    # ------------------------------------------------------------------ adapter events

    def set_target(self, name: str, version: int) -> None:
        """The newest adapter pushed: nodes entering rotation must serve it first."""
        if version >= self.target.version:
            self.target = AdapterTarget(name, version)

    def push_succeeded(self, address: str, version: int, serving: common_pb2.AdapterRef,
                       now: float, sequence: int = 0) -> Effects:
        """Policy ``version`` was pushed to the node at ``now``; ``serving`` is its answer,
        ``sequence`` the answer's report number (``PushAdapterResponse.sequence``, 0: none)."""
        effects = Effects()
        m = self._members.get(address)
        if m is None:
            return effects
        s = m.state
        s.synced_version = version
        m.synced_at = now
        m.sequence = max(m.sequence, sequence)
        s.adapter_version = int(serving.version)
        s.adapter_name = serving.name
        # A push older than the target (a late catch-up) must not leave the node in rotation.
        return self._update(m, effects, behind=self._needs_adapter(s))

    def push_failed(self, address: str, version: int, reason: str, now: float) -> Effects:
        """A push of policy ``version`` failed: bench the node (it would sample a stale
        policy); it comes back, and gets the newest adapter, like any benched node."""
        effects = Effects()
        m = self._members.get(address)
        if m is None:
            return effects
        m.state.last_error = f"PushAdapter v{version}: {reason}"
        self._bench(m, f"adapter push of policy version {version} failed: {reason}", now,
                    effects)
        return self._update(m, effects)

    # ------------------------------------------------------------------ the trainer's flags

    def flag(self, address: str, reason: str) -> Effects:
        """The trainer found the node's samples stale or mismatched (``reason``; a flagged
        node's reason is updated): a member is out of rotation until :meth:`unflag`."""
        effects = Effects()
        if address not in self._flags:
            self._flagged_ever[address] = reason
        m = self._members.get(address)
        if m is not None and address not in self._flags:
            log.warning("node %s leaves rotation: flagged: %s", address, reason)
        self._flags[address] = reason
        return self._update(m, effects) if m is not None else effects

    def unflag(self, address: str) -> Effects:
        """The node passed a fresh check, or its samples are fine again: a member is back in
        rotation (when otherwise eligible)."""
        effects = Effects()
        if self._flags.pop(address, None) is None:
            return effects
        m = self._members.get(address)
        return self._update(m, effects) if m is not None else effects

    def flags(self) -> dict[str, str]:
        """Every flagged node -> why."""
        return dict(self._flags)

    def benched_flags(self) -> dict[str, str]:
        """The flagged members -> why."""
        return {a: why for a, why in self._flags.items() if a in self._members}

    def flagged_ever(self) -> dict[str, str]:
        """Every node flagged during the run -> the reason it was flagged with."""
        return dict(self._flagged_ever)

    # ------------------------------------------------------------------ internals

    def _apply_info(self, m: _Member, info: common_pb2.NodeInfo, observed_at: float,
                    direct: bool) -> bool:
        """Update the node from its NodeInfo; returns :meth:`_apply_served`'s verdict."""
        s = m.state
        m.reached = True
        s.backend = enum_word(common_pb2.Backend, info.backend)
        s.adapter_format = enum_word(common_pb2.AdapterFormat, info.adapter_format, "peft")
        s.capacity = max(1, int(info.capacity))
        s.dtype = info.dtype
        s.max_n, s.max_tokens, s.max_context = (int(info.max_n), int(info.max_tokens),
                                                int(info.max_context))
        s.kv_cache_tokens = int(info.kv_cache_tokens)
        s.sequence_overhead_tokens = int(info.sequence_overhead_tokens)
        problem = base_model_problem(info.base_model, self.identity)
        if problem and problem != s.excluded:
            log.error("EXCLUDED rollout node %s: its base model %r differs from the trainer's "
                      "(%s); it gets no rollouts and no adapters", s.address,
                      info.base_model.model_id, problem)
        s.excluded = problem
        served = self.own_adapter(info)
        return self._apply_served(m, served.name, int(served.version), observed_at,
                                  direct, sequence=int(info.sequence))

    def own_adapter(self, info: common_pb2.NodeInfo) -> common_pb2.AdapterRef:
        """What the node holds for this run: its adapter among the node's resident ones
        (several runs share a node, issue 46: each run's requests name its own adapter), else
        the adapter the node serves by default."""
        name = self.target.name
        if name:
            for ref in info.resident_adapters:
                if ref.name == name:
                    return ref
        return info.adapter

    def _apply_served(self, m: _Member, name: str, version: int, observed_at: float,
                      direct: bool, sequence: int = 0) -> bool:
        """Record the adapter the node served at ``observed_at``; observations older than
        its last push are ignored: by the node's own report numbers when both carry one
        (``sequence``, :mod:`gridrl.common.sequence`: a heartbeat the master relays after the
        push's answer arrived may have left the node before the push), else by arrival.
        Returns True when the node's own answer (``direct``) shows it serving less than it
        was pushed: it lost the adapter (restarted)."""
        s = m.state
        order = newer(sequence, m.sequence)
        if order is False or (order is None and observed_at < m.synced_at):
            return False
        m.sequence = max(m.sequence, sequence)
        s.adapter_version, s.adapter_name = version, name
        return direct and version < s.synced_version

    def _needs_adapter(self, s: NodeState) -> bool:
        t = self.target
        return t.version > 0 and not (s.adapter_name == t.name and s.adapter_version >= t.version)

    def _bench(self, m: _Member, reason: str, now: float, effects: Effects) -> None:
        """Take a node out of rotation until a probe or the master says it is back."""
        m.state.benched = reason
        m.strikes += 1
        backoff = self._probe_backoff.delay(m.strikes)
        m.probe_after = now + backoff
        log.warning("node %s leaves rotation: %s (probed again in %.1fs)", m.state.address,
                    reason, backoff)
        effects.redial.append(m.state.address)

    def _forget(self, m: _Member, why: str, effects: Effects) -> None:
        address = m.state.address
        if m.static:  # also a --rollout address: keep it, probed as usual
            m.from_master = False
            m.state.source = "static"
            effects.touched.add(address)
            return
        log.warning("rollout node %s left the pool: %s", address, why)
        del self._members[address]
        self._flags.pop(address, None)
        effects.forgotten.append(address)

    def _update(self, m: _Member, effects: Effects, lost: bool = False,
                behind: bool = False) -> Effects:
        """Recompute the node's syncing and rotation (``lost``: it just showed it lost its
        adapter; ``behind``: it was just given an adapter older than the target); notify when
        it enters rotation or starts waiting for the adapter."""
        s = m.state
        s.flagged = self._flags.get(s.address, "")  # the flag's one place is self._flags
        was_in, was_syncing = s.in_rotation, s.syncing
        if not s.eligible:
            s.syncing = False
        elif lost or behind or s.syncing or not s.in_rotation:  # entering, waiting: check
            s.syncing = (lost or (s.syncing and s.adapter_version < s.synced_version)
                         or self._needs_adapter(s))
        s.in_rotation = s.eligible and not s.syncing
        effects.touched.add(s.address)
        if s.in_rotation and not was_in:
            log.info("node %s in rotation (%s, %s adapters, capacity %d, serving policy "
                     "version %d)", s.address, s.backend, s.adapter_format, s.capacity,
                     s.adapter_version)
            effects.notify.append(replace(s))
        elif s.syncing and not was_syncing:
            if lost:
                log.warning("node %s serves policy version %d but was pushed %d (restarted?); "
                            "it gets no group until it is caught up", s.address,
                            s.adapter_version, s.synced_version)
            else:
                log.info("node %s serves policy version %d: it waits for version %d before it "
                         "gets groups", s.address, s.adapter_version, self.target.version)
            effects.notify.append(replace(s))
        return effects
