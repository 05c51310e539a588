"""``bench/env_learning.py`` end to end on a smoke setting (the tiny llama, 1 step, 2 held-out
items): both tasks run through ``gridrl-trainer run``, the table and the JSON record have the
figures docs/benchmarks.md's section 14 names, and that section names the full command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
FULL = ".venv/bin/python bench/env_learning.py --seeds 0 1 --steps 60 --record " \
       "docs/env_learning.json"


def test_benchmarks_md_names_the_full_command() -> None:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert f"`{FULL}`" in text
    section = text.split("## 14. Environments", 1)[1].split("\n## ", 1)[0]
    # the section's table is the recorded run's: every seed's success at the start and the end
    record = json.loads((REPO / "docs" / "env_learning.json").read_text())
    assert record["argv"] == FULL.split()[2:]
    for task, figures in record["tasks"].items():
        for run in figures["runs"]:
            first, last = run["evals"][0]["success"], run["evals"][-1]["success"]
            row = f"| {task} | {run['seed']} | {first:.3f} | {last:.3f} |"
            assert row in section, row


@pytest.mark.slow
def test_env_learning_bench_runs_end_to_end(tiny_llama_dir: Path, tmp_path: Path) -> None:
    record = tmp_path / "env_learning.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "env_learning.py"), "--seeds", "0", "--steps",
         "1", "--eval-every", "1", "--eval-tasks", "2", "--model", str(tiny_llama_dir),
         "--threads", "1", "--record", str(record), "--", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    from _common import cpu_flags  # bench/_common.py: the machine line names the CPU flags

    first = done.stdout.splitlines()[0]
    assert first.startswith("machine: ") and f"({cpu_flags()})" in first, first
    assert "| seed | success @0 | success @1 |" in done.stdout
    figures = json.loads(record.read_text())
    assert set(figures["tasks"]) == {"reverse-words-retry", "reasoning-gym:chain_sum"}
    retry = figures["tasks"]["reverse-words-retry"]
    assert retry["goal"] == 0.25 and figures["tasks"]["reasoning-gym:chain_sum"][
        "goal"] == 0.15
    (run,) = retry["runs"]
    assert [e["step"] for e in run["evals"]] == [0, 1] and run["turns_mean"] == 2.0
    assert {"first_attempt_success", "second_attempt_success"} <= set(run["evals"][-1])
