"""``gridrl-trainer sweep`` end to end (issue 46 item 2): two real ``gridrl-trainer run``
processes that differ in ``--lr``, at once, sampling from one local rollout node the sweep
starts itself (``gridrl-rollout serve`` on the tiny llama), two steps each; the closing table
has each run's row with its swept value, steps, exit status 0 and directory."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from trainer_runs import BIN, ONE_THREAD, records, write_task_files

pytestmark = pytest.mark.slow


def test_sweep_runs_two_variants_on_one_node_and_prints_the_table(tiny_llama_dir: Path,
                                                                    tmp_path: Path) -> None:
    data, reward = write_task_files(tmp_path)
    argv = [str(BIN / "gridrl-trainer"), "sweep", "--sweep-name", "e2e",
            "--model", str(tiny_llama_dir), "--task", str(data), "--reward-file", str(reward),
            "--lr", "1e-2,2e-2", "--steps", "2", "--prompts-per-step", "2", "--group-size", "4",
            "--max-tokens", "6", "--lora-rank", "4", "--lora-alpha", "8", "--eval-every", "2",
            "--eval-tasks", "4", "--checkpoint-every", "2"]
    done = subprocess.run(argv, cwd=tmp_path, env={**os.environ, **ONE_THREAD},
                          capture_output=True, text=True, timeout=900)
    out = done.stdout
    assert done.returncode == 0, f"{out}\n{done.stderr[-4000:]}"
    assert "started a local rollout node" in out  # neither --master nor --rollout: its own
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["lr", "final"])
    rows = {line.split()[0]: line for line in lines[head + 1:head + 3]}
    assert set(rows) == {"1e-2", "2e-2"}
    assert lines[head + 3].startswith("2 runs at once on one fleet, wall time ")
    nodes = set()
    for lr, line in rows.items():
        run_dir = f"runs/e2e/e2e-lr{lr}"
        cells = line.split()
        # lr, final eval, exact, steps, time, exit, run dir
        assert cells[3] == "2" and cells[5] == "0" and cells[6] == run_dir, line
        float(cells[1])  # a final eval was read from the run's log
        logged = records(tmp_path / run_dir)
        assert max(r.get("step", 0) for r in logged) == 2
        config = json.loads((tmp_path / run_dir / "config.json").read_text())
        assert float(config["lr"]) == float(lr)  # the swept value reached the run
        assert (tmp_path / run_dir / "adapter").is_dir()
        nodes |= {node for r in logged for node in r.get("nodes", {})}
    assert len(nodes) == 1  # both sampled from the one node the sweep started
