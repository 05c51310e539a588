"""Adapter directories <-> in-memory file mappings, with atomic writes and safe paths."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from gridrl.adapters.errors import AdapterError


def check_relpath(path: str) -> str:
    """Validate an adapter file path: relative, '/'-separated, no '..', '.' or empty parts.

    Returns the path. Paths come off the wire, so this guards every write.

    Raises:
        AdapterError: naming the path.
    """
    parts = path.split("/")
    if (not path or path.startswith("/") or "\\" in path or "\0" in path
            or any(p in ("", ".", "..") for p in parts)):
        raise AdapterError(f"adapter file path {path!r} must be relative, '/'-separated, "
                           "without '..', '.' or empty parts")
    return path


def read_dir(path: Path | str) -> dict[str, bytes]:
    """Every regular file under ``path`` (recursively; names starting with '.' skipped), as
    '/'-separated relative path -> bytes, sorted by path.

    Raises:
        AdapterError: ``path`` is not a directory.
    """
    root = Path(path)
    if not root.is_dir():
        raise AdapterError(f"{root}: not a directory")
    files: dict[str, bytes] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        files[rel.as_posix()] = p.read_bytes()
    return dict(sorted(files.items()))


def write_dir(files: Mapping[str, bytes | Iterable[bytes]], path: Path | str) -> Path:
    """Write ``files`` (relative path -> bytes) as the directory ``path``, atomically.

    A value may also be an iterable of byte chunks (bytes or memoryviews), written one after
    the other: a large file is then produced while it is written, never held whole in memory.
    An exception raised by the iterable aborts the write like any other (nothing is left).

    The files go into a temporary sibling directory (fsynced), which is renamed to ``path``;
    an existing ``path`` is first renamed aside and removed after, so ``path`` is never
    half-written (between the two renames it briefly does not exist). Returns ``path``.

    Raises:
        AdapterError: a path is unsafe (see :func:`check_relpath`).
        OSError: the filesystem refused.
    """
    for name in files:
        check_relpath(name)
    dst = Path(path)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would outlive the rename
    old: Path | None = None
    try:
        for name, data in files.items():
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                if isinstance(data, bytes | bytearray | memoryview):
                    f.write(data)
                else:
                    for chunk in data:
                        f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
        if dst.exists() or dst.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / "d")
        try:
            os.replace(tmp, dst)
        except BaseException:
            if old is not None:
                os.replace(old / "d", dst)  # put the previous adapter back
            raise
        fsync_dir(dst.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return dst


def _umask() -> int:
    """The process umask (read from /proc where it can be, else set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives a crash (best effort: no-op where
    directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
