"""What happens to a run besides its steps, as typed events (:data:`RunEvent`).

The run emits them through the reporter (:class:`gridrl.trainer.report.reporter.Reporter`); each
subscriber picks those it shows (``match event: case NodeFlagged(): ...``) and ignores the
rest. A step's own record is not an event: it goes to ``on_step``
(:class:`~gridrl.trainer.report.records.StepRecord`).

Lifecycle, in order: :class:`RunStarted` (the model loads), :class:`RunResumed` (a resumed run's
checkpoint is restored), :class:`NodesReady`, :class:`History` (a resumed run's earlier steps),
:class:`ResumedWeightsPushed`, :class:`BaselineEvaluated`, then per step the record and
:class:`Checkpointed`, and one end: :class:`RunFinished`, :class:`RunStopped` or
:class:`RunFailed` (after :class:`FailedRunCheckpointed` when the failure left steps to save).
Any time: :class:`EvalProgressed` (an eval under way), :class:`NodeWaitChanged`,
:class:`NodeFlagged`, :class:`NodeReviewed`,
:class:`SyncSkipped`, :class:`NoUpdate`, :class:`LearningWarning`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from gridrl.trainer.evaluation import EvalProgress
from gridrl.trainer.fleet.pool import NodeState, NodeWait
from gridrl.trainer.fleet.probation import Review
from gridrl.trainer.report.records import BaselineRecord, RunSummary, StepRecord

# What a flag does to a node in a run with a node pool (printed after the reason).
BENCHED = ("benched: no new groups, its samples kept out of the update until it serves the "
           "current policy version and passes a fresh mismatch check")


@dataclass(frozen=True)
class RunStarted:
    """The run begins: the model loads, the baseline is measured (TrainerService: STARTING)."""

    run_name: str
    run_dir: str
    total_steps: int
    model: str


@dataclass(frozen=True)
class RunResumed:
    """A checkpoint was restored: the run continues after ``step`` as ``policy_version`` (a
    version never used in the run directory); ``dropped_records`` log records past it went."""

    step: int
    checkpoint: Path
    policy_version: int
    dropped_records: int


@dataclass(frozen=True)
class NodesReady:
    """The rollout nodes the run starts with (``--min-nodes`` of them are in rotation)."""

    nodes: tuple[NodeState, ...]


@dataclass(frozen=True)
class History:
    """A resumed run's earlier steps, read back from ``log.jsonl`` (before its next step).

    Attributes:
        records: the steps up to the checkpoint, in order.
        baseline: the base model's eval record (None when the log has none).
        baseline_score: the base model's eval score the checkpoint holds.
    """

    records: tuple[StepRecord, ...]
    baseline: BaselineRecord | None
    baseline_score: float | None


@dataclass(frozen=True)
class ResumedWeightsPushed:
    """The resumed weights were pushed to ``nodes`` nodes as ``policy_version``."""

    policy_version: int
    nodes: int


@dataclass(frozen=True)
class BaselineEvaluated:
    """The base model's held-out eval, before step 1 (written to ``log.jsonl``)."""

    record: BaselineRecord


@dataclass(frozen=True)
class EvalProgressed:
    """A held-out eval at ``step`` (0: the baseline) is under way (``progress``: prompts done,
    of how many, the expected time once the first batch is done), or ended (None)."""

    step: int
    progress: EvalProgress | None


@dataclass(frozen=True)
class NoUpdate:
    """No sample of ``step`` survived: no update. ``dropped``: samples dropped by admission
    (staleness); ``why``: when every episode of the step was dropped before admission, that
    and its cause in words (:meth:`gridrl.trainer.rollouts.EpisodeStats.all_dropped_why`),
    else ""."""

    step: int
    dropped: int
    why: str = ""


@dataclass(frozen=True)
class LearningWarning:
    """Nothing can be learned as the run stands (``step`` 0: the baseline eval): every
    sample scored the same, or no group had signal for several steps in a row. ``message``
    says what was seen and what to change (:mod:`gridrl.trainer.run.watch`)."""

    step: int
    message: str


@dataclass(frozen=True)
class NodeFlagged:
    """The node monitor flagged ``node`` at ``step`` for ``reason`` (stale or mismatched
    samples); ``benched``: it is out of rotation until probation readmits it."""

    node: str
    step: int
    reason: str
    benched: bool


@dataclass(frozen=True)
class NodeReviewed:
    """Probation reviewed a flagged node (:class:`gridrl.trainer.fleet.probation.Review`)."""

    review: Review


@dataclass(frozen=True)
class SyncSkipped:
    """A push of ``policy_version`` left nodes out (address -> why) or behind (``lagging``)."""

    policy_version: int
    skipped: dict[str, str] = field(default_factory=dict)
    lagging: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeWaitChanged:
    """The run waits for rollout nodes (``wait``), or stopped waiting (None); ``stopping``:
    the run was asked to stop (a wait that ends then ends for that reason)."""

    wait: NodeWait | None
    stopping: bool = False


@dataclass(frozen=True)
class Checkpointed:
    """Checkpoint ``step`` is written at ``path``, in ``seconds``."""

    step: int
    path: Path
    seconds: float = 0.0


@dataclass(frozen=True)
class FailedRunCheckpointed:
    """A failing run checkpointed the steps it finished (``message``: how to continue)."""

    step: int
    message: str


@dataclass(frozen=True)
class RunStopped:
    """The run stopped on request after ``step`` (``message``: where, and how to resume)."""

    step: int
    message: str


@dataclass(frozen=True)
class RunFinished:
    """Every step is done; ``summary`` is what ``summary.json`` (in ``run_dir``) holds."""

    summary: RunSummary
    run_dir: Path


@dataclass(frozen=True)
class RunFailed:
    """The run failed with ``error`` (``"RuntimeError: ..."``)."""

    error: str


RunEvent = Union[RunStarted, RunResumed, NodesReady, History, ResumedWeightsPushed,  # noqa: UP007
                 BaselineEvaluated, EvalProgressed, NoUpdate, LearningWarning, NodeFlagged,
                 NodeReviewed,
                 SyncSkipped,
                 NodeWaitChanged, Checkpointed, FailedRunCheckpointed, RunStopped, RunFinished,
                 RunFailed]
