"""Partitions survived, with bounds (issue 44): the real master, rollout nodes and trainer,
each in its own network namespace (tests/netfleet.py), with mutual TLS and credentials; links
cut silently (packets vanish), slowed, processes paused. Each test asserts what the run did.
The deadlines and keepalives they run under are the settings docs/reliability.md lists."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from netfleet import fleet_or_skip
from partitions import (
    MASTER_FLAGS,
    StepWatch,
    check_versions,
    node_samples,
    pause_env,
    pause_file,
    trainer_flags,
)
from waiting import wait_for

pytestmark = pytest.mark.slow


def test_a_node_cut_mid_generate_stalls_the_run_for_seconds_then_rejoins_current(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Node 1's link is cut while it holds a group (paused in Generate, so the cut is
    mid-call); the trainer's keepalive or the master's verdict ends the call, the group goes
    to node 2, and the run steps on node 2 for as long as the cut lasts. After the cut node 1
    is caught up to the current adapter before it samples again."""
    with fleet_or_skip(tmp_path) as fleet:
        master = fleet.master(*MASTER_FLAGS)
        n1 = fleet.node("node-1", tiny_llama_dir, "--capacity", "4", master=master,
                        env=pause_env(fleet, "node-1", "rollout.generate", 6))
        n2 = fleet.node("node-2", tiny_llama_dir, "--capacity", "4", master=master)
        run_dir = tmp_path / "run"
        steps = 12
        trainer = fleet.trainer(tiny_llama_dir, *trainer_flags(
            steps, min_nodes=2, request_timeout_s=120, sync_deadline_s=10), master=master,
            run_dir=run_dir)
        watch = StepWatch(run_dir)
        try:
            wait_for(pause_file(fleet, "node-1").exists, 180, "node 1 to hold a group",
                     alive=trainer)
            fleet.cut("node-1")
            cut_at, cut_step = time.monotonic(), watch.last()
            # the run goes on without node 1: two steps complete while the link is still cut
            wait_for(lambda: len(watch.steps_after(cut_at)) >= 2, 90,
                     "two steps during the cut", alive=trainer)
            stall = watch.seen[watch.steps_after(cut_at)[0]] - cut_at
            fleet.restore("node-1")
            restored_at = time.monotonic()
            assert trainer.wait(240) == 0, trainer.log()[-4000:]
        finally:
            watch.stop()
        records = watch.ordered()
        assert [r["step"] for r in records] == list(range(1, steps + 1))
        during = [r for r in records if cut_step < r["step"] and watch.seen[r["step"]] < restored_at]
        assert len(during) >= 2
        later = [r for r in during if r["step"] > cut_step + 1]  # after the cut step itself
        assert all(node_samples(r, n1) is None for r in later), later
        assert all(node_samples(r, n2) for r in during)
        # node 1 came back and sampled on the current adapter (pushed before it sampled)
        back = [r for r in records if watch.seen[r["step"]] > restored_at
                and node_samples(r, n1)]
        assert back, "node 1 never sampled again after the cut"
        for r in back:
            assert node_samples(r, n1)["versions"] == [r["policy_version"] - 1], r
        check_versions(records, max_staleness=0)
        assert "re-dispatched" in trainer.log() or "UNAVAILABLE" in trainer.log()
        print(f"\nMEASURED cut-mid-generate stall: {stall:.2f}s (first step after the cut)")
