"""The master's record of training runs (what its dashboard shows): each run's steps, evals,
events and node view as its trainer reports them (``RunReportService.ReportRun``), and the
fleet's own events (joins, losses) from the registry.

The record is typed (:mod:`gridrl.master.run_model`); its conversions from the protos and to
JSON (the page, the store) are :mod:`gridrl.master.run_wire`. Pure domain code: no gRPC, no
HTTP, no threads of its own. :class:`Runs` is thread-safe (one
lock, held for the in-memory work of one call; never during I/O).

Bounded whatever a run's length: a run keeps at most ``run_model.STEP_POINTS`` step points and
``EVAL_POINTS`` eval points (:class:`gridrl.master.run_model.Series`: when full, its oldest half is merged pairwise
into points covering two steps each, so recent steps stay exact and old ones get coarser: a run
of 100k steps is held in <= 1,000 points), ``RUN_EVENTS`` events, and the master at most
:data:`MAX_RUNS` runs (the least recently reported finished one goes first).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from gridrl.common.errors import Kind, StatusError, invalid_argument
from gridrl.master.run_model import RUN_EVENTS, Run, RunDetail, RunEvent, RunSummary
from gridrl.master.run_wire import (
    eval_point,
    event_from_proto,
    examples_from_proto,
    info_from_proto,
    node_from_proto,
    run_from_json,
    run_json,
    step_point,
)
from gridrl.v1 import runs_pb2, trainer_pb2

FLEET_EVENTS = 500
MAX_RUNS = 32
FLEET_LEAD_S = 60.0  # a run's events include the fleet's from this long before it started
MAX_ITEMS = 1000  # steps, events or nodes in one report
SHORT, LONG, TEXT = 256, 4096, 16_384  # string bounds (characters)
MAX_EXAMPLES, MAX_MESSAGES = 8, 64  # eval examples a step, messages an example
_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Event kinds the master records itself (from its registry); a trainer may not report them.
MASTER_KINDS = frozenset({runs_pb2.RUN_EVENT_KIND_NODE_JOINED, runs_pb2.RUN_EVENT_KIND_NODE_LEFT,
                          runs_pb2.RUN_EVENT_KIND_NODE_UNHEALTHY,
                          runs_pb2.RUN_EVENT_KIND_NODE_EXPIRED})
_LOST = frozenset({runs_pb2.RUN_EVENT_KIND_NODE_UNHEALTHY, runs_pb2.RUN_EVENT_KIND_NODE_EXPIRED})


# ------------------------------------------------------------------------------ validation


def _bounded(value: str, field: str, limit: int) -> None:
    if len(value) > limit:
        raise invalid_argument(field, f"{len(value)} characters, at most {limit}")


def validate_report(request: runs_pb2.ReportRunRequest) -> None:
    """Check a ReportRun request (see the RPC's comment in ``runs.proto``).

    Raises:
        StatusError: INVALID_ARGUMENT whose message starts with the offending field.
    """
    if not request.HasField("run"):
        raise invalid_argument("run", "is required")
    run = request.run
    if not _RUN_ID.fullmatch(run.run_id):
        raise invalid_argument("run.run_id", f"{run.run_id[:40]!r} must match "
                                             "[A-Za-z0-9._-]{1,128}")
    for name in ("run_name", "trainer_address", "model_id", "task", "eval_scorer"):
        _bounded(getattr(run, name), f"run.{name}", SHORT)
    _bounded(run.error, "run.error", LONG)
    if run.state not in trainer_pb2.RunState.values():
        raise invalid_argument("run.state", f"unknown value {run.state}")
    for name in ("steps", "events", "nodes"):
        if len(getattr(request, name)) > MAX_ITEMS:
            raise invalid_argument(name, f"{len(getattr(request, name))} items, at most "
                                         f"{MAX_ITEMS} a report")
    previous = 0
    for i, step in enumerate(request.steps):
        if step.report.step <= previous:
            raise invalid_argument(f"steps[{i}].report.step", f"{step.report.step} after "
                                   f"{previous}: steps must be >= 1 and increasing")
        previous = step.report.step
        if len(step.nodes) > MAX_ITEMS:
            raise invalid_argument(f"steps[{i}].nodes", f"at most {MAX_ITEMS} nodes")
        for j, node in enumerate(step.nodes):
            _bounded(node.address, f"steps[{i}].nodes[{j}].address", SHORT)
        if len(step.eval_examples) > MAX_EXAMPLES:
            raise invalid_argument(f"steps[{i}].eval_examples", f"{len(step.eval_examples)} "
                                   f"items, at most {MAX_EXAMPLES}")
        for j, example in enumerate(step.eval_examples):
            where = f"steps[{i}].eval_examples[{j}]"
            _bounded(example.prompt, f"{where}.prompt", TEXT)
            _bounded(example.dropped, f"{where}.dropped", SHORT)
            _bounded(example.error, f"{where}.error", TEXT)
            if len(example.transcript) > MAX_MESSAGES:
                raise invalid_argument(f"{where}.transcript", f"{len(example.transcript)} "
                                       f"messages, at most {MAX_MESSAGES}")
            for k, message in enumerate(example.transcript):
                _bounded(message.role, f"{where}.transcript[{k}].role", SHORT)
                _bounded(message.content, f"{where}.transcript[{k}].content", TEXT)
    for i, event in enumerate(request.events):
        if event.kind not in runs_pb2.RunEventKind.values() or event.kind == 0:
            raise invalid_argument(f"events[{i}].kind", f"unknown value {event.kind}")
        if event.kind in MASTER_KINDS:
            raise invalid_argument(f"events[{i}].kind", f"{runs_pb2.RunEventKind.Name(event.kind)}"
                                   " is recorded by the master itself, from its registry")
        _bounded(event.node, f"events[{i}].node", SHORT)
        _bounded(event.message, f"events[{i}].message", LONG)
    for i, view in enumerate(request.nodes):
        _bounded(view.address, f"nodes[{i}].address", SHORT)
        for name in ("out_of_rotation", "flagged", "benched", "readmitted"):
            _bounded(getattr(view, name), f"nodes[{i}].{name}", LONG)


# ---------------------------------------------------------------------------------- runs


class RunRecordStore(Protocol):
    """Persistence of runs (:class:`gridrl.master.store.SqliteStore`)."""

    def load_runs(self) -> list[str]: ...

    def put_runs(self, runs: Iterable[tuple[str, str]]) -> None: ...

    def delete_runs(self, run_ids: Iterable[str]) -> None: ...


class Runs:
    """Every run the master heard of, and the fleet's events (thread-safe).

    Args:
        store: where runs persist (None: kept until the master stops).
        clock: wall-clock seconds (tests pass a fake one).
    """

    def __init__(self, store: RunRecordStore | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, Run] = {}
        self._fleet_events: deque[RunEvent] = deque(maxlen=FLEET_EVENTS)
        self._store = store
        self._clock = clock
        if store is not None:
            for text in store.load_runs():
                try:
                    run = run_from_json(json.loads(text))
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue  # an unreadable row must not stop the master
                self._runs[run.run_id] = run

    def report(self, request: runs_pb2.ReportRunRequest, credential: str | None) -> int:
        """Apply a validated ReportRun request sent with ``credential`` (its id; None without
        credentials). Returns the last step held for the run.

        Raises:
            StatusError: PERMISSION_DENIED when another credential reported the run first.
        """
        run_id = request.run.run_id
        now = self._clock()
        info = info_from_proto(request.run)
        points = [(step_point(s), eval_point(s)) for s in request.steps]
        examples = next((e for e in map(examples_from_proto, reversed(request.steps)) if e), None)
        events = [event_from_proto(e, now) for e in request.events]
        nodes = (None if request.nodes_unchanged else
                 {n.address: node_from_proto(n) for n in request.nodes})
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                run = self._runs[run_id] = Run(run_id, credential)
                self._evict()
            elif credential is not None and run.owner is not None and run.owner != credential:
                raise StatusError(Kind.PERMISSION_DENIED,
                                  f"run {run_id!r} is reported by credential "
                                  f"{run.owner!r}, not {credential!r}", field="run.run_id")
            run.info = info
            for step, evaluation in points:
                if step.step <= run.steps.last_step:  # a resumed run re-runs later steps
                    run.steps.truncate(step.step)
                    run.evals.truncate(step.step)
                run.steps.add(step)
                if evaluation is not None:
                    run.evals.add(evaluation)
            run.events.extend(events)
            if examples is not None:
                run.examples = examples
            elif run.examples is not None and run.examples.step > run.steps.last_step:
                run.examples = None  # resumed before it
            if nodes is not None:
                run.nodes = nodes
            run.reported_at = now
            run.dirty = True
            return run.steps.last_step

    def _evict(self) -> None:
        """Drop the least recently reported run (a finished one first) past MAX_RUNS."""
        while len(self._runs) > MAX_RUNS:
            order = sorted(self._runs.values(), key=lambda r: (r.active, r.reported_at))
            gone = order[0].run_id
            del self._runs[gone]
            if self._store is not None:
                self._store.delete_runs([gone])

    def fleet_event(self, kind: runs_pb2.RunEventKind.ValueType, node: str,
                    message: str) -> None:
        """Record an event of the fleet (a node joined, left, turned unhealthy, expired)."""
        with self._lock:
            self._fleet_events.append(RunEvent(kind, self._clock(), node=node,
                                               ok=kind not in _LOST, message=message))

    def fleet_events(self) -> list[RunEvent]:
        """The fleet's events, oldest first."""
        with self._lock:
            return list(self._fleet_events)

    def summaries(self) -> list[RunSummary]:
        """Every run: its info, last step and report age, newest first."""
        now = self._clock()
        with self._lock:
            runs = sorted(self._runs.values(), key=lambda r: -r.reported_at)
            return [RunSummary(info=r.info, last_step=r.steps.last_step,
                               policy_version=(r.steps.points[-1].policy_version
                                               if r.steps.points else 0),
                               report_age_s=now - r.reported_at, nodes=tuple(r.nodes.values()))
                    for r in runs]

    def detail(self, run_id: str, since: int = 0, generation: int = -1) -> RunDetail | None:
        """One run for the page: info, the step and eval points after ``since`` (all of them
        when ``generation`` is not the series' current one: merged meanwhile), its events
        merged with the fleet's since it started, and the node view. None: unknown run."""
        now = self._clock()
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return None
            generation_now = run.steps.generation * 1_000_003 + run.evals.generation
            full = generation != generation_now
            # the fleet's events from shortly before the run started (its nodes joining)
            start = (run.info.started_at or 0.0) - FLEET_LEAD_S
            events = sorted([*run.events, *(e for e in self._fleet_events if e.time >= start)],
                            key=lambda e: e.time)[-RUN_EVENTS:]
            return RunDetail(info=run.info, last_step=run.steps.last_step,
                             report_age_s=now - run.reported_at, generation=generation_now,
                             full=full, steps=run.steps.since(0 if full else since),
                             evals=run.evals.since(0 if full else since), events=events,
                             nodes=tuple(run.nodes.values()), eval_examples=run.examples)

    def flush(self) -> None:
        """Write the runs changed since the last flush to the store (no-op without one)."""
        if self._store is None:
            return
        with self._lock:
            dirty = [(r.run_id, json.dumps(run_json(r))) for r in self._runs.values() if r.dirty]
            for r in self._runs.values():
                r.dirty = False
        if dirty:
            self._store.put_runs(dirty)
