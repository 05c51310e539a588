"""Runs that cannot learn, said early (issue 43 items 3, 4, 6): an environment whose every
episode fails stops the run non-zero, checkpointed, naming the cause (its message logged once
with a count); a baseline whose samples all score the same and steps without a group with
signal are warned about on the console and the master's dashboard; ``--eval-tasks`` is
honoured for a Python-file environment. The pure logic (run/watch.py) is tested on its own,
the rest through the real CLI on the tiny llama."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from trainer_runs import BIN, ENV

from gridrl.master.run_wire import detail_json
from gridrl.master.server import Master
from gridrl.trainer.report.events import LearningWarning, NoUpdate
from gridrl.trainer.report.to_master import MasterReporter
from gridrl.trainer.rollouts import DropReason, EpisodeStats
from gridrl.trainer.run.watch import LearningWatch, baseline_warning
from gridrl.v1 import runs_pb2, trainer_pb2

RAISING_ENV = '''
from gridrl.trainer.envs.base import Environment
from gridrl.trainer.envs.base import TaskItem

class Flaky(Environment):
    name, max_turns, max_tokens = "flaky", 2, 4

    def item(self, i):
        return TaskItem(f"w{i}", ({"role": "user", "content": f"w{i} w{i + 1}"},), {})
    def train_item(self, index):
        return self.item(index + 100)
    def eval_items(self):
        return [self.item(i) for i in range(4)]
    def respond(self, item, transcript, state):
        raise ConnectionError("the scoring service at 10.0.0.9 refused [Errno 111]")
    def score(self, prompts, completions, **columns):
        return [0.0] * len(completions)
'''

# Scores every reply the same: no group can ever have signal.
CONSTANT_ENV = '''
from gridrl.trainer.envs.base import Environment
from gridrl.trainer.envs.base import TaskItem

class Constant(Environment):
    name, max_tokens = "constant", 4

    def item(self, i):
        return TaskItem(f"w{i}", ({"role": "user", "content": f"w{i} w{i + 1}"},), {})
    def train_item(self, index):
        return self.item(index + 100)
    def eval_items(self):
        return [self.item(i) for i in range(16)]
    def score(self, prompts, completions, **columns):
        return [0.25] * len(completions)
'''


def episodes(n: int, dropped: dict[tuple[str, str], int] | None = None) -> EpisodeStats:
    """Stats of ``n`` episodes, ``dropped``: (reason's word, error) -> episodes."""
    errors = {(DropReason(r), m): k for (r, m), k in (dropped or {}).items()}
    by_reason: dict[DropReason, int] = {}
    for (reason, _), k in errors.items():
        by_reason[reason] = by_reason.get(reason, 0) + k
    return EpisodeStats(episodes=n, dropped=by_reason, errors=errors)


def test_a_step_whose_every_episode_was_dropped_says_so_with_the_environment_s_message():
    stats = episodes(16, {("env_error", "ValueError: no"): 16})
    assert stats.all_dropped
    assert stats.all_dropped_why() == ("every episode was dropped (16 of 16): the environment "
                                       "raised ValueError: no")
    mixed = episodes(16, {("env_error", "ValueError: no"): 12, ("sampler", "timeout"): 4})
    assert mixed.all_dropped_why().endswith("raised ValueError: no (12 of them; 1 other "
                                            "cause(s) for the rest)")
    assert episodes(16, {("env_error", "ValueError: no"): 15}).all_dropped_why() == ""
    assert episodes(0).all_dropped_why() == ""


def test_the_watch_stops_after_n_steps_in_a_row_with_every_episode_dropped():
    watch = LearningWatch(max_dropped_steps=3, no_signal_steps=3, group_size=8)
    dead = episodes(16, {("env_error", "RuntimeError: down"): 16})
    fine = episodes(16)
    assert watch.observe(1, dead, 0).stop == ""
    assert watch.observe(2, fine, 1).stop == ""  # a step that trained breaks the streak
    v = [watch.observe(s, dead, 0) for s in (3, 4, 5)]
    assert [x.stop == "" for x in v] == [True, True, False]
    assert v[2].stop.startswith("steps 3-5: every episode was dropped (16 of 16): the "
                                "environment raised RuntimeError: down; stopped after 3")
    assert "--max-dropped-steps 3" in v[2].stop
    assert all(x.no_update_why and not x.warning for x in v)  # a dropped step is not "no signal"
    never = LearningWatch(max_dropped_steps=0, no_signal_steps=0, group_size=8)
    assert not any(never.observe(s, dead, 0).stop for s in range(1, 20))


def test_the_watch_warns_once_per_streak_of_steps_without_signal():
    watch = LearningWatch(max_dropped_steps=3, no_signal_steps=2, group_size=4)
    fine = episodes(8)
    warnings = [watch.observe(s, fine, g).warning for s, g in
                enumerate([0, 0, 0, 0, 1, 0, 0], start=1)]
    assert [bool(w) for w in warnings] == [False, True, False, False, False, False, True]
    assert warnings[1].startswith("no group had signal in steps 1-2")
    assert warnings[6].startswith("no group had signal in steps 6-7")
    assert "partial credit" in warnings[1] and "--group-size, 4 now" in warnings[1]
    assert "easier task" in warnings[1]


def test_the_baseline_warning_is_for_samples_that_all_scored_the_same():
    assert baseline_warning([0.0] * 16, 8).startswith(
        "the baseline eval's 16 samples all scored 0.000")
    assert baseline_warning([0.0, 0.0, 0.5], 8) == ""
    assert baseline_warning([1.0], 8) == ""  # one sample says nothing


def test_the_warnings_reach_the_master_s_dashboard_as_event_lines():
    master = Master("127.0.0.1:0", dashboard_port=0).start()
    try:
        reporter = MasterReporter(
            master.address, None,
            run=lambda: runs_pb2.RunInfo(run_id="r-warn", run_name="warn",
                                         state=trainer_pb2.RUN_STATE_RUNNING, total_steps=3),
            nodes=lambda stats: [])
        reporter.on_event(LearningWarning(3, "no group had signal in steps 1-3: ..."))
        reporter.on_event(NoUpdate(4, 0, "every episode was dropped (16 of 16): boom"))
        reporter.on_event(NoUpdate(5, 3, ""))  # the staleness case: the step's own line
        reporter.close()
        events = [(e["kind"], e["step"], e["message"])
                  for e in detail_json(master.runs.detail("r-warn"))["events"]
                  if e["kind"] == "state"]
        assert ("state", 3, "nothing can be learned? no group had signal in steps 1-3: ...") \
            in events, events
        assert ("state", 4, "every episode was dropped (16 of 16): boom; no update") in events
        assert len([e for e in events if e[1] == 5]) == 0
    finally:
        master.stop(0)


def _run(tmp_path: Path, env_source: str, *flags: str, env: dict | None = None,
         ) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "my_env.py").write_text(env_source)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [str(BIN / "gridrl-trainer"), "run", "--task", str(tmp_path / "my_env.py"),
         "--group-size", "4", "--lr", "1e-3", "--lora-rank", "4", "--lora-alpha", "8",
         "--run-dir", str(run_dir), "--rollout", "local", "--threads", "1",
         "--listen", "127.0.0.1:0", "--metrics-port", "0", *flags],
        capture_output=True, text=True, timeout=600, env={**ENV, **(env or {})})
    return done, run_dir


@pytest.mark.slow
def test_an_environment_raising_on_every_call_stops_the_run_checkpointed(tiny_llama_dir,
                                                                         tmp_path):
    """``respond()`` raising every time, through the real CLI: each step's line says every
    episode was dropped with the environment's message (not the staleness filter), the
    message is logged once per step with a count, and after ``GRIDRL_TRAINER_MAX_DROPPED_STEPS``
    (2) such steps the run stops with exit 1, checkpointed, naming the cause."""
    done, run_dir = _run(tmp_path, RAISING_ENV, "--model", str(tiny_llama_dir),
                         "--steps", "10", "--eval-every", "10",
                         env={"GRIDRL_TRAINER_MAX_DROPPED_STEPS": "2"})
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    message = "ConnectionError: the scoring service at 10.0.0.9 refused [Errno 111]"
    for step in (1, 2):
        line = (f"step {step}: every episode was dropped (8 of 8): the environment raised "
                f"{message}; no update")
        assert out.count(line) == 1, out
    assert "staleness filter" not in out and "step 3" not in out, out
    # logged once per call with a count (the eval's 4 episodes, each step's 8), never per episode
    logged = [ln for ln in out.splitlines() if "environment flaky raised in" in ln]
    assert logged and all(message in ln for ln in logged), logged
    assert sum("raised in 8 of 8 episode(s)" in ln for ln in logged) == 2, logged
    assert not [ln for ln in logged if "raised in 1 of" in ln], logged
    assert (f"run failed: steps 1-2: every episode was dropped (8 of 8): the environment "
            f"raised {message}; stopped after 2 such step(s) in a row (--max-dropped-steps 2)"
            in out), out
    assert (run_dir / "checkpoints" / "step-000002" / "state.json").is_file(), out
    assert "checkpointed it: continue with:" in out


@pytest.mark.slow
def test_a_run_that_cannot_learn_is_warned_about_at_start_up_and_after_k_steps(
        tiny_llama_dir, tmp_path):
    """An environment scoring every reply 0.25: the baseline's samples all score the same
    (warned at start-up), and no step has a group with signal (warned once after
    ``--no-signal-warn-steps`` steps, naming what to change); the run itself goes on."""
    done, run_dir = _run(tmp_path, CONSTANT_ENV, "--model", str(tiny_llama_dir),
                         "--steps", "3", "--eval-every", "3", "--eval-tasks", "4",
                         "--no-signal-warn-steps", "2")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert ("nothing can be learned? (at start-up) the baseline eval's 4 samples all scored "
            "0.250") in out, out
    assert out.count("nothing can be learned? (at step 2) no group had signal in steps "
                     "1-2") == 1, out
    assert "partial credit" in out and "--group-size, 4 now" in out
    assert "at step 3" not in out  # once per streak
    steps = [json.loads(ln) for ln in (run_dir / "log.jsonl").read_text().splitlines()
             if '"step": ' in ln]
    assert [r["groups_with_signal"] for r in steps] == [0, 0, 0]


@pytest.mark.slow
def test_eval_tasks_wins_over_a_python_file_environment_s_own_set(tiny_llama_dir, tmp_path):
    """``--eval-tasks 5`` on an environment file whose ``eval_items()`` gives 16 (and whose
    class sets no eval_tasks): the eval runs on 5, as log.jsonl and summary.json say; asking
    for more than it gives says so and runs on all it gives."""
    done, run_dir = _run(tmp_path, CONSTANT_ENV, "--model", str(tiny_llama_dir),
                         "--steps", "1", "--eval-tasks", "5")
    assert done.returncode == 0, done.stdout + done.stderr
    evals = [json.loads(ln) for ln in (run_dir / "log.jsonl").read_text().splitlines()
             if '"eval_n"' in ln]
    assert evals and {r["eval_n"] for r in evals} == {5}, evals
    assert json.loads((run_dir / "summary.json").read_text())["eval_tasks"] == 5
    more = tmp_path / "more"
    more.mkdir()
    done, run_dir = _run(more, CONSTANT_ENV, "--model", str(tiny_llama_dir),
                         "--steps", "1", "--eval-tasks", "20")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert ("--eval-tasks 20: the environment constant gives 16 held-out item(s); the eval "
            "runs on those 16") in out, out
    assert json.loads((run_dir / "summary.json").read_text())["eval_tasks"] == 16
