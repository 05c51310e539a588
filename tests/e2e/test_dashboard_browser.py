"""The master's dashboard in a real browser (headless Chromium over the DevTools protocol,
``tests/browser.py``): a master, two rollout nodes and a trainer on the tiny llama; the page
shows the run's steps and eval points as they come, the node rows, a node SIGKILLed mid-run
turning unhealthy, two runs as two runs, and strings from trainers as text, never as HTML.
The screenshot is saved as ``dashboard.png`` in the test's directory, and copied to
``$GRIDRL_DASHBOARD_SCREENSHOT`` when that is set."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from browser import Browser, chromium_or_skip
from waiting import wait_for

from gridrl.common.rpc.channel import dial
from gridrl.v1 import runs_pb2, runs_pb2_grpc, trainer_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_runs import BIN, ENV, ONE_THREAD

pytestmark = pytest.mark.slow

STEPS = 24
EVAL_EVERY = 4
HOSTILE = '<img src=x onerror="window.__xss=1">'


def node(service_factory, model: Path, tmp_path: Path, name: str, master: str):
    return service_factory(["gridrl-rollout", "serve", "--backend", "torch", "--model",
                            str(model), "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                            "--adapter-root", str(tmp_path / f"{name}-adapters"),
                            "--master", master], name, env=ONE_THREAD)


def test_the_dashboard_shows_a_live_run_in_a_real_browser(service_factory, tiny_llama_dir,
                                                          tmp_path):
    chromium = chromium_or_skip()
    master = service_factory(["gridrl-master", "serve", "--listen", "127.0.0.1:0",
                              "--metrics-port", "-1", "--store", "", "--heartbeat-interval",
                              "0.5", "--unhealthy-after", "2", "--expire-after", "120",
                              "--dashboard-port", "0"], "master", env=ONE_THREAD)
    url = master.info["dashboard_url"]
    keep = node(service_factory, tiny_llama_dir, tmp_path, "node-keep", master.address)
    doomed = node(service_factory, tiny_llama_dir, tmp_path, "node-doomed", master.address)
    log = (tmp_path / "trainer.log").open("w")
    trainer = subprocess.Popen(
        [str(BIN / "gridrl-trainer"), "run", "--model", str(tiny_llama_dir), "--master",
         master.address, "--min-nodes", "2", "--steps", str(STEPS), "--prompts-per-step", "4",
         "--group-size", "4", "--max-tokens", "8", "--eval-every", str(EVAL_EVERY),
         "--eval-tasks", "4", "--checkpoint-every", "10", "--lora-rank", "4", "--lora-alpha",
         "8", "--lr", "1e-2", "--run-dir", str(tmp_path / "run"), "--run-name", "browser-run",
         "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--node-wait-s", "120",
         "--request-timeout-s", "30"], stdout=log, stderr=subprocess.STDOUT, env=ENV)
    browser = Browser(chromium)
    try:
        page = browser.page(url)

        def shown(what: str) -> int:
            return int(page.evaluate(f"document.getElementById('{what}').textContent") or 0)

        def health(address: str) -> str | None:
            return page.evaluate(f"(document.querySelector('#fleet tr[data-address=\"{address}\"]')"
                                 " || {dataset: {}}).dataset.health || null")

        wait_for(lambda: shown("steps-shown") >= 4, 240, "4 steps on the page", alive=trainer)
        assert health(keep.address) == health(doomed.address) == "healthy"
        doomed.proc.kill()  # SIGKILL mid-run: no deregistration, the master stops hearing it
        wait_for(lambda: health(doomed.address) == "unhealthy", 30,
                 "the killed node's row to turn unhealthy", every_s=0.2)
        assert health(keep.address) == "healthy"
        # the trainer exits 0 after its last step, possibly before the page's next poll shows
        # that step: its exit ends this wait only when it failed
        wait_for(lambda: shown("steps-shown") >= STEPS or trainer.poll() not in (None, 0), 240,
                 f"{STEPS} steps on the page")
        assert trainer.wait(120) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        wait_for(lambda: shown("steps-shown") >= STEPS, 20, f"{STEPS} steps on the page")
        wait_for(lambda: page.evaluate("document.querySelector('#runs tbody tr .state-finished')"
                                       " !== null"), 20, "the run shown finished")
        # the eval points, each with its standard error as data and as an error bar
        points = page.evaluate("[...document.querySelectorAll('#chart-eval circle.eval-point')]"
                               ".map(c => [+c.dataset.step, c.dataset.stderr])")
        assert [s for s, _ in points] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
        assert all(se != "" for _, se in points)
        assert page.evaluate("document.querySelectorAll('#chart-eval line.errbar').length") \
            == 3 * len(points)
        # the node that drew each step's groups; the event lines
        # ... as the trainer recorded it (log.jsonl: nodes.<address>.samples); which node draws
        # which step depends on the scheduler's timing, so the page is held to the record
        drawn = page.evaluate("[...document.querySelectorAll('#steps tbody tr')]"
                              ".map(r => [r.dataset.step, r.lastChild.textContent])")
        logged = {r["step"]: r["nodes"] for r in map(json.loads, (tmp_path / "run" / "log.jsonl")
                  .read_text().splitlines()) if "nodes" in r}
        assert drawn

        def shares(text: str) -> dict[str, int]:
            pairs = (part.rsplit(" ×", 1) for part in text.split(", ") if part)
            return {a: int(n) for a, n in pairs if int(n)}

        for step, text in drawn:
            recorded = {a: n["samples"] for a, n in logged[int(step)].items() if n["samples"]}
            assert shares(text) == recorded, (step, text, logged[int(step)])
            assert set(recorded) <= {keep.address, doomed.address}, recorded
        kinds = set(page.evaluate("[...document.querySelectorAll('#events li')]"
                                  ".map(li => li.dataset.kind)"))
        assert {"push", "eval", "checkpoint", "node_joined", "node_unhealthy"} <= kinds, kinds
        page.screenshot(tmp_path / "dashboard.png")
        if os.environ.get("GRIDRL_DASHBOARD_SCREENSHOT"):  # e.g. docs/dashboard.png
            shutil.copyfile(tmp_path / "dashboard.png", os.environ["GRIDRL_DASHBOARD_SCREENSHOT"])

        # a second run on the same master, whose trainer sends hostile strings
        channel = dial(master.address)
        hostile = runs_pb2.ReportRunRequest(run=runs_pb2.RunInfo(
            run_id="hostile", run_name=HOSTILE, state=trainer_pb2.RUN_STATE_RUNNING,
            total_steps=2, task="<b>task</b>"))
        hostile.steps.add(report=trainer_pb2.StepReport(step=1)).nodes.add(address=HOSTILE,
                                                                           samples=1)
        hostile.events.add(kind=runs_pb2.RUN_EVENT_KIND_NODE_FLAGGED, node=keep.address,
                           message="<script>window.__xss=2</script>")
        hostile.nodes.add(address=keep.address, flagged='<svg onload="window.__xss=3">')
        runs_pb2_grpc.RunReportServiceStub(channel).ReportRun(hostile, timeout=10)
        channel.close()
        wait_for(lambda: page.evaluate("document.querySelectorAll('#runs tbody tr').length")
                 == 2, 20, "two runs on the page")
        page.evaluate("document.querySelector('#runs tr[data-run-id=\"hostile\"]').click()")
        wait_for(lambda: HOSTILE in (page.evaluate(
            "document.getElementById('run-title').textContent") or ""), 20,
            "the hostile run shown, its name as text")
        assert page.evaluate("window.__xss === undefined")
        assert page.evaluate("document.querySelectorAll('img, script:not([src]), #events b, "
                             "#fleet svg, #run-info b').length") == 0
        assert "<script>window.__xss=2</script>" in page.evaluate(
            "document.getElementById('events').textContent")
    finally:
        browser.close()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        log.close()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == STEPS
    print(f"dashboard screenshot: {tmp_path / 'dashboard.png'}")
