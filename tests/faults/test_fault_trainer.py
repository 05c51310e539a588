"""The trainer SIGKILLed in the middle of an adapter push and in the middle of a checkpoint:
``--resume`` continues from the last checkpoint with no step lost or repeated, and the node,
which kept serving meanwhile, takes the resumed run's pushes."""

from __future__ import annotations

import subprocess

import pytest
from faultkit import (
    BIN,
    ONE_THREAD,
    check_steps_once,
    kill,
    node_adapter,
    step_records,
    wait_for,
)

pytestmark = pytest.mark.slow

STEPS = 8


def resume(run_dir, node: str) -> subprocess.CompletedProcess:
    import os

    done = subprocess.run([str(BIN / "gridrl-trainer"), "run", "--resume", str(run_dir),
                           "--steps", str(STEPS), "--listen", "127.0.0.1:0",
                           "--metrics-port", "-1", "--rollout", node],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **ONE_THREAD})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return done


def check_resumed(run_dir, node: str, done: subprocess.CompletedProcess, ckpt_step: int,
                  before: dict[int, dict]) -> None:
    assert f"resumed at step {ckpt_step}" in done.stdout
    records = step_records(run_dir)
    check_steps_once(records, STEPS)
    first = records[ckpt_step]  # the first resumed step
    resumed_version = first["policy_version"] - 1
    assert resumed_version > max(r["policy_version"] for r in before.values())
    assert first["nodes"][node]["versions"] == [resumed_version]  # pushed before it sampled
    for r in records:
        assert r["dropped_samples"] == 0 and r["flagged_nodes"] == {}, r
    # the same weights and sampler seeds as before the kill: the same samples
    if ckpt_step + 1 in before:
        assert first["sampled_tokens"] == before[ckpt_step + 1]["sampled_tokens"]
    assert node_adapter(node).version == records[-1]["policy_version"]


def killed_at(cluster, tmp_path, point: str, nth: int):
    """A node, and a trainer of STEPS steps (checkpoint every 3) SIGKILLed at the ``nth``
    hit of its pause ``point``; returns (node, run_dir, the step records before the kill)."""
    node = cluster.node("node")
    run_dir = tmp_path / "run"
    trainer = cluster.trainer("trainer", cluster.trainer_argv(run_dir, STEPS, [node.address],
                                                              checkpoint_every=3),
                              env=cluster.pause_env("trainer", point, nth))
    cluster.wait_paused(trainer, "trainer")
    kill(trainer)
    return node, run_dir, {r["step"]: r for r in step_records(run_dir)}


def test_trainer_killed_mid_push_resumes(cluster, tmp_path) -> None:
    # step 4's push: its first chunk is sent
    node, run_dir, before = killed_at(cluster, tmp_path, "trainer.push", 4)
    assert max(before) == 3  # step 4 trained but not logged: the push comes first
    # the node serves on, on the last adapter it took whole; nothing half-received kept
    held = node_adapter(node.address)
    assert (held.name, held.version) == ("fault-run", before[3]["policy_version"])
    pushed = tmp_path / "node-adapters" / "pushed"
    wait_for(lambda: not list(pushed.glob(".staging*")), 60, "the cut push to be discarded")

    done = resume(run_dir, node.address)
    check_resumed(run_dir, node.address, done, 3, before)


def test_trainer_killed_mid_checkpoint_resumes(cluster, tmp_path) -> None:
    # step 6's checkpoint written, `latest` not yet pointing at it
    node, run_dir, before = killed_at(cluster, tmp_path, "trainer.checkpoint", 2)
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-000003"
    assert max(before) == 6
    assert node_adapter(node.address).version == before[6]["policy_version"]

    done = resume(run_dir, node.address)
    check_resumed(run_dir, node.address, done, 3, before)
