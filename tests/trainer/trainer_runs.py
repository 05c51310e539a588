"""Helpers shared by the trainer's run tests: a tiny-llama task with a learnable reward, the
``gridrl-trainer run`` command line for it, and reading ``log.jsonl``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from waiting import wait_for

BIN = Path(sys.executable).parent
# One intra-op thread per process: tests run a trainer and nodes side by side on a few shared
# cores, where torch's default (a spinning thread per core in every process) thrashes.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
ENV = {**os.environ, **ONE_THREAD}

# Reward of the tiny llama's word-level vocabulary: the fraction of words "w<even number>".
REWARD_FILE = '''
def even_words(prompts, completions, **kwargs):
    out = []
    for c in completions:
        words = c.split()
        even = [w for w in words if w.startswith("w") and w[1:].isdigit() and int(w[1:]) % 2 == 0]
        out.append(len(even) / max(len(words), 1))
    return out
'''


def write_task_files(directory: Path) -> tuple[Path, Path]:
    """A 40-row JSONL task (prompt column only) and the reward file; returns their paths."""
    data = directory / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": "cat dog red blue sky sea "
                                        + " ".join(f"w{i * 7 + j}" for j in range(3))}) + "\n"
                            for i in range(40)))
    reward = directory / "even.py"
    reward.write_text(REWARD_FILE)
    return data, reward


def run_args(model: Path, data: Path, reward: Path, run_dir: Path, steps: int,
             **extra) -> list[str]:
    """``gridrl-trainer run`` on the tiny task, sampling locally (``extra``: more flags)."""
    args = [str(BIN / "gridrl-trainer"), "run", "--model", str(model), "--task", str(data),
            "--reward-file", str(reward), "--steps", str(steps), "--prompts-per-step", "2",
            "--group-size", "8", "--max-tokens", "8", "--lr", "2e-2", "--lora-rank", "8",
            "--lora-alpha", "16", "--eval-every", "6", "--eval-tasks", "8",
            "--checkpoint-every", "6", "--run-dir", str(run_dir), "--rollout", "local",
            "--listen", "127.0.0.1:0", "--metrics-port", "0"]
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def records(run_dir: Path) -> list[dict]:
    """Every complete record of ``run_dir/log.jsonl`` (none when it does not exist)."""
    path = run_dir / "log.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by kill -9
            continue
    return out


def wait_for_step(run_dir: Path, step: int, proc, timeout: float) -> None:
    """Wait until ``run_dir/log.jsonl`` has a record of ``step`` (or later) while ``proc`` (a
    ``subprocess.Popen``) runs.

    Raises:
        AssertionError: the process ended first, or ``timeout`` seconds passed.
    """
    wait_for(lambda: any(r.get("step", 0) >= step for r in records(run_dir)), timeout,
             f"step {step} in {run_dir / 'log.jsonl'}", alive=proc)


def step_record(step: int, **kw):
    """A :class:`~gridrl.trainer.report.records.StepRecord` of ``step`` with plain defaults
    (one node ``a:1`` of 16 samples), any field overridden by ``kw``."""
    from gridrl.trainer.report.records import NodeRecord, StepRecord

    base = dict(step=step, policy_version=step, reward_mean=0.5, reward_std=0.1, loss=0.0,
                eval_score=None, eval_policy_version=0, mismatch_kl=0.0, staleness_mean=0.0,
                dropped_samples=0, rollout_s=1.0, train_s=2.0, sync_s=0.0, nodes_synced=0,
                nodes_skipped=0, tokens_per_s=100.0, elapsed_s=3.0 * step, rollout_wait_s=0.0,
                collect_s=1.0, staleness_max=0, samples_used=16, sampled_tokens=100,
                solved_fraction=0.0, groups_with_signal=1, reward_funcs={},
                nodes={"a:1": NodeRecord(16, 0, [step - 1], 0.0, 1e-7, 250.0)},
                flagged_nodes={}, excluded_samples={}, updated=True, data_position=4 * step,
                lr=1e-3)
    base.update(kw)
    return StepRecord(**base)
