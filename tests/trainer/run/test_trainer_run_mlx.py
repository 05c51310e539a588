"""``gridrl-trainer run --backend mlx --rollout local`` end to end on the tiny llama: it trains
on its own MLX samples, evaluates on its own weights, checkpoints, and ``--resume`` after a
kill -9 continues exactly as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import numpy as np
import pytest
from trainer_runs import BIN, ENV, records, run_args, wait_for_step, write_task_files

pytestmark = pytest.mark.mlx
pytest.importorskip("mlx_lm")

STEPS = 6


def _args(model, data, reward, run_dir):
    return run_args(model, data, reward, run_dir, STEPS, backend="mlx", checkpoint_every=3,
                    eval_every=3, lr_schedule="cosine", warmup_steps=2, kl_beta=0.02,
                    micro_batch_size=8)


def _weights(directory):
    from gridrl.adapters import read_dir
    from gridrl.adapters.tensors import load, to_float64

    files = read_dir(directory)
    return {k: to_float64(t) for k, t in load(files["adapter_model.safetensors"]).tensors.items()}


def test_mlx_run_evaluates_checkpoints_and_resumes_exactly(tiny_llama_dir, tmp_path):
    data, reward = write_task_files(tmp_path)
    straight = tmp_path / "straight"
    done = subprocess.run(_args(tiny_llama_dir, data, reward, straight), capture_output=True,
                          text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ref = {r["step"]: r for r in records(straight) if r.get("step")}
    assert sorted(ref) == list(range(1, STEPS + 1))
    for r in ref.values():
        assert r["mismatch_kl"] < 1e-6  # the sampler is the trainer's own MLX model
        assert r["nodes"]["local"]["samples"] == 16 and r["policy_version"] == r["step"]
        assert r["train_tokens"] > 0 and np.isfinite(r["loss"])
    assert [s for s, r in ref.items() if r.get("eval_score") is not None] == [3, 6]
    baseline = [r for r in records(straight) if r.get("event") == "baseline"]
    assert len(baseline) == 1 and baseline[0]["eval_policy_version"] == 0
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_eval_policy_version"] == STEPS
    assert summary["adapter_mlx_error"] is None
    assert json.loads((straight / "config.json").read_text())["backend"] == "mlx"
    ckpt = straight / "checkpoints" / "step-000006"
    assert {"optimizer.safetensors", "rng.json", "adapter_model.safetensors"} <= {
        p.name for p in ckpt.iterdir()}
    final = _weights(straight / "adapter")
    assert any(np.abs(v).max() > 0 for k, v in final.items() if "lora_B" in k)  # it trained
    assert (straight / "adapter-mlx" / "adapters.safetensors").exists()

    # the same run killed after step 4 (checkpoint at 3) and resumed: steps 4-6 as before
    run_dir = tmp_path / "killed"
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen(_args(tiny_llama_dir, data, reward, run_dir), stdout=log,
                            stderr=subprocess.STDOUT, env=ENV)
    try:
        wait_for_step(run_dir, 4, proc, timeout=300)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-000003"
    resumed = subprocess.run([str(BIN / "gridrl-trainer"), "run", "--resume", str(run_dir),
                              "--listen", "127.0.0.1:0", "--metrics-port", "-1"],
                             capture_output=True, text=True, timeout=600, env=ENV)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed at step 3" in resumed.stdout
    got = {r["step"]: r for r in records(run_dir) if r.get("step")}
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(4, STEPS + 1):
        assert got[step]["reward_mean"] == ref[step]["reward_mean"]
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], abs=1e-6)
        assert got[step]["lr"] == pytest.approx(ref[step]["lr"], rel=1e-9)
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5)
    assert got[6]["eval_score"] == ref[6]["eval_score"]
    resumed_final = _weights(run_dir / "adapter")
    for name, value in final.items():
        np.testing.assert_allclose(resumed_final[name], value, atol=1e-6, err_msg=name)
