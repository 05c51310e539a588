"""How many KV-cache tokens a node holds at once, from the memory it may use.

A decode batch of ``rows`` sequences preallocates, per row, keys and values for the batch's
longest prompt plus its largest ``max_tokens`` (the torch backend's slab cache; other in-process
backends grow to the same), and a few vocabulary-sized buffers a step to sample with. So a
batch costs

    rows x (longest prompt + largest max_tokens + overhead) KV-cache tokens

with ``overhead = ceil(sequence_bytes / kv_bytes_per_token)`` (the backend's own estimates,
:attr:`gridrl.engine.contract.Backend.kv_bytes_per_token` and ``sequence_bytes``). The node
may use ``--kv-memory-mb`` for this (default: half the memory available once the model is
loaded, the rest left to the machine's other work and the allocator's slack), so it holds
``budget // kv_bytes_per_token`` tokens. The engine batches within that, refuses a request one
of whose sequences alone cannot fit (RESOURCE_EXHAUSTED, naming the limit: a node OOM-killed
in the middle of a batch loses every request in it), and the node advertises it
(``NodeInfo.kv_cache_tokens``) so the trainer sizes what it sends (its scheduler's slots).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from gridrl.common.errors import resource_exhausted

#: --kv-memory-mb 0 takes this fraction of the memory available when the node has loaded
DEFAULT_FRACTION = 0.5


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo"),
                           cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Memory this process could still take without swapping or being killed: the kernel's
    ``MemAvailable``, or what its cgroup (v2) allows beyond its current use when that is
    less. None where neither can be read (not Linux)."""
    found: list[int] = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text().strip())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


@dataclass(frozen=True)
class KvBudget:
    """A node's KV-cache capacity.

    Attributes:
        tokens: KV-cache tokens it holds at once (0: not limited).
        overhead_tokens: each sequence's working memory besides its keys and values, in
            tokens.
        limit: what set it, for messages (``"--kv-memory-mb 512"``).
    """

    tokens: int = 0
    overhead_tokens: int = 0
    limit: str = ""

    @classmethod
    def for_backend(cls, kv_bytes_per_token: int, sequence_bytes: int, memory_mb: float,
                    available: int | None = None) -> KvBudget:
        """The budget of a backend that reports its per-token and per-sequence bytes.

        Args:
            kv_bytes_per_token, sequence_bytes: the backend's estimates (0: it manages its own
                memory or cannot say: not limited).
            memory_mb: MB (10^6 bytes) the node may use for decoding; 0: DEFAULT_FRACTION of
                ``available``.
            available: bytes available now (default :func:`available_memory_bytes`).
        """
        if kv_bytes_per_token <= 0:
            return cls()
        overhead = math.ceil(sequence_bytes / kv_bytes_per_token)
        if memory_mb > 0:
            nbytes, limit = int(memory_mb * 1e6), f"--kv-memory-mb {memory_mb:g}"
        else:
            free = available_memory_bytes() if available is None else available
            if free is None:
                return cls(overhead_tokens=overhead)
            nbytes = int(free * DEFAULT_FRACTION)
            limit = (f"half of the {free / 1e6:.0f} MB available when the node started; "
                     "--kv-memory-mb sets it")
        return cls(nbytes // kv_bytes_per_token, overhead, limit)

    def batch_tokens(self, rows: int, longest_prompt: int, largest_max_tokens: int) -> int:
        """KV-cache tokens a batch of ``rows`` sequences takes."""
        return rows * (longest_prompt + largest_max_tokens + self.overhead_tokens)

    def rows_that_fit(self, longest_prompt: int, largest_max_tokens: int) -> int:
        """Most sequences of this shape one batch holds (a large number when not limited)."""
        if not self.tokens:
            return 1 << 30
        return self.tokens // (longest_prompt + largest_max_tokens + self.overhead_tokens)

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request one of whose sequences alone does not fit.

        Raises:
            StatusError: RESOURCE_EXHAUSTED naming the tokens needed and the limit.
        """
        if self.rows_that_fit(prompt_tokens, max_tokens) >= 1:
            return
        need = self.batch_tokens(1, prompt_tokens, max_tokens)
        raise resource_exhausted(
            f"one sequence needs {need} KV-cache tokens ({prompt_tokens} prompt + max_tokens "
            f"{max_tokens} + {self.overhead_tokens} for its sampling buffers); this node holds "
            f"{self.tokens} ({self.limit}): shorten the request or use a node with more memory")

