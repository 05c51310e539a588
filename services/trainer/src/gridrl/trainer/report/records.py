"""What a step leaves behind, as typed records: the adapter push (:class:`SyncOutcome`), the
step's record (:class:`StepRecord`) and the base model's eval (:class:`BaselineRecord`); and
what the run leaves at its end: ``summary.json`` (:class:`RunSummary`, with each held-out eval
an :class:`EvalPoint`; built by :class:`gridrl.trainer.report.summary.RunHistory`). The
reporter hands each to its subscribers (:mod:`gridrl.trainer.report.reporter`): one line of
``log.jsonl``, a ``gridrl.v1.StepReport`` (TrainerService, Prometheus), the trackers, the
console, the summary and the plot.

The JSON form (:meth:`StepRecord.to_json`) is the on-disk contract: its keys are what
``log.jsonl`` has always held (a resumed run reads them back typed, :meth:`StepRecord.from_json`),
so a field added here is added there under the same name (unless listed in
:data:`NOT_LOGGED`).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from gridrl.trainer.backends.base import UpdateStats
from gridrl.trainer.evaluation import EvalResult
from gridrl.trainer.grpo.batch import StepBatch

# Keys present only after an update, a sync or an eval (absent otherwise, not null).
_UPDATE_KEYS = ("clip_fraction", "grad_norm", "lr", "ref_kl", "train_tokens", "skipped_groups",
                "peak_rss_mb")
_SYNC_KEYS = ("synced_nodes", "skipped_nodes", "lagging_nodes")
_EVAL_KEYS = ("eval_exact", "eval_stderr", "eval_n", "eval_s", "eval_examples", "eval_metrics",
              "eval_scorer")
# Keys present only after an update with an importance-sampling correction (--is-correction).
IS_KEYS = ("is_weight_mean", "is_weight_max", "is_limited_fraction")
# Fields of a record that are published but not written to log.jsonl.
NOT_LOGGED = ("mismatch_kl_bound",)


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
        versions: policy versions its samples carried (every model turn of an episode), sorted.
        staleness_mean: mean staleness of its admitted samples (None when none).
        fresh_mismatch_kl: mismatch KL of its staleness-0 samples, nats/token (None: none).
        tokens_per_s: completion tokens it sampled for the step per second of its Generate
            calls (None: no timed group).
    """

    samples: int
    dropped: int
    versions: list[int]
    staleness_mean: float | None
    fresh_mismatch_kl: float | None
    tokens_per_s: float | None = None


@dataclass
class StepRecord:
    """One finished step (one line of ``log.jsonl``; times in seconds).

    The first block are the ``gridrl.v1.StepReport`` fields (same names, ``time`` aside);
    ``loss``, ``mismatch_kl`` are 0 and the update block is absent when no sample survived
    admission (``updated`` False); the sync block is present at a push, the eval block at an
    eval (``eval_score`` not None).

    The episode block (every task runs as episodes; a single-turn one has one turn each and
    no environment tokens): ``episodes`` run for the step (dropped ones included),
    ``turns_mean`` model turns per episode, ``model_tokens`` sampled by the model and
    ``env_tokens`` appended by the environment's turns (no gradient), ``truncated_episodes``
    cut by ``--max-turns`` / ``--max-episode-tokens``, ``dropped_episodes`` reason -> episodes
    not trained on (``env_error``, ``template``, ``sampler``, ``mixed_version``,
    ``mixed_node``), ``env_counts`` the environment's counters summed (``tool_calls``,
    ``tool_errors``, ``tool_timeouts``...). ``reward_funcs`` holds each reward function's mean;
    ``eval_metrics`` the environment's eval figures (e.g. ``first_attempt_success``,
    ``second_attempt_success``, ``turns_mean``); ``eval_exact`` the fraction of eval completions
    with full marks (score >= 1: for reverse-words the exact reversal) and ``eval_scorer`` what
    scored the eval. ``reward_error_groups``: groups left out because a reward function failed
    on them (``--on-reward-error drop``). ``reward_min`` / ``reward_max``: the range of the
    admitted samples' rewards (None when none was admitted).
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
    # the step's episodes
    episodes: int = 0
    turns_mean: float = 0.0
    model_tokens: int = 0
    env_tokens: int = 0
    truncated_episodes: int = 0
    dropped_episodes: dict[str, int] = field(default_factory=dict)  # reason -> episodes
    env_counts: dict[str, int] = field(default_factory=dict)  # tool_calls, tool_errors...
    reward_error_groups: int = 0
    reward_min: float | None = None  # the lowest and highest reward of the admitted samples
    reward_max: float | None = None
    # after an update
    clip_fraction: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    ref_kl: float | None = None
    train_tokens: int | None = None
    skipped_groups: int | None = None  # groups without signal left out of the update
    peak_rss_mb: float | None = None  # the trainer's peak resident memory in the update, MiB
    # after an update with an importance-sampling correction (UpdateStats.is_*)
    is_weight_mean: float | None = None
    is_weight_max: float | None = None
    is_limited_fraction: float | None = None
    # at a push
    synced_nodes: list[str] | None = None
    skipped_nodes: dict[str, str] | None = None
    lagging_nodes: list[str] | None = None
    # with an eval
    eval_exact: float | None = None
    eval_stderr: float | None = None
    eval_n: int | None = None
    eval_s: float | None = None
    eval_examples: list[dict[str, Any]] | None = None
    eval_metrics: dict[str, float] | None = None
    eval_scorer: str | None = None
    # published, not logged (NOT_LOGGED): the loosest mismatch bound applied to the step's
    # nodes, nats/token (None: not judged, e.g. a record read back from log.jsonl)
    mismatch_kl_bound: float | None = None

    @classmethod
    def of_step(cls, batch: StepBatch, stats: UpdateStats | None, sync: SyncOutcome,
                evaluation: EvalResult | None, flagged: dict[str, str], *, policy_version: int,
                data_position: int, elapsed_s: float, collect_s: float,
                train_s: float, mismatch_kl_bound: float | None = None) -> StepRecord:
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
            mismatch_kl_bound: the loosest mismatch bound applied to the step's nodes.
        """
        ro = batch.rollouts
        episodes = ro.episodes
        staleness = batch.staleness
        drawn: dict[str, tuple[int, float]] = {}  # node -> (tokens, seconds) of its groups
        for group in ro.groups:
            tokens, seconds = drawn.get(group.node, (0, 0.0))
            drawn[group.node] = (tokens + sum(len(s.token_ids) for s in group.samples),
                                 seconds + group.seconds)
        nodes = {}
        for node, ns in batch.per_node.items():
            kept = ns.samples - ns.dropped
            tokens, seconds = drawn.get(node, (0, 0.0))
            nodes[node] = NodeRecord(samples=ns.samples, dropped=ns.dropped,
                                     versions=sorted(ns.versions or ()),
                                     staleness_mean=ns.staleness_sum / kept if kept else None,
                                     fresh_mismatch_kl=ns.fresh_kl,
                                     tokens_per_s=tokens / seconds if seconds > 0 else None)
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
            data_position=data_position, episodes=episodes.episodes,
            turns_mean=episodes.turns_mean, model_tokens=episodes.model_tokens,
            env_tokens=episodes.env_tokens, truncated_episodes=episodes.truncated,
            dropped_episodes={r.value: n for r, n in sorted(episodes.dropped.items())},
            env_counts=dict(sorted(episodes.counts.items())),
            reward_error_groups=batch.reward_error_groups,
            mismatch_kl_bound=mismatch_kl_bound)
        rewards = [a.reward for a in batch.samples]
        if rewards:
            record.reward_min, record.reward_max = float(min(rewards)), float(max(rewards))
        if stats is not None:
            record.clip_fraction, record.grad_norm, record.lr = (stats.clip_fraction,
                                                                 stats.grad_norm, stats.lr)
            record.ref_kl, record.train_tokens = stats.ref_kl, stats.tokens
            record.skipped_groups = stats.skipped_groups
            if stats.peak_rss_bytes is not None:
                record.peak_rss_mb = round(stats.peak_rss_bytes / (1 << 20), 1)
            record.is_weight_mean = stats.is_weight_mean
            record.is_weight_max = stats.is_weight_max
            record.is_limited_fraction = stats.is_limited_fraction
        if sync.pushed:
            record.synced_nodes = sync.synced_nodes
            record.skipped_nodes = sync.skipped_nodes
            record.lagging_nodes = sync.lagging_nodes
        if evaluation is not None:
            record.eval_exact, record.eval_s = evaluation.exact, evaluation.seconds
            record.eval_stderr, record.eval_n = evaluation.stderr, evaluation.n
            record.eval_examples = evaluation.examples
            record.eval_metrics = dict(evaluation.metrics)
            record.eval_scorer = evaluation.scorer
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
                              (_EVAL_KEYS, self.eval_score is not None),
                              (IS_KEYS, self.is_weight_mean is not None),
                              (NOT_LOGGED, False)):
            if not present:
                for key in keys:
                    del out[key]
        return out

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> StepRecord:
        """A ``log.jsonl`` step record read back (a resumed run's earlier steps). Keys this
        version does not know are ignored; a key an older version did not write takes its
        field's default (an empty value of its type for the fields that always have one)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in record:
                values[f.name] = record[f.name]
            elif f.default is MISSING:
                values[f.name] = _empty(str(f.type))
        values["nodes"] = {node: NodeRecord(**n) for node, n in (values["nodes"] or {}).items()}
        return cls(**values)


def _empty(annotation: str) -> Any:
    """The empty value of a field's type (``"dict[str, int]"`` -> ``{}``)."""
    if "None" in annotation:
        return None
    for prefix, value in (("dict", {}), ("list", []), ("int", 0), ("float", 0.0),
                          ("bool", False)):
        if annotation.startswith(prefix):
            return value
    return None


@dataclass(frozen=True)
class BaselineRecord:
    """The base model's eval (policy version 0), before step 1: the ``log.jsonl`` line with
    ``"event": "baseline"``.

    Attributes: as :class:`~gridrl.trainer.evaluation.EvalResult` (``eval_score`` its score).
    """

    eval_score: float
    eval_exact: float
    eval_stderr: float | None
    eval_n: int
    eval_policy_version: int
    eval_examples: list[dict[str, Any]] = field(default_factory=list)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    eval_scorer: str = ""

    @classmethod
    def of(cls, evaluation: EvalResult) -> BaselineRecord:
        """The record of the base model's eval."""
        return cls(eval_score=evaluation.score, eval_exact=evaluation.exact,
                   eval_stderr=evaluation.stderr, eval_n=evaluation.n,
                   eval_policy_version=evaluation.policy_version,
                   eval_examples=evaluation.examples, eval_metrics=dict(evaluation.metrics),
                   eval_scorer=evaluation.scorer)

    def to_json(self) -> dict[str, Any]:
        """The ``log.jsonl`` record (``"event": "baseline"``, no ``step``)."""
        return {"event": "baseline", **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> BaselineRecord:
        """The ``log.jsonl`` baseline record read back (older runs' lack some keys)."""
        return cls(eval_score=record["eval_score"], eval_exact=record.get("eval_exact", 0.0),
                   eval_stderr=record.get("eval_stderr"), eval_n=record.get("eval_n", 0),
                   eval_policy_version=record.get("eval_policy_version", 0),
                   eval_examples=record.get("eval_examples") or [],
                   eval_metrics=record.get("eval_metrics") or {},
                   eval_scorer=record.get("eval_scorer") or "")


@dataclass(frozen=True)
class EvalPoint:
    """One held-out eval of the run: at ``step``, of ``policy_version``, ``score`` ±
    ``stderr``, ``exact`` of its completions with full marks, ``elapsed_s`` training seconds
    into the run, taking ``eval_s`` seconds; ``metrics`` the environment's own figures (e.g.
    first- and second-attempt success); ``scorer`` what scored it."""

    step: int
    score: float
    policy_version: int
    stderr: float | None
    elapsed_s: float | None
    eval_s: float | None
    metrics: dict[str, float] = field(default_factory=dict)
    exact: float | None = None
    scorer: str | None = None


@dataclass(frozen=True)
class RunSummary:
    """``summary.json``: totals and scores of a finished run (times in seconds; evals in
    [0, 1]; ``*_eval_exact`` the fraction of eval completions with full marks, beside the
    score; ``eval_scorer`` what scored the evals; ``rollout``: the nodes that served the run,
    or ``"local"``; the episode totals over the steps of the records kept, ``turns_mean`` per
    episode; ``*_eval_metrics`` the environment's own eval figures; ``reward_error_groups``:
    groups left out for a reward function's failure; ``reward_funcs_first10`` /
    ``reward_funcs_last10`` each reward function's mean over the first / last 10 steps, before
    weighting); ``baseline_eval_examples`` / ``final_eval_examples`` the first episodes of the
    baseline's and the last eval, whole (:func:`gridrl.trainer.evaluation.eval_example`: the
    prompt, every model and environment turn with its role, the score)."""

    run_name: str | None
    model: str
    task: str
    steps: int
    total_steps: int
    policy_version: int
    baseline_eval: float | None
    baseline_eval_stderr: float | None
    final_eval: float | None
    final_eval_stderr: float | None
    final_eval_policy_version: int | None
    best_eval: float | None
    baseline_eval_exact: float | None
    final_eval_exact: float | None
    eval_scorer: str
    baseline_eval_metrics: dict[str, float]
    final_eval_metrics: dict[str, float]
    eval_tasks: int
    evals: list[EvalPoint]
    reward_mean_first10: float | None
    reward_mean_last10: float | None
    elapsed_s: float
    seconds_per_step: float
    dropped_samples: int
    episodes: int
    turns_mean: float | None
    model_tokens: int
    env_tokens: int
    truncated_episodes: int
    dropped_episodes: dict[str, int]
    env_counts: dict[str, int]
    reward_error_groups: int
    flagged_nodes: dict[str, str]
    resumed_at: list[int]
    rollout: str | list[str]
    master: str | None
    adapter: str
    adapter_mlx: str | None
    adapter_mlx_error: str | None
    plot: str
    reward_funcs_first10: dict[str, float] = field(default_factory=dict)
    reward_funcs_last10: dict[str, float] = field(default_factory=dict)
    baseline_eval_examples: list[dict[str, Any]] = field(default_factory=list)
    final_eval_examples: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The ``summary.json`` object (its keys are the field names)."""
        return asdict(self)
