"""``gridrl-trainer run`` as a newcomer meets it (issue 20): a wait for a master that is not up
is reported on the console and in GetRunStatus, and never called a lost watch; the first
Ctrl-C says at once what it will do and the run exits 130; a second Ctrl-C aborts and says
which steps are lost; a run that fails (its only node gone past --wait-for-nodes-s)
checkpoints the steps it finished."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer_run_nodes import serve_node, step_records, trainer_args
from trainer_runs import ENV, run_args, wait_for_step, write_task_files
from waiting import wait_for

from gridrl.common.rpc.channel import dial
from gridrl.v1 import trainer_pb2, trainer_pb2_grpc

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def trainer_process(args: list[str], log_path: Path):
    """``args`` run with stdout and stderr in ``log_path`` (a file: not a terminal); killed
    if still running when the block ends."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_for_text(log_path: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    wait_for(lambda: text in log_path.read_text(), timeout, repr(text), alive=proc, every_s=0.1)


def test_absent_master_wait_is_reported_and_ctrl_c_stops_it(tiny_llama_dir, tmp_path,
                                                            reserved_port):
    master = f"127.0.0.1:{reserved_port}"  # nothing listens there
    run_dir, ready, log_path = tmp_path / "run", tmp_path / "ready.json", tmp_path / "log"
    args = trainer_args(tiny_llama_dir, run_dir, [], steps=2)
    args[args.index("--node-wait-s") + 1] = "120"
    args += ["--master", master, "--ready-file", str(ready)]
    with trainer_process(args, log_path) as proc:
        wait_for(ready.exists, 120, "ready file", alive=proc, every_s=0.1)
        address = json.loads(ready.read_text())["address"]

        def node_wait():
            with dial(address) as channel:
                response = trainer_pb2_grpc.TrainerServiceStub(channel).GetRunStatus(
                    trainer_pb2.GetRunStatusRequest(), timeout=10)
            return response.node_wait if response.HasField("node_wait") else None

        wait_for(node_wait, 120, "node_wait in GetRunStatus", alive=proc, every_s=0.1)
        wait = node_wait()
        assert master in wait.waiting_for and 0 < wait.left_s <= 120, wait
        wait_for_text(log_path, "waiting for 1 rollout node(s)", proc, 30)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
    out = log_path.read_text()
    line = next(ln for ln in out.splitlines() if "waiting for 1 rollout node(s)" in ln)
    assert re.fullmatch(r"waiting for 1 rollout node\(s\) \(0 ready\) for \d+s, \d+s left "
                        r"\(--start-wait-s\): master 127\.0\.0\.1:\d+ \(.+\)", line), line
    assert ("SIGINT: stopping before step 1 once the setup in progress (model load, node "
            "wait, baseline eval) ends; Ctrl-C again aborts") in out
    assert f"master {master}: not reachable yet" in out
    assert "node watch lost" not in out  # it never connected: nothing was lost
    assert not run_dir.exists()  # nothing recorded: no run directory left behind


def test_second_ctrl_c_aborts_and_names_the_lost_steps(tiny_llama_dir, tmp_path):
    data, reward = write_task_files(tmp_path)
    run_dir, log_path = tmp_path / "run", tmp_path / "log"
    # steps long enough (32 tokens) that the second Ctrl-C lands while a step is in progress
    # even on a machine twice as fast as this one
    args = run_args(tiny_llama_dir, data, reward, run_dir, steps=60, checkpoint_every=2,
                    eval_every=100, max_tokens=32)
    with trainer_process(args, log_path) as proc:
        wait_for_step(run_dir, 3, proc, timeout=180)
        proc.send_signal(signal.SIGINT)
        wait_for_text(log_path, "Ctrl-C again aborts", proc, 30)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
    out = log_path.read_text()
    # a log file: no progress bars or cursor escapes, no INFO line among the step lines
    raw = log_path.read_bytes()  # (read_text would turn a carriage return into a newline)
    assert b"\r" not in raw and b"\x1b[" not in raw
    lines = out.splitlines()
    first_step = next(i for i, ln in enumerate(lines) if ln.startswith("step "))
    assert not [ln for ln in lines[first_step:] if " INFO " in ln], out[-3000:]
    assert re.search(r"^SIGINT: finishing step \d+, then checkpointing; Ctrl-C again aborts$",
                     out, re.M), out[-3000:]
    lost = re.search(r"^SIGINT again: aborting; (?:finished steps? [\d-]+, )?step \d+ in "
                     r"progress lost; --resume (\S+) continues from the checkpoint of step "
                     r"(\d+)$", out, re.M)
    assert lost, out[-3000:]
    assert lost.group(1) == str(run_dir)
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert latest == f"step-{int(lost.group(2)):06d}"


def test_failed_run_checkpoints_the_steps_it_finished(tiny_llama_dir, tmp_path,
                                                       service_factory):
    node = serve_node(service_factory, tiny_llama_dir, tmp_path, "node")
    run_dir, log_path = tmp_path / "run", tmp_path / "log"
    args = trainer_args(tiny_llama_dir, run_dir, [node.address], steps=200,
                        wait_for_nodes_s=1)
    with trainer_process(args, log_path) as proc:
        wait_for_step(run_dir, 2, proc, timeout=180)
        node.stop(signal.SIGKILL)
        assert proc.wait(240) == 1, log_path.read_text()[-4000:]
    out = log_path.read_text()
    last = max(r["step"] for r in step_records(run_dir))
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step-{last:06d}", out[-3000:]
    hint = re.search(rf"run failed after step {last} \(RuntimeError\); checkpointed it: "
                     rf"continue with: (\S+) run --resume {re.escape(str(run_dir))}$", out, re.M)
    assert hint, out[-3000:]
    own = (Path(sys.executable).parent / "gridrl-trainer").resolve()  # the trainer that ran
    assert (Path(shutil.which(hint.group(1)) or "/") if "/" not in hint.group(1)
            else Path(hint.group(1))).resolve() == own, hint.group(1)
