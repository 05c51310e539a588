"""Multi-turn runs are inspectable (issue 43.7): the held-out eval's examples keep the whole
transcript (model and environment turns, roles marked) in ``log.jsonl``, ``summary.json`` and
the master's dashboard API, and the console's legend names every field of the step line."""

from __future__ import annotations

import io
import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console
from trainer_runs import BIN, ENV, records, step_record

from gridrl.master.server import Master
from gridrl.trainer.report.console import (
    EPISODE_LEGEND,
    EPISODE_LEGEND_FIELDS,
    LEGEND,
    LEGEND_FIELDS,
    ConsoleLines,
)
from gridrl.trainer.report.to_master import MAX_MESSAGES, MAX_TEXT, MasterReporter
from gridrl.v1 import runs_pb2, trainer_pb2

ENV_FILE = '''
from gridrl.trainer.envs.base import Environment, EnvTurn
from gridrl.trainer.envs.base import TaskItem


class Retry(Environment):
    """Two model turns per episode: the environment answers the first with feedback."""

    name = "retry"
    max_turns = 2
    max_tokens = 4
    eval_tasks = 2

    def train_item(self, index):
        return TaskItem(f"w{index % 50}", ({"role": "user", "content": f"w{index % 50}"},),
                        {"index": index})

    def eval_items(self):
        return [self.train_item(1000 + i) for i in range(2)]

    def respond(self, item, transcript, state):
        if len([m for m in transcript if m["role"] == "assistant"]) == 1:
            return EnvTurn([{"role": "user", "content": "feedback: try w2 again"}])
        return EnvTurn([], done=True)

    def score(self, prompts, completions, **columns):
        return [float("w2" in c) for c in completions]
'''



def test_the_legend_names_every_field_of_the_step_line():
    out = io.StringIO()
    lines = ConsoleLines(Console(file=out, width=1000, no_color=True), total_steps=60,
                         remote=True)
    lines.on_step(step_record(1))  # a single-turn step: no episode legend yet
    lines.on_step(step_record(
        2, reward_funcs={"f:a": 0.5, "f:b": 0.25}, eval_score=0.5, eval_stderr=0.1,
        eval_policy_version=2, eval_exact=0.25, reward_error_groups=1, episodes=8,
        turns_mean=1.5, model_tokens=300, env_tokens=96, truncated_episodes=2,
        dropped_episodes={"env_error": 1}, env_counts={"tool_calls": 5, "tool_errors": 1,
                                                       "tool_timeouts": 0},
        dropped_samples=3, grad_norm=0.5, is_weight_mean=1.0, is_weight_max=2.0,
        is_limited_fraction=0.1, synced_nodes=["a:1"], nodes_synced=1, sync_s=0.2,
        flagged_nodes={"b:1": "stale"}))
    printed = out.getvalue().splitlines()
    legend, episode_legend = (re.sub(r"\[/?[a-z ]*\]", "", x) for x in (LEGEND,
                                                                         EPISODE_LEGEND))
    assert printed[0] == legend and printed[2] == episode_legend, printed[:3]
    assert printed.count(episode_legend) == 1 and printed.count(legend) == 1
    step_line = printed[3]
    named = " ".join(name for name, _ in LEGEND_FIELDS + EPISODE_LEGEND_FIELDS)
    meanings = legend + " " + episode_legend
    # every word of the step line that is not a number or a value is a field the legend names
    values = {"f:a", "f:b", "a:1", "b:1", "env_error", "±", "│", "-"}
    words = {w for w in re.split(r"[\s│()/@±]+", step_line)
             if w and w not in values and not re.fullmatch(r"[+-]?[\d.,%e+-]+s?|v\d+|\d+/\d+",
                                                            w)}
    unnamed = sorted(w for w in words if w.rstrip(":") not in meanings)
    assert not unnamed, (unnamed, step_line)
    for field in ("turns", "env a/b tok", "trunc", "drop", "tools", "stale", "kl", "loss",
                  "sync", "roll", "eval", "reward"):
        assert field in named, field
    for word in ("turns", "env", "tok", "trunc", "drop", "tools", "calls", "err", "timeouts",
                 "gnorm", "dropped", "exact", "capped", "tok/s", "FLAGGED"):
        assert word in step_line and word in meanings, word


def test_eval_transcripts_reach_the_master_s_dashboard_api():
    master = Master("127.0.0.1:0", dashboard_port=0).start()
    long_reply = "x" * (MAX_TEXT + 50)
    transcript = [{"role": "assistant", "content": "w3 w4"},
                  {"role": "user", "content": "feedback: <b>try</b> again"},
                  {"role": "assistant", "content": long_reply}]
    many = [{"role": "assistant" if i % 2 else "user", "content": f"m{i}"}
            for i in range(MAX_MESSAGES + 10)]
    try:
        reporter = MasterReporter(master.address, None, run=lambda: runs_pb2.RunInfo(
            run_id="r-tr", run_name="transcripts", state=trainer_pb2.RUN_STATE_RUNNING,
            total_steps=2))
        reporter.on_step(step_record(1))
        reporter.on_step(step_record(2, eval_score=0.5, eval_stderr=0.1, eval_policy_version=2,
                                     eval_examples=[
                                         {"prompt": "w1", "completion": long_reply,
                                          "score": 0.5, "turns": 2, "transcript": transcript},
                                         {"prompt": "w9", "completion": "m", "score": 0.0,
                                          "turns": 0, "transcript": many,
                                          "dropped": "env_error", "error": "boom"}]))
        reporter.close()
        url = f"http://127.0.0.1:{master.dashboard_port}/api/runs/r-tr"
        with urllib.request.urlopen(url, timeout=10) as response:
            shown = json.loads(response.read())["eval_examples"]
        assert shown["step"] == 2 and shown["policy_version"] == 2
        first, second = shown["examples"]
        assert first["prompt"] == "w1" and first["turns"] == 2 and first["score"] == 0.5
        assert [m["role"] for m in first["transcript"]] == ["assistant", "user", "assistant"]
        assert first["transcript"][1]["content"] == "feedback: <b>try</b> again"
        assert len(first["transcript"][2]["content"]) == MAX_TEXT  # cut to the wire's bound
        assert first["transcript"][2]["content"].endswith("…")
        # a transcript past the bound keeps its first messages and its last (the scored one)
        assert len(second["transcript"]) == MAX_MESSAGES
        assert second["transcript"][-1]["content"] == f"m{MAX_MESSAGES + 9}"
        assert second["dropped"] == "env_error" and second["error"] == "boom"
    finally:
        master.stop(0)


def test_the_master_refuses_eval_examples_past_their_bounds():
    from gridrl.common.errors import StatusError
    from gridrl.master.runs import validate_report

    request = runs_pb2.ReportRunRequest(run=runs_pb2.RunInfo(run_id="r", total_steps=1))
    step = request.steps.add(report=trainer_pb2.StepReport(step=1))
    step.eval_examples.add(prompt="p").transcript.add(role="user", content="y" * 20_000)
    with pytest.raises(StatusError, match=r"steps\[0\].eval_examples\[0\].transcript\[0\]"
                                          r".content: 20000 characters"):
        validate_report(request)


@pytest.mark.slow
def test_a_multi_turn_run_keeps_whole_eval_transcripts_in_its_log_and_summary(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    env_file = tmp_path / "retry_env.py"
    env_file.write_text(ENV_FILE)
    run_dir = tmp_path / "run"
    argv = [str(BIN / "gridrl-trainer"), "run", "--model", str(tiny_llama_dir), "--task",
            str(env_file), "--steps", "1", "--prompts-per-step", "1", "--group-size", "2",
            "--lora-rank", "4", "--lora-alpha", "8", "--eval-every", "1",
            "--checkpoint-every", "1", "--run-dir", str(run_dir), "--rollout", "local",
            "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--threads", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=ENV)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    evals = [r for r in records(run_dir) if r.get("eval_examples")]
    assert evals, out[-3000:]

    def check(examples: list[dict]) -> None:
        assert len(examples) == 2
        for example in examples:
            roles = [m["role"] for m in example["transcript"]]
            assert roles == ["assistant", "user", "assistant"], example
            assert example["transcript"][1]["content"] == "feedback: try w2 again"
            assert example["turns"] == 2
            assert example["completion"] == example["transcript"][-1]["content"]

    for r in evals:
        check(r["eval_examples"])
    summary = json.loads((run_dir / "summary.json").read_text())
    check(summary["baseline_eval_examples"])
    check(summary["final_eval_examples"])
    assert summary["final_eval_examples"] == evals[-1]["eval_examples"]
    # the console: the legends, then step lines whose episode part they explain
    assert "env a/b tok:" in out and "turns:" in out and "drop:" in out
    assert re.search(r"turns 2\.00 env \d+/\d+ tok", out), out[-3000:]
