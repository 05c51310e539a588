"""The saved checkpoints on the trainer's disk as Tinker's RestClient sees them: training
runs, their checkpoints, time-to-live and deletion.

The files are the ones :class:`~gridrl.trainer.primitives.service.PrimitivesService` writes
(layout in :mod:`gridrl.trainer.primitives.paths`); this module adds two small files::

    <root>/<model dir>/run.json              the training run: model id, base model, LoRA
                                             settings, user metadata, creation time
    <root>/<model dir>/<kind>/<name>/ttl.json  {"expires_at": <unix seconds>} when a TTL is set

A checkpoint is a directory holding ``state.json`` (a training state, Tinker's ``training``
checkpoint), ``snapshot.json`` (sampler weights, ``sampler``) or ``external.json`` (an export,
``external``). One whose TTL has passed is
gone: every lookup treats it as deleted and :meth:`CheckpointStore.sweep` (run by the server
periodically and before every listing) deletes its files. The clock is injected; no threads.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gridrl.common.errors import invalid_argument, not_found
from gridrl.trainer.primitives import paths

RUN_FILE = "run.json"
TTL_FILE = "ttl.json"
META_FILES = {paths.STATE: "state.json", paths.SAMPLER: "snapshot.json",
              paths.EXTERNAL: "external.json"}
# Tinker's checkpoint_type of each kind
TINKER_TYPE = {paths.STATE: "training", paths.SAMPLER: "sampler", paths.EXTERNAL: "external"}


@dataclass(frozen=True)
class Checkpoint:
    """One saved checkpoint.

    Attributes:
        where: its ``tinker://`` path.
        created: unix seconds it was written.
        size_bytes: bytes of its files.
        expires_at: unix seconds it expires (None: never).
        meta: its ``state.json`` / ``snapshot.json`` (base model, LoRA rank, target modules).
    """

    where: paths.WeightsPath
    created: float
    size_bytes: int
    expires_at: float | None
    meta: dict[str, Any]


class CheckpointStore:
    """Runs and checkpoints under ``root``.

    Args:
        root: the primitives' directory (``--api-dir``).
        clock: unix seconds (tests pass a fake one).
    """

    def __init__(self, root: Path, clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self._clock = clock

    # ---------------------------------------------------------------- runs

    def record_run(self, model_id: str, meta: dict[str, Any]) -> None:
        """Write the run file of a new training model (``meta``: base_model, lora_rank,
        train_attn, train_mlp, train_unembed, user_metadata)."""
        directory = self.root / paths.model_dir_name(model_id)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / RUN_FILE).write_text(json.dumps(
            {"model_id": model_id, "created": self._clock(), **meta}, indent=2))

    def run(self, model_id: str) -> dict[str, Any]:
        """The run file of ``model_id``.

        Raises:
            StatusError: NOT_FOUND naming the run.
        """
        file = self.root / paths.model_dir_name(model_id) / RUN_FILE
        if not file.is_file():
            raise not_found(f"training run {model_id!r} is unknown here")
        return json.loads(file.read_text())

    def runs(self) -> list[dict[str, Any]]:
        """Every run file, newest first."""
        found = [json.loads(f.read_text()) for f in self.root.glob(f"*/{RUN_FILE}")]
        return sorted(found, key=lambda r: -float(r.get("created", 0)))

    # ---------------------------------------------------------------- checkpoints

    def checkpoints(self, model_id: str | None = None) -> list[Checkpoint]:
        """Live checkpoints of ``model_id`` (None: of every run), newest first."""
        self.sweep()
        runs = ([paths.model_dir_name(model_id)] if model_id is not None
                else [p.name for p in self.root.iterdir() if p.is_dir()]
                if self.root.is_dir() else [])
        found = []
        for run_dir in runs:
            run_id = self._run_id(self.root / run_dir)
            for kind, meta_name in META_FILES.items():
                for meta_file in (self.root / run_dir / kind).glob(f"*/{meta_name}"):
                    found.append(self._read(paths.WeightsPath(run_id, kind,
                                                              meta_file.parent.name)))
        return sorted(found, key=lambda c: -c.created)

    def get(self, where: paths.WeightsPath) -> Checkpoint:
        """The checkpoint at ``where``.

        Raises:
            StatusError: NOT_FOUND naming the path (never saved, deleted or expired).
        """
        meta_file = where.directory(self.root) / META_FILES[where.kind]
        if not meta_file.is_file():
            raise not_found(f"{where.uri}: no checkpoint there (never saved, deleted or "
                            "expired)")
        checkpoint = self._read(where)
        if checkpoint.expires_at is not None and checkpoint.expires_at <= self._clock():
            self._remove(where)
            raise not_found(f"{where.uri}: the checkpoint expired (its TTL passed)")
        return checkpoint

    def set_ttl(self, where: paths.WeightsPath, ttl_s: float | None) -> None:
        """Expire the checkpoint ``ttl_s`` seconds from now (None: never).

        Raises:
            StatusError: NOT_FOUND naming the path; INVALID_ARGUMENT ``ttl_seconds`` <= 0.
        """
        self.get(where)
        file = where.directory(self.root) / TTL_FILE
        if ttl_s is None:
            file.unlink(missing_ok=True)
            return
        if ttl_s <= 0:
            raise invalid_argument("ttl_seconds", f"must be > 0, got {ttl_s}")
        file.write_text(json.dumps({"expires_at": self._clock() + ttl_s}))

    def delete(self, where: paths.WeightsPath) -> None:
        """Delete the checkpoint's files.

        Raises:
            StatusError: NOT_FOUND naming the path.
        """
        self.get(where)
        self._remove(where)

    def sweep(self) -> list[str]:
        """Delete every checkpoint whose TTL has passed; their paths."""
        now, gone = self._clock(), []
        for ttl_file in self.root.glob(f"*/*/*/{TTL_FILE}"):
            try:
                expires_at = float(json.loads(ttl_file.read_text())["expires_at"])
            except (OSError, ValueError, KeyError):
                continue
            if expires_at <= now:
                directory = ttl_file.parent
                where = paths.WeightsPath(self._run_id(directory.parent.parent),
                                          directory.parent.name, directory.name)
                self._remove(where)
                gone.append(where.uri)
        return gone

    def file_urls(self, where: paths.WeightsPath) -> dict[str, str]:
        """``file://`` URLs of the checkpoint's files, by path relative to it (the files are
        on the trainer's disk: readable where that disk is).

        Raises:
            StatusError: NOT_FOUND naming the path.
        """
        self.get(where)
        directory = where.directory(self.root)
        return {str(p.relative_to(directory)): "file://" + urllib.parse.quote(str(p.resolve()))
                for p in sorted(directory.rglob("*")) if p.is_file() and p.name != TTL_FILE}

    def _read(self, where: paths.WeightsPath) -> Checkpoint:
        directory = where.directory(self.root)
        meta_file = directory / META_FILES[where.kind]
        ttl_file = directory / TTL_FILE
        expires_at = None
        if ttl_file.is_file():
            expires_at = float(json.loads(ttl_file.read_text())["expires_at"])
        size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
        return Checkpoint(where, meta_file.stat().st_mtime, size, expires_at,
                          json.loads(meta_file.read_text()))

    def _remove(self, where: paths.WeightsPath) -> None:
        shutil.rmtree(where.directory(self.root), ignore_errors=True)

    def _run_id(self, run_dir: Path) -> str:
        """The model id of a run directory (its run file's; else the directory's name)."""
        file = run_dir / RUN_FILE
        if file.is_file():
            return str(json.loads(file.read_text())["model_id"])
        return run_dir.name


def parse_checkpoint_id(run_id: str, checkpoint_id: str) -> paths.WeightsPath:
    """The path of Tinker's ``(training_run_id, checkpoint_id)`` (``weights/<name>`` or
    ``sampler_weights/<name>``); INVALID_ARGUMENT naming ``checkpoint_id`` otherwise."""
    return paths.parse(f"{paths.SCHEME}{run_id}/{checkpoint_id}", "checkpoint_id")
