"""`make demo`'s orchestrator end to end on the tiny llama: processes, summary, clean stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_for

DEMO = [sys.executable, "-m", "gridrl.trainer.demo"]


def _children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (the demo's services)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("trainer, nodes", [
    ("torch", "torch"), pytest.param("mlx", "mlx", marks=pytest.mark.mlx, id="all-mlx")])
def test_demo_runs_end_to_end_and_stops_everything(tiny_llama_dir: Path, tmp_path: Path,
                                                   trainer: str, nodes: str) -> None:
    run = tmp_path / "run"
    scratch = tmp_path / "tmp"  # where the demo's scratch directory goes (TMPDIR)
    scratch.mkdir()
    proc = subprocess.Popen(
        [*DEMO, "--model", str(tiny_llama_dir), "--run-dir", str(run), "--trainer", trainer,
         "--nodes", nodes, "--",
         "--steps", "3", "--eval-every", "3", "--eval-tasks", "4", "--max-tokens", "8",
         "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)})
    children: set[int] = set()

    def exited() -> bool:
        children.update(_children_of(proc.pid))
        return proc.poll() is not None

    wait_for(exited, timeout_s=900, what="the demo to finish", every_s=0.5)
    out = proc.stdout.read()
    assert proc.returncode in (0, 1), out  # 1: the tiny model's eval did not climb in 3 steps
    assert "master " in out and "rollout node " in out and "step    3/3" in out
    assert "eval (held-out, greedy, trainer's own weights):" in out
    summary = json.loads((run / "summary.json").read_text())
    # the exact-match rate beside the similarity score, and the scorer named
    assert (f"exact (full marks): {summary['baseline_eval_exact']:.1%} -> "
            f"{summary['final_eval_exact']:.1%}; scored by reverse-words word similarity") in out
    assert summary["steps"] == 3 and summary["final_eval"] is not None
    # the run is named as its directory; the summary names the nodes, and the master apart
    assert summary["run_name"] == run.name
    node_lines = [ln.split() for ln in out.splitlines() if ln.startswith("rollout node ")]
    assert summary["rollout"] == sorted(ln[2] for ln in node_lines), (summary, node_lines)
    master_line = next(ln.split() for ln in out.splitlines() if ln.startswith("master "))
    assert summary["master"] == master_line[1]
    assert not [ln for ln in out.splitlines() if ln.startswith("rollout node ") and "log " in ln]
    assert json.loads((run / "config.json").read_text())["backend"] == trainer
    assert f"--backend {trainer}" in out and f"backend={nodes}" in out
    assert (run / "plot.png").stat().st_size > 0
    assert len(children) >= 3  # master, rollout node, trainer
    assert not [c for c in children if _alive(c)], "demo left processes running"
    # the nodes' adapter stores are removed; the service logs stay only when it failed
    # (MLX on a CPU keeps its compiled-kernel cache in TMPDIR/mlx/<version>: MLX's own,
    # shared by every MLX process and meant to outlive them, not the demo's scratch)
    left = [p for p in scratch.rglob("*") if p.is_file()
            and not p.is_relative_to(scratch / "mlx")]
    if proc.returncode == 0:
        assert left == [], left
    else:
        assert "service logs kept in" in out and left
        assert all(p.suffix == ".log" and p.parent.parent == scratch for p in left), left


@pytest.mark.slow
def test_demo_interrupted_stops_every_process(tiny_llama_dir: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen(
        [*DEMO, "--model", str(tiny_llama_dir), "--run-dir", str(tmp_path / "run"), "--",
         "--steps", "500", "--eval-every", "100", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TMPDIR": str(scratch)})
    children: set[int] = set()

    def started() -> bool:
        children.update(_children_of(proc.pid))
        return len(children) >= 3

    wait_for(started, timeout_s=180, what="the demo to start its services", every_s=0.2)
    assert len(children) >= 3, "demo did not start its services"
    # the trainer has started its run (its run directory holds its settings), so the Ctrl-C
    # lands on a running cluster, not on one still starting
    wait_for(lambda: (tmp_path / "run" / "config.json").exists() or proc.poll() is not None,
             timeout_s=180, what="the demo's run to start")
    proc.send_signal(signal.SIGINT)
    proc.wait(120)
    assert proc.returncode == 130, proc.stdout.read()
    # the init process reaps services the demo did not
    wait_for(lambda: not [c for c in children if _alive(c)], timeout_s=10,
             what="every service to end after Ctrl-C", every_s=0.1)
    assert not [c for c in children if _alive(c)], "Ctrl-C left processes running"
    assert list(scratch.iterdir()) == []  # nothing left in its scratch directory


@pytest.mark.slow
def test_demo_secure_runs_every_channel_over_mutual_tls(tiny_llama_dir: Path,
                                                        tmp_path: Path) -> None:
    """``--secure``: the same processes with a CA, a certificate each and scoped credentials
    made for the run; the trainer finds the node and pushes to it over mutual TLS, and nothing
    of it (keys, tokens) is left behind."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run(
        [*DEMO, "--model", str(tiny_llama_dir), "--run-dir", str(tmp_path / "run"), "--secure",
         "--", "--steps", "2", "--eval-every", "2", "--eval-tasks", "2", "--max-tokens", "4",
         "--threads", "1"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)})
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), out  # 1: the tiny model's eval did not climb
    assert "secure        mutual TLS, scoped credentials" in out
    assert "TrainerService on" in out and "(mutual TLS; 3 authorized credential(s)" in out
    assert "step    2/2" in out
    records = [json.loads(ln) for ln in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    last = next(r for r in records if r.get("step") == 2)  # the sync is in the step's record
    assert (last["policy_version"], last["nodes_synced"]) == (2, 1), last
    assert "--auth-token-file" in out and "--authorized-tokens" in out
    left = [p for p in scratch.rglob("*") if p.is_file()]
    assert not [p for p in left if p.suffix in (".key", ".token", ".crt")], left


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("task", ["reverse-words-retry", "reasoning-gym:spell_backward",
                                  "tool-arithmetic"])
def test_make_demo_task_passes_the_environment_to_the_demo(task: str) -> None:
    """``make demo TASK=...`` runs the demo with ``--task`` (read with ``make -n``)."""
    dry = subprocess.run(["make", "-n", "demo", f"TASK={task}"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    (command,) = [ln for ln in dry.stdout.splitlines() if "gridrl.trainer.demo" in ln]
    assert f"--task {task} " in command, command


@pytest.mark.parametrize("task, line", [
    ("reasoning-gym:spell_backwards", "Error: --task: reasoning-gym has no dataset "
                                      "'spell_backwards'"),
    ("reverse-word", "Error: --task: 'reverse-word' is none of"),
])
def test_demo_refuses_a_task_it_cannot_make_before_starting_anything(tmp_path: Path, task: str,
                                                                     line: str) -> None:
    """A ``--task`` that cannot be made fails in one line before a process starts (nothing
    listens, no run directory)."""
    proc = subprocess.run([*DEMO, "--model", "nonexistent-model", "--task", task,
                           "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(line), proc.stderr
    assert "resolving" not in proc.stdout and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("task", ["reverse-words-retry", "reasoning-gym:spell_backward",
                                  "tool-arithmetic"])
def test_demo_runs_each_shipped_environment(tiny_llama_dir: Path, tmp_path: Path,
                                            task: str) -> None:
    """``--task``: the demo's trainer runs the environment's episodes over the node (the
    tiny model never solves reverse-words at once, so every episode has its second turn; a
    reasoning-gym dataset is single-turn; the tiny model's tool calls are never well-formed,
    so tool episodes end after one turn, with the tool counters at zero); the tool
    environment's demo exits 0 without a climbing eval."""
    run = tmp_path / "run"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run(
        [*DEMO, "--model", str(tiny_llama_dir), "--run-dir", str(run), "--task", task, "--",
         "--steps", "2", "--eval-every", "2", "--eval-tasks", "2", "--max-tokens", "4",
         "--threads", "1"],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)})
    out = proc.stdout + proc.stderr
    assert proc.returncode in ((0,) if task == "tool-arithmetic" else (0, 1)), out
    assert f"--task {task}" in out and "step    2/2" in out
    config = json.loads((run / "config.json").read_text())
    assert config["task"] == task
    records = [json.loads(ln) for ln in (run / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step")]
    assert len(steps) == 2 and all(r["episodes"] == 16 for r in steps), steps
    if task == "reverse-words-retry":
        assert all(r["turns_mean"] == 2.0 and r["env_tokens"] > 0 for r in steps), steps
        assert "turns 2.00 env" in out
        assert set(records[-1]["eval_metrics"]) >= {"first_attempt_success",
                                                    "second_attempt_success"}
    elif task == "tool-arithmetic":
        assert all(set(r["env_counts"]) == {"tool_calls", "tool_errors", "tool_timeouts"}
                   for r in steps), steps
    else:
        assert all(r["turns_mean"] == 1.0 and r["env_tokens"] == 0 for r in steps), steps
        assert all(set(r["reward_funcs"]) == {f"{task}:score"} for r in steps), steps


def _descendants_of(pid: int) -> list[int]:
    """Every living descendant of ``pid`` (children, their children...)."""
    found, todo = [], [pid]
    while todo:
        for child in _children_of(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


class _DemoRun:
    """A real ``python -m gridrl.trainer.demo`` on the tiny llama that runs long (500 steps),
    its output in a file, the pids of every process it started collected while it runs."""

    def __init__(self, tiny_llama_dir: Path, tmp_path: Path, *extra: str) -> None:
        self.run = tmp_path / "run"
        self.scratch = tmp_path / "tmp"
        self.scratch.mkdir(exist_ok=True)
        self.out_path = tmp_path / "demo.out"
        self.proc = subprocess.Popen(
            [*DEMO, "--model", str(tiny_llama_dir), "--run-dir", str(self.run), "--",
             "--steps", "500", "--eval-every", "100", "--eval-tasks", "4",
             "--checkpoint-every", "100", "--max-tokens", "8", "--threads", "1", *extra],
            stdout=self.out_path.open("w"), stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(self.scratch)})
        self.pids: set[int] = set()

    def out(self) -> str:
        return self.out_path.read_text()

    def watch(self) -> bool:
        self.pids.update(_descendants_of(self.proc.pid))
        return self.proc.poll() is not None

    def wait_for_step(self, step: int = 1) -> None:
        """Until the trainer has logged ``step`` (the services run, the trainer steps)."""
        log = self.run / "log.jsonl"

        def stepped() -> bool:
            if self.watch():
                return True
            return log.is_file() and f'"step": {step},' in log.read_text()

        wait_for(stepped, timeout_s=600, what=f"the demo's step {step}", every_s=0.2)
        assert self.proc.poll() is None, self.out()
        assert len(self.pids) >= 3, self.pids  # master, rollout node, trainer

    def wait_exit(self, timeout_s: float = 600) -> int:
        wait_for(self.watch, timeout_s=timeout_s, what="the demo to exit", every_s=0.1)
        return self.proc.returncode

    def survivors(self) -> list[int]:
        return [p for p in self.pids if _alive(p)]


@pytest.mark.slow
def test_demo_ctrl_c_keeps_the_run_and_its_resume_command_runs(tiny_llama_dir: Path,
                                                               tmp_path: Path) -> None:
    """One real SIGINT once the trainer steps: the demo waits for the trainer's own stop
    (finish the step, checkpoint), then stops the node and the master; the run directory keeps
    a checkpoint, the summary, the plot and the adapter; the demo prints them and
    ``make demo RESUME=<run>``, whose command (``make -n``) resumes the run on new services."""
    demo = _DemoRun(tiny_llama_dir, tmp_path)
    demo.wait_for_step(1)
    demo.proc.send_signal(signal.SIGINT)
    rc = demo.wait_exit()
    out = demo.out()
    assert rc == 130, out
    wait_for(lambda: not demo.survivors(), timeout_s=10, what="every service to end")
    steps = [json.loads(ln) for ln in (demo.run / "log.jsonl").read_text().splitlines()
             if '"step"' in ln]
    last = max(r["step"] for r in steps)
    checkpoint = demo.run / "checkpoints" / f"step-{last:06d}"
    assert (checkpoint / "state.json").is_file(), out
    summary = json.loads((demo.run / "summary.json").read_text())
    assert summary["steps"] == last and summary["total_steps"] == 500, summary
    assert (demo.run / "adapter" / "adapter_config.json").is_file()
    assert (demo.run / "plot.png").stat().st_size > 0
    assert "the trainer finishes its step and checkpoints it" in out, out
    assert "killed" not in out, out
    for line in (f"checkpoint  {checkpoint}",
                 f"summary     {demo.run}/summary.json", f"adapter     {demo.run}/adapter",
                 f"continue with: make demo RESUME={demo.run}"):
        assert line in out, out
    assert list(demo.scratch.iterdir()) == []  # nothing left in its scratch directory
    # the printed command is runnable: make passes it to the demo as --resume, and the demo
    # resumes the run on a new master and node (one more step)
    dry = subprocess.run(["make", "-n", "demo", f"RESUME={demo.run}"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    (command,) = [ln for ln in dry.stdout.splitlines() if "gridrl.trainer.demo" in ln]
    assert f"--resume {demo.run} " in command, command
    resumed = subprocess.run(
        [*DEMO, "--resume", str(demo.run), "--", "--steps", str(last + 1), "--threads", "1"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(demo.scratch)})
    assert resumed.returncode in (0, 1), resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((demo.run / "summary.json").read_text())
    assert summary["steps"] == last + 1 and summary["resumed_at"] == [last], summary


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [(signal.SIGINT, signal.SIGINT),
                                           (signal.SIGTERM, signal.SIGHUP)],
                         ids=["ctrl-c-twice", "term-then-hup"])
def test_demo_second_signal_leaves_no_process(tiny_llama_dir: Path, tmp_path: Path,
                                              first: signal.Signals,
                                              second: signal.Signals) -> None:
    """Two real signals in quick succession (the second while the trainer finishes its
    step): every process the demo started ends (checked by pid), the demo says it killed
    them, and it exits non-zero."""
    demo = _DemoRun(tiny_llama_dir, tmp_path)
    demo.wait_for_step(1)
    demo.proc.send_signal(first)
    wait_for(lambda: "the trainer finishes its step" in demo.out() or demo.watch(),
             timeout_s=30, what="the demo to pass the stop on")
    assert demo.proc.poll() is None, demo.out()
    demo.proc.send_signal(second)
    rc = demo.wait_exit(timeout_s=120)
    out = demo.out()
    assert rc == 128 + first, out
    wait_for(lambda: not demo.survivors(), timeout_s=10, what="every process to end")
    assert f"{second.name} again: killed" in out, out


@pytest.mark.slow
def test_demo_killed_outright_takes_its_services_with_it(tiny_llama_dir: Path,
                                                         tmp_path: Path) -> None:
    """SIGKILL, which the demo cannot handle: its children die with it (PR_SET_PDEATHSIG),
    none left running with PPID 1."""
    demo = _DemoRun(tiny_llama_dir, tmp_path)
    demo.wait_for_step(1)
    demo.proc.kill()
    demo.wait_exit(timeout_s=30)
    wait_for(lambda: not demo.survivors(), timeout_s=20, what="every service to die")
