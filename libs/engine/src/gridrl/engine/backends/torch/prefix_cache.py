"""Keys and values of sampled sequences kept for their continuation (a multi-turn episode's
next turn), keyed by token ids and the adapter that computed them.

Turn ``k`` of an episode is a request whose prompt is turn ``k - 1``'s prompt, its sampled
tokens and the environment's tokens. A request that asks for it (``SequenceRequest.keep_cache``)
leaves, per sample, the keys and values of everything the decode fed through the model (the
prompt and every sampled token but the last, which was drawn and never fed); the next request
whose prompt starts with those ids prefills only the rest (the last sampled token and the
environment's tokens), attending to the kept ones. Entries computed under one adapter are never
used under another (a push changes the key), and the cache holds at most ``max_bytes``,
evicting the least recently used entry first (an entry larger than the whole budget is not
kept).

Reused keys and values were computed in decode steps, a fresh prefill computes them in one
pass: the same function up to float rounding, as with any KV cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: per layer (keys, values), each (1, H, L, D)
Prefill = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PrefixCacheStats:
    """Counters since start: lookups that found a prefix (``hits``) or none (``misses``),
    prompt tokens not prefilled thanks to a hit (``reused_tokens``), entries stored and
    evicted, and the bytes held now."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    stored: int = 0
    evicted: int = 0
    bytes: int = 0


def prefill_bytes(kv: Prefill) -> int:
    """Bytes of the tensors of one entry."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


class PrefixCache:
    """An LRU map ``(adapter key, token ids) -> keys/values`` bounded in bytes.

    Args:
        max_bytes: the most bytes of keys and values held (> 0).

    Thread-safe (a lock around every operation), though a backend calls it from one thread.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], tuple[Prefill, int]] = \
            OrderedDict()
        self._lengths: dict[str, dict[int, int]] = {}  # adapter -> length -> entries
        self._lock = threading.Lock()
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, adapter: str, prompt: Sequence[int]) -> tuple[int, Prefill] | None:
        """The longest kept prefix of ``prompt`` under ``adapter`` that leaves at least one
        token of it to prefill: ``(its length, its keys/values)``; None when there is none."""
        with self._lock:
            lengths = sorted((n for n in self._lengths.get(adapter, {}) if n < len(prompt)),
                             reverse=True)
            for n in lengths:
                key = (adapter, tuple(prompt[:n]))
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    self.stats.hits += 1
                    self.stats.reused_tokens += n
                    return n, entry[0]
            self.stats.misses += 1
            return None

    def store(self, adapter: str, ids: Sequence[int], kv: Prefill) -> None:
        """Keep ``kv`` (the keys/values of ``ids``, ``L = len(ids)`` columns) for ``adapter``,
        evicting least recently used entries to stay within :attr:`max_bytes`."""
        size = prefill_bytes(kv)
        key = (adapter, tuple(ids))
        if size > self.max_bytes or not ids:
            return
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
            while self._entries and self.stats.bytes + size > self.max_bytes:
                self._pop_oldest()
            self._entries[key] = (kv, size)
            counts = self._lengths.setdefault(adapter, {})
            counts[len(ids)] = counts.get(len(ids), 0) + 1
            self.stats.bytes += size
            self.stats.stored += 1

    def _pop_oldest(self) -> None:
        (adapter, ids), (_, size) = self._entries.popitem(last=False)
        self._forget(adapter, len(ids), size)
        self.stats.evicted += 1

    def _forget(self, adapter: str, length: int, size: int) -> None:
        self.stats.bytes -= size
        counts = self._lengths[adapter]
        counts[length] -= 1
        if not counts[length]:
            del counts[length]
        if not counts:
            del self._lengths[adapter]

    def drop_adapter(self, adapter: str) -> None:
        """Forget every entry of ``adapter`` (unloaded, or its weights changed)."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == adapter]:
                _, size = self._entries.pop(key)
                self._forget(adapter, len(key[1]), size)

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._entries.clear()
            self._lengths.clear()
            self.stats.bytes = 0
