"""Admission: which samples of a step enter the update (pure), and a flagged node's readmission."""

from __future__ import annotations

import pytest

from gridrl.trainer.grpo.admission import admit, readmission
from gridrl.trainer.rollouts import Group, RolloutSample

LINEAGE = {0: 0, 3: 2, 4: 3, 5: 4}  # version -> step whose weights it names


def group(node: str, *versions: int, tokens: int = 2) -> Group:
    samples = [RolloutSample(token_ids=[7] * tokens, logprobs=[-1.0] * tokens, text="",
                             finish_reason="stop", policy_version=v, node=node)
               for v in versions]
    return Group(prompt_index=0, prompt_ids=[1], samples=samples, node=node, seconds=0.1)


def test_staleness_lineage_and_flagged_nodes() -> None:
    groups = [group("a", 5, 5), group("b", 4, 3), group("c", 5, 9), group("bad", 5, 5)]
    got = admit(groups, lineage=LINEAGE, max_staleness=1,
                flagged={"bad": "mismatched"})
    # a: staleness 0, 0; b: 1 and 2 (> 1: dropped); c: 0 and unknown version 9
    assert [(b, j, s.node) for b, j, s in got.kept] == [(0, 0, "a"), (0, 1, "a"), (1, 0, "b"),
                                                       (2, 0, "c")]
    assert got.staleness == [0, 0, 1, 0]
    assert got.excluded == {"bad": 2} and "bad" not in got.per_node  # not judged again
    assert got.dropped == 2 and got.sampled_tokens == 16
    assert (got.per_node["b"].samples, got.per_node["b"].dropped) == (2, 1)
    assert got.per_node["c"].unknown_version == 1 and got.per_node["c"].versions == {5, 9}
    assert got.per_node["b"].staleness_sum == 1


def test_staleness_counts_updates_not_steps() -> None:
    """Steps 5 and 6 made no update (no sample survived): version 5 still names the weights
    being trained at step 7, so its samples are fresh, not two steps old; a run with
    ``--max-staleness 0`` must not drop every later step after one empty step."""
    got = admit([group("a", 5, 4)], lineage=LINEAGE, max_staleness=0)
    assert got.staleness == [0] and got.dropped == 1  # 4 is one update behind 5
    got = admit([group("a", 4)], lineage=LINEAGE, max_staleness=1)
    assert got.staleness == [1] and got.dropped == 0


def test_nothing_flagged_nothing_stale() -> None:
    got = admit([group("a", 5)], lineage=LINEAGE, max_staleness=0)
    assert len(got.kept) == 1 and got.excluded == {} and got.dropped == 0


@pytest.mark.parametrize(("versions", "kl", "bound", "want"), [
    ([5, 5], 1e-7, 0.01, ""),
    ([5, 5], 0.02, 0.01, "KL(behaviour || trainer) 2.00e-02 nats/token > 0.01"),
    ([5, 4], 1e-7, 0.01, "sampled with policy version(s) 4,5, not the current 5"),
    ([], None, 0.01, "sampled with policy version(s) , not the current 5"),
    ([5], None, 0.01, "the check group has no token to measure"),
    ([5], float("nan"), 0.01, "KL(behaviour || trainer) nan nats/token > 0.01"),
])
def test_readmission(versions, kl, bound, want) -> None:
    assert readmission(versions, 5, kl, bound) == want
