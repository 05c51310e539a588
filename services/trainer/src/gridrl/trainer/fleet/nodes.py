"""What the fleet knows about a rollout node, as types: its state (:class:`NodeState`), what
a membership event asks the RPC layer to do (:class:`Effects`), the adapter nodes must serve
(:class:`AdapterTarget`), and where the trainer's flags on nodes live (:class:`NodeFlags`).
:class:`gridrl.trainer.fleet.membership.Membership` owns and changes them; the pool, the sync,
probation and the run read copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class NodeState:
    """What the pool knows about one rollout node (a copy; mutating it changes nothing).

    Attributes:
        address: host:port.
        backend: ``"torch"``, ``"mlx"`` or ``"vllm"`` ("" before the node was reached).
        adapter_format: adapter layout the node loads natively, ``"peft"`` or ``"mlx"``.
        capacity: sequences the node decodes together in one batch.
        dtype: the node's compute dtype, e.g. ``"float32"``, ``"bfloat16"`` ("" = unknown).
        healthy: master status HEALTHY (master nodes) or last probe answered (static nodes).
        in_rotation: healthy, usable, not benched, flagged or syncing: it is given groups.
        adapter_version: policy version the node last reported serving (0 = base model).
        synced_version: policy version last pushed to it successfully (0 = none).
        failures: consecutive failed or timed-out Generate calls.
        adapter_name: name of the adapter it last reported serving ("" = base model).
        source: ``"master"`` or ``"static"``.
        excluded: why the node is never used (base model mismatch); "" when usable.
        benched: why it left rotation (failures, failed push); "" when not benched.
        flagged: why the trainer benched it for its samples (stale or mismatched); "" when
            not flagged.
        syncing: it waits for the current adapter before it is given groups.
        last_error: the last failure seen on it.
        max_n, max_tokens, max_context: the node's request bounds (0 = unknown).
        kv_cache_tokens, sequence_overhead_tokens: its KV-cache capacity in tokens and each
            sequence's working memory in tokens (0 = not limited).
        in_flight: groups being sampled on it now.
        group_s: moving average of its Generate calls' seconds (a group's latency there,
            queueing included; 0 = not measured yet); the scheduler's estimate.
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
    flagged: str = ""
    syncing: bool = False
    last_error: str = ""
    max_n: int = 0
    max_tokens: int = 0
    max_context: int = 0
    kv_cache_tokens: int = 0
    sequence_overhead_tokens: int = 0
    in_flight: int = 0
    group_s: float = 0.0

    @property
    def eligible(self) -> bool:
        """Healthy, usable, not benched and not flagged: in rotation unless syncing."""
        return self.healthy and not self.excluded and not self.benched and not self.flagged

    def why_out(self) -> str:
        """Why the node is out of rotation ("in rotation" when it is not)."""
        if self.in_rotation:
            return "in rotation"
        if self.excluded:
            return f"excluded: {self.excluded}"
        if self.flagged:
            return f"flagged: {self.flagged}"
        if self.benched:
            return f"benched: {self.benched}"
        if not self.healthy:
            return f"unhealthy: {self.last_error or 'no GetNodeInfo answer yet'}"
        if self.syncing:
            return "syncing: waits for the current adapter"
        return "not in rotation"


@dataclass
class Effects:
    """What the RPC layer must do after an event.

    Attributes:
        notify: states to hand to the listeners (the node entered rotation, or now waits
            for the current adapter).
        touched: addresses whose state changed (re-export their metrics).
        forgotten: addresses that left the pool (close their channels, drop their metrics).
        redial: addresses whose channel should be replaced (benched: a fresh channel later
            skips gRPC's reconnect backoff).
        probe: a probe fell due now (run the probe loop at once, not at its next turn).
    """

    notify: list[NodeState] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)
    forgotten: list[str] = field(default_factory=list)
    redial: list[str] = field(default_factory=list)
    probe: bool = False

    def merge(self, other: Effects) -> Effects:
        self.notify += other.notify
        self.touched |= other.touched
        self.forgotten += other.forgotten
        self.redial += other.redial
        self.probe |= other.probe
        return self


@dataclass
class AdapterTarget:
    """The adapter nodes entering rotation must serve: the newest one pushed (version 0: none
    pushed yet, any node may enter)."""

    name: str = ""
    version: int = 0


class NodeFlags(Protocol):
    """Where the trainer's flags on nodes live: a :class:`Membership`, or the
    :class:`~gridrl.trainer.fleet.pool.NodePool` that owns one (under its lock)."""

    def flag(self, address: str, reason: str) -> object:
        """The node's samples are stale or mismatched (``reason``): flag it (or update the
        reason); a member leaves rotation."""

    def unflag(self, address: str) -> object:
        """The node passed a fresh check (or its samples are fine again): clear its flag."""

    def flags(self) -> dict[str, str]:
        """Every flagged node -> why, now."""

    def benched_flags(self) -> dict[str, str]:
        """The flagged members -> why: nodes benched for their samples, whose samples still
        arriving stay out of the update."""

    def flagged_ever(self) -> dict[str, str]:
        """Every node flagged during the run -> why it was flagged (first reason of its last
        flag)."""
