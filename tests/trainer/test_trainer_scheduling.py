"""The scheduler as a pure function: node tables and a fake clock in, assignments out."""

from __future__ import annotations

import pytest

from gridrl.trainer.scheduling import (
    REEXPLORE_MIN_S,
    Assignment,
    Candidate,
    PendingGroup,
    expected_finish_s,
    schedule,
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
                          "node's bounds: a (max_n 0, max_tokens 0, max_context 16)")
    rejected = PendingGroup(1, 3, rejected={"a": "no", "b": "never"})
    assert unservable([a, b], rejected, group_size=2, max_tokens=8) == (
        "prompt 1: rejected by every node in rotation: a: no; b: never")
    assert unservable([a, b], PendingGroup(0, 3), group_size=2, max_tokens=8) == ""
