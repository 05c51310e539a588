"""A rollout node SIGKILLed in the middle of multi-turn episodes under a real trainer: in a
later turn, the episodes it held are dropped and counted (never continued on another node,
never trained across policy versions) and the step goes on with the other node's episodes; in
the first turn, the group restarts on the other node. Either way every turn of every trained
episode carries one policy version, which the step record (log.jsonl) shows."""

from __future__ import annotations

import signal

import pytest
from faultkit import (
    check_steps_once,
    finish,
    kill,
    metric,
    records_after,
    step_records,
    wait_for,
)

pytestmark = pytest.mark.slow


def _kill_node_b_in_its_generate(cluster, tmp_path, call: int):
    """Nodes a and b, a trainer of ``reverse-words-retry`` (2 prompts a step) on both; node b
    is SIGKILLed paused in its ``call``-th Generate. Returns (node a, run dir, trainer)."""
    a = cluster.node("a")
    b = cluster.node("b", env=cluster.pause_env("b", "rollout.generate", call))
    run_dir = tmp_path / "run"
    argv = cluster.trainer_argv(run_dir, 500, [a.address, b.address], min_nodes=2,
                                task="reverse-words-retry", prompts_per_step=2)
    trainer = cluster.trainer("trainer", argv)
    cluster.wait_paused(b, "b")
    kill(b)
    return a, run_dir, trainer


def test_node_killed_mid_episode_drops_its_episodes_and_never_mixes_versions(cluster,
                                                                             tmp_path) -> None:
    """Two nodes holding one group of 4 each (``--capacity 4``), 2 prompts a step of
    ``reverse-words-retry``: the tiny random model never reverses a phrase at once, so every
    episode gets the environment's feedback and a second turn, pinned to the node of its
    first. Node b pauses in its second Generate (the first is its turn-1 group, the second one
    of its episodes' second turns) and is SIGKILLed there."""
    a, run_dir, trainer = _kill_node_b_in_its_generate(cluster, tmp_path, 2)
    wait_for(lambda: any(r["dropped_episodes"] for r in step_records(run_dir)), 240,
             "the step of the kill", alive=trainer)
    killed_step = max(r["step"] for r in step_records(run_dir))
    wait_for(records_after(run_dir, killed_step, 2), 240, "two steps on the survivor",
             alive=trainer)
    dropped_metric = metric(trainer.metrics_port, "gridrl_trainer_dropped_episodes_total",
                            {"reason": "sampler"})
    trainer.proc.send_signal(signal.SIGTERM)  # stop after the step in progress
    assert finish(trainer) == 143, trainer.log()[-4000:]

    records = step_records(run_dir)
    check_steps_once(records, records[-1]["step"])
    dropped = sum(r["dropped_episodes"].get("sampler", 0) for r in records)
    assert dropped >= 1, [r["dropped_episodes"] for r in records]
    # nothing of the killed node's episodes was continued elsewhere or across versions
    assert all(set(r["dropped_episodes"]) <= {"sampler"} for r in records), records
    killed_at = next(r for r in records if r["dropped_episodes"].get("sampler"))
    assert killed_at["episodes"] == 8 and killed_at["turns_mean"] < 2.0, killed_at
    assert killed_at["nodes"][a.address]["samples"] == 4, killed_at  # a's group trained
    for r in records:
        # every turn of every trained episode was sampled by the version pushed at the end
        # of the step before (a node's versions hold each model turn's version)
        for node, stats in r["nodes"].items():
            assert stats["versions"] == [r["policy_version"] - 1], (r["step"], node, stats)
        assert r["dropped_samples"] == 0 and r["env_tokens"] > 0, r
        if r["step"] > killed_at["step"]:  # the survivor runs every episode, both turns
            assert list(r["nodes"]) == [a.address] and r["turns_mean"] == 2.0, r
            assert r["dropped_episodes"] == {}, r
    assert dropped_metric == dropped
    assert "sampler" in trainer.log()  # the step line's drop count, by reason


def test_node_killed_in_an_episode_s_first_turn_restarts_it_on_the_other(cluster,
                                                                         tmp_path) -> None:
    """Node b is SIGKILLed in its first Generate, its group's turn 1 (no episode has a turn
    on it yet): the request is sampled again on node a, whose episodes then run both turns
    there; nothing is dropped, and every turn carries the version of the step before."""
    a, run_dir, trainer = _kill_node_b_in_its_generate(cluster, tmp_path, 1)
    wait_for(records_after(run_dir, 0, 2), 240, "two steps", alive=trainer)
    trainer.proc.send_signal(signal.SIGTERM)
    assert finish(trainer) == 143, trainer.log()[-4000:]

    records = step_records(run_dir)
    check_steps_once(records, records[-1]["step"])
    first = records[0]
    assert list(first["nodes"]) == [a.address], first  # b's group restarted on a
    assert first["nodes"][a.address]["samples"] == 8 and first["episodes"] == 8, first
    for r in records:
        assert r["dropped_episodes"] == {} and r["turns_mean"] == 2.0, r
        for node, stats in r["nodes"].items():
            assert stats["versions"] == [r["policy_version"] - 1], (r["step"], node, stats)
