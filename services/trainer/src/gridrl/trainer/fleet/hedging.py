"""Which groups in flight to start again elsewhere: pure decisions over the calls of one batch,
from an injected clock; the pool (:mod:`gridrl.trainer.fleet.pool`) makes the calls.

Two reasons, checked in this order:

- **re-dispatch**: the group's node left the pool or its rotation for a reason a live call
  would not survive (the master declared it unhealthy, it was benched or excluded, it left the
  pool): the call is abandoned (cancelled, its late answer ignored) and the group goes back to
  the queue at once, instead of waiting for the call's deadline;
- **hedge** (backup request, Dean & Barroso, "The Tail at Scale", CACM 56(2), 2013): the group
  has run ``factor`` times longer than its node's measured group latency (and at least
  ``min_s``), so a second copy starts on another node; the first answer wins and the other call
  is cancelled. A group is hedged at most once.

A backup is only worth starting when another node in rotation can take it: the pool passes
``elsewhere(address)``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Attempt", "HedgePolicy", "Move", "MoveKind", "moves"]


@dataclass(frozen=True)
class HedgePolicy:
    """When a slow group gets a backup copy.

    Attributes:
        factor: k: a group running more than k x its node's measured group latency is hedged
            (0: never hedge).
        min_s: seconds a group runs at least before it may be hedged (also the bound before
            the node's latency is measured).
    """

    factor: float = 0.0
    min_s: float = 10.0

    def __post_init__(self) -> None:
        if self.factor < 0:
            raise ValueError(f"hedge_after: must be >= 0, got {self.factor}")
        if self.min_s < 0:
            raise ValueError(f"hedge_min_s: must be >= 0, got {self.min_s}")

    def threshold_s(self, group_s: float) -> float | None:
        """Seconds after which a group on a node of measured latency ``group_s`` (0: not
        measured) is hedged; None when hedging is off."""
        if self.factor <= 0:
            return None
        return max(self.min_s, self.factor * group_s)


@dataclass(frozen=True)
class Attempt:
    """One Generate call of a group in flight.

    Attributes:
        key: the caller's handle of the call (opaque here).
        index: the group's index in its batch.
        address: the node it runs on.
        started: clock seconds when it started.
    """

    key: object
    index: int
    address: str
    started: float


class MoveKind(enum.Enum):
    REDISPATCH = "re-dispatch"  # abandon the call, queue the group again now
    HEDGE = "hedge"             # keep the call, start a backup copy elsewhere


@dataclass(frozen=True)
class Move:
    """What to do about one attempt, and why (for the log)."""

    kind: MoveKind
    attempt: Attempt
    reason: str


def moves(attempts: Sequence[Attempt], *, now: float, gone: Mapping[str, str],
          group_s: Mapping[str, float], policy: HedgePolicy,
          elsewhere: Callable[[str], bool]) -> list[Move]:
    """Decide, for the calls in flight, which to abandon and which groups to hedge.

    Args:
        attempts: every call of the batch in flight (a group may have two: a hedged one).
        now: clock seconds.
        gone: nodes that can no longer answer -> why (out of the pool, unhealthy at the
            master, benched, excluded).
        group_s: each node's measured group latency in seconds (0 or absent: not measured).
        policy: the hedging policy.
        elsewhere: ``elsewhere(address)``: another node in rotation could take a copy of a
            group running on ``address``.

    Returns:
        re-dispatches (each call on a gone node, unless its group has a live copy elsewhere:
        then the call is only abandoned, with ``MoveKind.REDISPATCH`` too, and the caller must
        not queue the group twice — see :func:`needs_queue`), then hedges.
    """
    by_group: dict[int, list[Attempt]] = {}
    for a in attempts:
        by_group.setdefault(a.index, []).append(a)
    out: list[Move] = []
    for index in sorted(by_group):
        copies = by_group[index]
        live = [a for a in copies if a.address not in gone]
        for a in copies:
            if a.address in gone:
                out.append(Move(MoveKind.REDISPATCH, a, f"node {a.address} {gone[a.address]}"))
        if len(copies) != 1 or len(live) != 1:
            continue  # already hedged, or nothing live left to hedge
        a = live[0]
        threshold = policy.threshold_s(group_s.get(a.address, 0.0))
        if threshold is None or now - a.started <= threshold or not elsewhere(a.address):
            continue
        out.append(Move(MoveKind.HEDGE, a, f"running {now - a.started:.1f}s on {a.address}, "
                                           f"over {threshold:.1f}s (hedge)"))
    return out


def needs_queue(move: Move, attempts: Sequence[Attempt], gone: Mapping[str, str]) -> bool:
    """Whether a re-dispatch must queue its group again: no other copy of it is still live."""
    return not any(a.index == move.attempt.index and a.key != move.attempt.key
                   and a.address not in gone for a in attempts)
