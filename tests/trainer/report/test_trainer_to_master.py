"""The trainer's reports to the master's dashboard (report/to_master.py): the event lines a
step implies, the steps reaching a real master, and a master that is down never holding up
the loop."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from trainer_runs import step_record as record
from waiting import wait_for

from gridrl.master.run_wire import detail_json
from gridrl.master.server import Master
from gridrl.trainer.report.events import Checkpointed
from gridrl.trainer.report.to_master import MAX_PENDING, MasterReporter, run_id_for, step_events
from gridrl.v1 import runs_pb2, trainer_pb2


def test_a_step_implies_its_push_eval_and_flag_lines():
    pushed = record(4, synced_nodes=["a:1"], skipped_nodes={"b:1": "UNAVAILABLE"},
                    lagging_nodes=[], nodes_synced=1, nodes_skipped=1, sync_s=0.3,
                    eval_score=0.625, eval_stderr=0.04, eval_n=128, eval_policy_version=4,
                    eval_s=2.5, flagged_nodes={"c:1": "stale: 16/16 samples dropped"})
    events = step_events(pushed, flagged_before={"d:1": "mismatched"})
    assert [(e.kind, e.node, e.ok) for e in events] == [
        ("push", "", False), ("eval", "", True), ("node_flagged", "c:1", False),
        ("node_readmitted", "d:1", True)]
    push, evaluation, flagged, _ = events
    assert push.message == "policy version 4 to 1/2 node(s) — b:1: UNAVAILABLE"
    assert push.duration_s == 0.3 and evaluation.duration_s == 2.5
    assert evaluation.message == "0.625 ± 0.040 at policy version 4 (128 prompts)"
    assert flagged.message == "stale: 16/16 samples dropped"
    # a flag already reported is not repeated; a quiet step says nothing
    assert step_events(record(5, flagged_nodes={"c:1": "stale"}), {"c:1": "stale"}) == []


def test_run_ids_are_stable_per_run_directory(tmp_path):
    assert run_id_for(tmp_path / "a") == run_id_for(tmp_path / "a")
    assert run_id_for(tmp_path / "a") != run_id_for(tmp_path / "b")


def run_info(state=trainer_pb2.RUN_STATE_RUNNING):
    return lambda: runs_pb2.RunInfo(run_id="r-test", run_name="test-run", state=state,
                                    total_steps=3)


def test_steps_events_and_the_node_view_reach_the_master():
    master = Master("127.0.0.1:0", dashboard_port=0).start()
    state = {"value": trainer_pb2.RUN_STATE_RUNNING}
    try:
        reporter = MasterReporter(
            master.address, None,
            run=lambda: runs_pb2.RunInfo(run_id="r-test", run_name="test-run",
                                         state=state["value"], total_steps=3),
            nodes=lambda stats: [runs_pb2.RunNode(
                address=a, in_rotation=True, tokens_per_s=s.tokens_per_s or 0.0,
                last_step=s.step) for a, s in sorted(stats.items())])
        for n in (1, 2, 3):
            reporter.on_step(record(n, eval_score=0.5 if n == 2 else None, eval_stderr=0.1,
                                    eval_policy_version=n))
        reporter.on_event(Checkpointed(3, Path("run/checkpoints/step-000003"), seconds=0.5))
        state["value"] = trainer_pb2.RUN_STATE_FINISHED
        reporter.close()
        assert reporter.sent_steps == 3
        detail = detail_json(master.runs.detail("r-test"))  # what the page reads
        assert [p["step"] for p in detail["steps"]] == [1, 2, 3]
        assert [(p["step"], p["score"], p["stderr"]) for p in detail["evals"]] == [
            (2, 0.5, 0.1)]
        assert detail["steps"][0]["nodes"] == {"a:1": 16} and detail["steps"][0]["lr"] == 1e-3
        assert detail["info"]["state"] == "finished"
        assert [(n["address"], n["tokens_per_s"], n["last_step"]) for n in detail["nodes"]] == [
            ("a:1", 250.0, 3)]
        kinds = [e["kind"] for e in detail["events"]]
        assert kinds.count("eval") == 1 and "checkpoint" in kinds
        assert [e["message"] for e in detail["events"] if e["kind"] == "checkpoint"] == [
            "step-000003 written"]
        assert [e["message"] for e in detail["events"] if e["kind"] == "state"][-1] == "finished"
        url = f"http://127.0.0.1:{master.dashboard_port}/api/runs/r-test"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert json.loads(response.read())["info"]["run_name"] == "test-run"
    finally:
        master.stop(0)


def test_a_master_that_is_down_never_holds_up_the_run(reserved_port):
    reporter = MasterReporter(f"127.0.0.1:{reserved_port}", None, run=run_info())
    start = time.monotonic()
    for n in range(1, MAX_PENDING + 201):
        reporter.on_step(record(n))
    queued_s = time.monotonic() - start
    # bounded: the oldest steps went; queueing never waited on the master
    assert len(reporter._steps) == MAX_PENDING and reporter._dropped == 200
    assert queued_s < 10, queued_s  # 1,200 records queued, not sent (a loaded 2-core CI)
    wait_for(lambda: reporter._thread.is_alive(), 5, "the reporter's thread to keep trying")
    start = time.monotonic()
    reporter.close(timeout_s=3.0)
    assert time.monotonic() - start < 8  # close waits at most its timeout (+ scheduling)
    assert reporter.sent_steps == 0
