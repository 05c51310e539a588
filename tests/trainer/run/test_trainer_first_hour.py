"""A first hour on a task of one's own: the eval says how long it will take and how far it is
(console, ``gridrl-trainer status`` over a real TrainerService), the resume hint is a command
the user can run, every address flag is checked as host:port before anything dials, and the
plot's lower panel shows where each step's time went."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from trainer_runs import BIN, ENV

from gridrl.trainer.config import TrainConfig
from gridrl.trainer.envs.reverse import ReverseWords
from gridrl.trainer.evaluation import FIRST_BATCH, EvalProgress, Evaluator
from gridrl.trainer.report.console import ConsoleLines
from gridrl.trainer.report.events import EvalProgressed
from gridrl.trainer.report.reporter import Reporter
from gridrl.trainer.report.status import RunStatus, StatusSubscriber
from gridrl.trainer.run.control import resume_command, trainer_executable
from gridrl.trainer.server import serve_trainer


def test_the_eval_reports_its_progress_and_expected_time_from_its_first_batch(tiny_llama_dir):
    from gridrl.trainer.backends.base import create_backend

    backend = create_backend(TrainConfig(model=str(tiny_llama_dir), lora_rank=4,
                                         lora_alpha=8, device="cpu", dtype="float32",
                                         rollout=["local"], run_dir="unused").finalize())
    try:
        n = FIRST_BATCH + 4
        evaluator = Evaluator(backend, ReverseWords(seed=0, eval_size=n), max_tokens=3)
        seen: list[EvalProgress] = []
        result = evaluator.run(policy_version=0, on_progress=seen.append)
        whole = Evaluator(backend, ReverseWords(seed=0, eval_size=n), max_tokens=3).run(0)
    finally:
        backend.close(wait=True)
    assert [(p.done, p.total) for p in seen] == [(0, n), (FIRST_BATCH, n), (n, n)]
    assert seen[0].expected_s is None
    first = seen[1]  # the first batch's time, scaled to the whole eval
    assert first.expected_s == pytest.approx(first.elapsed_s * n / FIRST_BATCH)
    assert result.n == n and result.scorer.startswith("reverse-words word similarity")
    assert (result.score, result.exact) == (whole.score, whole.exact)


def test_status_shows_the_baseline_eval_s_progress_not_starting(tmp_path):
    """During the baseline eval ``gridrl-trainer status`` says ``baseline eval, 16/128``
    (with the expected time), the console says once how long it is expected to take, and
    both forget it when the eval ends."""
    status = RunStatus()
    out = io.StringIO()
    reporter = Reporter()
    reporter.subscribe(ConsoleLines(Console(file=out, width=300), total_steps=60,
                                    remote=False))
    reporter.subscribe(StatusSubscriber(status))
    status.begin("run", str(tmp_path), total_steps=60, model_id="tiny")
    server = serve_trainer(status, "127.0.0.1:0", metrics_port=-1)

    def cli() -> str:
        done = subprocess.run([str(BIN / "gridrl-trainer"), "status", "--address",
                               server.address], capture_output=True, text=True, timeout=60,
                              env={**ENV, "COLUMNS": "200"})
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        reporter.event(EvalProgressed(0, EvalProgress(0, 128, 0.0)))
        reporter.event(EvalProgressed(0, EvalProgress(16, 128, 12.0, 96.0)))
        text = cli()
        assert "run (baseline eval, 16/128 (12s, about 96s expected))" in text, text
        assert "starting" not in text
        reporter.event(EvalProgressed(0, None))
        assert "baseline eval, " not in cli()
    finally:
        server.stop(grace_s=0)
    lines = out.getvalue().splitlines()
    assert lines == ["baseline eval: 128 prompts, about 1.6 min expected (the first 16 took 12s; "
                     "--eval-tasks sets how many)"]


def test_the_resume_hint_is_a_command_the_user_can_run(tmp_path, monkeypatch):
    """Not on PATH: the trainer's own path (relative from a directory above it, absolute
    otherwise); on PATH as the same program: its bare name."""
    own = Path(sys.executable).parent / "gridrl-trainer"
    monkeypatch.setattr(sys, "argv", [str(own), "run"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.chdir(own.parent.parent.parent)
    assert trainer_executable() == str(own.relative_to(own.parent.parent.parent))
    monkeypatch.chdir(tmp_path)
    assert trainer_executable() == str(own.absolute())
    assert resume_command("runs/my run", None) == f"{own.absolute()} run --resume 'runs/my run'"
    monkeypatch.setenv("PATH", f"{own.parent}{os.pathsep}/usr/bin")
    assert shutil.which("gridrl-trainer") == str(own)
    assert trainer_executable() == "gridrl-trainer"
    # the command runs: it is this venv's trainer
    path = resume_command(str(tmp_path), None).split()[0]
    done = subprocess.run([path, "run", "--help"], capture_output=True, text=True, timeout=60,
                          env={**ENV, "PATH": f"{own.parent}{os.pathsep}/usr/bin"})
    assert done.returncode == 0 and "--resume" in done.stdout


@pytest.mark.parametrize(("argv", "flag"), [
    (["serve-api", "--master", "127.0.0.1"], "--master"),
    (["serve-api", "--rollout", "127.0.0.1"], "--rollout"),
    (["status", "--address", "127.0.0.1"], "--address"),
    (["run", "--master", "127.0.0.1"], "--master"),
    (["run", "--rollout", "localhost"], "--rollout"),
])
def test_every_address_flag_needs_host_and_port(argv, flag):
    """A bare host never dials gRPC's default port 443: one line naming the flag, exit 2."""
    done = subprocess.run([str(BIN / "gridrl-trainer"), *argv], capture_output=True,
                          text=True, timeout=60, env=ENV)
    assert done.returncode == 2, done.stdout + done.stderr
    assert flag in done.stderr and "the port is missing" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_plot_shows_the_step_time_split(tmp_path):
    """The lower panel: rollout, update, sync and eval seconds of each step, stacked."""
    from gridrl.trainer.report.plot import plot_run, step_times
    from gridrl.trainer.report.records import StepRecord

    def record(step: int, **kw) -> StepRecord:
        base = {"step": step, "policy_version": step, "reward_mean": 0.5, "reward_std": 0.1,
                "loss": 0.0, "eval_score": None, "eval_policy_version": 0, "mismatch_kl": 0.0,
                "staleness_mean": 0.0, "dropped_samples": 0, "rollout_s": 1.0, "train_s": 2.0,
                "sync_s": 0.5, "nodes_synced": 1, "nodes_skipped": 0, "tokens_per_s": 1.0,
                "elapsed_s": step * 5.0, "collect_s": 1.5}
        return StepRecord.from_json({**base, **kw})

    records = [record(1), record(2, eval_score=0.4, eval_exact=0.25, eval_s=3.0)]
    times = {label: values for label, _, values in step_times(records)}
    assert times == {"rollout": [1.5, 1.5], "update": [2.0, 2.0], "sync": [0.5, 0.5],
                     "eval": [0.0, 3.0]}
    path = plot_run(records, tmp_path / "plot.png", baseline=0.1, baseline_exact=0.0,
                    title="run", scorer="reward upper (upper_reward.py)")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the dashboard gets the exact-match rate with the step that evaluated, not the others
    from gridrl.trainer.report.status import step_report
    from gridrl.trainer.report.to_master import step_message

    assert step_message(records[1]).eval_exact == 0.25
    assert not step_message(records[0]).HasField("eval_exact")
    assert step_report(records[1]).eval_exact == 0.25
