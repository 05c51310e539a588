"""The master's record of training runs (what its dashboard shows): each run's steps, evals,
events and node view as its trainer reports them (``RunReportService.ReportRun``), and the
fleet's own events (joins, losses) from the registry.

Pure domain code: no gRPC, no HTTP, no threads of its own. :class:`Runs` is thread-safe (one
lock, held for the in-memory work of one call; never during I/O).

Bounded whatever a run's length: a run keeps at most :data:`STEP_POINTS` step points and
:data:`EVAL_POINTS` eval points (:class:`Series`: when full, its oldest half is merged pairwise
into points covering two steps each, so recent steps stay exact and old ones get coarser: a run
of 100k steps is held in <= 1,000 points), :data:`RUN_EVENTS` events, and the master at most
:data:`MAX_RUNS` runs (the least recently reported finished one goes first).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gridrl.common.errors import Kind, StatusError, invalid_argument
from gridrl.v1 import runs_pb2, trainer_pb2
from gridrl.v1.enums import enum_word

STEP_POINTS = 1000
EVAL_POINTS = 500
RUN_EVENTS = 500
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
_ACTIVE = frozenset({trainer_pb2.RUN_STATE_STARTING, trainer_pb2.RUN_STATE_RUNNING,
                     trainer_pb2.RUN_STATE_UNSPECIFIED})


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
    for i, node in enumerate(request.nodes):
        _bounded(node.address, f"nodes[{i}].address", SHORT)
        for name in ("out_of_rotation", "flagged", "benched", "readmitted"):
            _bounded(getattr(node, name), f"nodes[{i}].{name}", LONG)


# --------------------------------------------------------------------------------- points


def _num(x: float | None) -> float | None:
    """A float JSON can carry (NaN and infinities become None)."""
    return x if x is not None and math.isfinite(x) else None


def step_point(step: runs_pb2.RunStep) -> dict[str, Any]:
    """A step as a dashboard point: a flat dict of numbers (None: not measured), ``steps``
    the number of steps it stands for (1; more once merged), ``nodes`` address -> samples."""
    r = step.report
    iw = step.importance_weights if step.HasField("importance_weights") else None
    return {
        "step": r.step, "first_step": r.step, "steps": 1, "policy_version": r.policy_version,
        "reward_mean": _num(r.reward_mean), "reward_std": _num(r.reward_std),
        "loss": _num(r.loss), "mismatch_kl": _num(r.mismatch_kl),
        "staleness_mean": _num(r.staleness_mean), "rollout_s": _num(r.rollout_s),
        "update_s": _num(r.train_s), "sync_s": _num(r.sync_s), "eval_s": _num(step.eval_s),
        "dropped": r.dropped_samples, "excluded": step.excluded_samples,
        "lr": _num(step.lr) if step.HasField("lr") else None,
        "reward_min": _num(step.reward_min) if step.HasField("reward_min") else None,
        "reward_max": _num(step.reward_max) if step.HasField("reward_max") else None,
        "tokens_per_s": _num(r.tokens_per_s), "elapsed_s": _num(r.elapsed_s),
        "time": r.time.ToNanoseconds() / 1e9 if r.HasField("time") else None,
        "is_mean": _num(iw.mean) if iw else None, "is_max": _num(iw.max) if iw else None,
        "is_limited": _num(iw.limited_fraction) if iw else None,
        "nodes": {n.address: n.samples for n in step.nodes},
    }


def eval_point(step: runs_pb2.RunStep) -> dict[str, Any] | None:
    """The step's eval as a point (``evals``: how many evals it stands for), or None."""
    r = step.report
    if not r.HasField("eval_score"):
        return None
    return {"step": r.step, "first_step": r.step, "steps": 1,
            "policy_version": r.eval_policy_version, "score": _num(r.eval_score),
            "stderr": _num(step.eval_stderr) if step.HasField("eval_stderr") else None,
            "exact": (_num(step.eval_exact) if step.HasField("eval_exact")
                      else _num(r.eval_exact) if r.HasField("eval_exact") else None)}


# Fields merged as a sum, and fields the later point gives.
_SUMS = frozenset({"dropped", "excluded", "steps"})
_LATER = frozenset({"step", "policy_version", "time", "elapsed_s"})
_EXTREMES = {"reward_min": min, "reward_max": max}  # a range: the steps' together


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One point standing for the steps of ``a`` and then ``b``: counts summed, the later
    step, version and time, the reward range covering both, the others averaged weighted by the steps each stands for (over
    the points that measured them). Two eval points' standard errors combine as that of
    their mean (independent evals: sqrt(wa^2 se_a^2 + wb^2 se_b^2))."""
    wa, wb = a["steps"], b["steps"]
    out: dict[str, Any] = {"first_step": a["first_step"]}
    for key, va in a.items():
        vb = b.get(key)
        if key == "first_step":
            continue
        if key in _SUMS:
            out[key] = va + vb
        elif key in _LATER:
            out[key] = vb if vb is not None else va
        elif key == "nodes":
            out[key] = {n: va.get(n, 0) + vb.get(n, 0) for n in {*va, *vb}}
        elif key == "stderr":
            out[key] = (None if va is None or vb is None else
                        math.sqrt((wa * va) ** 2 + (wb * vb) ** 2) / (wa + wb))
        elif va is None or vb is None:
            out[key] = va if vb is None else vb
        elif key in _EXTREMES:
            out[key] = _EXTREMES[key](va, vb)
        else:
            out[key] = (wa * va + wb * vb) / (wa + wb)
    return out


class Series:
    """Points in step order, at most ``capacity``: appending to a full series merges its
    oldest half pairwise (:func:`merge`), so the newest quarter-to-half stays one point a step.

    Attributes:
        generation: how many times points were merged or dropped (a reader holding points of
            an older generation must read them all again).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 4:
            raise ValueError(f"capacity {capacity} < 4")
        self.capacity = capacity
        self.points: list[dict[str, Any]] = []
        self.generation = 0

    def add(self, point: dict[str, Any]) -> None:
        """Append ``point`` (its step above every held one: :meth:`truncate` first)."""
        self.points.append(point)
        if len(self.points) > self.capacity:
            old = self.capacity // 2
            merged = [merge(self.points[i], self.points[i + 1]) for i in range(0, old - 1, 2)]
            self.points[:old - old % 2] = merged
            self.generation += 1

    def truncate(self, step: int) -> None:
        """Drop the points standing for ``step`` or later steps."""
        kept = [p for p in self.points if p["step"] < step]
        if len(kept) != len(self.points):
            self.points = kept
            self.generation += 1

    def since(self, step: int) -> list[dict[str, Any]]:
        """The points after ``step``."""
        return [p for p in self.points if p["step"] > step]

    @property
    def last_step(self) -> int:
        return self.points[-1]["step"] if self.points else 0


# ---------------------------------------------------------------------------------- runs


def event_dict(kind: int, time_s: float, step: int = 0, node: str = "", duration_s: float = 0.0,
               ok: bool = True, message: str = "") -> dict[str, Any]:
    """An event line as the dashboard shows it (``kind``: the short name, e.g. ``push``)."""
    return {"kind": enum_word(runs_pb2.RunEventKind, kind, None), "time": time_s, "step": step,
            "node": node, "duration_s": _num(duration_s), "ok": ok, "message": message}


@dataclass
class Run:
    """One run's record. ``info``: the latest :class:`RunInfo` as a dict; ``nodes``: the
    trainer's latest node view, address -> dict; ``owner``: the credential that reported it
    first (None without credentials)."""

    run_id: str
    owner: str | None
    info: dict[str, Any] = field(default_factory=dict)
    steps: Series = field(default_factory=lambda: Series(STEP_POINTS))
    evals: Series = field(default_factory=lambda: Series(EVAL_POINTS))
    events: deque = field(default_factory=lambda: deque(maxlen=RUN_EVENTS))
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    examples: dict[str, Any] = field(default_factory=dict)  # the latest eval's, examples_dict
    reported_at: float = 0.0  # wall clock of the last report
    dirty: bool = True  # changed since last persisted

    @property
    def active(self) -> bool:
        return self.info.get("state_value", 0) in _ACTIVE

    def to_json(self) -> dict[str, Any]:
        """Everything held, for the store."""
        return {"run_id": self.run_id, "owner": self.owner, "info": self.info,
                "steps": self.steps.points, "evals": self.evals.points,
                "events": list(self.events), "nodes": self.nodes,
                "examples": self.examples, "reported_at": self.reported_at}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Run:
        run = cls(d["run_id"], d.get("owner"), info=d["info"], nodes=d.get("nodes", {}),
                  examples=d.get("examples") or {}, reported_at=d.get("reported_at", 0.0), dirty=False)
        run.steps.points = list(d.get("steps", []))[-STEP_POINTS:]
        run.evals.points = list(d.get("evals", []))[-EVAL_POINTS:]
        run.events.extend(d.get("events", []))
        return run


class RunRecordStore(Protocol):
    """Persistence of runs (:class:`gridrl.master.store.SqliteStore`)."""

    def load_runs(self) -> list[str]: ...

    def put_runs(self, runs: Iterable[tuple[str, str]]) -> None: ...

    def delete_runs(self, run_ids: Iterable[str]) -> None: ...


def _info(run: runs_pb2.RunInfo) -> dict[str, Any]:
    return {"run_id": run.run_id, "run_name": run.run_name,
            "trainer_address": run.trainer_address,
            "state": enum_word(trainer_pb2.RunState, run.state, None),
            "state_value": run.state, "error": run.error, "total_steps": run.total_steps,
            "model_id": run.model_id, "task": run.task,
            "baseline_eval": _num(run.baseline_eval) if run.HasField("baseline_eval") else None,
            "baseline_eval_stderr": (_num(run.baseline_eval_stderr)
                                     if run.HasField("baseline_eval_stderr") else None),
            "baseline_eval_exact": (_num(run.baseline_eval_exact)
                                    if run.HasField("baseline_eval_exact") else None),
            "eval_scorer": run.eval_scorer,
            "importance_weighting": run.importance_weighting,
            "started_at": (run.started_at.ToNanoseconds() / 1e9
                           if run.HasField("started_at") else None)}


def examples_dict(step: runs_pb2.RunStep) -> dict[str, Any] | None:
    """An evaluating step's eval examples for the page: ``{"step", "policy_version",
    "examples": [{"prompt", "score", "turns", "dropped", "error", "transcript": [{"role",
    "content"}...]}...]}``; None when the step carries none."""
    if not step.eval_examples:
        return None
    return {"step": step.report.step, "policy_version": step.report.eval_policy_version,
            "examples": [{"prompt": e.prompt, "score": _num(e.score), "turns": e.turns,
                          "dropped": e.dropped, "error": e.error,
                          "transcript": [{"role": m.role, "content": m.content}
                                         for m in e.transcript]}
                         for e in step.eval_examples]}


def _node(node: runs_pb2.RunNode) -> dict[str, Any]:
    return {"address": node.address, "in_rotation": node.in_rotation,
            "out_of_rotation": node.out_of_rotation, "flagged": node.flagged,
            "benched": node.benched, "readmitted": node.readmitted,
            "policy_version": node.policy_version, "staleness": node.staleness,
            "mismatch_kl": _num(node.mismatch_kl) if node.HasField("mismatch_kl") else None,
            "mismatch_kl_bound": _num(node.mismatch_kl_bound),
            "tokens_per_s": _num(node.tokens_per_s), "in_flight": node.in_flight,
            "last_step": node.last_step}


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
        self._fleet_events: deque = deque(maxlen=FLEET_EVENTS)
        self._store = store
        self._clock = clock
        if store is not None:
            for text in store.load_runs():
                try:
                    run = Run.from_json(json.loads(text))
                except (ValueError, KeyError, TypeError):
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
        points = [(step_point(s), eval_point(s)) for s in request.steps]
        examples = next((e for e in map(examples_dict, reversed(request.steps)) if e), None)
        events = [event_dict(e.kind, e.time.ToNanoseconds() / 1e9 if e.HasField("time") else now,
                             e.step, e.node, e.duration_s, e.ok, e.message)
                  for e in request.events]
        nodes = None if request.nodes_unchanged else {n.address: _node(n) for n in request.nodes}
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                run = self._runs[run_id] = Run(run_id, credential)
                self._evict()
            elif credential is not None and run.owner is not None and run.owner != credential:
                raise StatusError(Kind.PERMISSION_DENIED,
                                  f"run {run_id!r} is reported by credential "
                                  f"{run.owner!r}, not {credential!r}", field="run.run_id")
            run.info = _info(request.run)
            for step, evaluation in points:
                if step["step"] <= run.steps.last_step:  # a resumed run re-runs later steps
                    run.steps.truncate(step["step"])
                    run.evals.truncate(step["step"])
                run.steps.add(step)
                if evaluation is not None:
                    run.evals.add(evaluation)
            run.events.extend(events)
            if examples is not None:
                run.examples = examples
            elif run.examples.get("step", 0) > run.steps.last_step:  # resumed before it
                run.examples = {}
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

    def fleet_event(self, kind: int, node: str, message: str) -> None:
        """Record an event of the fleet (a node joined, left, turned unhealthy, expired)."""
        with self._lock:
            self._fleet_events.append(event_dict(kind, self._clock(), node=node,
                                                 ok=kind not in _LOST, message=message))

    def fleet_events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._fleet_events)

    def summaries(self) -> list[dict[str, Any]]:
        """Every run: its info, last step and report age, newest first."""
        now = self._clock()
        with self._lock:
            runs = sorted(self._runs.values(), key=lambda r: -r.reported_at)
            return [{**r.info, "last_step": r.steps.last_step,
                     "policy_version": r.steps.points[-1]["policy_version"]
                     if r.steps.points else 0,
                     "report_age_s": now - r.reported_at, "nodes": list(r.nodes.values())}
                    for r in runs]

    def detail(self, run_id: str, since: int = 0, generation: int = -1) -> dict[str, Any] | None:
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
            start = (run.info.get("started_at") or 0.0) - FLEET_LEAD_S
            events = sorted([*run.events, *(e for e in self._fleet_events if e["time"] >= start)],
                            key=lambda e: e["time"])[-RUN_EVENTS:]
            return {"info": {**run.info, "last_step": run.steps.last_step,
                             "report_age_s": now - run.reported_at},
                    "generation": generation_now, "full": full,
                    "steps": run.steps.since(0 if full else since),
                    "evals": run.evals.since(0 if full else since),
                    "events": events, "nodes": list(run.nodes.values()),
                    "eval_examples": run.examples or None}

    def flush(self) -> None:
        """Write the runs changed since the last flush to the store (no-op without one)."""
        if self._store is None:
            return
        with self._lock:
            dirty = [(r.run_id, json.dumps(r.to_json())) for r in self._runs.values() if r.dirty]
            for r in self._runs.values():
                r.dirty = False
        if dirty:
            self._store.put_runs(dirty)
