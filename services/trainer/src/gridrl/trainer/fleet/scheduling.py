"""Which node samples which group: a pure function of the nodes' load and a clock.

    plan = schedule(candidates, pending, group_size=8, max_tokens=128, now=time.monotonic())
    for a in plan: start Generate(group a.index) on a.address

One group (one prompt, ``group_size`` samples) is one ``Generate`` on one node (prompt-prefix
locality). Each group goes to the node where it is expected to finish first (earliest finish
time, as list schedulers such as HEFT do; Topcuoglu et al. 2002):

- a node holds at most ``slots = max(1, capacity // group_size)`` groups at a time, and no
  more than its KV cache holds (``kv_cache_tokens // (group_size x (prompt + max_tokens +
  sequence_overhead_tokens))``, at least 1: a node decodes a group larger than its cache a
  few sequences at a time);
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
  whose declared bounds (max_n, max_tokens, max_context, and one sequence's KV-cache tokens)
  it exceeds;
- ties go to the least loaded node (in-flight groups / slots), then the bigger one, then the
  one given a group longest ago;
- a *pinned* request (a later turn of a multi-turn episode: its earlier turns were sampled
  on one node, which holds their keys and values and their policy version) goes to that node
  only, when it has a free slot (``capacity // n`` of its own ``n``); when that node is out of
  rotation, has rejected it or cannot fit it, :func:`stranded` says so and the caller fails
  the request instead of moving the episode (an episode is never sampled on two nodes).

A request is a group of ``n`` samples of one prompt: a single-turn group (``n`` = the group
size), or the first turn of a group's episodes (the same), or one later turn of one episode
(``n`` = 1, pinned).

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
        kv_cache_tokens, sequence_overhead_tokens: its KV-cache capacity and each sequence's
            working memory in tokens (``NodeInfo``; 0 = not limited).
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
    kv_cache_tokens: int = 0
    sequence_overhead_tokens: int = 0


@dataclass(frozen=True)
class PendingGroup:
    """A group waiting for a node.

    Attributes:
        index: its prompt index in the batch.
        prompt_len: prompt tokens.
        tried: nodes it failed on, one entry per failure.
        rejected: nodes that refused it as INVALID_ARGUMENT (address -> their message).
        n: its samples (0: the call's ``group_size``).
        max_tokens: its new tokens per sample (0: the call's ``max_tokens``).
        pinned: the only node it may go to ("" for any): the node of its episode's earlier
            turns.
    """

    index: int
    prompt_len: int
    tried: tuple[str, ...] = ()
    rejected: Mapping[str, str] = field(default_factory=dict)
    n: int = 0
    max_tokens: int = 0
    pinned: str = ""


@dataclass(frozen=True)
class Assignment:
    """Start group ``index`` on ``address``."""

    index: int
    address: str


def slots(node: Candidate, group_size: int, sequence_tokens: int = 0) -> int:
    """Groups a node may hold at once: about its capacity worth of sequences, and (given
    ``sequence_tokens`` = prompt + max_tokens of a sequence) no more than its KV cache holds;
    at least 1."""
    groups = node.capacity // group_size
    if node.kv_cache_tokens and sequence_tokens:
        per_group = group_size * (sequence_tokens + node.sequence_overhead_tokens)
        groups = min(groups, node.kv_cache_tokens // per_group)
    return max(1, groups)


def fits(node: Candidate, prompt_len: int, group_size: int, max_tokens: int) -> bool:
    """Whether a request fits the node's declared bounds (0 = unknown, assumed to fit), one
    sequence of it within its KV cache included (the node refuses it otherwise)."""
    return ((not node.max_n or group_size <= node.max_n)
            and (not node.max_tokens or max_tokens <= node.max_tokens)
            and (not node.max_context or prompt_len + max_tokens <= node.max_context)
            and (not node.kv_cache_tokens or prompt_len + max_tokens
                 + node.sequence_overhead_tokens <= node.kv_cache_tokens))


def expected_finish_s(node: Candidate, group_size: int, now: float, queued: int = 0,
                      sequence_tokens: int = 0) -> float:
    """Seconds until a group given to the node at ``now``, behind ``queued`` other groups,
    would be done: its measured latency, times the batches ahead of it when its slots are
    full; 0 when not measured yet or when it sat idle long enough to be worth trying again."""
    idle_s = now - node.last_call_at
    if not node.group_s or (not node.in_flight
                            and idle_s > max(REEXPLORE_MIN_S, REEXPLORE_AFTER * node.group_s)):
        return 0.0
    return node.group_s * (1 + (node.in_flight + queued)
                           // slots(node, group_size, sequence_tokens))


def pick(nodes: Sequence[Candidate], group: PendingGroup, *, group_size: int, max_tokens: int,
         now: float, ahead: int = 0) -> Candidate | None:
    """The node to give ``group`` to now, or None to wait: no node is free, or a busy one is
    still expected to finish the group before any free one would, counting the ``ahead``
    groups of this round already waiting as queued before it. A pinned group gets its node
    when that node has a free slot, else None."""
    group_size, max_tokens = group.n or group_size, group.max_tokens or max_tokens
    if group.pinned:
        node = next((n for n in nodes if n.address == group.pinned), None)
        if node is None or stranded(nodes, group, group_size=group_size, max_tokens=max_tokens):
            return None
        return node if node.in_flight < slots(node, group_size) else None
    usable = [n for n in nodes if n.address not in group.rejected
              and fits(n, group.prompt_len, group_size, max_tokens)]
    candidates = [n for n in usable if n.address not in group.tried] or usable
    seq = group.prompt_len + max_tokens
    free = [n for n in candidates if n.in_flight < slots(n, group_size, seq)]
    if not free:
        return None
    best = min(free, key=lambda n: (expected_finish_s(n, group_size, now, 0, seq),
                                    n.in_flight / slots(n, group_size, seq),
                                    group.tried.count(n.address),
                                    -slots(n, group_size, seq), n.last_assigned))
    best_busy = min((expected_finish_s(n, group_size, now, ahead, seq) for n in candidates
                     if n not in free and n.group_s), default=float("inf"))
    if best_busy < expected_finish_s(best, group_size, now, 0, seq):
        return None  # queueing on a faster busy node beats this free one
    return best


def schedule(nodes: Sequence[Candidate], pending: Sequence[PendingGroup], *, group_size: int,
             max_tokens: int, now: float, tick: int = 0) -> list[Assignment]:
    """Assign the pending groups, in order, to the nodes in rotation (see the module
    docstring); a group that should wait is left out.

    Args:
        nodes: the nodes in rotation with their current load.
        pending: the groups waiting, first come first served.
        group_size: samples per group (``sampling.n``) where a group does not give its own.
        max_tokens: new tokens per sample, likewise.
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
    if group.pinned:
        return stranded(nodes, group, group_size=group_size, max_tokens=max_tokens)
    group_size, max_tokens = group.n or group_size, group.max_tokens or max_tokens
    if all(n.address in group.rejected for n in nodes):
        return (f"prompt {group.index}: rejected by every node in rotation: "
                + "; ".join(f"{a}: {d}" for a, d in sorted(group.rejected.items())))
    if not any(fits(n, group.prompt_len, group_size, max_tokens) for n in nodes):
        return (f"prompt {group.index}: {group.prompt_len} prompt tokens + max_tokens "
                f"{max_tokens}, n={group_size} exceed every node's bounds: " + "; ".join(
                    f"{n.address} (max_n {n.max_n}, max_tokens {n.max_tokens}, max_context "
                    f"{n.max_context}, KV-cache tokens {n.kv_cache_tokens or 'unlimited'}, "
                    f"{n.sequence_overhead_tokens} more a sequence)" for n in nodes))
    return ""


def stranded(nodes: Sequence[Candidate], group: PendingGroup, *, group_size: int,
             max_tokens: int) -> str:
    """Why a pinned ``group`` can never be served ("" when its node can take it now or
    later, and for a group that is not pinned): its node is not in rotation (``nodes``: the
    nodes in rotation), rejected it (INVALID_ARGUMENT), or cannot fit it. The caller fails
    such a request: its episode's keys, values and policy version are on that node only.
    """
    if not group.pinned:
        return ""
    group_size, max_tokens = group.n or group_size, group.max_tokens or max_tokens
    node = next((n for n in nodes if n.address == group.pinned), None)
    if node is None:
        return f"request {group.index}: its episode's node {group.pinned} is out of rotation"
    if node.address in group.rejected:
        return (f"request {group.index}: rejected by its episode's node {node.address}: "
                f"{group.rejected[node.address]}")
    if not fits(node, group.prompt_len, group_size, max_tokens):
        return (f"request {group.index}: {group.prompt_len} prompt tokens + max_tokens "
                f"{max_tokens}, n={group_size} exceed the bounds of its episode's node "
                f"{node.address} (max_n {node.max_n}, max_tokens {node.max_tokens}, "
                f"max_context {node.max_context})")
    return ""
