"""Checkpoints: everything a run needs to continue with no repeated or lost step.

Layout under ``<run_dir>/checkpoints/``::

    step-000010/
        adapter_config.json, adapter_model.safetensors   # the LoRA adapter (peft files)
        optimizer.pt      # AdamW state
        scheduler.pt      # learning-rate schedule state
        rng.pt            # python, numpy, torch (and CUDA) RNG states
        state.json        # step, policy version, version lineage, data position, baseline...
        config.json       # the run's config
    latest                # text: name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, every file fsynced, then renamed
into place (``gridrl.adapters.io.write_dir``), and only then is ``latest`` replaced
(atomically): a kill at any moment leaves the previous checkpoint intact and ``latest``
pointing at a complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

LATEST = "latest"
# Checkpoints load with torch.load(weights_only=True): tensors, containers and numbers only, no
# code from the file runs. numpy's RNG state (a uint32 array) is the one other type a checkpoint
# holds; these are the globals that rebuild a plain uint32 array.
_NUMPY_ARRAY_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
                        np._core.multiarray._reconstruct]


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    Attributes:
        path: its directory.
        state: ``state.json`` (at least ``step``, ``policy_version``, ``data_position``).
        adapter_files: peft files, name -> bytes.
        optimizer: optimizer state dict.
        scheduler: scheduler state dict (or None).
        rng: RNG states (see :func:`rng_state`).
        config: the saved config dict.
    """

    path: Path
    state: dict[str, Any]
    adapter_files: dict[str, bytes]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    rng: dict[str, Any]
    config: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def rng_state() -> dict[str, Any]:
    """Python ``random``, numpy and torch (CPU and every CUDA device) RNG states."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _torch_bytes(obj: Any) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save_checkpoint(root: Path, *, step: int, adapter_files: dict[str, bytes],
                    optimizer: torch.optim.Optimizer, scheduler: Any | None,
                    state: dict[str, Any], config: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically under ``root`` (``<run_dir>/checkpoints``), point
    ``latest`` at it, and delete all but the newest ``keep`` checkpoints.

    Args:
        root: the checkpoints directory (created).
        step: the last finished step.
        adapter_files: peft files in memory.
        state: JSON-able trainer state; ``step`` is added.
        config: the run's config dict.
        keep: checkpoints to keep (>= 1).
    Returns:
        the checkpoint directory.
    """
    from gridrl.adapters.io import write_dir

    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    files = dict(adapter_files)
    files["optimizer.pt"] = _torch_bytes(optimizer.state_dict())
    if scheduler is not None:
        files["scheduler.pt"] = _torch_bytes(scheduler.state_dict())
    files["rng.pt"] = _torch_bytes(rng_state())
    files["state.json"] = json.dumps({**state, "step": step}, indent=2).encode()
    files["config.json"] = json.dumps(config, indent=2, sort_keys=True).encode()
    final = write_dir(files, root / name)  # fsynced temporary directory renamed into place
    _write_atomic(root / LATEST, name.encode())
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The directory ``latest`` names, else the newest complete ``step-*``, else None."""
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if (target / "state.json").is_file():
            return target
    complete = sorted(p for p in root.glob("step-*") if (p / "state.json").is_file())
    return complete[-1] if complete else None


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint directory. The ``.pt`` files load with ``weights_only=True`` (a
    crafted file cannot run code); the adapter is safetensors.

    Raises:
        FileNotFoundError: a file is missing.
        pickle.UnpicklingError: a ``.pt`` file holds anything but tensors, containers, numbers
            and numpy arrays.
    """
    adapter = {p.name: p.read_bytes() for p in path.iterdir()
               if p.name.startswith("adapter_")}
    sched = path / "scheduler.pt"
    with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
        return Checkpoint(
            path=path,
            state=json.loads((path / "state.json").read_text()),
            adapter_files=adapter,
            optimizer=torch.load(path / "optimizer.pt", weights_only=True),
            scheduler=torch.load(sched, weights_only=True) if sched.exists() else None,
            rng=torch.load(path / "rng.pt", weights_only=True),
            config=json.loads((path / "config.json").read_text()),
        )
