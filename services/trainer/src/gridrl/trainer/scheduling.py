"""Which node samples which group: a pure function of the nodes' load and a clock.

    plan = schedule(candidates, pending, group_size=8, max_tokens=128, now=time.monotonic())
    for a in plan: start Generate(group a.index) on a.address

One group (one prompt, ``group_size`` samples) is one ``Generate`` on one node (prompt-prefix
locality). Each group goes to the node where it is expected to finish first (earliest finish
time, as list schedulers such as HEFT do; Topcuoglu et al. 2002):

- a node holds at most ``slots = max(1, capacity // group_size)`` groups at a time;
- a node with a free slot finishes a group in its measured group latency ``group_s`` (a
  moving average of its Generate calls, queueing included); a full node in
  ``group_s * (1 + (in_flight + waiting) // slots)``, ``waiting`` being the groups of this
  round already waiting ahead; a full node not measured yet is not waited for;
- a node not measured yet counts as instant (it is tried), and so does one left idle for
  ``REEXPLORE_AFTER`` latencies (at least ``REEXPLORE_MIN_S``), in case it got faster;
- so a node several times slower than another (an MLX node on a Linux CPU beside a torch
  one) gets groups only while the fast node is that far behind, instead of holding every
  step back by its own latency;
- a group is given to a node it has not failed on when one is in rotation, else to one it
  has failed on the fewest times; never to a node that rejected it (INVALID_ARGUMENT) or
  whose declared bounds (max_n, max_tokens, max_context) it exceeds;
- ties go to the least loaded node (in-flight groups / slots), then the bigger one, then the
  one given a group longest ago.

No threads, no RPC, no clock of its own: the pool passes the load it holds and ``now``; tests
pass a table and a number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

# A node given no group for REEXPLORE_AFTER times its group latency (and at least
# REEXPLORE_MIN_S seconds) is tried again as if unmeasured: a slow node is not starved forever.
REEXPLORE_AFTER = 20.0
REEXPLORE_MIN_S = 120.0


@dataclass(frozen=True)
class Candidate:
    """A node in rotation as the scheduler sees it.

    Attributes:
        address: host:port.
        capacity: sequences it decodes together in one batch.
        in_flight: groups being sampled on it now.
        group_s: measured seconds of a group there (0 = not measured yet).
        last_call_at: clock time its last group was started (seconds, the caller's clock).
        last_assigned: the scheduler tick of its last group (ties go to the oldest).
        max_n, max_tokens, max_context: its request bounds (0 = unknown: assumed to fit).
    """

    address: str
    capacity: int = 1
    in_flight: int = 0
    group_s: float = 0.0
    last_call_at: float = 0.0
    last_assigned: int = 0
    max_n: int = 0
    max_tokens: int = 0
    max_context: int = 0


@dataclass(frozen=True)
class PendingGroup:
    """A group waiting for a node.

    Attributes:
        index: its prompt index in the batch.
        prompt_len: prompt tokens.
        tried: nodes it failed on, one entry per failure.
        rejected: nodes that refused it as INVALID_ARGUMENT (address -> their message).
    """

    index: int
    prompt_len: int
    tried: tuple[str, ...] = ()
    rejected: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Assignment:
    """Start group ``index`` on ``address``."""

    index: int
    address: str


def slots(node: Candidate, group_size: int) -> int:
    """Groups a node may hold at once: about its capacity worth of sequences, at least 1."""
    return max(1, node.capacity // group_size)


def fits(node: Candidate, prompt_len: int, group_size: int, max_tokens: int) -> bool:
    """Whether a request fits the node's declared bounds (0 = unknown, assumed to fit)."""
    return ((not node.max_n or group_size <= node.max_n)
            and (not node.max_tokens or max_tokens <= node.max_tokens)
            and (not node.max_context or prompt_len + max_tokens <= node.max_context))


def expected_finish_s(node: Candidate, group_size: int, now: float, queued: int = 0) -> float:
    """Seconds until a group given to the node at ``now``, behind ``queued`` other groups,
    would be done: its measured latency, times the batches ahead of it when its slots are
    full; 0 when not measured yet or when it sat idle long enough to be worth trying again."""
    idle_s = now - node.last_call_at
    if not node.group_s or (not node.in_flight
                            and idle_s > max(REEXPLORE_MIN_S, REEXPLORE_AFTER * node.group_s)):
        return 0.0
    return node.group_s * (1 + (node.in_flight + queued) // slots(node, group_size))


def pick(nodes: Sequence[Candidate], group: PendingGroup, *, group_size: int, max_tokens: int,
         now: float, ahead: int = 0) -> Candidate | None:
    """The node to give ``group`` to now, or None to wait: no node is free, or a busy one is
    still expected to finish the group before any free one would, counting the ``ahead``
    groups of this round already waiting as queued before it."""
    usable = [n for n in nodes if n.address not in group.rejected
              and fits(n, group.prompt_len, group_size, max_tokens)]
    candidates = [n for n in usable if n.address not in group.tried] or usable
    free = [n for n in candidates if n.in_flight < slots(n, group_size)]
    if not free:
        return None
    best = min(free, key=lambda n: (expected_finish_s(n, group_size, now),
                                    n.in_flight / slots(n, group_size),
                                    group.tried.count(n.address),
                                    -slots(n, group_size), n.last_assigned))
    best_busy = min((expected_finish_s(n, group_size, now, ahead) for n in candidates
                     if n not in free and n.group_s), default=float("inf"))
    if best_busy < expected_finish_s(best, group_size, now):
        return None  # queueing on a faster busy node beats this free one
    return best


def schedule(nodes: Sequence[Candidate], pending: Sequence[PendingGroup], *, group_size: int,
             max_tokens: int, now: float, tick: int = 0) -> list[Assignment]:
    """Assign the pending groups, in order, to the nodes in rotation (see the module
    docstring); a group that should wait is left out.

    Args:
        nodes: the nodes in rotation with their current load.
        pending: the groups waiting, first come first served.
        group_size: samples per group (``sampling.n``).
        max_tokens: new tokens per sample.
        now: the clock (same clock as ``Candidate.last_call_at``), seconds.
        tick: the caller's scheduler tick (each assignment counts one after it).
    Returns:
        the groups to start now, in the order they were assigned.
    """
    load = {n.address: n for n in nodes}
    out: list[Assignment] = []
    waiting = 0  # groups of this round already waiting for a node
    for group in pending:
        node = pick(list(load.values()), group, group_size=group_size, max_tokens=max_tokens,
                    now=now, ahead=waiting)
        if node is None:
            waiting += 1
            continue
        tick += 1
        load[node.address] = replace(node, in_flight=node.in_flight + 1, last_call_at=now,
                                     last_assigned=tick)
        out.append(Assignment(group.index, node.address))
    return out


def unservable(nodes: Sequence[Candidate], group: PendingGroup, *, group_size: int,
               max_tokens: int) -> str:
    """Why no node in rotation can ever take ``group`` ("" when one could, or when none is in
    rotation: then the caller waits for a node).

    Returns:
        a message naming the prompt's problem: rejected (INVALID_ARGUMENT) by every node in
        rotation, or beyond every node's bounds.
    """
    if not nodes:
        return ""
    if all(n.address in group.rejected for n in nodes):
        return (f"prompt {group.index}: rejected by every node in rotation: "
                + "; ".join(f"{a}: {d}" for a, d in sorted(group.rejected.items())))
    if not any(fits(n, group.prompt_len, group_size, max_tokens) for n in nodes):
        return (f"prompt {group.index}: {group.prompt_len} prompt tokens + max_tokens "
                f"{max_tokens}, n={group_size} exceed every node's bounds: " + "; ".join(
                    f"{n.address} (max_n {n.max_n}, max_tokens {n.max_tokens}, max_context "
                    f"{n.max_context})" for n in nodes))
    return ""
