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
    NODE_KEEPALIVE_FLAGS,
    StepWatch,
    check_versions,
    node_samples,
    pause_env,
    pause_file,
    trainer_flags,
)
from waiting import wait_for

pytestmark = pytest.mark.slow

REQUEST_TIMEOUT_S = 120  # the Generate deadline of the two-node runs: no stall may reach it


def _longest_gap(watch: StepWatch, since: float, steps: int) -> float:
    """The longest wait for a step record from ``since`` over the next ``steps`` records."""
    gaps, previous = [], since
    for s in watch.steps_after(since)[:steps]:
        gaps.append(watch.seen[s] - previous)
        previous = watch.seen[s]
    return max(gaps)


def _two_nodes_and_a_trainer(fleet, tiny_llama_dir: Path, run_dir: Path, pause_at: str | None,
                             nth: int, sync_deadline_s: float, node_flags: tuple[str, ...] = (),
                             master=None):
    """A master (or ``master``), node 1 (paused at its ``nth`` ``pause_at``, unless None),
    node 2 (both with ``node_flags``) and a trainer on both with --min-nodes 2 (stopped by
    the test); returns ``(n1, n2, trainer)`` once both nodes are ready."""
    master = master or fleet.master(*MASTER_FLAGS)
    n1 = fleet.node("node-1", tiny_llama_dir, "--capacity", "4", *node_flags, master=master,
                    wait=False, env=pause_env(fleet, "node-1", pause_at, nth) if pause_at
                    else None)
    n2 = fleet.node("node-2", tiny_llama_dir, "--capacity", "4", *node_flags, master=master,
                    wait=False)
    trainer = fleet.trainer(tiny_llama_dir, *trainer_flags(
        5000, min_nodes=2, request_timeout_s=REQUEST_TIMEOUT_S, sync_deadline_s=sync_deadline_s),
        master=master, run_dir=run_dir)
    for node in (n1, n2):
        node.wait_ready()
    return n1, n2, trainer


def _check_node_1_out_during_the_cut_and_back_after(watch: StepWatch, trainer, n1, n2,
                                                     cut_step: int, restored_at: float) -> None:
    """What a cut between node 1 and the trainer must leave: every step once, three or more
    during the cut, all with node 2's samples and none of node 1's past the step in progress;
    node 1 back after the restore on the adapter pushed just before; staleness 0; the trainer
    said why it moved the group."""
    records = watch.ordered()
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    during = [r for r in records if cut_step < r["step"] and watch.seen[r["step"]] < restored_at]
    assert len(during) >= 3
    # node 1's samples may reach the step in progress at the cut (groups it finished
    # before), which is cut_step + 1, or + 2 when the last record was still being
    # written; none reach a later step
    later = [r for r in during if r["step"] > cut_step + 2]
    assert later and all(node_samples(r, n1) is None for r in later), later
    assert all(node_samples(r, n2) for r in during), during
    # node 1 came back and sampled on the current adapter (pushed before it sampled)
    back = [r for r in records if watch.seen[r["step"]] > restored_at and node_samples(r, n1)]
    assert back, "node 1 never sampled again after the cut"
    for r in back:
        assert node_samples(r, n1)["versions"] == [r["policy_version"] - 1], r
    check_versions(records, max_staleness=0)
    assert "re-dispatched" in trainer.log() or "UNAVAILABLE" in trainer.log()


def test_a_node_cut_mid_generate_stalls_the_run_for_seconds_then_rejoins_current(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Node 1's link is cut while it holds a group (paused in Generate, so the cut is
    mid-call); the trainer's keepalive or the master's verdict ends the call, the group goes
    to node 2, and the run steps on node 2 for as long as the cut lasts. After the cut node 1
    is caught up to the current adapter before it samples again."""
    with fleet_or_skip(tmp_path) as fleet:
        run_dir = tmp_path / "run"  # the run is stopped once node 1 sampled again after the cut
        n1, n2, trainer = _two_nodes_and_a_trainer(fleet, tiny_llama_dir, run_dir,
                                                   "rollout.generate", 6, sync_deadline_s=10)
        watch = StepWatch(run_dir)
        try:
            wait_for(pause_file(fleet, "node-1").exists, 180, "node 1 to hold a group",
                     alive=trainer)
            fleet.cut("node-1")
            cut_at, cut_step = time.monotonic(), watch.last()
            # the run goes on without node 1: three steps complete while the link is still cut
            wait_for(lambda: len(watch.steps_after(cut_at)) >= 3, 90,
                     "three steps during the cut", alive=trainer)
            stall = _longest_gap(watch, cut_at, 2)
            fleet.restore("node-1")
            restored_at = time.monotonic()
            wait_for(lambda: [s for s in watch.steps_after(restored_at)
                              if node_samples(watch.records[s], n1)], 90,
                     "node 1 to sample again after the cut", alive=trainer)
            rejoin_s = time.monotonic() - restored_at
        finally:
            watch.stop()
            trainer.stop()
        _check_node_1_out_during_the_cut_and_back_after(watch, trainer, n1, n2, cut_step,
                                                        restored_at)
        print(f"\nMEASURED cut-mid-generate stall: {stall:.2f}s (longest wait for a step "
              "record, over the cut and the two steps after it); "
              f"node 1 sampled again {rejoin_s:.2f}s after the restore")


def test_a_node_cut_mid_push_does_not_hold_the_others_past_the_sync_deadline(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Node 1's link is cut while it receives a push (its first chunk read): the push to
    node 2 completes, the step's sync ends within --sync-deadline-s, the run goes on with
    node 2, and node 1 is caught up to the current adapter once the cut ends."""
    sync_deadline_s = 10.0
    with fleet_or_skip(tmp_path) as fleet:
        run_dir = tmp_path / "run"  # the run is stopped once node 1 sampled again after the cut
        n1, n2, trainer = _two_nodes_and_a_trainer(fleet, tiny_llama_dir, run_dir,
                                                   "rollout.push", 2, sync_deadline_s)
        watch = StepWatch(run_dir)
        try:
            wait_for(pause_file(fleet, "node-1").exists, 180, "node 1 to be mid-push",
                     alive=trainer)
            fleet.cut("node-1")
            cut_at, cut_step = time.monotonic(), watch.last()
            wait_for(lambda: len(watch.steps_after(cut_at)) >= 3, 90,
                     "three steps during the cut", alive=trainer)
            fleet.restore("node-1")
            restored_at = time.monotonic()
            wait_for(lambda: [s for s in watch.steps_after(restored_at)
                              if node_samples(watch.records[s], n1)], 90,
                     "node 1 to sample again after the cut", alive=trainer)
            rejoin_s = time.monotonic() - restored_at
        finally:
            watch.stop()
            trainer.stop()
        records = watch.ordered()
        assert [r["step"] for r in records] == list(range(1, len(records) + 1))
        pushed = records[cut_step]  # the step whose push was cut (the next record)
        assert pushed["sync_s"] <= sync_deadline_s + 1, pushed
        assert n2.address in pushed["synced_nodes"], pushed
        assert n1.address in pushed["skipped_nodes"] or n1.address in pushed["lagging_nodes"] \
            or n1.address not in pushed["synced_nodes"], pushed
        during = [r for r in records[cut_step:] if watch.seen[r["step"]] < restored_at]
        assert all(r["sync_s"] <= sync_deadline_s + 1 for r in during), during
        back = [r for r in records if watch.seen[r["step"]] > restored_at
                and node_samples(r, n1)]
        assert back, "node 1 never sampled again after the cut"
        for r in back:
            assert node_samples(r, n1)["versions"] == [r["policy_version"] - 1], r
        check_versions(records, max_staleness=0)
        print(f"\nMEASURED cut-mid-push sync: {pushed['sync_s']:.2f}s (deadline "
              f"{sync_deadline_s:.0f}s); node 1 sampled again {rejoin_s:.2f}s after the restore")


def _trainer_at_master(fleet, master) -> list[dict]:
    listing = fleet.cli_json("gridrl-master", "nodes", "--master", master.address,
                             "--role", "trainer", "--timeout-s", "5")
    return listing["nodes"] if listing else []


def test_the_trainer_cut_from_the_master_trains_on_and_the_master_sees_it_come_back(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Only the trainer and the master lose each other, for longer than the master's expiry:
    the trainer trains on the nodes it knows; the master drops the run's trainer (unhealthy,
    then expired), then lists it healthy again once the link is back."""
    expire = ("--heartbeat-interval", "0.5", "--unhealthy-after", "2", "--expire-after", "4")
    with fleet_or_skip(tmp_path) as fleet:
        master = fleet.master(*expire)
        n1 = fleet.node("node-1", tiny_llama_dir, "--capacity", "4", master=master, wait=False)
        run_dir = tmp_path / "run"
        steps = 5000  # stopped by the test once the master saw it come back
        trainer = fleet.trainer(tiny_llama_dir, *trainer_flags(steps, request_timeout_s=120),
                                master=master, run_dir=run_dir)
        n1.wait_ready()
        watch = StepWatch(run_dir)
        try:
            wait_for(lambda: watch.last() >= 2, 180, "two steps", alive=trainer)
            listed = wait_for(lambda: _trainer_at_master(fleet, master), 30,
                              "the master to list the trainer")
            assert listed[0]["status"] == "NODE_STATUS_HEALTHY", listed
            fleet.cut_between("trainer", "master")
            cut_at = time.monotonic()
            # the master lets the trainer expire (4 s without a heartbeat)...
            wait_for(lambda: not _trainer_at_master(fleet, master), 30,
                     "the master to drop the cut trainer", alive=trainer)
            expired_at = time.monotonic()
            # ...while the trainer steps on the node it knows
            wait_for(lambda: len(watch.steps_after(expired_at)) >= 2, 60,
                     "two steps after the master dropped the trainer", alive=trainer)
            assert all(node_samples(watch.records[s], n1) for s in watch.steps_after(cut_at))
            fleet.restore_between("trainer", "master")
            restored_at = time.monotonic()
            back = wait_for(lambda: [n for n in _trainer_at_master(fleet, master)
                                     if n["status"] == "NODE_STATUS_HEALTHY"], 60,
                            "the master to list the trainer healthy again", alive=trainer)
            rejoin_s = time.monotonic() - restored_at
            assert back[0]["info"]["address"] == trainer.address, back
            wait_for(lambda: watch.steps_after(restored_at), 60, "a step after the restore",
                     alive=trainer)
        finally:
            watch.stop()
            trainer.stop()
        records = watch.ordered()
        assert [r["step"] for r in records] == list(range(1, len(records) + 1))
        check_versions(records, max_staleness=0)
        print(f"\nMEASURED trainer cut from master: expired after {expired_at - cut_at:.2f}s, "
              f"listed healthy {rejoin_s:.2f}s after the restore")


def test_the_only_node_asleep_past_the_generate_deadline_makes_the_run_wait_then_go_on(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """The only node is SIGSTOPped (a sleeping Mac) past --request-timeout-s: the run waits,
    saying for what (console and GetRunStatus); after SIGCONT it goes on, and the node's late
    answers to the abandoned calls never reach an update."""
    with fleet_or_skip(tmp_path) as fleet:
        master = fleet.master(*MASTER_FLAGS)
        node = fleet.node("node-1", tiny_llama_dir, "--capacity", "4", master=master, wait=False)
        run_dir = tmp_path / "run"
        steps = 8
        trainer = fleet.trainer(tiny_llama_dir, *trainer_flags(
            steps, request_timeout_s=3, outage_wait_s=120), master=master, run_dir=run_dir)
        node.wait_ready()
        watch = StepWatch(run_dir)

        def waiting() -> dict | None:
            status = fleet.cli_json("gridrl-trainer", "status", "--address", trainer.address)
            return status.get("nodeWait") or status.get("node_wait") if status else None

        try:
            wait_for(lambda: watch.last() >= 2, 180, "two steps", alive=trainer)
            node.pause()
            paused_at, paused_step = time.monotonic(), watch.last()
            wait = wait_for(waiting, 60, "GetRunStatus to say the run waits", alive=trainer,
                            every_s=0.5)
            # past the Generate deadline: a call timed out, or the master's verdict came first
            wait_for(lambda: time.monotonic() - paused_at > 3 + 1, 10, "the deadline")
            assert watch.last() <= paused_step + 1
            node.resume()
            resumed_at = time.monotonic()
            assert trainer.wait(240) == 0, trainer.log()[-4000:]
        finally:
            watch.stop()
        waiting_for = wait.get("waitingFor") or wait.get("waiting_for")
        assert node.address in waiting_for, wait
        assert "no rollout node in rotation" in trainer.log()
        records = watch.ordered()
        assert [r["step"] for r in records] == list(range(1, steps + 1))
        for r in records:  # every sample drawn with the version pushed just before
            for stats in r["nodes"].values():
                assert stats["versions"] == [r["policy_version"] - 1], r
        after = watch.steps_after(resumed_at)
        assert after and watch.seen[after[0]] - resumed_at < 60
        print(f"\nMEASURED sleeping node: first step {watch.seen[after[0]] - resumed_at:.2f}s "
              "after SIGCONT")


def test_a_node_behind_a_10_mbit_link_gets_fewer_groups_and_never_holds_the_step_back(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Node 2 sits behind the ``slow`` profile (10 Mbit/s) and the adapter is large (rank
    512 on the tiny llama, 4.5 MB: ~3.6 s at 10 Mbit/s, ~40 ms at 1 Gbit/s): every step's
    push ends within --sync-deadline-s with node 1 synced, whatever node 2's push does; node 2
    samples only on the current adapter, so it gets fewer groups than node 1."""
    sync_deadline_s = 2.0
    with fleet_or_skip(tmp_path) as fleet:
        master = fleet.master(*MASTER_FLAGS)
        n1 = fleet.node("node-1", tiny_llama_dir, "--capacity", "4", master=master, wait=False)
        n2 = fleet.node("node-2", tiny_llama_dir, "--capacity", "4", master=master,
                        profile="slow", wait=False)
        run_dir = tmp_path / "run"
        steps = 8
        flags = trainer_flags(steps, min_nodes=2, request_timeout_s=120,
                              sync_deadline_s=sync_deadline_s)
        flags[flags.index("--lora-rank") + 1] = "512"
        flags[flags.index("--lora-alpha") + 1] = "1024"
        trainer = fleet.trainer(tiny_llama_dir, *flags, master=master, run_dir=run_dir)
        for node in (n1, n2):
            node.wait_ready()
        watch = StepWatch(run_dir)
        try:
            assert trainer.wait(300) == 0, trainer.log()[-4000:]
        finally:
            watch.stop()
        records = watch.ordered()
        assert [r["step"] for r in records] == list(range(1, steps + 1))
        for r in records:
            assert r["sync_s"] <= sync_deadline_s + 1, r
            assert n1.address in r["synced_nodes"], r
        check_versions(records, max_staleness=0)
        samples = {n.name: sum(s["samples"] for r in records if (s := node_samples(r, n)))
                   for n in (n1, n2)}
        assert samples["node-2"] < samples["node-1"], samples
        print(f"\nMEASURED slow node: sync_s max {max(r['sync_s'] for r in records):.2f}s "
              f"(deadline {sync_deadline_s:.0f}s), samples {samples}")


def _one_node_and_a_trainer(fleet, master, tiny_llama_dir: Path, run_dir: Path):
    """Node 1 (short keepalives) and a trainer on it alone that waits out outages (600 s;
    stopped by the test); returns ``(node, trainer)`` once the node is ready."""
    node = fleet.node("node-1", tiny_llama_dir, "--capacity", "4", *NODE_KEEPALIVE_FLAGS,
                      master=master, wait=False)
    trainer = fleet.trainer(tiny_llama_dir, *trainer_flags(
        5000, request_timeout_s=REQUEST_TIMEOUT_S, outage_wait_s=600), master=master,
        run_dir=run_dir)
    node.wait_ready()
    return node, trainer


def _status_at_master(fleet, master, node) -> str | None:
    """``node``'s status in the master's listing ("NODE_STATUS_HEALTHY", ...; None: not
    listed, or the listing failed)."""
    listing = fleet.cli_json("gridrl-master", "nodes", "--master", master.address,
                             "--role", "rollout", "--timeout-s", "5")
    for n in (listing or {}).get("nodes", []):
        if n["info"]["address"] == node.address:
            return n["status"]
    return None


def test_a_node_cut_from_the_master_only_does_not_stall_the_run(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Node 1 loses the master but not the trainer (a partial cut). The master declares it
    unhealthy; the trainer takes it out of rotation (its group in flight is re-dispatched on
    node 2), probes it itself, finds it answering and puts it back: node 1 samples again
    while the cut lasts, never on a stale version. The nodes run with short keepalives of their own (--keepalive-s 1,
    --keepalive-timeout-s 2: a heartbeat in flight into the cut fails after ~3 s, before its
    5 s deadline). After the cut node 1 is listed healthy again, caught up, and samples on
    the current adapter."""
    with fleet_or_skip(tmp_path) as fleet:
        run_dir = tmp_path / "run"
        master = fleet.master(*MASTER_FLAGS)
        n1, n2, trainer = _two_nodes_and_a_trainer(fleet, tiny_llama_dir, run_dir, None, 0,
                                                   sync_deadline_s=10,
                                                   node_flags=NODE_KEEPALIVE_FLAGS,
                                                   master=master)
        watch = StepWatch(run_dir)
        try:
            wait_for(lambda: [s for s in watch.steps_after(0)
                              if node_samples(watch.records[s], n1)], 180,
                     "node 1 to sample", alive=trainer)
            assert _status_at_master(fleet, master, n1) == "NODE_STATUS_HEALTHY"
            fleet.cut_between("node-1", "master")
            cut_at, cut_step = time.monotonic(), watch.last()
            wait_for(lambda: _status_at_master(fleet, master, n1) not in
                     (None, "NODE_STATUS_HEALTHY"), 30,
                     "the master to declare node 1 unhealthy", alive=trainer, every_s=0.25)
            verdict_s = time.monotonic() - cut_at
            out = f"node {n1.address} is NODE_STATUS_"
            wait_for(lambda: out in trainer.log(), 30,
                     "the trainer to take node 1 out of rotation", alive=trainer)
            out_at = time.monotonic()
            # the run does not stall: three more steps complete while the cut lasts
            wait_for(lambda: len(watch.steps_after(out_at)) >= 3, 90,
                     "three steps after node 1 left rotation", alive=trainer)
            # the trainer's own probe finds node 1 and it samples again, the cut still on
            wait_for(lambda: "answers the trainer although the master lists it unhealthy"
                     in trainer.log(), 60, "the trainer to probe node 1 back into rotation",
                     alive=trainer)
            readmitted_at = time.monotonic()
            wait_for(lambda: [s for s in watch.steps_after(readmitted_at)
                              if node_samples(watch.records[s], n1)], 90,
                     "node 1 to sample during the cut", alive=trainer)
            assert _status_at_master(fleet, master, n1) != "NODE_STATUS_HEALTHY"
            stall = _longest_gap(watch, cut_at, len(watch.steps_after(cut_at)))
            cut_s = time.monotonic() - cut_at
            fleet.restore_between("node-1", "master")
            restored_at = time.monotonic()
            wait_for(lambda: _status_at_master(fleet, master, n1) == "NODE_STATUS_HEALTHY", 30,
                     "the master to list node 1 healthy again", alive=trainer, every_s=0.25)
            healthy_s = time.monotonic() - restored_at
            wait_for(lambda: [s for s in watch.steps_after(restored_at)
                              if node_samples(watch.records[s], n1)], 90,
                     "node 1 to sample again after the cut", alive=trainer)
            rejoin_s = time.monotonic() - restored_at
        finally:
            watch.stop()
            trainer.stop()
        records = watch.ordered()
        assert [r["step"] for r in records] == list(range(1, len(records) + 1))
        during = [r for r in records if cut_step < r["step"] and watch.seen[r["step"]] < restored_at]
        assert len(during) >= 3
        assert all(node_samples(r, n2) for r in during), during
        # node 1 left rotation on the master's verdict and came back on the trainer's own
        # probe: it sampled in steps of the cut begun after it was readmitted
        readmitted = [r for r in during if watch.seen[r["step"]] > readmitted_at
                      and node_samples(r, n1)]
        assert readmitted, during
        # far from the Generate deadline: no step waited for node 1's group (a call the
        # verdict cancelled is re-dispatched at once)
        assert stall < REQUEST_TIMEOUT_S / 2, (stall, cut_s)
        back = [r for r in records if watch.seen[r["step"]] > restored_at
                and node_samples(r, n1)]
        assert back, "node 1 never sampled again after the cut"
        for r in back:
            assert node_samples(r, n1)["versions"] == [r["policy_version"] - 1], r
        check_versions(records, max_staleness=0)
        n1_during = sum(1 for r in during if node_samples(r, n1))
        print(f"\nMEASURED node cut from the master only: unhealthy at the master after "
              f"{verdict_s:.2f}s, out of the trainer's rotation {out_at - cut_at:.2f}s after the cut, "
              f"back on the trainer's probe {readmitted_at - cut_at:.2f}s after it; "
              f"longest wait for a step {stall:.2f}s over the cut ({cut_s:.1f}s, node 1 "
              f"sampled in {n1_during} of "
              f"{len(during)} steps of the cut); healthy at the master {healthy_s:.2f}s after "
              f"the restore, node 1 sampled again {rejoin_s:.2f}s after it")


def test_a_node_the_trainer_cannot_reach_stalls_the_run_for_seconds(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """The reverse partial cut: node 1 still heartbeats to the master (which keeps listing it
    healthy) but the trainer cannot reach it, while it holds a group (paused in Generate). The
    trainer's keepalive (--keepalive-s 1, --keepalive-timeout-s 2) fails the call, the group
    goes to node 2 and the run keeps stepping, the stall bounded by seconds (far below the
    Generate deadline) although the master never says node 1 is gone. After the cut node 1 is
    caught up to the current adapter before it samples again."""
    with fleet_or_skip(tmp_path) as fleet:
        run_dir = tmp_path / "run"
        master = fleet.master(*MASTER_FLAGS)
        n1, n2, trainer = _two_nodes_and_a_trainer(fleet, tiny_llama_dir, run_dir,
                                                   "rollout.generate", 6, sync_deadline_s=10,
                                                   node_flags=NODE_KEEPALIVE_FLAGS,
                                                   master=master)
        watch = StepWatch(run_dir)
        try:
            wait_for(pause_file(fleet, "node-1").exists, 180, "node 1 to hold a group",
                     alive=trainer)
            fleet.cut_between("trainer", "node-1")
            cut_at, cut_step = time.monotonic(), watch.last()
            wait_for(lambda: len(watch.steps_after(cut_at)) >= 3, 90,
                     "three steps during the cut", alive=trainer)
            stall = _longest_gap(watch, cut_at, 3)
            # the master saw nothing wrong: node 1 heartbeats to it all along
            status = _status_at_master(fleet, master, n1)
            fleet.restore_between("trainer", "node-1")
            restored_at = time.monotonic()
            wait_for(lambda: [s for s in watch.steps_after(restored_at)
                              if node_samples(watch.records[s], n1)], 90,
                     "node 1 to sample again after the cut", alive=trainer)
            rejoin_s = time.monotonic() - restored_at
        finally:
            watch.stop()
            trainer.stop()
        assert status == "NODE_STATUS_HEALTHY", status
        assert stall < REQUEST_TIMEOUT_S / 2, stall
        _check_node_1_out_during_the_cut_and_back_after(watch, trainer, n1, n2, cut_step,
                                                        restored_at)
        print(f"\nMEASURED trainer cut from a node only: longest wait for a step {stall:.2f}s "
              "over the cut's first three steps; node 1 sampled again "
              f"{rejoin_s:.2f}s after the restore")


def test_the_only_node_cut_from_the_master_keeps_the_run_stepping(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """The run's only node loses the master but not the trainer. The master declares it
    unhealthy and the trainer takes it out of rotation, then probes it itself, finds it
    answering and puts it back: the run keeps stepping on it for as long as the cut lasts
    (before, it waited for the whole cut with a node it could reach)."""
    with fleet_or_skip(tmp_path) as fleet:
        master = fleet.master(*MASTER_FLAGS)
        run_dir = tmp_path / "run"
        node, trainer = _one_node_and_a_trainer(fleet, master, tiny_llama_dir, run_dir)
        watch = StepWatch(run_dir)
        try:
            wait_for(lambda: watch.last() >= 2, 180, "two steps", alive=trainer)
            fleet.cut_between("node-1", "master")
            cut_at = time.monotonic()
            wait_for(lambda: _status_at_master(fleet, master, node) not in
                     (None, "NODE_STATUS_HEALTHY"), 30,
                     "the master to declare the node unhealthy", alive=trainer, every_s=0.25)
            verdict_at = time.monotonic()
            wait_for(lambda: f"node {node.address} is NODE_STATUS_" in trainer.log(), 30,
                     "the trainer to take the node out of rotation", alive=trainer)
            # three steps complete after the verdict, the cut still on and the master still
            # listing the node unhealthy: the trainer's own probe let it back
            wait_for(lambda: len(watch.steps_after(verdict_at)) >= 3, 90,
                     "three steps after the master's verdict", alive=trainer)
            assert _status_at_master(fleet, master, node) != "NODE_STATUS_HEALTHY"
            stall = _longest_gap(watch, cut_at, len(watch.steps_after(cut_at)))
            cut_s = time.monotonic() - cut_at
            fleet.restore_between("node-1", "master")
        finally:
            watch.stop()
            trainer.stop()
        assert "answers the trainer although the master lists it unhealthy" in trainer.log()
        records = watch.ordered()
        assert [r["step"] for r in records] == list(range(1, len(records) + 1))
        check_versions(records, max_staleness=0)
        # bounded by the trainer's probe (sent on the master's verdict) plus a step
        assert stall < 30, (stall, cut_s)
        print(f"\nMEASURED only node cut from the master: unhealthy at the master after "
              f"{verdict_at - cut_at:.2f}s; longest wait for a step {stall:.2f}s over the cut "
              f"({cut_s:.1f}s)")


def test_the_only_node_cut_from_the_master_past_its_expiry_keeps_the_run_stepping(
        tmp_path: Path, tiny_llama_dir: Path) -> None:
    """The partial cut outlasts the master's --expire-after (6 s here): the master removes
    the run's only node, which the trainer still reaches. The trainer keeps it (it answered
    the trainer's probe since the master's verdict) and the run steps on it through the
    expiry; after the cut the node registers again, the master lists it healthy and the run
    goes on, on the current adapter."""
    expire = ("--heartbeat-interval", "0.5", "--unhealthy-after", "2", "--expire-after", "6")
    with fleet_or_skip(tmp_path) as fleet:
        master = fleet.master(*expire)
        run_dir = tmp_path / "run"
        node, trainer = _one_node_and_a_trainer(fleet, master, tiny_llama_dir, run_dir)
        watch = StepWatch(run_dir)
        try:
            wait_for(lambda: watch.last() >= 2, 180, "two steps", alive=trainer)
            fleet.cut_between("node-1", "master")
            cut_at = time.monotonic()
            wait_for(lambda: "expired from the master but answers the trainer" in trainer.log(),
                     60, "the master to expire the node and the trainer to keep it",
                     alive=trainer, every_s=0.25)
            expired_at = time.monotonic()
            assert _status_at_master(fleet, master, node) is None  # removed from the registry
            wait_for(lambda: len(watch.steps_after(expired_at)) >= 3, 90,
                     "three steps after the master removed the node", alive=trainer)
            assert _status_at_master(fleet, master, node) is None
            stall = _longest_gap(watch, cut_at, len(watch.steps_after(cut_at)))
            cut_s = time.monotonic() - cut_at
            fleet.restore_between("node-1", "master")
            restored_at = time.monotonic()
            wait_for(lambda: _status_at_master(fleet, master, node) == "NODE_STATUS_HEALTHY",
                     60, "the node to register with the master again", alive=trainer,
                     every_s=0.25)
            registered_at = time.monotonic()
            registered_s = registered_at - restored_at
            wait_for(lambda: watch.steps_after(registered_at), 60,
                     "a step after the node registered again", alive=trainer)
        finally:
            watch.stop()
            trainer.stop()
        assert "left the pool" not in trainer.log()
        records = watch.ordered()
        assert [r["step"] for r in records] == list(range(1, len(records) + 1))
        after = [r for r in records if watch.seen[r["step"]] > expired_at]
        assert len(after) >= 3 and all(node_samples(r, node) for r in after), after
        check_versions(records, max_staleness=0)
        # bounded by the trainer's probe (sent on the master's verdict) plus a step
        assert stall < 30, (stall, cut_s)
        print(f"\nMEASURED only node cut from the master past its expiry: removed and kept "
              f"{expired_at - cut_at:.2f}s after the cut; longest wait for a step {stall:.2f}s "
              f"over the cut ({cut_s:.1f}s); registered again {registered_s:.2f}s after the "
              "restore")
