"""A node's resident memory: helpers that keep it at one copy of each weight.

transformers maps safetensors checkpoints into memory (``mmap``, private and read-only in
practice): a weight costs resident memory once its pages are read, and those pages stay
resident as long as the mapping lives -- until the last tensor viewing the file is freed. The
lean forward reads every projection weight once, to pack it, and never again:
:func:`drop_mapped_pages` hands those pages back right after (``madvise(MADV_DONTNEED)``; the
file is untouched and would be read again on a later access), so loading never holds the
checkpoint and the packed weights in full at once. :func:`trim_heap` returns the load's freed
temporaries to the operating system. Both are best-effort and do nothing outside Linux/glibc.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's memory mappings backed by a regular file."""
    out = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end))
    return out


def drop_mapped_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Give back the resident pages of CPU tensors that view a memory-mapped file, for
    tensors the process will not read again (their data stays valid: a later read maps the
    file's pages in again). Only whole pages inside each tensor are dropped, so neighbouring
    tensors keep theirs; tensors in ordinary memory are left alone.

    Returns:
        bytes advised away (0 where not supported).
    """
    libc = _libc()
    tensors = [t for t in tensors if t.device.type == "cpu" and t.numel()]
    if libc is None or not tensors:
        return 0
    mappings = _file_mappings()
    dropped = 0
    for t in tensors:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if not any(lo <= start and end <= hi for lo, hi in mappings):
            continue
        first = -(-start // _PAGE) * _PAGE
        last = end // _PAGE * _PAGE
        if last > first and libc.madvise(first, last - first, _MADV_DONTNEED) == 0:
            dropped += last - first
    return dropped


def trim_heap() -> None:
    """Return the C heap's free memory to the operating system (glibc ``malloc_trim``): the
    temporaries of loading and packing a model, freed but kept by the allocator."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
