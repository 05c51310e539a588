"""Rollout nodes SIGKILLed at exact points (mid-Generate, mid-PushAdapter, all at once) under a
real trainer: the step finishes on the other nodes or the run waits for one, says so (console,
GetRunStatus, metrics), and a restarted node serves the current adapter before it samples."""

from __future__ import annotations

import signal

import pytest
from faultkit import (
    check_on_current_weights,
    check_steps_once,
    finish,
    kill,
    metric,
    node_adapter,
    port_of,
    records_after,
    run_status,
    step_records,
    wait_for,
)

pytestmark = pytest.mark.slow


def test_the_only_node_killed_mid_generate_run_waits_and_goes_on(cluster, tmp_path) -> None:
    """The design's topology (one node, one trainer): the node dies in the middle of a
    Generate of step 2 and comes back on the same port; the run waits instead of failing."""
    node = cluster.node("node", env=cluster.pause_env("node", "rollout.generate", 6))
    run_dir = tmp_path / "run"
    trainer = cluster.trainer("trainer", cluster.trainer_argv(run_dir, 5, [node.address]))
    cluster.wait_paused(node, "node")  # the 6th Generate: a group of step 2 (4 per step)
    kill(node)

    status = wait_for(lambda: (s := run_status(trainer.address)) and s.HasField("node_wait")
                      and s, 120, "GetRunStatus to report the wait", alive=trainer)
    assert node.address in status.node_wait.waiting_for
    assert 0 < status.node_wait.left_s <= 240
    assert metric(trainer.metrics_port, "gridrl_trainer_node_wait_left_seconds") > 0
    wait_for(lambda: "waiting for a rollout node" in trainer.log(), 60, "the console line",
             alive=trainer)

    back = cluster.node("node-restarted", port=port_of(node), adapters="node")
    assert finish(trainer) == 0, trainer.log()[-4000:]
    records = step_records(run_dir)
    check_steps_once(records, 5)
    check_on_current_weights(records)  # the returning node was synced before it sampled
    assert records[1]["nodes"][node.address]["samples"] == 16  # step 2 finished on it
    assert "a rollout node is back" in trainer.log()
    assert node_adapter(back.address).version == records[-1]["policy_version"]


def test_node_killed_mid_push_the_other_goes_on_and_it_returns_synced(cluster, tmp_path) -> None:
    a = cluster.node("a")
    b = cluster.node("b", env=cluster.pause_env("b", "rollout.push", 2))
    run_dir = tmp_path / "run"
    # every push goes to each node itself (--no-relay): the second push b takes is step 2's
    # (a node killed mid-relay: tests/rollout/test_relay.py)
    trainer = cluster.trainer("trainer", [*cluster.trainer_argv(
        run_dir, 500, [a.address, b.address], min_nodes=2), "--no-relay"])
    cluster.wait_paused(b, "b")  # step 2's push: b has read the header
    kill(b)
    later = wait_for(records_after(run_dir, 2, 2), 240, "two steps on the survivor", alive=trainer)
    assert b.address in step_records(run_dir)[1]["skipped_nodes"]  # step 2's sync skipped it
    for r in later:
        assert list(r["nodes"]) == [a.address] and r["nodes"][a.address]["samples"] == 16

    back = cluster.node("b-restarted", port=port_of(b), adapters="b")
    last = later[-1]["step"]
    wait_for(lambda: any(b.address in r["nodes"] for r in records_after(run_dir, last)()),
             240, "the restarted node to sample again", alive=trainer)
    trainer.proc.send_signal(signal.SIGTERM)  # stop after the step in progress
    assert finish(trainer) == 143, trainer.log()[-4000:]
    records = step_records(run_dir)
    check_steps_once(records, records[-1]["step"])
    check_on_current_weights(records)
    assert node_adapter(back.address).version == records[-1]["policy_version"]


def test_every_node_of_the_master_killed_at_once(cluster, tmp_path) -> None:
    master = cluster.master(heartbeat_s=1.0)
    a = cluster.node("a", master=master.address)
    b = cluster.node("b", master=master.address)
    run_dir = tmp_path / "run"
    trainer = cluster.trainer("trainer", cluster.trainer_argv(run_dir, 500, master=master.address,
                                                              min_nodes=2))
    wait_for(records_after(run_dir, 1), 240, "step 2", alive=trainer)
    kill(a)
    kill(b)
    wait_for(lambda: (s := run_status(trainer.address)) and s.HasField("node_wait"), 120,
             "the run to wait for a node", alive=trainer)
    waited_at = max(r["step"] for r in step_records(run_dir))

    a2 = cluster.node("a-restarted", port=port_of(a), master=master.address, adapters="a")
    b2 = cluster.node("b-restarted", port=port_of(b), master=master.address, adapters="b")
    wait_for(lambda: {a2.address, b2.address} <= {
        n for r in records_after(run_dir, waited_at)() for n in r["nodes"]}, 240,
        "both restarted nodes to sample", alive=trainer)  # one group each at a time
    trainer.proc.send_signal(signal.SIGTERM)
    assert finish(trainer) == 143, trainer.log()[-4000:]
    records = step_records(run_dir)
    check_steps_once(records, records[-1]["step"])
    check_on_current_weights(records)
