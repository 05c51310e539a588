"""``gridrl-trainer run`` on a user's environment file that misbehaves (the tiny llama, sampling
in-process): an environment that raises drops that episode (counted, logged with its message)
and the step goes on; one that never ends is cut at the turn limit; every episode figure and
the environment's reward function reach the console, ``log.jsonl``, ``summary.json``, the
trackers (TensorBoard); Prometheus publishes the same record (``test_trainer_server.py``,
and a live trainer's counters in ``tests/faults/test_fault_episodes.py``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from trainer_runs import BIN, ENV, records

ENV_FILE = '''
from gridrl.trainer.envs.base import Environment, EnvTurn
from gridrl.trainer.envs.base import TaskItem


class Flaky(Environment):
    """Never says done; raises on odd items."""

    name = "flaky"
    max_turns = 3
    max_tokens = 4
    eval_tasks = 4

    def train_item(self, index):
        return TaskItem(f"w{index}", ({"role": "user", "content": f"w{index % 50}"},),
                        {"index": index})

    def eval_items(self):
        return [self.train_item(1000 + 2 * i) for i in range(4)]

    def respond(self, item, transcript, state):
        if item.columns["index"] % 2:
            raise RuntimeError(f"flaky broke on item {item.columns['index']}")
        return EnvTurn([{"role": "user", "content": "more"}], counts={"pokes": 1})

    def score(self, prompts, completions, **columns):
        return [float(len(c.split()) % 2) for c in completions]
'''


@pytest.mark.slow
def test_a_raising_and_an_endless_environment_run_to_the_end(tiny_llama_dir: Path,
                                                             tmp_path: Path) -> None:
    env_file = tmp_path / "flaky_env.py"
    env_file.write_text(ENV_FILE)
    run_dir = tmp_path / "run"
    argv = [str(BIN / "gridrl-trainer"), "run", "--model", str(tiny_llama_dir), "--task",
            str(env_file), "--steps", "2", "--prompts-per-step", "2", "--group-size", "4",
            "--lr", "2e-2", "--lora-rank", "4", "--lora-alpha", "8", "--eval-every", "2",
            "--checkpoint-every", "2", "--run-dir", str(run_dir), "--rollout", "local",
            "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--report-to", "tensorboard",
            "--threads", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=ENV)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]

    steps = [r for r in records(run_dir) if r.get("step")]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # one item of each step raised (its 4 episodes dropped), one never ended
        assert r["episodes"] == 8 and r["dropped_episodes"] == {"env_error": 4}, r
        assert r["truncated_episodes"] == 4 and r["env_counts"] == {"pokes": 12}, r
        assert r["turns_mean"] == (4 * 3 + 4 * 1) / 8 and r["env_tokens"] > 0, r
        assert r["samples_used"] == 4 and set(r["reward_funcs"]) == {"flaky:score"}, r
    assert "environment flaky raised" in out and "RuntimeError: flaky broke on item" in out
    assert "drop 4 (env_error 4)" in out and "trunc 4" in out and "pokes 12" in out
    evals = [r for r in records(run_dir) if r.get("eval_score") is not None]
    assert evals and all(r["eval_metrics"]["truncated"] == 1.0 for r in evals), evals

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dropped_episodes"] == {"env_error": 8} and summary["episodes"] == 16
    assert summary["truncated_episodes"] == 8 and summary["env_counts"] == {"pokes": 24}
    assert summary["turns_mean"] == 2.0 and set(summary["reward_funcs_last10"]) == \
        {"flaky:score"}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/turns_mean", "train/env_tokens", "train/model_tokens",
            "train/truncated_episodes", "train/dropped_episodes/env_error", "train/env/pokes",
            "train/rewards/flaky:score/mean"} <= tags, sorted(tags)
