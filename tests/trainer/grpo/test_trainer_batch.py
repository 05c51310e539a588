"""The step's data as typed records, without a model: the batch of admitted samples with their
rewards and advantages (``batch.py``; admission itself: test_trainer_admission.py), the
``log.jsonl`` record (``records.py``), and the loop importing no tensor framework."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from gridrl.trainer.backends.base import UpdateStats
from gridrl.trainer.envs.base import TaskItem
from gridrl.trainer.evaluation import EvalResult, standard_error
from gridrl.trainer.grpo import advantages as grpo
from gridrl.trainer.grpo.batch import build_batch
from gridrl.trainer.report.records import IS_KEYS, StepRecord, SyncOutcome
from gridrl.trainer.report.status import step_report
from gridrl.trainer.rollouts import Group, RolloutSample, StepRollouts
from gridrl.v1 import trainer_pb2

# The gridrl.v1.StepReport fields every record holds under the same name (``time`` is the
# report's own; ``eval_exact`` only at an eval).
STEP_REPORT_FIELDS = tuple(f.name for f in trainer_pb2.StepReport.DESCRIPTOR.fields
                           if f.name not in ("time", "eval_exact"))
# version -> the step whose weights it names
LINEAGE = {0: 0, 3: 2, 4: 3}


def _sample(node: str, version: int, tokens: list[int], text: str) -> RolloutSample:
    return RolloutSample(token_ids=tokens, logprobs=[-1.0] * len(tokens), text=text,
                         finish_reason="stop", policy_version=version, node=node)


def _rollouts() -> StepRollouts:
    """Step 4 (weights after step 3): group 0 from node a, group 1 from node b.
    Staleness: version 4 -> 0, version 3 -> 1, version 0 -> 3, version 9 -> unknown."""
    g0 = Group(0, [1, 2], [_sample("a", 4, [5, 6], "1"), _sample("a", 3, [7], "0"),
                           _sample("a", 0, [8, 9, 10], "1")], "a", 0.5)
    g1 = Group(1, [3], [_sample("b", 9, [11], "1"), _sample("b", 4, [12, 13], "0.5"),
                        _sample("b", 4, [14], "0")], "b", 0.5)
    return StepRollouts(step=4, groups=[g0, g1], generate_s=2.0, wait_s=0.25)


def _rewards(prompts, completions, columns):
    """Reward = the completion's text as a number; a second function that never scores."""
    assert columns["answer"] == [f"answer of {p}" for p in prompts]
    assert len(columns["completion_ids"]) == len(completions)
    values = [float(c) for c in completions]
    return values, {"numeric": values, "never": [math.nan] * len(values)}


def test_build_batch_weighs_the_admitted_samples_of_each_group():
    items = [TaskItem(prompt=p, messages=({"role": "user", "content": p},),
                      columns={"answer": f"answer of {p}"}) for p in ("p0", "p1")]
    batch = build_batch(4, _rollouts(), items, [[1, 2], [3]], lineage=LINEAGE, bound=1,
                        rewards=_rewards, scale_rewards=True, advantage_eps=1e-4)
    assert [(a.group, a.index, a.staleness, a.reward) for a in batch.samples] == [
        (0, 0, 0, 1.0), (0, 1, 1, 0.0), (1, 1, 0, 0.5), (1, 2, 0, 0.0)]
    # advantages over the admitted samples only: group 0 = (1, 0), group 1 = (0.5, 0)
    want = grpo.group_advantages([[1.0, 0.0], [0.5, 0.0]])
    assert [s.advantage for s in batch.sequences] == pytest.approx(
        [want[0, 0], want[0, 1], want[1, 0], want[1, 1]])
    seq = batch.sequences[2]
    assert (seq.prompt_ids, seq.completion_ids, seq.behaviour_logprobs, seq.group) == (
        (3,), (12, 13), (-1.0, -1.0), 1)
    assert batch.dropped == 2 and batch.staleness == [0, 1, 0, 0]
    assert batch.reward_mean == pytest.approx(0.375)
    assert batch.reward_std == pytest.approx(float(np.std([1.0, 0.0, 0.5, 0.0])))
    assert batch.solved_fraction == 0.25 and batch.groups_with_signal == 2
    assert batch.reward_funcs == {"numeric": pytest.approx(0.375), "never": None}
    assert batch.excluded == {}
    # the mismatch KL of fresh samples goes to their node, weighted by tokens
    batch.account_mismatch([0.1, 0.2, 0.3, 0.4])
    assert batch.per_node["a"].fresh_kl == pytest.approx(0.1)  # the stale sample is left out
    assert batch.per_node["b"].fresh_kl == pytest.approx((0.3 * 2 + 0.4) / 3)
    # a flagged node's samples stay out (and out of its group's mean)
    kept_out = build_batch(4, _rollouts(), items, [[1, 2], [3]], lineage=LINEAGE, bound=1,
                           rewards=_rewards, scale_rewards=True, advantage_eps=1e-4,
                           flagged={"b": "mismatched"})
    assert [(a.group, a.index) for a in kept_out.samples] == [(0, 0), (0, 1)]
    assert kept_out.excluded == {"b": 3} and kept_out.groups_with_signal == 1


def test_step_record_json_keeps_the_log_keys():
    items = [TaskItem(prompt=p, messages=(), columns={"answer": f"answer of {p}"})
             for p in ("p0", "p1")]
    batch = build_batch(4, _rollouts(), items, [[1, 2], [3]], lineage=LINEAGE, bound=1,
                        rewards=_rewards, scale_rewards=False, advantage_eps=1e-4)
    base = dict(policy_version=5, data_position=8, elapsed_s=9.0, collect_s=2.5, train_s=1.0)
    always = {*STEP_REPORT_FIELDS, "rollout_wait_s", "collect_s", "staleness_max",
              "samples_used", "sampled_tokens", "solved_fraction", "groups_with_signal",
              "reward_funcs", "nodes", "flagged_nodes", "excluded_samples", "updated",
              "data_position", "episodes", "turns_mean", "model_tokens", "env_tokens",
              "truncated_episodes", "dropped_episodes", "env_counts", "reward_error_groups",
              "reward_min", "reward_max"}  # the admitted samples' reward range
    bare = StepRecord.of_step(batch, None, SyncOutcome(), None, {}, **base).to_json()
    assert set(bare) == always
    assert (bare["loss"], bare["mismatch_kl"], bare["updated"], bare["eval_score"]) == (
        0.0, 0.0, False, None)
    assert bare["nodes"]["a"] == {"samples": 3, "dropped": 1, "versions": [0, 3, 4],
                                  "staleness_mean": 0.5, "fresh_mismatch_kl": None,
                                  "tokens_per_s": 6 / 0.5}  # its group: 6 tokens in 0.5 s
    assert (bare["rollout_s"], bare["rollout_wait_s"], bare["tokens_per_s"]) == (2.0, 0.25, 5.0)
    assert (bare["staleness_max"], bare["samples_used"], bare["dropped_samples"]) == (1, 4, 2)
    assert bare["excluded_samples"] == {}
    kept_out = build_batch(4, _rollouts(), items, [[1, 2], [3]], lineage=LINEAGE, bound=1,
                           rewards=_rewards, scale_rewards=False, advantage_eps=1e-4,
                           flagged={"b": "mismatched"})
    assert StepRecord.of_step(kept_out, None, SyncOutcome(), None, {"b": "mismatched"},
                              **base).to_json()["excluded_samples"] == {"b": 3}

    stats = UpdateStats(loss=0.5, mismatch_kl=1e-3, per_sequence_mismatch_kl=[0.0] * 4,
                        clip_fraction=0.1, ref_kl=None, grad_norm=2.0, lr=1e-4, tokens=6)
    sync = SyncOutcome(pushed=True, seconds=0.2, synced_nodes=["a"], skipped_nodes={"b": "x"})
    evaluation = EvalResult(score=0.75, exact=0.5, policy_version=5, n=4, seconds=3.0,
                            stderr=0.125)
    full = StepRecord.of_step(batch, stats, sync, evaluation, {"b": "stale"}, **base)
    record = full.to_json()
    assert set(record) == always | {"clip_fraction", "grad_norm", "lr", "ref_kl", "train_tokens",
                                    "skipped_groups", "peak_rss_mb", "synced_nodes", "skipped_nodes", "lagging_nodes",
                                    "eval_exact", "eval_stderr", "eval_n", "eval_s",
                                    "eval_examples", "eval_metrics", "eval_scorer"}
    assert record["ref_kl"] is None and record["train_tokens"] == 6  # present though null
    assert (record["nodes_synced"], record["nodes_skipped"], record["sync_s"]) == (1, 1, 0.2)
    assert (record["eval_score"], record["eval_policy_version"]) == (0.75, 5)
    assert (record["eval_stderr"], record["eval_n"]) == (0.125, 4)
    assert json.loads(json.dumps(record)) == record
    report = step_report(full)  # the gridrl.v1.StepReport fields are the record's
    assert {k: getattr(report, k) if k != "eval_score" or report.HasField(k) else None
            for k in STEP_REPORT_FIELDS} == {k: record[k] for k in STEP_REPORT_FIELDS}
    assert not step_report(StepRecord.of_step(batch, None, SyncOutcome(), None, {},
                                              **base)).HasField("eval_score")
    assert StepRecord.from_json(json.loads(json.dumps(record))) == full  # read back typed
    assert (full.is_weight_mean, full.is_weight_max, full.is_limited_fraction) == (None,) * 3

    corrected = UpdateStats(loss=0.5, mismatch_kl=1e-3, per_sequence_mismatch_kl=[0.0] * 4,
                            tokens=6, is_weight_mean=1.25, is_weight_max=3.5,
                            is_limited_fraction=0.25)
    with_is = StepRecord.of_step(batch, corrected, SyncOutcome(), None, {}, **base)
    assert set(with_is.to_json()) == always | {"clip_fraction", "grad_norm", "lr", "ref_kl",
                                               "train_tokens", "skipped_groups", "peak_rss_mb",
                                               *IS_KEYS}
    assert {k: with_is.to_json()[k] for k in IS_KEYS} == {
        "is_weight_mean": 1.25, "is_weight_max": 3.5, "is_limited_fraction": 0.25}


def test_eval_standard_error_by_hand():
    # scores 0, 1, 1, 0: mean 0.5, sample var = 4 * 0.25 / 3 = 1/3, se = sqrt(1/3 / 4)
    assert standard_error([0.0, 1.0, 1.0, 0.0]) == pytest.approx(math.sqrt(1 / 12))
    assert standard_error([0.4]) == 0.0 and standard_error([0.3, 0.3, 0.3]) == 0.0
    # the worst case for scores in [0, 1] is 0.5 / sqrt(n - 1): 279 prompts give <= 0.03
    half = [0.0, 1.0] * 139 + [0.0]
    assert standard_error(half) <= 0.5 / math.sqrt(278) <= 0.03


def test_the_loop_imports_no_tensor_framework():
    code = ("import sys, gridrl.trainer.run.driver, gridrl.trainer.cli; print(sorted(m for m in "
            "sys.modules if m.split('.')[0] in ('torch', 'mlx', 'transformers', 'peft')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_reward_function_that_fails_names_itself_and_the_step_or_its_group_is_dropped():
    """A function returning the wrong number of values (here for group p1's samples only):
    with ``fail`` the error names the function, its file and the step; with ``drop`` that
    group is left out, counted, and the other group is weighed as alone."""
    import pytest

    from gridrl.trainer.rewards import RewardError, RewardSet

    def short_on_p1(prompts, completions, **kwargs):
        values = [float(c) for c in completions]
        return values[:-1] if "p1" in prompts else values

    rewards = RewardSet([("short_on_p1", short_on_p1)], [1.0])
    items = [TaskItem(prompt=p, messages=(), columns={"answer": f"answer of {p}"})
             for p in ("p0", "p1")]
    args = dict(lineage=LINEAGE, bound=1, rewards=rewards, scale_rewards=False,
                advantage_eps=1e-4)
    with pytest.raises(RewardError) as e:
        build_batch(4, _rollouts(), items, [[1, 2], [3]], **args)
    assert str(e.value) == ("reward function short_on_p1 (test_trainer_batch.py) at step 4: "
                            "returned 3 values for 4 completions")
    batch = build_batch(4, _rollouts(), items, [[1, 2], [3]], on_reward_error="drop", **args)
    assert batch.reward_error_groups == 1 and "at step 4: returned 1 values for 2" in \
        batch.reward_error
    assert {a.group for a in batch.samples} == {0} and len(batch.samples) == 2
    alone = build_batch(4, _rollouts(), items[:1] + items[:1], [[1, 2], [1, 2]],
                        **{**args, "rewards": _rewards})
    assert [a.sequence.advantage for a in batch.samples] == [
        a.sequence.advantage for a in alone.samples if a.group == 0]
