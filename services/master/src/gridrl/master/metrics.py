"""The master's Prometheus metrics (``gridrl_master_*``) on the default registry, served by the
``/metrics`` endpoint of :mod:`gridrl.common.rpc.metrics` next to the shared RPC metrics.

``gridrl_master_nodes{role,backend,status}`` is computed at scrape time from the registries
that are serving in this process (:func:`track`), with a series for every combination so that
a count dropping to zero reads 0 rather than vanishing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric

from gridrl.v1 import common_pb2
from gridrl.v1.enums import enum_word

HEARTBEATS = Counter("gridrl_master_heartbeats_total", "Heartbeats accepted from known nodes.")
REGISTRATIONS = Counter(
    "gridrl_master_registrations_total",
    "Successful RegisterNode calls, by role and whether a record at that address was replaced.",
    ["role", "replaced"])
DEREGISTRATIONS = Counter("gridrl_master_deregistrations_total",
                          "Nodes removed by DeregisterNode (clean shutdowns).")
EXPIRATIONS = Counter("gridrl_master_expirations_total",
                      "Nodes removed because they missed heartbeats for --expire-after seconds.")
UNHEALTHY_TRANSITIONS = Counter(
    "gridrl_master_unhealthy_total",
    "Times a node was marked UNHEALTHY after missing heartbeats for --unhealthy-after seconds.")
WATCHERS = Gauge("gridrl_master_watchers", "Open WatchNodes streams.")


class _Counts(Protocol):
    def counts(self) -> dict[tuple[int, int, int], int]: ...


class _NodesCollector:
    """Collects ``gridrl_master_nodes`` from the tracked registries at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: list[_Counts] = []

    def track(self, source: _Counts) -> None:
        with self._lock:
            self._sources.append(source)

    def untrack(self, source: _Counts) -> None:
        with self._lock:
            self._sources = [s for s in self._sources if s is not source]

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources = list(self._sources)
        totals: dict[tuple[int, int, int], int] = {}
        for source in sources:
            for key, n in source.counts().items():
                totals[key] = totals.get(key, 0) + n
        family = self._family()
        keys = {(role, backend, status)
                for role in common_pb2.NodeRole.values() if role
                for backend in common_pb2.Backend.values()
                for status in common_pb2.NodeStatus.values() if status} | set(totals)
        for role, backend, status in sorted(keys):
            family.add_metric([enum_word(common_pb2.NodeRole, role, None),
                               enum_word(common_pb2.Backend, backend, None),
                               enum_word(common_pb2.NodeStatus, status, None)],
                              totals.get((role, backend, status), 0))
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily("gridrl_master_nodes", "Registered nodes by role, backend and status.",
                                 labels=["role", "backend", "status"])


_NODES = _NodesCollector()
REGISTRY.register(_NODES)


def track(source: _Counts) -> None:
    """Count ``source.counts()`` (a :class:`gridrl.master.registry.Registry`) in
    ``gridrl_master_nodes`` until :func:`untrack`."""
    _NODES.track(source)


def untrack(source: _Counts) -> None:
    """Stop counting ``source``."""
    _NODES.untrack(source)
