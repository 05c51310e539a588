"""What a step leaves behind, as typed records: the adapter push (:class:`SyncOutcome`) and the
step's record (:class:`StepRecord`), written as one line of ``log.jsonl``, published as a
``gridrl.v1.StepReport`` (TrainerService, Prometheus) and printed.

The JSON form (:meth:`StepRecord.to_json`) is the on-disk contract: its keys are what
``log.jsonl`` has always held (``summary.json``, the plot and resumed runs read them back), so a
field added here is added there under the same name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from gridrl.trainer.backend import UpdateStats
from gridrl.trainer.batch import StepBatch
from gridrl.trainer.evaluation import EvalResult

# The record's fields that make up a gridrl.v1.StepReport (same names).
STEP_REPORT_FIELDS = ("step", "policy_version", "reward_mean", "reward_std", "loss",
                      "eval_score", "eval_policy_version", "mismatch_kl", "staleness_mean",
                      "dropped_samples", "rollout_s", "train_s", "sync_s", "nodes_synced",
                      "nodes_skipped", "tokens_per_s", "elapsed_s")
# Keys present only after an update, a sync or an eval (absent otherwise, not null).
_UPDATE_KEYS = ("clip_fraction", "grad_norm", "lr", "ref_kl", "train_tokens")
_SYNC_KEYS = ("synced_nodes", "skipped_nodes", "lagging_nodes")
_EVAL_KEYS = ("eval_exact", "eval_s", "eval_examples")


@dataclass
class SyncOutcome:
    """What a step's adapter push did.

    Attributes:
        pushed: a push happened (remote nodes, a sync step, weights past the base model).
        seconds: wall-clock seconds of the push (0 without one).
        synced_nodes: addresses that now serve the pushed version, sorted.
        skipped_nodes: address -> why it did not take the adapter.
        lagging_nodes: nodes still behind the pushed version after it.
    """

    pushed: bool = False
    seconds: float = 0.0
    synced_nodes: list[str] = field(default_factory=list)
    skipped_nodes: dict[str, str] = field(default_factory=dict)
    lagging_nodes: list[str] = field(default_factory=list)


@dataclass
class NodeRecord:
    """One node's share of a step (``log.jsonl``: ``nodes.<address>``).

    Attributes:
        samples: samples it produced for the step.
        dropped: of which dropped by admission.
        versions: policy versions its samples carried, sorted.
        staleness_mean: mean staleness of its admitted samples (None when none).
        fresh_mismatch_kl: mismatch KL of its staleness-0 samples, nats/token (None: none).
    """

    samples: int
    dropped: int
    versions: list[int]
    staleness_mean: float | None
    fresh_mismatch_kl: float | None


@dataclass
class StepRecord:
    """One finished step (one line of ``log.jsonl``; times in seconds).

    The first block are the ``gridrl.v1.StepReport`` fields (:data:`STEP_REPORT_FIELDS`);
    ``loss``, ``mismatch_kl`` are 0 and the update block is absent when no sample survived
    admission (``updated`` False); the sync block is present at a push, the eval block at an
    eval (``eval_score`` not None).
    """

    step: int
    policy_version: int
    reward_mean: float
    reward_std: float
    loss: float
    eval_score: float | None
    eval_policy_version: int
    mismatch_kl: float
    staleness_mean: float
    dropped_samples: int
    rollout_s: float
    train_s: float
    sync_s: float
    nodes_synced: int
    nodes_skipped: int
    tokens_per_s: float
    elapsed_s: float
    # beyond StepReport
    rollout_wait_s: float
    collect_s: float
    staleness_max: int
    samples_used: int
    sampled_tokens: int
    solved_fraction: float
    groups_with_signal: int
    reward_funcs: dict[str, float | None]
    nodes: dict[str, NodeRecord]
    flagged_nodes: dict[str, str]
    excluded_samples: dict[str, int]  # flagged node -> its samples kept out of the update
    updated: bool
    data_position: int
    # after an update
    clip_fraction: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    ref_kl: float | None = None
    train_tokens: int | None = None
    # at a push
    synced_nodes: list[str] | None = None
    skipped_nodes: dict[str, str] | None = None
    lagging_nodes: list[str] | None = None
    # with an eval
    eval_exact: float | None = None
    eval_s: float | None = None
    eval_examples: list[dict[str, Any]] | None = None

    @classmethod
    def of_step(cls, batch: StepBatch, stats: UpdateStats | None, sync: SyncOutcome,
                evaluation: EvalResult | None, flagged: dict[str, str], *, policy_version: int,
                data_position: int, elapsed_s: float, collect_s: float,
                train_s: float) -> StepRecord:
        """The record of a step from its parts.

        Args:
            batch: the step's admitted samples and node counts (after
                :meth:`StepBatch.account_mismatch`).
            stats: the update's stats, None when nothing was trained.
            sync: the push of the step.
            evaluation: the eval of the step, if any.
            flagged: every node flagged so far -> why.
            policy_version: the trainer's version after the step.
            data_position: index of the next training prompt.
            elapsed_s: training seconds of the run so far.
            collect_s: wall-clock seconds the loop spent collecting the rollouts.
            train_s: seconds of the update.
        """
        ro = batch.rollouts
        staleness = batch.staleness
        nodes = {}
        for node, ns in batch.per_node.items():
            kept = ns.samples - ns.dropped
            nodes[node] = NodeRecord(samples=ns.samples, dropped=ns.dropped,
                                     versions=sorted(ns.versions or ()),
                                     staleness_mean=ns.staleness_sum / kept if kept else None,
                                     fresh_mismatch_kl=ns.fresh_kl)
        record = cls(
            step=batch.step, policy_version=policy_version,
            reward_mean=batch.reward_mean, reward_std=batch.reward_std,
            loss=stats.loss if stats else 0.0,
            eval_score=evaluation.score if evaluation else None,
            eval_policy_version=evaluation.policy_version if evaluation else 0,
            mismatch_kl=stats.mismatch_kl if stats else 0.0,
            staleness_mean=sum(staleness) / len(staleness) if staleness else 0.0,
            dropped_samples=batch.dropped,
            rollout_s=ro.generate_s, train_s=train_s, sync_s=sync.seconds,
            nodes_synced=len(sync.synced_nodes), nodes_skipped=len(sync.skipped_nodes),
            tokens_per_s=batch.sampled_tokens / ro.generate_s if ro.generate_s > 0 else 0.0,
            elapsed_s=elapsed_s,
            rollout_wait_s=ro.wait_s, collect_s=collect_s,
            staleness_max=max(staleness) if staleness else 0,
            samples_used=len(batch.samples), sampled_tokens=batch.sampled_tokens,
            solved_fraction=batch.solved_fraction, groups_with_signal=batch.groups_with_signal,
            reward_funcs=batch.reward_funcs, nodes=nodes, flagged_nodes=flagged,
            excluded_samples=dict(batch.excluded), updated=stats is not None,
            data_position=data_position)
        if stats is not None:
            record.clip_fraction, record.grad_norm, record.lr = (stats.clip_fraction,
                                                                 stats.grad_norm, stats.lr)
            record.ref_kl, record.train_tokens = stats.ref_kl, stats.tokens
        if sync.pushed:
            record.synced_nodes = sync.synced_nodes
            record.skipped_nodes = sync.skipped_nodes
            record.lagging_nodes = sync.lagging_nodes
        if evaluation is not None:
            record.eval_exact, record.eval_s = evaluation.exact, evaluation.seconds
            record.eval_examples = evaluation.examples
        return record

    def to_json(self) -> dict[str, Any]:
        """The ``log.jsonl`` record: every field by name, nodes as dicts; the update, sync and
        eval blocks only when the step had one."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "nodes":
                value = {node: vars(n).copy() for node, n in value.items()}
            out[f.name] = value
        for keys, present in ((_UPDATE_KEYS, self.updated),
                              (_SYNC_KEYS, self.synced_nodes is not None),
                              (_EVAL_KEYS, self.eval_score is not None)):
            if not present:
                for key in keys:
                    del out[key]
        return out

    def report(self) -> dict[str, Any]:
        """The ``gridrl.v1.StepReport`` fields of the record."""
        return step_report(self.to_json())


def step_report(record: dict[str, Any]) -> dict[str, Any]:
    """The ``gridrl.v1.StepReport`` fields of a ``log.jsonl`` step record (a resumed run
    republishes its earlier steps from the file)."""
    return {k: record.get(k) for k in STEP_REPORT_FIELDS}


def baseline_record(evaluation: EvalResult) -> dict[str, Any]:
    """The ``log.jsonl`` record of the base model's eval (policy version 0), before step 1."""
    return {"event": "baseline", "eval_score": evaluation.score, "eval_exact": evaluation.exact,
            "eval_policy_version": evaluation.policy_version,
            "eval_examples": evaluation.examples}
