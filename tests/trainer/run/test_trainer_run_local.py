"""``gridrl-trainer run --rollout local`` end to end on the tiny llama: it learns a reward, feeds
TrainerService, writes the run directory; kill -9 and ``--resume`` continue the same steps."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from trainer_runs import BIN, ENV, ONE_THREAD, run_args, wait_for_step, write_task_files
from trainer_runs import records as read_records


@pytest.fixture
def task_files(tmp_path):
    return write_task_files(tmp_path)


def _args(model, data, reward, run_dir, steps, **extra):
    args = run_args(model, data, reward, run_dir, steps, **extra)
    args[0] = "gridrl-trainer"  # service_factory prefixes the venv's bin directory
    return args


def runnable_trainer(command: str, cwd: Path | None = None) -> bool:
    """Whether ``command`` (the first word of a printed hint) runs this venv's gridrl-trainer
    from ``cwd``: its bare name found on PATH, or a path to it."""
    own = (BIN / "gridrl-trainer").resolve()
    if "/" not in command:
        found = shutil.which(command)
        return found is not None and Path(found).resolve() == own
    return (Path(cwd or Path.cwd()) / command).resolve() == own


def _watch_all(address: str) -> list:
    from gridrl.common.rpc.channel import dial
    from gridrl.v1 import trainer_pb2, trainer_pb2_grpc

    with dial(address) as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        first = stub.GetRunStatus(trainer_pb2.GetRunStatusRequest(), timeout=10)
        reports = [r.report for r in stub.WatchRun(
            trainer_pb2.WatchRunRequest(include_history=True), timeout=120)]
        return first, reports


def test_local_run_learns_and_writes_the_run_directory(tiny_llama_dir, task_files, tmp_path,
                                                        service_factory):
    from gridrl.v1 import trainer_pb2

    data, reward = task_files
    run_dir = tmp_path / "run"
    svc = service_factory(_args(tiny_llama_dir, data, reward, run_dir, steps=12), "trainer",
                          env=ONE_THREAD)
    cli = subprocess.run([str(BIN / "gridrl-trainer"), "status", "--address", svc.address,
                          "--json"], capture_output=True, text=True, timeout=30)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["total_steps"] == "12"  # proto3 JSON: uint64 as a string
    first, reports = _watch_all(svc.address)
    assert first.state in (trainer_pb2.RUN_STATE_STARTING, trainer_pb2.RUN_STATE_RUNNING)
    assert svc.proc.wait(60) == 0, svc.log()
    log_text = svc.log()

    # TrainerService streamed every step, with the eval's policy version
    assert [r.step for r in reports] == list(range(1, 13))
    assert [r.step for r in reports if r.HasField("eval_score")] == [6, 12]
    assert all(r.eval_policy_version == r.policy_version for r in reports
               if r.HasField("eval_score"))

    records = read_records(run_dir)
    baseline = [r for r in records if r.get("event") == "baseline"]
    steps = [r for r in records if r.get("step")]
    assert len(baseline) == 1 and baseline[0]["eval_policy_version"] == 0
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert [r["policy_version"] for r in steps] == list(range(1, 13))
    for r in steps:
        assert r["staleness_mean"] == 0 and r["dropped_samples"] == 0
        assert r["mismatch_kl"] < 1e-6  # the sampler is the trainer's own model
        assert r["nodes"]["local"]["samples"] == 16 and r["nodes"]["local"]["versions"] == [
            r["policy_version"] - 1]
        assert r["nodes_synced"] == 0 and r["sync_s"] == 0
    # it learns: the reward and the greedy eval go up
    first3 = sum(r["reward_mean"] for r in steps[:3]) / 3
    last3 = sum(r["reward_mean"] for r in steps[-3:]) / 3
    assert last3 > first3 + 0.2, (first3, last3)
    assert steps[-1]["eval_score"] > baseline[0]["eval_score"] + 0.2
    assert "step   12/12" in log_text and "eval" in log_text

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["final_eval_policy_version"] == 12
    assert summary["final_eval"] == steps[-1]["eval_score"]
    assert summary["adapter_mlx_error"] is None
    assert (run_dir / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((run_dir / "config.json").read_text())["lr"] == 2e-2
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == [
        "step-000006", "step-000012"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-000012"
    assert {p.name for p in (run_dir / "adapter").iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors"}
    assert (run_dir / "adapter-mlx" / "adapters.safetensors").exists()

    # the final peft adapter holds the trained weights and loads with peft
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    final = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    ckpt = load_file(run_dir / "checkpoints" / "step-000012" / "adapter_model.safetensors")
    assert final.keys() == ckpt.keys() and all(torch.equal(final[k], ckpt[k]) for k in final)
    assert any(v.abs().max() > 0 for k, v in final.items() if "lora_B" in k)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir),
                                      run_dir / "adapter")
    assert model.peft_config["default"].r == 8


def test_kill_9_and_resume_continue_the_same_steps(tiny_llama_dir, task_files, tmp_path):
    data, reward = task_files
    run_dir = tmp_path / "run"
    args = _args(tiny_llama_dir, data, reward, run_dir, steps=40, checkpoint_every=3,
                 eval_every=20)
    args[0] = str(BIN / args[0])
    log1 = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(args, stdout=log1, stderr=subprocess.STDOUT, env=ENV)
    try:
        wait_for_step(run_dir, 4, proc, timeout=120)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed = {r["step"]: r for r in read_records(run_dir) if r.get("step")}
    last_ckpt = (run_dir / "checkpoints" / "latest").read_text()
    ckpt_step = int(last_ckpt.split("-")[1])
    assert 3 <= ckpt_step < max(killed)  # steps after the checkpoint were lost with the kill
    versions_before = [json.loads(v)["version"]
                       for v in (run_dir / "versions.jsonl").read_text().splitlines()]

    resumed = subprocess.run([str(BIN / "gridrl-trainer"), "run", "--resume", str(run_dir),
                              "--steps", "12", "--listen", "127.0.0.1:0", "--metrics-port",
                              "-1"], capture_output=True, text=True, timeout=300, env=ENV)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed at step {ckpt_step}" in resumed.stdout

    records = read_records(run_dir)
    steps = [r["step"] for r in records if r.get("step")]
    assert steps == list(range(1, 13))  # no step repeated or lost, same numbering
    assert sum(1 for r in records if r.get("event") == "baseline") == 1
    by_step = {r["step"]: r for r in records if r.get("step")}
    # the step after the checkpoint is re-done exactly as before the kill (same data, same
    # sampler seeds, restored weights, optimizer and RNG)
    again = by_step[ckpt_step + 1]
    before = killed[ckpt_step + 1]
    assert again["reward_mean"] == pytest.approx(before["reward_mean"], abs=1e-9)
    assert again["loss"] == pytest.approx(before["loss"], abs=1e-6)
    assert again["data_position"] == before["data_position"]
    # versions minted after the resume are new: none reuses a number the killed run used
    assert min(by_step[s]["policy_version"] for s in range(ckpt_step + 1, 13)) > max(
        versions_before)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_at"] == [ckpt_step] and summary["steps"] == 12
    config = json.loads((run_dir / "config.json").read_text())
    assert config["steps"] == 12 and config["lr"] == 2e-2


@pytest.mark.real_model
@pytest.mark.slow
def test_reverse_words_on_smollm2(smollm2_dir, tmp_path):
    """Two steps of the built-in task on the bundled SmolLM2 (its own chat template): exact
    behaviour logprobs from the local sampler, an eval stamped with the version it measured."""
    run_dir = tmp_path / "run"
    done = subprocess.run([str(BIN / "gridrl-trainer"), "run", "--model", str(smollm2_dir),
                           "--steps", "2", "--prompts-per-step", "1",  # its budget before
                           "--group-size", "4", "--max-tokens", "12",  # the default became 2
                           "--min-words", "3", "--max-words", "4", "--eval-every", "2",
                           "--eval-tasks", "4", "--run-dir", str(run_dir), "--rollout", "local",
                           "--listen", "127.0.0.1:0", "--metrics-port", "-1"],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    recs = read_records(run_dir)
    assert "Words:" in recs[0]["eval_examples"][0]["prompt"]
    steps = [r for r in recs if r.get("step")]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["mismatch_kl"] < 1e-5 and r["train_tokens"] > 0 for r in steps)
    assert steps[-1]["eval_policy_version"] == 2 and 0.0 <= steps[-1]["eval_score"] <= 1.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["adapter_mlx_error"] is None


def test_sigterm_checkpoints_the_step_and_resume_continues(tiny_llama_dir, task_files, tmp_path):
    data, reward = task_files
    run_dir = tmp_path / "run"
    args = _args(tiny_llama_dir, data, reward, run_dir, steps=40, checkpoint_every=100,
                 eval_every=100)
    args[0] = str(BIN / args[0])
    out = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=ENV)
    try:
        wait_for_step(run_dir, 2, proc, timeout=120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = [r["step"] for r in read_records(run_dir) if r.get("step")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 40
    # the step in progress was finished and checkpointed (--checkpoint-every 100 never would)
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step-{steps[-1]:06d}"
    # the hint is a command the user can run: the trainer by the name or path that runs it
    hint = re.search(r"continue with: (\S+) run --resume (\S+)",
                     (tmp_path / "first.log").read_text())
    assert hint and hint.group(2) == str(run_dir), (tmp_path / "first.log").read_text()[-2000:]
    assert runnable_trainer(hint.group(1))
    # The same command again, without --resume, is refused before anything is loaded: a
    # second run there would mix its log, checkpoints and versions with this one's.
    log_before = (run_dir / "log.jsonl").read_bytes()
    again = subprocess.run(args, capture_output=True, text=True, timeout=120, env=ENV)
    assert again.returncode == 2, again.stdout + again.stderr
    # (a stopped run keeps its adapter and summary too, so the user has them at once)
    assert (f"--run-dir: {run_dir} already holds a run (checkpoints up to step {steps[-1]} "
            f"and a log.jsonl and adapter and summary.json); continue it with --resume "
            f"{run_dir}") in again.stderr, again.stderr
    assert (run_dir / "log.jsonl").read_bytes() == log_before
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step-{steps[-1]:06d}"
    resumed = subprocess.run([str(BIN / "gridrl-trainer"), "run", "--resume", str(run_dir),
                              "--steps", str(len(steps) + 2), "--listen", "127.0.0.1:0",
                              "--metrics-port", "-1"], capture_output=True, text=True,
                             timeout=300, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = [r["step"] for r in read_records(run_dir) if r.get("step")]
    assert after == list(range(1, len(steps) + 3))
