"""Checkpoints: everything a run needs to continue with no repeated or lost step.

Layout under ``<run_dir>/checkpoints/``::

    step-000010/
        adapter_config.json, adapter_model.safetensors   # the LoRA adapter (peft files)
        optimizer.pt, scheduler.pt, rng.pt  # the backend's state (these are torch's; see
                                            # TrainerBackend.checkpoint_files)
        state.json        # step, policy version, version lineage, data position, baseline...
        config.json       # the run's config
    latest                # text: name of the newest complete checkpoint

This module is framework-free: the backend turns its optimizer, schedule and random states
into files (:meth:`gridrl.trainer.backends.base.TrainerBackend.checkpoint_files`) and back.

A checkpoint is written into a hidden temporary directory, every file fsynced, then renamed
into place (``gridrl.adapters.io.write_dir``), and only then is ``latest`` replaced
(atomically): a kill at any moment leaves the previous checkpoint intact and ``latest``
pointing at a complete one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gridrl.adapters.io import write_dir
from gridrl.common.faults import pause_point
from gridrl.common.progress import StatusLine
from gridrl.trainer.backends.base import RESERVED_CHECKPOINT_FILES

LATEST = "latest"
STATE = "state.json"
CONFIG = "config.json"


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        path: its directory.
        state: ``state.json`` (at least ``step``, ``policy_version``, ``data_position``).
        files: the backend's files (adapter, optimizer, schedule, RNG), name -> bytes.
        config: the saved config dict.
    """

    path: Path
    state: dict[str, Any]
    files: dict[str, bytes]
    config: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: Path, *, step: int, files: Mapping[str, bytes], state: dict[str, Any],
                    config: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically under ``root`` (``<run_dir>/checkpoints``), point
    ``latest`` at it, and delete all but the newest ``keep`` checkpoints.

    Args:
        root: the checkpoints directory (created).
        step: the last finished step.
        files: the backend's checkpoint files (``TrainerBackend.checkpoint_files()``).
        state: JSON-able trainer state; ``step`` is added.
        config: the run's config dict.
        keep: checkpoints to keep (>= 1).
    Returns:
        the checkpoint directory.
    Raises:
        ValueError: ``files`` uses a name the checkpoint keeps for itself.
    """
    clash = sorted(RESERVED_CHECKPOINT_FILES & set(files))
    if clash:
        raise ValueError(f"files: {', '.join(clash)} is the checkpoint's own file")
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    out = dict(files)
    out[STATE] = json.dumps({**state, "step": step}, indent=2).encode()
    out[CONFIG] = json.dumps(config, indent=2, sort_keys=True).encode()
    with StatusLine(f"writing checkpoint {root / name}"):  # shows only when it is slow
        final = write_dir(out, root / name)  # fsynced temporary directory renamed into place
    pause_point("trainer.checkpoint")  # test-only (gridrl.common.faults): kill here
    _write_atomic(root / LATEST, name.encode())
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The directory ``latest`` names, else the newest complete ``step-*``, else None."""
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if (target / STATE).is_file():
            return target
    complete = sorted(p for p in root.glob("step-*") if (p / STATE).is_file())
    return complete[-1] if complete else None


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint directory.

    Raises:
        FileNotFoundError: ``state.json`` or ``config.json`` is missing.
    """
    files = {p.name: p.read_bytes() for p in sorted(path.iterdir())
             if p.is_file() and not p.name.startswith(".")
             and p.name not in RESERVED_CHECKPOINT_FILES}
    return Checkpoint(path=path, state=json.loads((path / STATE).read_text()), files=files,
                      config=json.loads((path / CONFIG).read_text()))
