"""Re-dispatch and hedging decisions (gridrl.trainer.fleet.hedging): pure, on an injected
clock — which calls in flight are abandoned, which groups get a backup copy."""

from __future__ import annotations

import pytest

from gridrl.trainer.fleet.hedging import Attempt, HedgePolicy, MoveKind, moves, needs_queue


def _decide(attempts, now, gone=None, group_s=None, policy=HedgePolicy(3.0, 2.0),
            elsewhere=lambda a: True):
    return moves(attempts, now=now, gone=gone or {}, group_s=group_s or {}, policy=policy,
                 elsewhere=elsewhere)


def test_a_group_on_a_node_that_left_rotation_is_re_dispatched_at_once() -> None:
    a = Attempt("call-1", 0, "n1:1", started=100.0)
    b = Attempt("call-2", 1, "n2:1", started=100.0)
    out = _decide([a, b], now=100.5, gone={"n1:1": "is unhealthy (the master says so)"},
                  group_s={"n1:1": 1.0, "n2:1": 1.0})
    assert [(m.kind, m.attempt.key) for m in out] == [(MoveKind.REDISPATCH, "call-1")]
    assert "n1:1 is unhealthy" in out[0].reason
    assert needs_queue(out[0], [a, b], {"n1:1": "x"})


def test_a_group_is_hedged_after_k_times_its_nodes_latency_and_only_once() -> None:
    a = Attempt("call-1", 0, "n1:1", started=0.0)
    group_s = {"n1:1": 1.0}
    assert _decide([a], now=3.0, group_s=group_s) == []   # 3 x 1 s: not over it yet
    out = _decide([a], now=3.01, group_s=group_s)
    assert [(m.kind, m.attempt.key) for m in out] == [(MoveKind.HEDGE, "call-1")]
    backup = Attempt("call-2", 0, "n2:1", started=3.01)
    assert _decide([a, backup], now=100.0, group_s=group_s) == []  # hedged already


def test_the_hedge_waits_at_least_min_s_and_for_an_unmeasured_node() -> None:
    a = Attempt("call-1", 0, "n1:1", started=0.0)
    assert _decide([a], now=1.9, group_s={"n1:1": 0.1}) == []   # 3 x 0.1 s < min 2 s
    assert _decide([a], now=2.1, group_s={"n1:1": 0.1})
    assert _decide([a], now=1.9) == [] and _decide([a], now=2.1)  # not measured: min_s


def test_no_hedge_when_off_or_when_no_other_node_can_take_it() -> None:
    a = Attempt("call-1", 0, "n1:1", started=0.0)
    assert _decide([a], now=1e6, policy=HedgePolicy(0.0, 0.0)) == []
    assert _decide([a], now=1e6, elsewhere=lambda address: address != "n1:1") == []


def test_a_gone_copy_of_a_hedged_group_is_abandoned_without_queueing_the_group_again() -> None:
    slow = Attempt("call-1", 0, "n1:1", started=0.0)
    backup = Attempt("call-2", 0, "n2:1", started=5.0)
    gone = {"n1:1": "is benched: 3 consecutive Generate failures"}
    out = _decide([slow, backup], now=6.0, gone=gone)
    assert [(m.kind, m.attempt.key) for m in out] == [(MoveKind.REDISPATCH, "call-1")]
    assert not needs_queue(out[0], [slow, backup], gone)


def test_policy_values_are_checked_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="hedge_after: must be >= 0"):
        HedgePolicy(-1.0)
    with pytest.raises(ValueError, match="hedge_min_s: must be >= 0"):
        HedgePolicy(1.0, -1.0)
    assert HedgePolicy(0.0).threshold_s(5.0) is None
    assert HedgePolicy(4.0, 1.0).threshold_s(5.0) == 20.0
