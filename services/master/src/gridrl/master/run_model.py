"""The master's run model, typed: a run's info, its step and eval points, its events, the
trainer's node view, the latest eval's examples, and what the dashboard reads of a run
(:class:`RunSummary`, :class:`RunDetail`). Conversions from the ``ReportRun`` protos and to and
from JSON (the page, the store) live in one module, :mod:`gridrl.master.run_wire`.

Pure data: no gRPC, no JSON, no locks. Enums stay enum values (``trainer_pb2.RunState``,
``runs_pb2.RunEventKind``) until the JSON edge spells them as words
(:func:`gridrl.v1.enums.enum_word`). ``None`` in a float field: not measured.

Points merge (:func:`merge`) when a run outgrows its bound (:class:`Series`):
each field of a point says how (``metadata["merge"]``): ``first`` (the earlier point's),
``later`` (the later point's, unless it lacks one), ``sum``, ``min``/``max`` (a range covering
both), ``nodes`` (samples per node summed), ``stderr`` (that of the weighted mean of independent
estimates), and by default the mean weighted by the steps each point stands for.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from gridrl.v1 import runs_pb2, trainer_pb2

STEP_POINTS = 1000  # step points a run keeps at most
EVAL_POINTS = 500  # eval points a run keeps at most
RUN_EVENTS = 500  # events a run keeps at most
#: run states in which a run still goes on (unspecified: a trainer that has not said)
ACTIVE_STATES = frozenset({trainer_pb2.RUN_STATE_STARTING, trainer_pb2.RUN_STATE_RUNNING,
                           trainer_pb2.RUN_STATE_UNSPECIFIED})


def _rule(rule: str, default: Any = None) -> Any:
    return field(default=default, metadata={"merge": rule})


@dataclass(frozen=True)
class RunInfo:
    """What a trainer says of its run (``runs_pb2.RunInfo``). ``started_at``: wall-clock
    seconds, None when not sent."""

    run_id: str = ""
    run_name: str = ""
    trainer_address: str = ""
    state: trainer_pb2.RunState.ValueType = trainer_pb2.RUN_STATE_UNSPECIFIED
    error: str = ""
    total_steps: int = 0
    model_id: str = ""
    task: str = ""
    baseline_eval: float | None = None
    baseline_eval_stderr: float | None = None
    baseline_eval_exact: float | None = None
    eval_scorer: str = ""
    importance_weighting: bool = False
    started_at: float | None = None

    @property
    def active(self) -> bool:
        """Whether the run still goes on (starting, running, or not said)."""
        return self.state in ACTIVE_STATES


@dataclass(frozen=True)
class StepPoint:
    """One training step, or consecutive steps ``first_step..step`` once merged (``steps``:
    how many it stands for). Seconds for ``*_s``; ``time``: wall-clock seconds of the last
    step; ``nodes``: node address -> samples it gave."""

    step: int = _rule("later", 0)
    first_step: int = _rule("first", 0)
    steps: int = _rule("sum", 1)
    policy_version: int = _rule("later", 0)
    reward_mean: float | None = None
    reward_std: float | None = None
    loss: float | None = None
    mismatch_kl: float | None = None
    staleness_mean: float | None = None
    rollout_s: float | None = None
    update_s: float | None = None
    sync_s: float | None = None
    eval_s: float | None = None
    dropped: int = _rule("sum", 0)
    excluded: int = _rule("sum", 0)
    lr: float | None = None
    reward_min: float | None = _rule("min")
    reward_max: float | None = _rule("max")
    tokens_per_s: float | None = None
    elapsed_s: float | None = _rule("later")
    time: float | None = _rule("later")
    is_mean: float | None = None
    is_max: float | None = None
    is_limited: float | None = None
    nodes: dict[str, int] = field(default_factory=dict, metadata={"merge": "nodes"})


@dataclass(frozen=True)
class EvalPoint:
    """One eval (at ``step``, of policy ``policy_version``), or several once merged
    (``steps``: how many it stands for): the mean ``score``, its standard error, and the
    share of replies with full marks (``exact``)."""

    step: int = _rule("later", 0)
    first_step: int = _rule("first", 0)
    steps: int = _rule("sum", 1)
    policy_version: int = _rule("later", 0)
    score: float | None = None
    stderr: float | None = _rule("stderr")
    exact: float | None = None


#: a point type (a Series holds one kind)
P = TypeVar("P", StepPoint, EvalPoint)


def merge(a: P, b: P) -> P:
    """One point standing for the steps of ``a`` and then ``b``, each field by its rule (the
    module's docstring): counts summed, the later step, version and time, the reward range
    covering both, the others averaged weighted by the steps each stands for (over the
    points that measured them). Two evals' standard errors combine as that of their mean
    (independent evals: sqrt(wa^2 se_a^2 + wb^2 se_b^2) / (wa + wb))."""
    wa, wb = a.steps, b.steps
    out: dict[str, Any] = {}
    for f in dataclasses.fields(a):
        va: Any = getattr(a, f.name)
        vb: Any = getattr(b, f.name)
        rule = f.metadata.get("merge", "mean")
        if rule == "first":
            out[f.name] = va
        elif rule == "sum":
            out[f.name] = va + vb
        elif rule == "later":
            out[f.name] = vb if vb is not None else va
        elif rule == "nodes":
            out[f.name] = {n: va.get(n, 0) + vb.get(n, 0) for n in {*va, *vb}}
        elif rule == "stderr":
            out[f.name] = (None if va is None or vb is None else
                           math.sqrt((wa * va) ** 2 + (wb * vb) ** 2) / (wa + wb))
        elif va is None or vb is None:
            out[f.name] = va if vb is None else vb
        elif rule == "min":
            out[f.name] = min(va, vb)
        elif rule == "max":
            out[f.name] = max(va, vb)
        else:
            out[f.name] = (wa * va + wb * vb) / (wa + wb)
    return type(a)(**out)


@dataclass(frozen=True)
class RunEvent:
    """An event line: the trainer's (a push, a checkpoint, a state change ...) or the fleet's
    (a node joined, left, turned unhealthy, expired). ``time``: wall-clock seconds."""

    kind: runs_pb2.RunEventKind.ValueType
    time: float
    step: int = 0
    node: str = ""
    duration_s: float | None = 0.0
    ok: bool = True
    message: str = ""


@dataclass(frozen=True)
class NodeView:
    """The trainer's view of one node (``runs_pb2.RunNode``): in rotation or why not (the
    reason strings are empty when it does not apply), its adapter version, staleness,
    mismatch KL against its bound, speed, calls in flight, the last step it gave samples to."""

    address: str
    in_rotation: bool = False
    out_of_rotation: str = ""
    flagged: str = ""
    benched: str = ""
    readmitted: str = ""
    policy_version: int = 0
    staleness: int = 0
    mismatch_kl: float | None = None
    mismatch_kl_bound: float | None = None
    tokens_per_s: float | None = None
    in_flight: int = 0
    last_step: int = 0


@dataclass(frozen=True)
class Message:
    """One message of an eval transcript."""

    role: str
    content: str


@dataclass(frozen=True)
class EvalExample:
    """One eval example: its prompt, score, turns, and why it was dropped (empty: it was not)."""

    prompt: str
    score: float | None
    turns: int
    dropped: str
    error: str
    transcript: tuple[Message, ...] = ()


@dataclass(frozen=True)
class EvalExamples:
    """The eval examples of the evaluating step ``step`` (policy ``policy_version``)."""

    step: int
    policy_version: int
    examples: tuple[EvalExample, ...]


@dataclass(frozen=True)
class RunSummary:
    """A run as the page's run list and fleet table read it: its info, last step, the policy
    version of its last step, the age of its last report (seconds), the trainer's node view."""

    info: RunInfo
    last_step: int
    policy_version: int
    report_age_s: float
    nodes: tuple[NodeView, ...]


@dataclass(frozen=True)
class RunDetail:
    """One run for the page: the points after the reader's step (all of them when ``full``:
    the series were merged since the reader's ``generation``), the events (the run's and the
    fleet's since shortly before it started, in time order), the node view, the latest eval's
    examples (None: none yet)."""

    info: RunInfo
    last_step: int
    report_age_s: float
    generation: int
    full: bool
    steps: list[StepPoint]
    evals: list[EvalPoint]
    events: list[RunEvent]
    nodes: tuple[NodeView, ...]
    eval_examples: EvalExamples | None


class Series(Generic[P]):
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
        self.points: list[P] = []
        self.generation = 0

    def add(self, point: P) -> None:
        """Append ``point`` (its step above every held one: :meth:`truncate` first)."""
        self.points.append(point)
        if len(self.points) > self.capacity:
            old = self.capacity // 2
            merged = [merge(self.points[i], self.points[i + 1]) for i in range(0, old - 1, 2)]
            self.points[:old - old % 2] = merged
            self.generation += 1

    def truncate(self, step: int) -> None:
        """Drop the points standing for ``step`` or later steps."""
        kept = [p for p in self.points if p.step < step]
        if len(kept) != len(self.points):
            self.points = kept
            self.generation += 1

    def since(self, step: int) -> list[P]:
        """The points after ``step``."""
        return [p for p in self.points if p.step > step]

    @property
    def last_step(self) -> int:
        return self.points[-1].step if self.points else 0


@dataclass
class Run:
    """One run's record: its latest info, its points and events, the trainer's latest node
    view (address -> view), the latest eval's examples; ``owner``: the credential that
    reported it first (None without credentials)."""

    run_id: str
    owner: str | None
    info: RunInfo = field(default_factory=RunInfo)
    steps: Series[StepPoint] = field(default_factory=lambda: Series(STEP_POINTS))
    evals: Series[EvalPoint] = field(default_factory=lambda: Series(EVAL_POINTS))
    events: deque[RunEvent] = field(default_factory=lambda: deque(maxlen=RUN_EVENTS))
    nodes: dict[str, NodeView] = field(default_factory=dict)
    examples: EvalExamples | None = None
    reported_at: float = 0.0  # wall clock of the last report
    dirty: bool = True  # changed since last persisted

    @property
    def active(self) -> bool:
        return self.info.active
