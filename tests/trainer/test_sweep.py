"""``gridrl-trainer sweep`` (issue 46 item 2): the expansion of swept flags into runs, the
closing table and the eval read from each run directory -- pure functions, no processes; the
whole command runs in bench/sweep.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gridrl.trainer.cli import main
from gridrl.trainer.config import TrainConfig
from gridrl.trainer.sweep import Outcome, expand, last_eval, numeric_flags, table

NUMERIC = numeric_flags(TrainConfig)


def test_numeric_flags_are_the_sweepable_ones() -> None:
    assert {"--lr", "--seed", "--steps", "--share-weight"} <= NUMERIC
    assert "--model" not in NUMERIC and "--run-name" not in NUMERIC


def test_one_swept_flag_gives_one_run_per_value() -> None:
    variants = expand(["--lr", "1e-4,3e-4,1e-3", "--steps", "5", "--task=reverse-words"],
                      NUMERIC, "s1")
    assert [v.values for v in variants] == [{"--lr": "1e-4"}, {"--lr": "3e-4"},
                                            {"--lr": "1e-3"}]
    assert [v.name for v in variants] == ["s1-lr1e-4", "s1-lr3e-4", "s1-lr1e-3"]
    first = variants[0]
    assert first.argv == ["--lr", "1e-4", "--steps", "5", "--task", "reverse-words",
                          "--run-name", "s1-lr1e-4", "--run-dir", "runs/s1/s1-lr1e-4"]
    assert len({v.run_dir for v in variants}) == 3


def test_several_swept_flags_give_every_combination() -> None:
    variants = expand(["--lr=1e-4,1e-3", "--seed", "0,1", "--model", "a,b"], NUMERIC, "g")
    assert [(v.values["--lr"], v.values["--seed"]) for v in variants] == [
        ("1e-4", "0"), ("1e-4", "1"), ("1e-3", "0"), ("1e-3", "1")]
    assert all(v.argv[4:6] == ["--model", "a,b"] for v in variants)  # not numeric: as given


@pytest.mark.parametrize("args, message", [
    (["--run-name", "x"], "--run-name"), (["--lr", "1e-4,"], "empty value"),
    (["--lr", "1,2", "--lr", "3,4"], "given twice")])
def test_bad_sweeps_are_refused_naming_the_flag(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        expand(args, NUMERIC, "s")


def test_last_eval_and_the_table(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    records = [{"step": 0, "eval_score": 0.1, "eval_exact": 0.0},
               {"step": 5, "reward_mean": 0.3},
               {"step": 10, "eval_score": 0.42, "eval_exact": 0.25}]
    (run_dir / "log.jsonl").write_text("\n".join(json.dumps(r) for r in records)
                                       + '\n{"step": 11, "ev')  # a torn last line
    assert last_eval(run_dir) == (0.42, 0.25, 10)
    assert last_eval(tmp_path / "missing") == (None, None, 0)
    variants = expand(["--lr", "1e-4,1e-3"], NUMERIC, "t", root=str(tmp_path))
    text = table([Outcome(variants[0], 0, 61.2, 0.42, 0.25, 10),
                  Outcome(variants[1], 1, 3.0)], 64.0, "at once on one fleet")
    lines = text.splitlines()
    assert lines[0].split() == ["lr", "final", "eval", "exact", "steps", "time", "exit",
                                "run", "dir"]
    assert lines[1].split()[:6] == ["1e-4", "0.420", "0.25", "10", "61s", "0"]
    assert lines[2].split()[:6] == ["1e-3", "-", "-", "0", "3s", "1"]
    assert variants[0].run_dir in lines[1]
    assert lines[-1] == "2 runs at once on one fleet, wall time 64s"


def test_the_command_refuses_a_run_name() -> None:
    result = CliRunner().invoke(main, ["sweep", "--lr", "1,2", "--run-name", "x"])
    assert result.exit_code == 2 and "--run-name" in result.output
