"""What a run leaves for the tools users already have: ``--report-to`` tracker files that read
back with each tracker's own reader (TensorBoard, W&B offline, Trackio) and hold every number of
``log.jsonl`` under TRL's names; and adapters that load with ``PeftModel.from_pretrained`` and
``mlx_lm.load(..., adapter_path=...)``, or fold into a plain model with
``gridrl-adapters merge``."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from trainer_runs import BIN, ENV, run_args, write_task_files
from trainer_runs import records as read_records
from waiting import wait_for

from gridrl.common.errors import Kind
from gridrl.trainer.report.trackers import (
    extra_requirement,
    parse_report_to,
    require,
    tracker_metrics,
)

IDS = [1, 5, 9, 20, 33, 100, 7, 8, 300, 42, 6, 2]


@pytest.fixture(scope="module")
def run(tiny_llama_dir: Path, tmp_path_factory) -> dict:
    """A 4-step local run on the tiny llama reporting to all three trackers, offline."""
    tmp = tmp_path_factory.mktemp("exports")
    data, reward = write_task_files(tmp)
    run_dir = tmp / "run"
    env = {**ENV, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_PROJECT": "gridrl-test",
           "TRACKIO_DIR": str(tmp / "trackio"), "TRACKIO_PROJECT": "gridrl-test"}
    args = run_args(tiny_llama_dir, data, reward, run_dir, steps=4, eval_every=2,
                    run_name="exports", report_to="tensorboard,wandb,trackio",
                    metrics_port=-1)
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = read_records(run_dir)
    assert [r.get("step", 0) for r in records] == [0, 1, 2, 3, 4]  # baseline, then the steps
    expected = {r.get("step", 0): tracker_metrics(r, groups=2) for r in records}
    return {"run_dir": run_dir, "env": env, "expected": expected, "records": records}


def test_metric_names_are_trl_s(run: dict) -> None:
    expected = run["expected"]
    assert set(expected[0]) == {"eval/reward", "eval/exact", "eval/policy_version",
                                "eval/stderr", "eval/n"}  # the eval's standard error and size
    step2 = expected[2]
    for name in ("train/reward", "train/reward_std", "train/frac_reward_zero_std",
                 "train/rewards/even_words/mean", "train/completions/mean_length",
                 "train/loss", "train/grad_norm", "train/learning_rate",
                 "train/clip_ratio/region_mean", "train/mismatch_kl", "train/staleness_mean",
                 "train/dropped_samples", "train/rollout_s", "train/train_s", "train/sync_s",
                 "train/nodes_synced", "train/policy_version", "train/nodes/local/samples",
                 "train/nodes/local/mismatch_kl", "eval/reward", "eval/exact", "eval/runtime",
                 "eval/policy_version"):
        assert name in step2, name
    assert "eval/reward" not in expected[1] and "train/kl" not in step2  # no eval, --kl-beta 0
    record = next(r for r in run["records"] if r.get("step") == 2)
    assert step2["train/reward"] == record["reward_mean"]
    assert step2["eval/reward"] == record["eval_score"]
    assert step2["train/learning_rate"] == record["lr"] == 2e-2
    assert step2["train/nodes/local/samples"] == 16
    assert step2["train/completions/mean_length"] == record["sampled_tokens"] / 16
    assert step2["train/frac_reward_zero_std"] == 1 - record["groups_with_signal"] / 2


def test_tensorboard_event_files(run: dict) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run["run_dir"] / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            got.setdefault(event.step, {})[tag] = event.value
    expected = run["expected"]
    assert sorted(got) == sorted(expected)
    for step, metrics in expected.items():
        assert got[step].keys() == metrics.keys(), step
        for name, value in metrics.items():  # stored as float32
            assert got[step][name] == pytest.approx(value, rel=1e-6, abs=1e-30), (step, name)
    assert json.loads(acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0])["lr"] \
        == 2e-2


def _wandb_records(path: Path) -> list:
    """Every record of a W&B ``.wandb`` transaction log: leveldb's log format (a 7-byte header
    ``:W&B`` + magic + version, then 32 KiB blocks of records with a 7-byte header: crc32,
    length, type FULL/FIRST/MIDDLE/LAST) holding ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, parts, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            out.append(wandb_internal_pb2.Record.FromString(parts))
    return out


def test_wandb_offline_run(run: dict) -> None:
    run_dir = run["run_dir"]
    run_id = (run_dir / "wandb" / "gridrl-run-id").read_text().strip()
    [log_file] = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    records = _wandb_records(log_file)
    [start] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert start.project == "gridrl-test" and start.display_name == "exports"
    config = {u.key or ".".join(u.nested_key): json.loads(u.value_json)
              for u in start.config.update}
    assert config["lr"] == 2e-2 and config["report_to"] == ["tensorboard", "wandb", "trackio"]
    assert "security" not in config and "auth_token" not in config  # credentials never logged
    rows = [{i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    expected = run["expected"]
    assert [row["train/global_step"] for row in rows] == sorted(expected)
    for row in rows:
        metrics = {k: v for k, v in row.items() if not k.startswith("_")}
        step = metrics.pop("train/global_step")
        assert metrics == pytest.approx(expected[step]), step
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished cleanly


def test_trackio_local_run(run: dict) -> None:
    code = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage; "
            "print(json.dumps(SQLiteStorage.get_logs('gridrl-test', 'exports')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TRACKIO_DIR": run["env"]["TRACKIO_DIR"]},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    expected = run["expected"]
    assert [row["step"] for row in rows] == sorted(expected)
    for row in rows:
        metrics = {k: v for k, v in row.items() if k not in ("step", "timestamp")}
        assert metrics.pop("train/global_step") == row["step"]
        assert metrics == pytest.approx(expected[row["step"]]), row["step"]


def test_resume_after_kill_9_continues_the_tracker_runs(tiny_llama_dir: Path,
                                                          tmp_path: Path) -> None:
    """kill -9 after the checkpoint, then ``--resume``: TensorBoard purges the lost steps the
    killed run had logged (each step appears once, with the resumed run's value) and W&B
    continues the same run id."""
    import signal

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data, reward = write_task_files(tmp_path)
    run_dir = tmp_path / "run"
    env = {**ENV, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    args = run_args(tiny_llama_dir, data, reward, run_dir, steps=40, checkpoint_every=2,
                    eval_every=100, report_to="tensorboard,wandb", metrics_port=-1)
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_for(lambda: max((r.get("step", 0) for r in read_records(run_dir)), default=0) >= 3,
                 180, "step 3 in log.jsonl", alive=proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = max(r.get("step", 0) for r in read_records(run_dir))
    ckpt = int((run_dir / "checkpoints" / "latest").read_text().split("-")[1])
    run_id = (run_dir / "wandb" / "gridrl-run-id").read_text()
    resumed = subprocess.run([str(BIN / "gridrl-trainer"), "run", "--resume", str(run_dir),
                              "--steps", str(killed_at + 1), "--listen", "127.0.0.1:0",
                              "--metrics-port", "-1"],
                             capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert ckpt < killed_at  # the killed run had logged steps the resumed run redoes

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars("train/reward")
    assert [e.step for e in events] == list(range(1, killed_at + 2))
    final = {r["step"]: r["reward_mean"] for r in read_records(run_dir) if r.get("step")}
    assert [e.value for e in events] == pytest.approx([final[e.step] for e in events])
    assert (run_dir / "wandb" / "gridrl-run-id").read_text() == run_id
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id.strip()}"))) == 2


def test_report_to_names_and_missing_packages(monkeypatch) -> None:
    from gridrl.common.errors import StatusError

    assert parse_report_to("none") == [] and parse_report_to(None) == []
    assert parse_report_to("wandb, tensorboard,wandb") == ["wandb", "tensorboard"]
    with pytest.raises(StatusError) as e:
        parse_report_to("tensorboard,mlflow")
    assert e.value.kind is Kind.INVALID_ARGUMENT
    assert e.value.message.startswith("--report-to: unknown tracker 'mlflow'")
    monkeypatch.setitem(sys.modules, "trackio", None)  # what an uninstalled package looks like
    with pytest.raises(StatusError) as e:
        require(["tensorboard", "trackio"])
    assert e.value.kind is Kind.FAILED_PRECONDITION
    assert e.value.message == ("--report-to trackio: the trackio package is not installed: "
                               f"pip install '{extra_requirement('trackio')}' (the "
                               "gridrl-trainer[trackio] extra)")
    # the range comes from the installed gridrl-trainer's metadata (its pyproject's extra)
    from packaging.requirements import Requirement

    assert Requirement(extra_requirement("trackio")).specifier.contains("0.43.0")
    assert extra_requirement("no-such-extra") == "no-such-extra"


def test_missing_tracker_package_is_one_line_before_the_model_loads(tmp_path: Path) -> None:
    """``gridrl-trainer run --report-to wandb`` without wandb: exit 2 with one line naming the
    flag and the pip command; the model is never loaded, the run directory not kept."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    run_dir = tmp_path / "run"
    model = tmp_path / "model"  # exists (passes the --model check), but holds no model
    model.mkdir()
    done = subprocess.run(
        [str(BIN / "gridrl-trainer"), "run", "--model", str(model),
         "--report-to", "tensorboard,wandb", "--run-dir", str(run_dir), "--listen",
         "127.0.0.1:0", "--metrics-port", "-1"], capture_output=True, text=True, timeout=120,
        env={**ENV, "PYTHONPATH": str(hide)})
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --report-to wandb: the wandb package is not installed: pip install "
        f"'{extra_requirement('wandb')}' (the gridrl-trainer[wandb] extra)")
    assert "Traceback" not in done.stderr
    assert not run_dir.exists()
    bad = subprocess.run([str(BIN / "gridrl-trainer"), "run", "--report-to", "neptune"],
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert bad.returncode == 2 and "--report-to: unknown tracker 'neptune'" in bad.stderr


# ------------------------------------------------------------------ the run's adapters


def _torch_logits(model_dir: Path, adapter: Path | None = None) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(torch.tensor([IDS])).logits[0].numpy()


def test_run_adapter_loads_with_peft_and_merges(run: dict, tiny_llama_dir: Path,
                                                tmp_path: Path) -> None:
    """``adapter/`` is the trained policy (its logits differ from the base) and
    ``gridrl-adapters merge`` turns it into a plain model with the same logits."""
    run_dir = run["run_dir"]
    peft = _torch_logits(tiny_llama_dir, run_dir / "adapter")
    assert np.abs(peft - _torch_logits(tiny_llama_dir)).max() > 1e-3
    merged = tmp_path / "merged"
    done = subprocess.run([str(BIN / "gridrl-adapters"), "merge", "--base", str(tiny_llama_dir),
                           "--adapter", str(run_dir / "adapter"), "--out", str(merged)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert np.abs(_torch_logits(merged) - peft).max() <= 1e-5 * np.abs(peft).max()


@pytest.mark.mlx
def test_run_mlx_adapter_loads_with_mlx_lm(run: dict, tiny_llama_dir: Path) -> None:
    """``adapter-mlx/`` loads with ``mlx_lm.load(model, adapter_path=...)`` and computes the
    policy peft computes from ``adapter/``."""
    import mlx.core as mx
    from mlx_lm import load

    run_dir = run["run_dir"]
    model, _ = load(str(tiny_llama_dir), adapter_path=str(run_dir / "adapter-mlx"))
    got = np.array(model(mx.array([IDS]))[0])
    want = _torch_logits(tiny_llama_dir, run_dir / "adapter")
    base, _ = load(str(tiny_llama_dir))
    assert np.abs(np.array(base(mx.array([IDS]))[0]) - want).max() > 1e-3
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def _peft_greedy(model_dir: Path, adapter: Path, prompt: list[int], tokens: int) -> list[int]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter).eval()
    ids = list(prompt)
    with torch.no_grad():  # argmax, token after token, eos or not (as mlx-lm's generate_step)
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _mlx_greedy(model_dir: Path, adapter: Path, prompt: list[int], tokens: int
                ) -> tuple[list[int], np.ndarray]:
    """``mlx_lm.load(model_dir, adapter_path=adapter)`` with no override: its greedy tokens
    (mlx-lm's own generator) and its logits over ``prompt``."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(model_dir), adapter_path=str(adapter))
    steps = generate_step(mx.array(prompt), model, max_tokens=tokens)
    return [int(t) for t, _ in steps], np.array(model(mx.array([prompt]))[0])


@pytest.mark.mlx
def test_mlx_lm_reads_the_model_directory_as_transformers_does(run: dict,
                                                               tmp_path: Path) -> None:
    """The same tiny llama with rope base 100000 (SmolLM2's), written as transformers 5 writes
    it (``rope_parameters`` only): mlx-lm silently uses 10000 and its logits differ from
    peft's; once gridrl wrote the directory's ``config.json`` (top-level ``rope_theta``, as the
    converted cache and merged models carry it), ``mlx_lm.load(model_dir,
    adapter_path=run/adapter-mlx)`` with no override gives peft's greedy tokens and logits."""
    from gridrl.models import make_config_portable
    from gridrl.models.testing import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "rope1e5", rope_theta=100000.0)
    config = json.loads((model_dir / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 100000.0
    run_dir = run["run_dir"]
    want = _torch_logits(model_dir, run_dir / "adapter")
    _, wrong = _mlx_greedy(model_dir, run_dir / "adapter-mlx", IDS, 1)
    assert np.abs(wrong - want).max() > 1e-3  # the rope base mlx-lm fell back to

    assert make_config_portable(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_theta"] == 100000.0 and config["rope_parameters"]["rope_theta"] == 1e5
    assert not make_config_portable(model_dir)  # nothing more to add
    greedy, logits = _mlx_greedy(model_dir, run_dir / "adapter-mlx", IDS, 6)
    assert np.abs(logits - want).max() <= 1e-5 * np.abs(want).max()
    assert greedy == _peft_greedy(model_dir, run_dir / "adapter", IDS, 6)
    assert np.abs(_torch_logits(model_dir, run_dir / "adapter") - want).max() == 0  # the same
    # model for transformers 5, which reads rope_parameters first
