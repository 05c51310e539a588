"""Adapters on a node's disk, under its ``--adapter-root``.

Layout::

    <root>/pushed/<name>/v<version>/    a pushed adapter, in the node's own format, plus
        .gridrl-adapter.json            {name, version, format, pushed_format, converted, manifest}
    <root>/pushed/.staging-*/           a push being applied (removed on failure and at start)
    <root>/pushed/.deleting-*/          an old version being pruned (--keep-adapters)
    <root>/<anything else>/             adapters placed by an operator (ReloadAdapter path)

A push is written into a staging directory and renamed into place only once it is verified,
converted and loaded, so ``pushed/`` never holds a half-written adapter. Paths given by clients
are resolved inside the root (symlinks followed) and refused when they leave it.

Pushes are not fsynced: the write and the rename reach the page cache, which survives a crash of
the node process, and the adapter sync stays off the disk's latency (an fsync of a 20 MB
adapter costs ~45 ms, more than the rest of the node's part of a push). A power loss or kernel
crash can lose the newest pushes; the node serves the base model after any restart and the
trainer, which owns the adapter, pushes it again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gridrl.common.errors import invalid_argument, not_found

log = logging.getLogger(__name__)

META = ".gridrl-adapter.json"
PUSHED = "pushed"
STAGING_PREFIX = ".staging-"


@dataclass(frozen=True)
class StoredAdapter:
    """An adapter directory on the node.

    Attributes:
        name: adapter name ("" when unknown).
        version: policy version (0 when unknown).
        path: its directory.
        meta: the contents of its ``.gridrl-adapter.json`` ({} when absent).
    """

    name: str
    version: int
    path: Path
    meta: dict[str, Any]

    @property
    def file_digests(self) -> dict[str, str]:
        """path -> sha256 of the files as they were pushed (from the stored manifest)."""
        files = self.meta.get("manifest", {}).get("files", [])
        return {f["path"]: f["sha256"] for f in files}


class AdapterStore:
    """The adapter directories under ``root`` (created if missing).

    Raises:
        OSError: ``root`` cannot be created.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().resolve()
        self.pushed_root = self.root / PUSHED
        self.pushed_root.mkdir(parents=True, exist_ok=True)
        for prefix in (STAGING_PREFIX, ".deleting-"):
            for leftover in self.pushed_root.glob(f"{prefix}*"):
                log.warning("removing %s, left by an interrupted push or prune", leftover)
                shutil.rmtree(leftover, ignore_errors=True)

    # -- pushes ------------------------------------------------------------------------------

    def stage(self, files: Mapping[str, bytes], meta: Mapping[str, Any]) -> Path:
        """Write ``files`` (relative path -> bytes, paths already checked) and the metadata into
        a fresh staging directory (not fsynced, see the module docstring). Returns it.

        Raises:
            OSError: the disk refused (the staging directory is removed).
        """
        staged = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.pushed_root))
        try:
            for rel, data in {**files, META: json.dumps(dict(meta), indent=2).encode()}.items():
                target = staged / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        return staged

    def commit(self, staged: Path, name: str, version: int) -> StoredAdapter:
        """Rename a staging directory to ``pushed/<name>/v<version>``.

        Raises:
            FileExistsError: that version is already stored.
            OSError: the rename failed (the staging directory is left for the caller).
        """
        final = self.pushed_dir(name, version)
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            raise FileExistsError(f"{final} already exists")
        os.rename(staged, final)
        return self.describe(final)

    @staticmethod
    def discard(staged: Path) -> None:
        """Remove a staging directory (after a failed push)."""
        shutil.rmtree(staged, ignore_errors=True)

    def pushed_dir(self, name: str, version: int) -> Path:
        """Where ``name`` version ``version`` is (or would be) stored."""
        return self.pushed_root / name / f"v{version}"

    def get(self, name: str, version: int) -> StoredAdapter | None:
        """The stored push ``name`` / ``version``, or None."""
        path = self.pushed_dir(name, version)
        return self.describe(path) if path.is_dir() else None

    def pushed(self) -> list[StoredAdapter]:
        """Every stored push, ordered by name then version."""
        out = []
        for name_dir in sorted(p for p in self.pushed_root.iterdir()
                               if p.is_dir() and not p.name.startswith(".")):
            for vdir in name_dir.iterdir():
                if vdir.is_dir() and vdir.name[:1] == "v" and vdir.name[1:].isdigit():
                    out.append(self.describe(vdir))
        return sorted(out, key=lambda s: (s.name, s.version))

    def by_version(self, version: int, prefer_name: str = "") -> StoredAdapter:
        """The stored push with ``version``: of ``prefer_name`` when it has one, else the only
        name that does.

        Raises:
            StatusError: NOT_FOUND when no push has that version; INVALID_ARGUMENT
                (``version``) when several names do and none is ``prefer_name``.
        """
        matches = [s for s in self.pushed() if s.version == version]
        for s in matches:
            if s.name == prefer_name:
                return s
        if not matches:
            raise not_found(f"version: no stored adapter has version {version} (see "
                            "GetNodeInfo stored_adapters)")
        if len(matches) > 1:
            raise invalid_argument("version", f"version {version} is stored under several "
                                              f"names ({', '.join(s.name for s in matches)})")
        return matches[0]

    def prune(self, name: str, keep: int, protect: tuple[str, int] | None = None) -> list[int]:
        """Delete all but the newest ``keep`` stored versions of ``name`` (``keep`` 0: keep
        all), never ``protect`` (the serving one). A version is renamed to a hidden directory
        before it is deleted, so it is never seen half-deleted. Returns the versions deleted."""
        doomed = doomed_versions(self.pushed(), name, keep, protect)
        for stored in doomed:
            self._delete(stored.path)
        return [s.version for s in doomed]

    def prune_names(self, current: str, keep_names: int,
                    protect: tuple[str, int] | None = None) -> list[str]:
        """Bound the store across runs: every name but ``current`` keeps only its newest
        version, and only the ``keep_names`` names pushed to most recently (``current``
        included) are kept at all (``keep_names`` 0: every name, each still trimmed to its
        newest version). ``protect`` (the serving one) is never deleted. Returns the deleted
        entries as ``"name/vN"``."""
        doomed = doomed_names(self.pushed(), current, keep_names, protect)
        for stored in doomed:
            self._delete(stored.path)
        return [f"{s.name}/v{s.version}" for s in doomed]

    def after_push(self, name: str, version: int, keep: int, keep_names: int
                   ) -> list[tuple[str, int]]:
        """What :meth:`pushed` will list once push ``name`` v``version`` (serving) is committed
        and pruned with ``keep`` / ``keep_names``: (name, version) pairs, ordered. Reads the
        store, changes nothing."""
        listing = [s for s in self.pushed() if (s.name, s.version) != (name, version)]
        listing.append(StoredAdapter(name, version, self.pushed_dir(name, version), {}))
        doomed = doomed_versions(listing, name, keep, (name, version))
        listing = [s for s in listing if s not in doomed]
        doomed = doomed_names(listing, name, keep_names, (name, version))
        return sorted((s.name, s.version) for s in listing if s not in doomed)

    def _delete(self, path: Path) -> None:
        """Remove a stored directory, renamed to a hidden one first so it is never seen
        half-deleted."""
        doomed = Path(tempfile.mkdtemp(prefix=".deleting-", dir=self.pushed_root))
        os.rename(path, doomed / "d")
        shutil.rmtree(doomed, ignore_errors=True)

    # -- operator directories ----------------------------------------------------------------

    def resolve(self, rel: str) -> Path:
        """The directory ``rel`` (relative to the root), symlinks followed.

        Nothing outside the root is ever read: the directory, and every file or directory in
        it, must resolve (``..`` and symlinks followed) to a path inside the root.

        Raises:
            StatusError: INVALID_ARGUMENT (``path``) when empty, absolute, leaving the root, or
                holding a symlink that leads out of it; NOT_FOUND when it is not a directory.
        """
        if not rel:
            raise invalid_argument("path", "is empty")
        if os.path.isabs(rel) or "\0" in rel:
            raise invalid_argument("path", f"{rel!r} must be relative to the adapter root")
        path = (self.root / rel).resolve()
        if not self._inside(path):
            raise invalid_argument("path", f"{rel!r} leaves the adapter root")
        if path.name.startswith(STAGING_PREFIX) or not path.is_dir():
            raise not_found(f"path: {rel!r} is not an adapter directory under the adapter root")
        for entry in path.rglob("*"):
            if not self._inside(entry.resolve()):
                raise invalid_argument("path", f"{rel!r}: {entry.relative_to(path)} is a link "
                                               "leading out of the adapter root")
        return path

    def _inside(self, resolved: Path) -> bool:
        return resolved == self.root or self.root in resolved.parents

    def describe(self, path: Path) -> StoredAdapter:
        """Read a directory's name and version from its metadata; without metadata the name is
        its path relative to the root and the version 0."""
        meta: dict[str, Any] = {}
        try:
            meta = json.loads((path / META).read_text())
        except (OSError, ValueError):
            meta = {}
        if not isinstance(meta, dict):
            meta = {}
        name = str(meta.get("name") or path.relative_to(self.root).as_posix())
        try:
            version = int(meta.get("version", 0))
        except (TypeError, ValueError):
            version = 0
        return StoredAdapter(name=name, version=version, path=path, meta=meta)


def doomed_versions(listing: list[StoredAdapter], name: str, keep: int,
                    protect: tuple[str, int] | None) -> list[StoredAdapter]:
    """Of ``listing``, the versions of ``name`` beyond its newest ``keep`` (``keep`` 0: none),
    ``protect`` excepted (:meth:`AdapterStore.prune`)."""
    if keep < 1:
        return []
    versions = sorted((s for s in listing if s.name == name), key=lambda s: s.version,
                      reverse=True)
    return [s for s in versions[keep:] if protect != (name, s.version)]


def doomed_names(listing: list[StoredAdapter], current: str, keep_names: int,
                 protect: tuple[str, int] | None) -> list[StoredAdapter]:
    """Of ``listing``, what :meth:`AdapterStore.prune_names` deletes: every name but
    ``current`` trimmed to its newest version, names beyond the ``keep_names`` most recently
    pushed dropped (by directory mtime), ``protect`` excepted."""
    by_name: dict[str, list[StoredAdapter]] = {}
    for stored in listing:
        by_name.setdefault(stored.name, []).append(stored)
    others = sorted((n for n in by_name if n != current),
                    key=lambda n: max(s.path.stat().st_mtime for s in by_name[n]),
                    reverse=True)
    keep_whole = others if keep_names < 1 else others[:max(0, keep_names - 1)]
    doomed = []
    for name in others:
        versions = sorted(by_name[name], key=lambda s: s.version, reverse=True)
        doomed += [s for s in (versions[1:] if name in keep_whole else versions)
                   if protect != (name, s.version)]
    return doomed
