"""The dashboard's data for its polish (issue 43.8; the page itself is checked in headless
Chromium, tests/e2e/test_dashboard_browser.py): a trainer that finished its run and left shows
as finished, a step's reward range travels and merges as a range, and the page carries the data
of its first render (HTML-escaped in an attribute, so a trainer's string stays text)."""

from __future__ import annotations

import html
import http.client
import json
import re

from gridrl.common.rpc.channel import dial
from gridrl.master.fleet_view import fleet_rows
from gridrl.master.run_model import RunInfo, RunSummary, StepPoint, merge
from gridrl.master.run_wire import step_point
from gridrl.master.server import Master
from gridrl.v1 import runs_pb2, runs_pb2_grpc, trainer_pb2


def trainer_row(health: str) -> dict:
    return {"address": "t:1", "role": "trainer", "health": health, "node_id": "t"}


def test_a_trainer_that_ended_its_run_and_left_shows_the_run_s_end_not_left():
    def health(state: int, gone: str = "left") -> str:
        run = RunSummary(RunInfo(run_id="r", run_name="x", trainer_address="t:1", state=state,
                                 total_steps=3), last_step=3, policy_version=3,
                         report_age_s=0.0, nodes=())
        rows = fleet_rows([], [run], {"t:1": trainer_row(gone)}, now=0.0)
        return rows[0]["health"]

    finished, stopped = trainer_pb2.RUN_STATE_FINISHED, trainer_pb2.RUN_STATE_STOPPED
    assert health(finished) == "finished" and health(stopped) == "stopped"
    assert health(trainer_pb2.RUN_STATE_FAILED) == "left"
    assert health(trainer_pb2.RUN_STATE_RUNNING) == "left"
    assert health(finished, gone="expired") == "expired"  # silent, not a clean end


def test_the_reward_range_travels_with_the_step_and_merges_as_a_range():
    def point(step: int, lo: float, hi: float) -> StepPoint:
        s = runs_pb2.RunStep(report=trainer_pb2.StepReport(step=step, reward_mean=(lo + hi) / 2,
                                                           reward_std=0.4))
        s.reward_min, s.reward_max = lo, hi
        return step_point(s)

    a, b = point(1, 0.0, 0.5), point(2, 0.25, 1.0)
    assert (a.reward_min, a.reward_max) == (0.0, 0.5)
    merged = merge(a, b)
    assert (merged.reward_min, merged.reward_max) == (0.0, 1.0)
    assert merged.reward_mean == (0.25 + 0.625) / 2
    bare = step_point(runs_pb2.RunStep(report=trainer_pb2.StepReport(step=3)))
    assert bare.reward_min is None and bare.reward_max is None


def test_the_page_carries_its_first_render_s_data_escaped():
    master = Master("127.0.0.1:0", dashboard_port=0).start()
    hostile = '</script><script>window.__xss=1</script>&'
    try:
        channel = dial(master.address)
        request = runs_pb2.ReportRunRequest(run=runs_pb2.RunInfo(
            run_id="r-page", run_name=hostile, state=trainer_pb2.RUN_STATE_RUNNING,
            total_steps=2))
        request.steps.add(report=trainer_pb2.StepReport(step=1, reward_mean=0.5))
        runs_pb2_grpc.RunReportServiceStub(channel).ReportRun(request, timeout=10)
        channel.close()
        conn = http.client.HTTPConnection("127.0.0.1", master.dashboard_port, timeout=10)
        conn.request("GET", "/")
        response = conn.getresponse()
        page = response.read().decode()
        conn.close()
        assert response.status == 200
        block = re.search(r'<meta name="gridrl-initial" id="initial" content="([^"]*)">', page)
        assert block is not None
        assert "<" not in block.group(1) and ">" not in block.group(1)
        initial = json.loads(html.unescape(block.group(1)))
        assert [r["run_name"] for r in initial["state"]["runs"]] == [hostile]
        assert initial["run"]["info"]["run_id"] == "r-page"
        assert [p["step"] for p in initial["run"]["steps"]] == [1]
        assert page.count("<script") == 1  # app.js, nothing injected
    finally:
        master.stop(0)
