"""The scheduler as a pure function: node tables and a fake clock in, assignments out."""

from __future__ import annotations

import pytest

from gridrl.trainer.fleet.scheduling import (
    REEXPLORE_MIN_S,
    Assignment,
    Candidate,
    PendingGroup,
    expected_finish_s,
    schedule,
    stranded,
    unservable,
)

NOW = 1000.0  # the fake clock: seconds


def node(address: str, **kw) -> Candidate:
    kw.setdefault("last_call_at", NOW - 1.0)
    return Candidate(address=address, **kw)


def groups(n: int, prompt_len: int = 3, **kw) -> list[PendingGroup]:
    return [PendingGroup(i, prompt_len, **kw) for i in range(n)]


def placed(plan: list[Assignment]) -> list[str]:
    return [a.address for a in plan]


# (case, nodes, pending groups, group_size, expected addresses in assignment order)
CASES = [
    ("slots follow capacity // group size",
     [node("big", capacity=8), node("small", capacity=2)], groups(6), 2,
     ["big", "small", "big", "big", "big"]),  # big: 4 slots, small: 1; the sixth waits
    ("a full pool leaves the rest waiting",
     [node("a", capacity=2, in_flight=1)], groups(3), 2, []),
    ("unmeasured nodes count as instant and are tried",
     [node("measured", capacity=2, group_s=0.5), node("new", capacity=2)], groups(1), 2,
     ["new"]),
    ("queueing on a fast busy node beats a free slow one",
     [node("fast", capacity=2, group_s=0.1, in_flight=1),
      node("slow", capacity=2, group_s=2.0)], groups(1), 2, []),
    ("the slow node gets the group once the fast queue is that long",
     [node("fast", capacity=2, group_s=0.1, in_flight=1),
      node("slow", capacity=2, group_s=0.25)], groups(4), 2, ["slow"]),
    ("a fast free node takes groups before a slower free one",
     [node("slow", capacity=4, group_s=1.0), node("fast", capacity=4, group_s=0.1)],
     groups(3), 2, ["fast", "fast"]),
    ("ties go to the least loaded, then the bigger, then the oldest assigned",
     [node("x", capacity=4, last_assigned=5), node("y", capacity=4, last_assigned=2),
      node("z", capacity=8, in_flight=1, last_assigned=9)], groups(4), 2,
     ["y", "x", "z", "z"]),
    ("a group avoids the nodes it failed on",
     [node("a", capacity=4), node("b", capacity=4, last_assigned=3)],
     [PendingGroup(0, 3, tried=("a",))], 2, ["b"]),
    ("with every node failed on, the one failed on least",
     [node("a", capacity=4), node("b", capacity=4)],
     [PendingGroup(0, 3, tried=("a", "a", "b"))], 2, ["b"]),
    ("a node that rejected the group is never used",
     [node("a", capacity=4), node("b", capacity=4, in_flight=2)],
     [PendingGroup(0, 3, rejected={"a": "prompt_token_ids[0]: bad"})], 2, []),
    ("a node whose bounds the request exceeds is never used",
     [node("short", capacity=4, max_context=16), node("long", capacity=4, max_context=64)],
     groups(2, prompt_len=20), 2, ["long", "long"]),
    ("a node with max_n below the group size is never used",
     [node("n4", capacity=16, max_n=4), node("n8", capacity=16, max_n=8)], groups(1), 8,
     ["n8"]),
    # a group of 2 sequences of 3 + 8 tokens, each with 5 more for sampling: 32 KV tokens
    ("slots follow the KV cache too",
     [node("roomy", capacity=8, kv_cache_tokens=1000), node("tight", capacity=8,
                                                          kv_cache_tokens=64,
                                                          sequence_overhead_tokens=5)],
     groups(7), 2, ["roomy", "tight", "roomy", "roomy", "tight", "roomy"]),  # 4 + 2 slots
    ("a node holds one group even when its cache takes it a few sequences at a time",
     [node("tiny", capacity=8, kv_cache_tokens=20, sequence_overhead_tokens=5)], groups(2), 2,
     ["tiny"]),
    ("a node whose cache cannot hold one sequence is never used",
     [node("tiny", capacity=8, kv_cache_tokens=15, sequence_overhead_tokens=5),
      node("big", capacity=8, kv_cache_tokens=16, sequence_overhead_tokens=5)], groups(1), 2,
     ["big"]),
    # episodes: a later turn is pinned to the node of its episode's earlier turns
    ("a pinned turn goes to its node even when another is faster and idle",
     [node("a", capacity=8, group_s=2.0), node("b", capacity=8, group_s=0.1)],
     [PendingGroup(i, 3, n=1, pinned="a") for i in range(3)], 4, ["a", "a", "a"]),
    ("pinned turns take their node's slots of their own n, the rest wait there",
     [node("a", capacity=2), node("b", capacity=8)],
     [PendingGroup(i, 3, n=1, pinned="a") for i in range(4)], 8, ["a", "a"]),
    ("a group's episodes stay together: each turn follows its episode's node",
     [node("a", capacity=4), node("b", capacity=4)],
     [PendingGroup(0, 3, n=1, pinned="b"), PendingGroup(1, 3, n=1, pinned="a"),
      PendingGroup(2, 3, n=1, pinned="b")], 4, ["b", "a", "b"]),
    ("a pinned turn never moves to a node it did not start on, even after a failure",
     [node("a", capacity=4), node("b", capacity=4)],
     [PendingGroup(0, 3, tried=("a",), n=1, pinned="a")], 4, ["a"]),
    ("a pinned turn whose node is out of rotation is not placed (stranded)",
     [node("b", capacity=4)], [PendingGroup(0, 3, n=1, pinned="a")], 4, []),
    ("first turns (unpinned groups of n samples) and pinned turns share a round",
     [node("a", capacity=4), node("b", capacity=4, last_assigned=5)],
     [PendingGroup(0, 3, n=1, pinned="b"), PendingGroup(1, 3, n=4), PendingGroup(2, 3, n=4)],
     4, ["b", "a"]),  # the pinned turn holds b's one slot for a group of 4: group 2 waits
    ("a pinned turn beyond its node's bounds is not placed",
     [node("a", capacity=4, max_context=16)],
     [PendingGroup(0, 20, n=1, pinned="a")], 4, []),
]


@pytest.mark.parametrize(("case", "nodes", "pending", "group_size", "want"), CASES,
                         ids=[c[0] for c in CASES])
def test_schedule_table(case, nodes, pending, group_size, want) -> None:
    plan = schedule(nodes, pending, group_size=group_size, max_tokens=8, now=NOW)
    assert placed(plan) == want, case
    assert [a.index for a in plan] == sorted(a.index for a in plan)  # first come first served


def test_schedule_counts_its_own_assignments_and_ticks() -> None:
    nodes = [node("a", capacity=4), node("b", capacity=4)]
    plan = schedule(nodes, groups(5), group_size=2, max_tokens=8, now=NOW, tick=10)
    assert placed(plan) == ["a", "b", "a", "b"]  # two slots each, alternating by load
    assert [a.index for a in plan] == [0, 1, 2, 3]
    # the inputs are not mutated: the pool commits the plan itself
    assert nodes[0].in_flight == 0


def test_a_slow_node_idle_long_enough_is_explored_again() -> None:
    fast = node("fast", capacity=2, group_s=0.1, in_flight=1)
    idle_s = REEXPLORE_MIN_S + 1.0
    slow_recent = node("slow", capacity=2, group_s=2.0, last_call_at=NOW - 10.0)
    slow_idle = node("slow", capacity=2, group_s=2.0, last_call_at=NOW - idle_s)
    assert placed(schedule([fast, slow_recent], groups(1), group_size=2, max_tokens=8,
                           now=NOW)) == []
    assert placed(schedule([fast, slow_idle], groups(1), group_size=2, max_tokens=8,
                           now=NOW)) == ["slow"]
    assert expected_finish_s(slow_idle, 2, NOW) == 0.0
    assert expected_finish_s(slow_recent, 2, NOW) == 2.0
    # a full node's expected finish counts the batches queued ahead
    assert expected_finish_s(fast, 2, NOW, queued=2) == pytest.approx(0.1 * 4)


def test_unservable_names_the_problem_or_waits() -> None:
    a = node("a", max_context=16)
    b = node("b", max_context=16)
    g = PendingGroup(3, 20)
    assert unservable([], g, group_size=2, max_tokens=8) == ""  # no node: the caller waits
    msg = unservable([a, b], g, group_size=2, max_tokens=8)
    assert msg.startswith("prompt 3: 20 prompt tokens + max_tokens 8, n=2 exceed every "
                          "node's bounds: a (max_n 0, max_tokens 0, max_context 16, KV-cache "
                          "tokens unlimited, 0 more a sequence)")
    small = node("c", kv_cache_tokens=30, sequence_overhead_tokens=4)
    assert unservable([small], g, group_size=2, max_tokens=8) == (
        "prompt 3: 20 prompt tokens + max_tokens 8, n=2 exceed every node's bounds: c (max_n "
        "0, max_tokens 0, max_context 0, KV-cache tokens 30, 4 more a sequence)")
    rejected = PendingGroup(1, 3, rejected={"a": "no", "b": "never"})
    assert unservable([a, b], rejected, group_size=2, max_tokens=8) == (
        "prompt 1: rejected by every node in rotation: a: no; b: never")
    assert unservable([a, b], PendingGroup(0, 3), group_size=2, max_tokens=8) == ""


def test_stranded_says_why_a_pinned_turn_can_never_be_served() -> None:
    a, b = node("a", max_context=16), node("b")
    assert stranded([a, b], PendingGroup(0, 3), group_size=1, max_tokens=8) == ""  # unpinned
    assert stranded([a, b], PendingGroup(0, 3, n=1, pinned="a"), group_size=1,
                    max_tokens=8) == ""
    assert stranded([b], PendingGroup(2, 3, n=1, pinned="a"), group_size=1, max_tokens=8) == (
        "request 2: its episode's node a is out of rotation")
    assert stranded([], PendingGroup(2, 3, n=1, pinned="a"), group_size=1, max_tokens=8) == (
        "request 2: its episode's node a is out of rotation")  # no waiting for a node
    assert stranded([a], PendingGroup(1, 3, rejected={"a": "bad id"}, n=1, pinned="a"),
                    group_size=1, max_tokens=8) == (
        "request 1: rejected by its episode's node a: bad id")
    assert stranded([a], PendingGroup(1, 12, n=1, max_tokens=8, pinned="a"), group_size=4,
                    max_tokens=2) == (
        "request 1: 12 prompt tokens + max_tokens 8, n=1 exceed the bounds of its episode's "
        "node a (max_n 0, max_tokens 0, max_context 16)")
    # unservable() defers to it for a pinned request, whatever is in rotation
    assert unservable([b], PendingGroup(2, 3, n=1, pinned="a"), group_size=1,
                      max_tokens=8) == "request 2: its episode's node a is out of rotation"
