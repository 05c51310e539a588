"""The fleet as the dashboard shows it: one row per node and trainer (fleet_rows: the registry's
records joined with the trainers' views of them, nodes that left lately included) and the
dashboard-fleet thread (FleetWatch) that turns the registry's changes into fleet event lines and
remembers the nodes that left or expired."""

from __future__ import annotations

import logging
import threading
import time
from enum import Enum
from typing import Any

from gridrl.master.registry import CHANGED, JOINED, REMOVED, UNHEALTHY, Registry
from gridrl.master.run_model import NodeView, RunSummary
from gridrl.master.run_wire import node_json
from gridrl.master.runs import Runs
from gridrl.master.subscriptions import NodeFilter
from gridrl.v1 import common_pb2, runs_pb2, trainer_pb2
from gridrl.v1.enums import enum_word

log = logging.getLogger(__name__)
#: run states of a trainer that deregistered after ending its run as asked: its row shows the
#: state ("finished", "stopped") instead of "left"
ENDED_CLEANLY = frozenset({trainer_pb2.RUN_STATE_FINISHED, trainer_pb2.RUN_STATE_STOPPED})
GONE_KEPT_S = 600.0  # how long a node that left or expired stays on the page
_TRAINER = enum_word(common_pb2.NodeRole, common_pb2.NODE_ROLE_TRAINER)  # a row's role words
_ROLLOUT = enum_word(common_pb2.NodeRole, common_pb2.NODE_ROLE_ROLLOUT)


class Presence(str, Enum):
    """A row's ``health`` for a node the registry no longer (or never) lists; a listed node's
    is its ``NodeStatus`` word (``healthy``, ``unhealthy``, ``draining``), a trainer's that
    left after ending its run cleanly its run state's (``finished``, ``stopped``)."""

    LEFT = "left"  # deregistered
    EXPIRED = "expired"  # silent past --expire-after
    UNREGISTERED = "unregistered"  # known only from a trainer's view (--rollout)


class KlLevel(str, Enum):
    """A node's mismatch KL against its bound (the fleet table's colour)."""

    FLAGGED = "flagged"  # the trainer flagged the node
    OVER = "over"  # above the bound
    NEAR = "near"  # above half of it
    OK = "ok"
    UNKNOWN = "-"  # not measured, or no bound


def _kl_level(view: NodeView) -> KlLevel:
    """How the node's mismatch KL stands against its bound."""
    if view.flagged:
        return KlLevel.FLAGGED
    kl, bound = view.mismatch_kl, view.mismatch_kl_bound or 0.0
    if kl is None or bound <= 0:
        return KlLevel.UNKNOWN
    return (KlLevel.OVER if kl > bound else KlLevel.NEAR if kl > bound / 2 else KlLevel.OK)


def fleet_rows(records: list[Any], runs: list[RunSummary], gone: dict[str, dict[str, Any]],
               now: float) -> list[dict[str, Any]]:
    """One row per node and trainer: the registry's record (``records``, NodeRecords) joined
    with the trainers' views of it (``runs``: :meth:`Runs.summaries`, newest first: the first
    run that knows a node gives its trainer-side columns), plus nodes that left or expired
    lately (``gone``: address -> their last row) and nodes only a trainer knows (--rollout)."""
    rows: dict[str, dict[str, Any]] = {}
    for record in records:
        info = record.info
        seen = record.last_seen.ToNanoseconds() / 1e9
        healthy = record.status != UNHEALTHY
        rows[info.address] = {
            "node_id": record.node_id, "address": info.address,
            "role": enum_word(common_pb2.NodeRole, info.role, None),
            "backend": enum_word(common_pb2.Backend, info.backend, None) if info.backend else "",
            "adapter_format": (enum_word(common_pb2.AdapterFormat, info.adapter_format, None)
                               if info.adapter_format else ""),
            "health": enum_word(common_pb2.NodeStatus, record.status, None),
            "last_seen_s": max(0.0, now - seen),
            "policy_version": info.adapter.version, "adapter": info.adapter.name,
            "queue": info.queue_depth, "load": record.load, "capacity": info.capacity,
            "uptime_s": info.uptime_s + (max(0.0, now - seen) if healthy else 0.0),
            "device": info.device, "dtype": info.dtype, "model": info.base_model.model_id,
            # several runs on one node (issue 46): what it holds, and each run's share
            "resident": [f"{a.name} v{a.version}" for a in info.resident_adapters],
            "run_shares": {s.run: s.share for s in info.run_shares},
        }
    for address, row in gone.items():
        rows.setdefault(address, dict(row))
    for run in reversed(runs):  # the newest run's view wins
        info = run.info
        for view in run.nodes:
            row = rows.setdefault(view.address, {
                "node_id": "", "address": view.address, "role": _ROLLOUT,
                "health": Presence.UNREGISTERED, "policy_version": view.policy_version})
            row["trainer_view"] = {**node_json(view), "run_name": info.run_name,
                                   "run_id": info.run_id, "kl_level": _kl_level(view)}
        address = info.trainer_address
        if address and address in rows and rows[address].get("role") == _TRAINER:
            state = enum_word(trainer_pb2.RunState, info.state, None)
            rows[address]["run"] = {"run_id": info.run_id, "run_name": info.run_name,
                                    "state": state, "last_step": run.last_step,
                                    "total_steps": info.total_steps}
            if rows[address].get("health") == Presence.LEFT and info.state in ENDED_CLEANLY:
                rows[address]["health"] = state  # finished or stopped, not "left"
    return sorted(rows.values(), key=lambda r: (r.get("role") != _TRAINER, r["address"]))


class FleetWatch:
    """The ``dashboard-fleet`` thread: registry changes -> fleet event lines in ``runs``, and
    the nodes that left or expired lately (:meth:`gone`)."""

    def __init__(self, registry: Registry, runs: Runs) -> None:
        self._registry = registry
        self._runs = runs
        self._lock = threading.Lock()
        self._status: dict[str, int] = {}
        self._gone: dict[str, tuple[float, dict[str, Any]]] = {}
        self._sub = registry.subscribe(NodeFilter())
        self._thread = threading.Thread(target=self._run, name="dashboard-fleet", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._sub.close()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def gone(self) -> dict[str, dict[str, Any]]:
        """address -> its last row, for nodes that left or expired in the last 10 minutes."""
        now = time.monotonic()
        with self._lock:
            for address in [a for a, (t, _) in self._gone.items() if now - t > GONE_KEPT_S]:
                del self._gone[address]
            return {a: row for a, (_, row) in self._gone.items()}

    def _run(self) -> None:
        while True:
            try:
                event = self._sub.get()
            except Exception:  # fell behind: watch again
                log.warning("dashboard: registry watch fell behind; watching again")
                self._sub = self._registry.subscribe(NodeFilter())
                continue
            if event is None:
                return
            if event.node is not None:
                self._apply(event.type, event.node)

    def _apply(self, kind: int, record: Any) -> None:
        address = record.info.address
        role = enum_word(common_pb2.NodeRole, record.info.role, None)
        before = self._status.get(record.node_id)
        what = f"{role} {address}"
        if kind == JOINED:
            backend = (f" ({enum_word(common_pb2.Backend, record.info.backend, None)})"
                       if record.info.backend else "")
            self._runs.fleet_event(runs_pb2.RUN_EVENT_KIND_NODE_JOINED, address,
                                   f"{what} joined{backend}")
        elif kind == CHANGED and before is not None and before != record.status:
            if record.status == UNHEALTHY:
                self._runs.fleet_event(runs_pb2.RUN_EVENT_KIND_NODE_UNHEALTHY, address,
                                       f"{what} unhealthy: no heartbeat")
            elif before == UNHEALTHY:
                self._runs.fleet_event(runs_pb2.RUN_EVENT_KIND_NODE_JOINED, address,
                                       f"{what} back: heartbeating again")
        elif kind == CHANGED and before is None:  # re-registered after a restart
            self._runs.fleet_event(runs_pb2.RUN_EVENT_KIND_NODE_JOINED, address,
                                   f"{what} registered again")
        elif kind == REMOVED:
            expired = record.status == UNHEALTHY
            self._runs.fleet_event(
                runs_pb2.RUN_EVENT_KIND_NODE_EXPIRED if expired else
                runs_pb2.RUN_EVENT_KIND_NODE_LEFT, address,
                f"{what} {'expired: silent past --expire-after' if expired else 'left'}")
            row = fleet_rows([record], [], {}, time.time())[0]
            row["health"] = Presence.EXPIRED if expired else Presence.LEFT
            with self._lock:
                self._gone[address] = (time.monotonic(), row)
            self._status.pop(record.node_id, None)
            return
        self._status[record.node_id] = record.status
        with self._lock:
            self._gone.pop(address, None)
