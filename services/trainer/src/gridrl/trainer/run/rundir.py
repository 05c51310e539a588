"""The run directory: everything a run leaves behind.

    <run_dir>/
        config.json          # the run's settings (no auth token)
        log.jsonl            # one JSON record per finished step (plus the baseline eval)
        versions.jsonl       # every policy version the run minted: {"version", "step"}
        checkpoints/         # see checkpoint.py
        adapter/             # final adapter, peft format
        adapter-mlx/         # the same, converted for mlx-lm
        summary.json         # totals and scores of the run
        plot.png             # reward, eval and staleness against step
        tensorboard/, wandb/ # with --report-to (see trackers.py)

``versions.jsonl`` is append-only and survives resumes, so a resumed run never reuses a version
number a node may already hold from the killed run. ``log.jsonl`` is written by the run's
:class:`LogFile` subscriber (one line per step record and for the baseline eval) and read back
typed by a resumed run (:meth:`RunDir.read_history`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from gridrl.adapters.convert import convert_dir
from gridrl.adapters.io import write_dir
from gridrl.trainer.report.events import BaselineEvaluated, RunEvent
from gridrl.trainer.report.records import BaselineRecord, StepRecord
from gridrl.trainer.run.checkpoint import latest_checkpoint


def earlier_run(run_dir: str | Path) -> str | None:
    """What ``run_dir`` holds of an earlier run, in words (e.g. "checkpoints up to step 13 and
    a log.jsonl"), or None when it holds none: missing, empty, or only the config.json
    of a start that failed before its first record. A new run must not be started there: it
    would mix its log, checkpoints and adapter versions with the earlier run's."""
    path = Path(run_dir)
    held = []
    latest = latest_checkpoint(path / "checkpoints")
    if latest is not None:
        held.append(f"checkpoints up to step {int(latest.name.removeprefix('step-'))}")
    log = path / "log.jsonl"
    if log.is_file() and log.stat().st_size:
        held.append("a log.jsonl")
    held += [name for name in ("adapter", "summary.json") if (path / name).exists()]
    return " and ".join(held) or None


class RunDir:
    """Paths and atomic writers of a run directory (created on construction)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.config = self.path / "config.json"
        self.log = self.path / "log.jsonl"
        self.versions = self.path / "versions.jsonl"
        self.checkpoints = self.path / "checkpoints"
        self.adapter = self.path / "adapter"
        self.adapter_mlx = self.path / "adapter-mlx"
        self.summary = self.path / "summary.json"
        self.plot = self.path / "plot.png"

    # ---------------------------------------------------------------- log.jsonl

    def append_log(self, record: Mapping[str, Any]) -> None:
        """Append one record as a JSON line and fsync (a kill loses at most the line being
        written, which :meth:`read_log` skips)."""
        line = json.dumps(record, sort_keys=True, default=_jsonable) + "\n"
        with open(self.log, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def read_log(self) -> list[dict[str, Any]]:
        """Every complete record of ``log.jsonl`` (a torn last line is skipped)."""
        return list(_read_jsonl(self.log))

    def read_history(self) -> tuple[BaselineRecord | None, list[StepRecord]]:
        """``log.jsonl`` read back typed: the baseline eval's record (None when absent) and the
        step records in order (a resumed run's earlier steps)."""
        baseline, steps = None, []
        for record in self.read_log():
            if record.get("step"):
                steps.append(StepRecord.from_json(record))
            elif record.get("event") == "baseline":
                baseline = BaselineRecord.from_json(record)
        return baseline, steps

    def truncate_log(self, last_step: int) -> int:
        """Keep only records of steps <= ``last_step`` (records without a step, such as the
        baseline, stay): a resumed run re-does the later steps. Returns records removed."""
        records = self.read_log()
        kept = [r for r in records if int(r.get("step", 0)) <= last_step]
        tmp = self.log.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        tmp.replace(self.log)
        return len(records) - len(kept)

    # ---------------------------------------------------------------- versions.jsonl

    def record_version(self, version: int, step: int) -> None:
        """Note that ``version`` holds the weights after ``step`` (before it is used)."""
        with open(self.versions, "a") as f:
            f.write(json.dumps({"version": version, "step": step}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def max_version(self) -> int:
        """The highest version ever minted in this run directory (0 when none)."""
        return max((int(r["version"]) for r in _read_jsonl(self.versions)), default=0)

    # ---------------------------------------------------------------- summary, adapter

    def write_json(self, path: Path, obj: Any) -> None:
        """Write ``obj`` as indented JSON atomically."""
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_jsonable) + "\n")
        tmp.replace(path)

    def write_final_adapter(self, files: Mapping[str, bytes], num_layers: int) -> Path | None:
        """Write the final adapter in peft format to ``adapter/`` and its mlx-lm conversion to
        ``adapter-mlx/`` (``gridrl.adapters.convert_dir``). Returns the mlx directory, or None
        when the conversion is not possible (the reason is raised for the caller to log)."""
        write_dir(files, self.adapter)
        convert_dir(self.adapter, self.adapter_mlx, to="mlx", num_layers=num_layers)
        return self.adapter_mlx


class LogFile:
    """The run's reporter subscriber that writes ``log.jsonl``: each step's record, and the
    baseline eval's (subscribe it as essential: a run that cannot write its log stops)."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir

    def on_step(self, record: StepRecord) -> None:
        self.run_dir.append_log(record.to_json())

    def on_event(self, event: RunEvent) -> None:
        if isinstance(event, BaselineEvaluated):
            self.run_dir.append_log(event.record.to_json())

    def close(self) -> None:
        pass


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError:  # torn by a kill mid-write
            continue


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, set | tuple):
        return list(obj)
    return str(obj)
