"""Checkpoints, run directory, config, node monitor, prefetcher and plot: the run's bookkeeping."""

from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np
import pytest
import torch
from scripted_nodes import BASE
from waiting import wait_for

from gridrl.common.errors import StatusError
from gridrl.trainer.config import TrainConfig
from gridrl.trainer.envs.base import TaskItem
from gridrl.trainer.fleet.membership import Membership
from gridrl.trainer.fleet.monitor import NodeMonitor
from gridrl.trainer.grpo.admission import NodeStepStats
from gridrl.trainer.report.plot import eval_points, plot_run
from gridrl.trainer.report.records import StepRecord
from gridrl.trainer.rollouts import EpisodeStats, Group
from gridrl.trainer.run.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from gridrl.trainer.run.rundir import RunDir
from gridrl.trainer.run.steps import Prefetcher, StepPrompts, StepSampler, step_seed


def test_checkpoint_round_trip_keeps_the_backend_files_and_the_state(tmp_path):
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"weights",
             "optimizer.pt": b"optimizer state", "scheduler.pt": b"s", "rng.pt": b"rng"}
    path = save_checkpoint(tmp_path, step=4, files=files,
                           state={"version": 4, "data_position": 4}, config={"lr": 0.1})
    ckpt = load_checkpoint(latest_checkpoint(tmp_path))
    assert ckpt.path == path and ckpt.step == 4 and ckpt.state["data_position"] == 4
    assert ckpt.files == files and ckpt.config == {"lr": 0.1}
    assert sorted(p.name for p in path.iterdir()) == sorted([*files, "config.json", "state.json"])
    with pytest.raises(ValueError, match=r"state\.json is the checkpoint's own file"):
        save_checkpoint(tmp_path, step=5, files={"state.json": b"{}"}, state={}, config={})
    assert latest_checkpoint(tmp_path).name == "step-000004"  # nothing half-written


class _Payload:
    """Pickles as a call that creates a file: what a crafted checkpoint would run on load."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_a_crafted_checkpoint_cannot_run_code(tmp_path):
    """The torch backend's checkpoint files load with weights_only=True: a .pt file whose
    pickle calls a function is refused, and the function never runs; the real RNG state
    (numpy's uint32 array included) still loads."""
    import io
    import pickle

    from gridrl.trainer.backends.torch.backend import load_state_bytes, rng_state

    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"state": _Payload(marker)}, buf)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_state_bytes(buf.getvalue())
    assert not marker.exists()
    buf = io.BytesIO()
    state = rng_state()
    torch.save(state, buf)
    again = load_state_bytes(buf.getvalue())
    assert np.array_equal(again["numpy"][1], state["numpy"][1])


def test_checkpoints_keep_the_newest_and_latest_points_at_a_complete_one(tmp_path):
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step=step, files={"a": b"x"}, state={}, config={}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000004", "step-000006"]
    assert latest_checkpoint(tmp_path).name == "step-000006"
    # a kill between the rename and the pointer update: the pointer names an older complete one
    (tmp_path / "latest").write_text("step-000004")
    assert latest_checkpoint(tmp_path).name == "step-000004"
    (tmp_path / "latest").unlink()  # no pointer: the newest complete directory
    assert latest_checkpoint(tmp_path).name == "step-000006"
    assert latest_checkpoint(tmp_path / "none") is None


def test_run_dir_log_truncation_versions_and_torn_lines(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.append_log({"event": "baseline", "eval_score": 0.1})
    for step in range(1, 6):
        rd.append_log({"step": step, "reward_mean": step / 10})
    with open(rd.log, "a") as f:
        f.write('{"step": 6, "rew')  # torn by kill -9
    assert [r.get("step") for r in rd.read_log()] == [None, 1, 2, 3, 4, 5]
    assert rd.truncate_log(3) == 2
    assert [r.get("step") for r in rd.read_log()] == [None, 1, 2, 3]
    assert rd.max_version() == 0
    for v in (1, 2, 7):
        rd.record_version(v, v)
    assert rd.max_version() == 7
    rd.write_json(rd.summary, {"x": np.float32(0.5)})
    assert json.loads(rd.summary.read_text()) == {"x": 0.5}


def test_config_defaults_validation_and_staleness_bound(tmp_path):
    cfg = TrainConfig().finalize()
    assert cfg.local and cfg.rollout == ["local"] and cfg.staleness_bound == 0
    # the settings that learn (config.py's docstring; the demo adds only --eval-every 5)
    assert (cfg.prompts_per_step, cfg.group_size, cfg.max_tokens, cfg.lr, cfg.lora_rank,
            cfg.lora_alpha, cfg.clip_eps, cfg.eval_every, cfg.eval_tasks, cfg.min_words,
            cfg.max_words) == (2, 8, 24, 3e-4, 16, 32.0, 0.2, 10, 128, 3, 4)
    # --max-tokens and --eval-tasks default to the task's own: a JSONL task keeps 40 and holds
    # out 16 rows; a flag wins
    jsonl = TrainConfig(task="qa.jsonl").finalize()
    assert (jsonl.max_tokens, jsonl.eval_tasks) == (40, 16)
    assert TrainConfig(max_tokens=64).finalize().max_tokens == 64
    assert TrainConfig(eval_tasks=7).finalize().eval_tasks == 7
    remote = TrainConfig(rollout=["h:1"], sync_every=3, async_steps=2).finalize()
    assert remote.staleness_bound == 4
    with pytest.raises(StatusError, match="--max-staleness"):
        TrainConfig(rollout=["h:1"], sync_every=3, max_staleness=1).finalize()
    with pytest.raises(StatusError, match="--group-size"):
        TrainConfig(group_size=1).finalize()
    with pytest.raises(StatusError, match="--temperature"):
        TrainConfig(temperature=0).finalize()
    with pytest.raises(StatusError, match="--async-steps"):
        TrainConfig(async_steps=1).finalize()
    with pytest.raises(StatusError, match="--rollout"):
        TrainConfig(rollout=["local", "h:1"]).finalize()
    with pytest.raises(StatusError, match="--run-name"):
        TrainConfig(run_name="my run/1").finalize()
    from gridrl.common.security.policy import Security

    cfg = TrainConfig(security=Security(token="gridrl_secret-never-saved"),
                      run_dir=str(tmp_path)).finalize()
    cfg.save(tmp_path / "config.json")
    assert "gridrl_secret-never-saved" not in (tmp_path / "config.json").read_text()
    assert "security" not in json.loads((tmp_path / "config.json").read_text())
    loaded = TrainConfig.load(tmp_path / "config.json")
    assert loaded.security is None and loaded.run_name == cfg.run_name


def test_node_monitor_flags_after_consecutive_bad_steps_and_recovers():
    mon = NodeMonitor(max_staleness=0, mismatch_kl_max=0.01, flag_after=2)
    flags = Membership(BASE)  # the flags' one owner; no member: flags are only recorded
    stale = NodeStepStats(samples=8, dropped=8, versions={3})
    good = NodeStepStats(samples=8, fresh_kl_sum=1e-6 * 80, fresh_tokens=80, versions={5})
    mismatched = NodeStepStats(samples=8, fresh_kl_sum=0.05 * 80, fresh_tokens=80,
                               versions={5})
    assert mon.observe(1, {"a": stale, "b": good}, flags) == {}
    newly = mon.observe(2, {"a": stale, "b": good}, flags)
    assert list(newly) == ["a"] and "stale: 8/8 samples dropped" in newly["a"]
    assert mon.observe(3, {"a": stale}, flags) == {} and "a" in flags.flags()  # flagged once
    assert mon.observe(4, {"b": mismatched}, flags) == {}
    assert "mismatched" in mon.observe(5, {"b": mismatched}, flags)["b"]
    mon.observe(6, {"a": good}, flags)
    assert set(flags.flags()) == {"b"}
    unknown = NodeStepStats(samples=2, dropped=2, unknown_version=2, versions={9})
    assert "outside this run's lineage" in mon.problem(unknown)
    # readmitted (probation's unflag): its bad steps count afresh, flag_after of them again
    flags.unflag("b")
    assert mon.observe(7, {"b": mismatched}, flags) == {} and flags.flags() == {}
    assert list(mon.observe(8, {"b": mismatched}, flags)) == ["b"]
    assert set(flags.flagged_ever()) == {"a", "b"}
    assert flags.benched_flags() == {}  # neither is a member of a pool: nothing benched


def test_node_monitor_holds_16_bit_steps_to_their_own_bound():
    mon = NodeMonitor(max_staleness=0, mismatch_kl_max=0.01, flag_after=1,
                      mismatch_kl_max_16bit=0.1)
    rounding = dict(samples=8, fresh_kl_sum=0.02 * 80, fresh_tokens=80, versions={5})
    assert mon.problem(NodeStepStats(**rounding, low_precision=True)) == ""
    assert "(> 0.01)" in mon.problem(NodeStepStats(**rounding))
    wrong = NodeStepStats(samples=8, fresh_kl_sum=0.5 * 80, fresh_tokens=80, versions={5},
                          low_precision=True)
    assert "(> 0.1, 16-bit bound)" in mon.problem(wrong)
    assert mon.bound({"a": NodeStepStats(**rounding)}) == 0.01
    assert mon.bound({"a": NodeStepStats(**rounding),
                      "b": NodeStepStats(**rounding, low_precision=True)}) == 0.1
    assert mon.bound({}) == 0.01
    # without a 16-bit bound every step is held to mismatch_kl_max
    strict = NodeMonitor(max_staleness=0, mismatch_kl_max=0.01, flag_after=1)
    assert "(> 0.01, 16-bit bound)" in strict.problem(NodeStepStats(**rounding, low_precision=True))


def test_prefetcher_runs_ahead_by_depth_and_no_further():
    calls: list[int] = []
    lock = threading.Lock()

    def generate(step):
        with lock:
            calls.append(step)
        return [step], EpisodeStats()

    def requested() -> list[int]:
        with lock:
            return list(calls)

    pre = Prefetcher(generate, depth=2, last_step=4)
    first = pre.get(1)
    assert first.groups == [1] and first.generate_s >= 0
    # steps 2 and 3 are sampled while step 1 "trains" (one worker: in order, one at a time)
    wait_for(lambda: len(requested()) >= 3, 10, "steps 2 and 3 prefetched")
    assert requested() == [1, 2, 3]
    assert pre.get(2).groups == [2]  # taken from the prefetch: not generated again
    wait_for(lambda: len(requested()) >= 4, 10, "step 4 prefetched")
    assert [pre.get(s).groups for s in (3, 4)] == [[3], [4]]
    pre.close()  # waits for anything in flight
    assert requested() == [1, 2, 3, 4]  # each step once, never beyond last_step
    sync = Prefetcher(lambda s: ([s], EpisodeStats()), depth=0, last_step=3)
    assert sync.get(2).groups == [2]


class _ItemSource:
    """An episode source whose item ``i`` is the prompt ``"item i"`` (token ids ``[i]``) and
    whose groups echo the prompt ids and the seed they were sampled for."""

    def __init__(self) -> None:
        self.env = self
        self.seeds: list[int] = []
        self._lock = threading.Lock()

    def train_item(self, index: int) -> TaskItem:
        return TaskItem(prompt=f"item {index}", messages=({"role": "user", "content": ""},))

    def prompt_ids(self, items):
        return [[int(item.prompt.split()[1])] for item in items]

    def generate(self, items, sampling, *, prompt_ids, group_size, seed):
        with self._lock:
            self.seeds.append(seed)
        return ([Group(prompt_index=i, prompt_ids=list(ids), samples=[], node=str(seed),
                       seconds=0.0) for i, ids in enumerate(prompt_ids)], EpisodeStats())


@pytest.mark.parametrize("async_steps", [0, 1, 2])
def test_each_step_trains_its_own_prompts_whatever_the_prefetch_depth(async_steps):
    """The rewards and advantages of a step are computed with ``SampledStep.items``: under
    ``--async-steps`` the groups a step gets (sampled ahead, on the prefetch thread) must be
    those of its own prompts (data position ``(step - 1) * B``) and its own seed, never a
    neighbouring step's."""
    cfg = TrainConfig(rollout=["h:1"], prompts_per_step=3, async_steps=async_steps,
                      steps=5).finalize()
    source = _ItemSource()
    sampler = StepSampler(cfg, StepPrompts(cfg, source), source)
    try:
        for step in range(1, 6):
            got = sampler.get(step)
            first = (step - 1) * 3
            assert [i.prompt for i in got.items] == [f"item {k}" for k in range(first, first + 3)]
            assert got.prompt_ids == [[k] for k in range(first, first + 3)]
            assert [g.prompt_ids for g in got.rollouts.groups] == got.prompt_ids
            assert {g.node for g in got.rollouts.groups} == {str(step_seed(cfg.seed, step))}
            assert got.rollouts.step == step
    finally:
        sampler.close()
    assert sorted(source.seeds) == sorted(step_seed(cfg.seed, s) for s in range(1, 6))


def test_plot_writes_a_png(tmp_path):
    records = [{"step": s, "reward_mean": s / 10, "reward_std": 0.1, "staleness_mean": s % 2,
                "dropped_samples": s % 3, "eval_score": 0.5 if s == 5 else None}
               for s in range(1, 11)]
    out = plot_run([StepRecord.from_json(r) for r in records], tmp_path / "plot.png",
                   baseline=0.1, title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_the_evals_standard_error_as_error_bars(tmp_path):
    records = [StepRecord.from_json(
        {"step": s, "reward_mean": 0.5, "reward_std": 0.1, "staleness_mean": 0,
         "dropped_samples": 0, "eval_score": 0.4 if s == 4 else None,
         "eval_stderr": 0.08 if s == 4 else None}) for s in range(1, 6)]
    assert eval_points(records, baseline=0.1, baseline_stderr=0.02) == [(0, 0.1, 0.02),
                                                                        (4, 0.4, 0.08)]
    assert eval_points(records, baseline=0.1) == [(0, 0.1, 0.0), (4, 0.4, 0.08)]
    with_bars = plot_run(records, tmp_path / "bars.png", baseline=0.1,
                         baseline_stderr=0.02).read_bytes()
    without = [dataclasses.replace(r, eval_stderr=None) for r in records]
    assert plot_run(without, tmp_path / "none.png", baseline=0.1).read_bytes() != with_bars
