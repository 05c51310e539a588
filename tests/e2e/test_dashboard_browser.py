"""The master's dashboard in a real browser (headless Chromium over the DevTools protocol,
``tests/browser.py``): a master, two rollout nodes and a trainer on the tiny llama; the page
shows the run's steps and eval points as they come, the node rows, a node SIGKILLed mid-run
turning unhealthy, two runs as two runs, and strings from trainers as text, never as HTML; its
polish (ticks, bars, empty charts, the reward band, a finished trainer, eval transcripts, a first
render without waiting for a request).
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


def check_chart_polish(page, run_dir: Path) -> None:
    """Readable ticks, no bar across the y-axis, "none" for an empty chart, the reward band
    within the rewards' range (issue 43.8), on the finished run's charts."""
    for chart in ("reward", "eval", "time", "lr"):
        # each tick label as drawn on the screen (the SVG scales with its box): its height
        ticks = page.evaluate(f"[...document.querySelectorAll('#chart-{chart} text.ytick')]"
                              ".map(t => [t.textContent, t.getBoundingClientRect().height])")
        assert len(ticks) >= 3, (chart, ticks)  # more than min and max
        assert all(height >= 12 for _, height in ticks), (chart, ticks)
        assert all("e-" not in text for text, _ in ticks), (chart, ticks)
        xticks = page.evaluate(f"[...document.querySelectorAll('#chart-{chart} text.xtick')]"
                               ".map(t => +t.dataset.value)")
        assert len(xticks) >= 3 and xticks == sorted(xticks), (chart, xticks)
    # bars start right of the y-axis (the first step's bar too)
    axis_x, lefts = page.evaluate(
        "[+document.querySelector('#chart-time line.axis:last-of-type').getAttribute('x1'), "
        "[...document.querySelectorAll('#chart-time rect')].map(r => +r.getAttribute('x'))]")
    assert lefts and min(lefts) >= axis_x, (axis_x, min(lefts or [0]))
    # nothing dropped or excluded in this run: the samples chart says "none", no 1e-9 axis
    assert page.evaluate("document.getElementById('chart-samples').dataset.empty") == "true"
    assert page.evaluate("document.querySelector('#chart-samples text.none').textContent") \
        == "none"
    assert page.evaluate("document.querySelectorAll('#chart-samples text.tick, "
                         "#chart-samples rect').length") == 0
    # the reward band stays inside the range of the rewards the steps scored
    logged = [r for r in map(json.loads, (run_dir / "log.jsonl").read_text().splitlines())
              if r.get("step") and r.get("reward_min") is not None]
    assert logged
    lo = min(r["reward_min"] for r in logged)
    hi = max(r["reward_max"] for r in logged)
    band = page.evaluate("(b => [+b.dataset.lo, +b.dataset.hi])"
                         "(document.querySelector('#chart-reward path.band'))")
    assert lo - 1e-9 <= band[0] <= band[1] <= hi + 1e-9, (band, lo, hi)


def check_transcripts(page) -> None:
    """The latest eval's episodes, every turn with its role marked (issue 43.7)."""
    roles = page.evaluate("[...document.querySelectorAll('#examples details')]"
                          ".map(d => [...d.querySelectorAll('.transcript li')]"
                          ".map(li => li.dataset.role))")
    assert roles and all(r[0] == "prompt" and "assistant" in r for r in roles), roles
    caption = page.evaluate("document.getElementById('examples-caption').textContent")
    assert f"step {STEPS}" in caption, caption


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
        # a trainer that finished its run and deregistered is shown finished, not "left"
        wait_for(lambda: page.evaluate(
            "[...document.querySelectorAll('#fleet tr[data-role=\"trainer\"]')]"
            ".map(r => r.dataset.health).join()") == "finished", 20,
            "the finished trainer's row shown finished")
        assert page.evaluate("document.querySelector('#fleet tr[data-role=\"trainer\"] "
                             ".health-finished') !== null")
        check_chart_polish(page, tmp_path / "run")
        check_transcripts(page)
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
        # a fresh page draws its charts from the data it was served with, before any request
        fresh = browser.page(url)
        assert fresh.evaluate("document.body.dataset.firstRender") == "inline"
        assert fresh.evaluate("document.body.dataset.fetchesBeforeFirstRender") == "0"
        assert fresh.evaluate("document.querySelectorAll('#chart-eval circle.eval-point')"
                              ".length") == len(points)
        assert fresh.evaluate("document.getElementById('steps-shown').textContent") \
            == str(STEPS)
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
