"""Numbers a user can trust on a task of their own: the held-out eval scores with the reward
the run trains on (or the ``--eval-reward-file`` named), says which scorer it used and its
exact-match rate everywhere a score is shown; a reward function that cannot run on the task
fails at start-up in one line, before the model loads; one that fails mid-run names itself and
the step, and the run checkpoints and exits non-zero, or drops the group when asked.

Real runs on the tiny llama (random weights: its replies are never the uppercase word), in
process (``train``) or as ``gridrl-trainer run`` processes."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest
from rich.console import Console
from trainer_runs import BIN, ENV

from gridrl.common.errors import StatusError
from gridrl.trainer.config import TrainConfig
from gridrl.trainer.envs.reverse import WORD_BANK
from gridrl.trainer.preflight import build_rewards
from gridrl.trainer.run.driver import train

# 1.0 only for the exact uppercase word; 0.25 otherwise (what the built-in case-insensitive
# word similarity never gives a random reply: a distinct mark of the user's function)
UPPER_REWARD = '''
def upper(prompts, completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.25 for c, a in zip(completions, answer)]

REWARD_FUNCS = [upper]
'''
# the same without an answer column: the word is the prompt
UPPER_NO_ANSWER = '''
def upper(prompts, completions, **kwargs):
    return [1.0 if c.strip() == p.upper() else 0.25 for p, c in zip(prompts, completions)]
'''


def upper_task(directory: Path, *, answer: bool, extra: dict | None = None) -> Path:
    """The uppercase task: one row per word of the word bank."""
    path = directory / "upper.jsonl"
    path.write_text("".join(json.dumps({"prompt": w, **({"answer": w.upper()} if answer else {}),
                                        **(extra or {})}) + "\n" for w in WORD_BANK[:40]))
    return path


def small_run(model: Path, task: Path, run_dir: Path, reward_files: list[str],
              **settings) -> TrainConfig:
    """A 2-step local run evaluating 4 rows at steps 0 (baseline) and 2."""
    return TrainConfig(model=str(model), task=str(task), reward_files=reward_files, steps=2,
                       prompts_per_step=1, group_size=2, max_tokens=3, eval_every=2,
                       eval_tasks=4, checkpoint_every=2, run_dir=str(run_dir),
                       rollout=["local"], lora_rank=4, lora_alpha=8, **settings).finalize()


@pytest.mark.parametrize("answer", [True, False], ids=["answer-column", "no-answer-column"])
def test_the_eval_scores_with_the_run_s_own_reward_and_names_it(tiny_llama_dir, tmp_path,
                                                                  answer):
    task = upper_task(tmp_path, answer=answer)
    reward = tmp_path / "upper_reward.py"
    reward.write_text(UPPER_REWARD if answer else UPPER_NO_ANSWER)
    run_dir = tmp_path / "run"
    out = io.StringIO()
    train(small_run(tiny_llama_dir, task, run_dir, [str(reward)]),
          console=Console(file=out, width=400))
    scorer = "reward upper (upper_reward.py)"
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("eval_score") is not None]
    assert [r.get("step", 0) for r in evals] == [0, 2]
    for r in evals:  # every reply is scored by upper(): 0.25 unless it is the uppercase word
        assert r["eval_scorer"] == scorer, r
        assert all(e["score"] in (0.25, 1.0) for e in r["eval_examples"]), r["eval_examples"]
        assert r["eval_score"] == pytest.approx(0.25 + 0.75 * r["eval_exact"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_scorer"] == scorer
    assert summary["baseline_eval_exact"] == evals[0]["eval_exact"]
    assert summary["final_eval_exact"] == evals[-1]["eval_exact"]
    assert summary["evals"][-1]["exact"] == evals[-1]["eval_exact"]
    text = out.getvalue()
    assert f"scored by {scorer}" in text
    done = next(line for line in text.splitlines() if line.startswith("done"))
    assert done.count(" exact ") == 2 and f"(scored by {scorer})" in done, done


def test_an_eval_reward_file_scores_the_eval_instead(tiny_llama_dir, tmp_path):
    task = upper_task(tmp_path, answer=True)
    reward = tmp_path / "upper_reward.py"
    reward.write_text(UPPER_REWARD)
    judge = tmp_path / "judge.py"
    judge.write_text("def half(prompts, completions, **kw):\n"
                     "    return [0.5 for _ in completions]\n")
    run_dir = tmp_path / "run"
    train(small_run(tiny_llama_dir, task, run_dir, [str(reward)],
                    eval_reward_files=[str(judge)]), console=Console(file=io.StringIO()))
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("eval_score") is not None]
    assert evals and all(r["eval_score"] == 0.5 and r["eval_exact"] == 0.0
                         and r["eval_scorer"] == "reward half (judge.py)" for r in evals)
    # the training reward is still the run's own
    assert all(set(r["reward_funcs"]) == {"upper"} for r in records if r.get("step"))


def test_a_reward_needing_a_column_the_rows_lack_fails_before_the_model_loads(tmp_path):
    task = upper_task(tmp_path, answer=True)
    reward = tmp_path / "needs_target.py"
    reward.write_text("def upper(prompts, completions, target, **kwargs):\n"
                      "    return [float(c == t) for c, t in zip(completions, target)]\n")
    # no model at all: the check never loads one
    cfg = TrainConfig(model="smollm2-135m-instruct", task=str(task),
                      reward_files=[str(reward)], run_dir=str(tmp_path / "run")).finalize()
    with pytest.raises(StatusError) as e:
        build_rewards(cfg, cfg.environment())
    assert e.value.field == "--reward-file"
    assert "reward function upper (needs_target.py): needs column 'target'" in e.value.message
    # the command line: one line, no traceback, exit 2, nothing written
    done = subprocess.run([str(BIN / "gridrl-trainer"), "run", "--task", str(task),
                           "--reward-file", str(reward), "--run-dir", str(tmp_path / "cli"),
                           "--listen", "127.0.0.1:0", "--metrics-port", "-1"],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "--reward-file" in errors[0] and "upper (needs_target.py)" in errors[0]
    assert "'target'" in errors[0]
    assert not (tmp_path / "cli").exists()


def test_a_task_score_without_its_answer_column_fails_at_start_up(tmp_path):
    task = upper_task(tmp_path, answer=False)
    cfg = TrainConfig(task=str(task), run_dir=str(tmp_path / "run")).finalize()
    with pytest.raises(StatusError) as e:
        build_rewards(cfg, cfg.environment())
    assert e.value.field == "--task" and "no 'answer' column" in e.value.message


# fails on the model's replies to rows marked bad (not on the start-up check's dummy reply)
FLAKY = '''
from gridrl.trainer.rewards import DUMMY_COMPLETION

def flaky(prompts, completions, bad, **kwargs):
    if any(b and c != DUMMY_COMPLETION for b, c in zip(bad, completions)):
        raise ValueError("cannot score this row")
    return [0.5 for _ in completions]
'''


def test_a_reward_failing_mid_run_names_itself_and_the_step_and_checkpoints(tiny_llama_dir,
                                                                            tmp_path):
    """Rows marked ``bad`` make the function raise on the model's replies; the eval rows
    (``--eval-file``) are good, so it fails at the first step with a bad row."""
    rows = [{"prompt": w, "bad": i % 3 == 1} for i, w in enumerate(WORD_BANK[:40])]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"prompt": w, "bad": False}) + "\n"
                                                 for w in WORD_BANK[40:44]))
    (tmp_path / "flaky.py").write_text(FLAKY)

    def args(run_dir: Path, *extra: str) -> list[str]:
        return [str(BIN / "gridrl-trainer"), "run", "--model", str(tiny_llama_dir), "--task",
                str(tmp_path / "data.jsonl"), "--eval-file", str(tmp_path / "eval.jsonl"),
                "--reward-file", str(tmp_path / "flaky.py"), "--steps", "8",
                "--prompts-per-step", "2", "--group-size", "2", "--max-tokens", "3",
                "--eval-every", "100", "--checkpoint-every", "100", "--lora-rank", "4",
                "--run-dir", str(run_dir), "--rollout", "local", "--listen", "127.0.0.1:0",
                "--metrics-port", "-1", *extra]

    failed = subprocess.run(args(tmp_path / "fail"), capture_output=True, text=True,
                            timeout=300, env=ENV)
    assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "fail" / "log.jsonl").read_text().splitlines() if '"step"' in line]
    bad_step = len(steps) + 1
    line = next(ln for ln in failed.stderr.splitlines() if "run failed: " in ln)
    assert (f"reward function flaky (flaky.py) at step {bad_step}: raised ValueError: cannot "
            "score this row") in line
    assert "Traceback" not in failed.stderr + failed.stdout
    if steps:  # the finished steps were checkpointed
        latest = (tmp_path / "fail" / "checkpoints" / "latest").read_text()
        assert latest == f"step-{steps[-1]:06d}"

    dropped = subprocess.run(args(tmp_path / "drop", "--on-reward-error", "drop"),
                             capture_output=True, text=True, timeout=300, env=ENV)
    assert dropped.returncode == 0, dropped.stdout[-2000:] + dropped.stderr[-2000:]
    records = [json.loads(line) for line in
               (tmp_path / "drop" / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step")]
    assert len(steps) == 8 and sum(r["reward_error_groups"] for r in steps) > 0
    for r in steps:  # each sample trained on or in a group left out; local samples are of
        # the weights being trained, so never stale, even after a step that made no update
        assert r["dropped_samples"] == 0, r
        assert r["samples_used"] + 2 * r["reward_error_groups"] == 4, r
    summary = json.loads((tmp_path / "drop" / "summary.json").read_text())
    assert summary["reward_error_groups"] == sum(r["reward_error_groups"] for r in steps)
    assert "reward function flaky (flaky.py) at step" in dropped.stderr + dropped.stdout
