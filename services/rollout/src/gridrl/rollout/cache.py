"""The rollout nodes' directories under ``<gridrl cache>/rollout``: which are ephemeral, and
pruning them (``gridrl-rollout cache``).

A node without ``--name`` or ``--adapter-root`` keeps its adapters in
``<gridrl cache>/rollout/<hostname>-<port>/adapters``: a node restarted on the same port finds
them again. A node listening on port 0 (tests, the demo, scripts) gets a new port each start,
so its directory is named ``<hostname>-pid<pid>`` and never reused: such a node removes it when
it stops (:func:`ephemeral_dir`), and ``gridrl-rollout cache --prune`` removes the ones a killed
node left behind.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from gridrl.models import cache_root
from gridrl.rollout.config import default_name

_PID_NAME = re.compile(r"^.+-pid(\d+)$")


def rollout_cache() -> Path:
    """``<gridrl cache>/rollout``: the default home of every node's directory."""
    return cache_root() / "rollout"


def ephemeral_dir(listen: str, name: str | None, adapter_root: str | None) -> Path | None:
    """The directory a node removes when it stops: its default directory when it listens on
    port 0 without ``--name`` or ``--adapter-root`` (named after its pid, never reused);
    None otherwise (a named or fixed-port node keeps its adapters for its next start)."""
    if name or adapter_root or listen.rpartition(":")[2] != "0":
        return None
    return rollout_cache() / default_name(listen)


@dataclass(frozen=True)
class CacheEntry:
    """One node directory under :func:`rollout_cache`.

    Attributes:
        path: the directory.
        size_bytes: bytes of every file under it.
        pid: the process of an ephemeral (port-0) node's directory, else None.
        running: that process is alive (only meaningful with ``pid``).
    """

    path: Path
    size_bytes: int
    pid: int | None
    running: bool

    @property
    def prunable(self) -> bool:
        """An ephemeral node's directory whose process is gone: nothing will use it again."""
        return self.pid is not None and not self.running


def scan(root: Path | None = None) -> list[CacheEntry]:
    """Every node directory under ``root`` (default :func:`rollout_cache`), by name."""
    root = root or rollout_cache()
    if not root.is_dir():
        return []
    entries = []
    for path in sorted(p for p in root.iterdir() if p.is_dir()):
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        m = _PID_NAME.match(path.name)
        pid = int(m.group(1)) if m else None
        entries.append(CacheEntry(path, size, pid, pid is not None and _alive(pid)))
    return entries


def prune(entries: list[CacheEntry]) -> list[CacheEntry]:
    """Remove the prunable directories among ``entries``; returns those removed."""
    removed = []
    for e in entries:
        if e.prunable:
            shutil.rmtree(e.path, ignore_errors=True)
            removed.append(e)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
