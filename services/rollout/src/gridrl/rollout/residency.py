"""Which adapters a rollout node keeps loaded: one per name (a run's newest version), at most
``max_resident`` names and ``max_bytes`` bytes in all, the least recently used unloaded first
(issue 46: several runs' adapters decoded in one batch). Pure bookkeeping: the scheduler
(:mod:`gridrl.rollout.scheduler`) calls it under its lock and unloads the handles it gives
back once no batch uses them."""

from __future__ import annotations

import collections
import logging
from typing import Any

from gridrl.common.errors import Kind, StatusError, resource_exhausted
from gridrl.rollout.jobs import ServingAdapter

log = logging.getLogger(__name__)


class ResidentAdapters:
    """The adapters loaded, by name, least recently used first.

    Args:
        max_resident: names held at once (>= 1).
        max_bytes: bytes they may take in all, by their ``ServingAdapter.nbytes`` (0: not
            limited).
    Raises:
        ValueError: ``max_resident`` < 1 or ``max_bytes`` < 0.
    """

    def __init__(self, max_resident: int, max_bytes: int = 0) -> None:
        if max_resident < 1 or max_bytes < 0:
            raise ValueError(f"max_resident ({max_resident}) must be >= 1 and max_bytes "
                             f"({max_bytes}) >= 0")
        self.max_resident = max_resident
        self.max_bytes = max_bytes
        self._by_name: collections.OrderedDict[str, ServingAdapter] = collections.OrderedDict()

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def listing(self) -> list[ServingAdapter]:
        """The adapters loaded, least recently used first."""
        return list(self._by_name.values())

    def use(self, name: str) -> ServingAdapter | None:
        """The adapter loaded under ``name`` (None: none), marked most recently used."""
        found = self._by_name.get(name)
        if found is not None:
            self._by_name.move_to_end(name)
        return found

    def put(self, adapter: ServingAdapter, protect: str = "") -> list[Any]:
        """Hold ``adapter`` under its name (most recently used), replacing that name's older
        version, then drop the least recently used names (never ``adapter``'s, never
        ``protect``) past the bounds. Returns the handles no longer held (to unload)."""
        gone: list[Any] = []
        old = self._by_name.pop(adapter.name, None)
        self._by_name[adapter.name] = adapter
        if old is not None and old.handle is not adapter.handle:
            gone.append(old.handle)
        for name in list(self._by_name):
            if not self._over():
                break
            if name in (adapter.name, protect):
                continue
            evicted = self._by_name.pop(name)
            log.info("adapter %s v%d unloaded: least recently used (--max-resident-adapters "
                     "%d, --adapter-memory-mb %g)", name, evicted.version, self.max_resident,
                     self.max_bytes / 1e6)
            gone.append(evicted.handle)
        return gone

    def _over(self) -> bool:
        used = sum(a.nbytes for a in self._by_name.values())
        return len(self._by_name) > self.max_resident or bool(self.max_bytes
                                                               and used > self.max_bytes)

    def check_fits(self, name: str, nbytes: int) -> None:
        """Refuse an adapter that cannot be held here even alone.

        Raises:
            StatusError: RESOURCE_EXHAUSTED naming the limit when ``nbytes`` exceeds
                ``max_bytes``.
        """
        if self.max_bytes and nbytes > self.max_bytes:
            raise resource_exhausted(
                f"adapter {name!r}: {nbytes / 1e6:.1f} MB does not fit the node's adapter "
                f"memory (--adapter-memory-mb {self.max_bytes / 1e6:g})")

    def not_resident(self, name: str) -> StatusError:
        """The NOT_FOUND error of a request naming an adapter that is not loaded."""
        held = ", ".join(self._by_name) or "none"
        return StatusError(Kind.NOT_FOUND, f"adapter: {name!r} is not loaded on this node "
                           f"(resident: {held}; --max-resident-adapters "
                           f"{self.max_resident}); push it, or ReloadAdapter it, first")
