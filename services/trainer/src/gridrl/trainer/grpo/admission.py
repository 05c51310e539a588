"""Which samples of a step enter the update: pure rules over the step's groups.

    admitted = admit(rollouts.groups, lineage=state.lineage, max_staleness=2,
                     flagged={"10.0.0.7:50051": "mismatched: ..."})
    admitted.kept          # (group index, sample index, sample) that enter the update
    admitted.per_node      # what each judged node produced (the monitor's input)
    admitted.excluded      # flagged node -> samples kept out

A sample enters the update when

- its node is not flagged: a node whose samples were stale or mismatched for ``--flag-after``
  steps (``monitor.py``) is benched, and every sample of it that still arrives (groups in
  flight or prefetched when it was flagged) is kept out until it serves the current version
  again and passes a fresh mismatch check (``probation.py``); those samples are counted in
  ``excluded``, not judged again (they say nothing new about the node);
- its policy version is in the lineage of the trainer's weights (versions of a killed run, or
  of another run's adapter, are dropped and counted as ``unknown_version``);
- its staleness, the number of updates between its version and the weights being trained
  (the lineage's versions newer than its own), is at most ``max_staleness``. Updates, not
  steps: a step in which no sample survived makes no update and mints no version, so the
  next step's samples of the current version are fresh (staleness 0), not one step old.

No threads, no RPC, no tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class NodeStepStats:
    """One node's samples in one step.

    Attributes:
        samples: samples received from the node.
        dropped: samples dropped as too stale or of a version outside the run's lineage.
        unknown_version: of ``dropped``, those whose version is not in the lineage.
        staleness_sum: sum of the staleness of the samples kept.
        fresh_kl_sum: sum over kept samples of staleness 0 of (per-token mismatch KL * tokens).
        fresh_tokens: tokens of those samples.
        versions: the policy versions seen (of every model turn of a multi-turn episode,
            so a record shows that no trained episode spans two versions).
        low_precision: the node or the trainer computes in a 16-bit float dtype.
    """

    samples: int = 0
    dropped: int = 0
    unknown_version: int = 0
    staleness_sum: float = 0.0
    fresh_kl_sum: float = 0.0
    fresh_tokens: int = 0
    versions: set[int] | None = None
    low_precision: bool = False

    @property
    def fresh_kl(self) -> float | None:
        """Mean mismatch KL per token over the node's staleness-0 samples, or None."""
        return self.fresh_kl_sum / self.fresh_tokens if self.fresh_tokens else None


@dataclass
class Admission:
    """The admission of one step's samples.

    Attributes:
        kept: (group index, sample index, sample) of every sample that enters the update, in
            group then sample order.
        staleness: the staleness of each kept sample (same order).
        per_node: node address -> its judged samples (flagged nodes' samples are not judged).
        excluded: flagged node address -> its samples kept out.
        sampled_tokens: completion tokens of every sample received, kept or not (the model's:
            a multi-turn episode's environment tokens are not counted).
    """

    kept: list[tuple[int, int, Any]] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    per_node: dict[str, NodeStepStats] = field(default_factory=dict)
    excluded: dict[str, int] = field(default_factory=dict)
    sampled_tokens: int = 0

    @property
    def dropped(self) -> int:
        """Samples dropped as too stale or of a version outside the lineage."""
        return sum(ns.dropped for ns in self.per_node.values())


def admit(groups: Sequence[Any], *, lineage: Mapping[int, int], max_staleness: int,
          flagged: Mapping[str, str] | frozenset[str] = frozenset()) -> Admission:
    """Decide which samples of ``groups`` enter the update (see the module docstring).

    Args:
        groups: the step's :class:`~gridrl.trainer.rollouts.Group` s, one per prompt; each
            sample has ``token_ids``, ``policy_version`` and ``node``.
        lineage: policy version -> the step whose weights it names (version 0: step 0), for
            every version of the weights being trained; the newest is those weights.
        max_staleness: the largest staleness kept (>= 0).
        flagged: addresses of the nodes benched for their samples.
    Returns:
        the :class:`Admission`.
    """
    out = Admission()
    newer = _updates_since(lineage)
    for b, group in enumerate(groups):
        for j, s in enumerate(group.samples):
            out.sampled_tokens += len(s.token_ids) if s.loss_mask is None else sum(s.loss_mask)
            if s.node in flagged:
                out.excluded[s.node] = out.excluded.get(s.node, 0) + 1
                continue
            ns = out.per_node.setdefault(s.node, NodeStepStats(versions=set()))
            ns.samples += 1
            assert ns.versions is not None
            ns.versions.add(s.policy_version)
            if s.episode is not None:
                ns.versions.update(s.episode.turn_versions)
            age = newer.get(s.policy_version)
            if age is None:
                ns.dropped += 1
                ns.unknown_version += 1
                continue
            if age > max_staleness:
                ns.dropped += 1
                continue
            ns.staleness_sum += age
            out.kept.append((b, j, s))
            out.staleness.append(age)
    return out


def _updates_since(lineage: Mapping[int, int]) -> dict[int, int]:
    """Version -> how many versions of ``lineage`` are newer (its staleness in updates)."""
    ordered = sorted(lineage, reverse=True)
    return {v: i for i, v in enumerate(ordered)}


def readmission(versions: Sequence[int], current_version: int, kl: float | None,
                bound: float) -> str:
    """Whether a flagged node's fresh check group lets it back into rotation.

    Args:
        versions: the policy version of each sample of the check group.
        current_version: the trainer's policy version (its weights gave ``kl``).
        kl: mean mismatch KL(behaviour || trainer) per token of the check group, nats (None:
            no token to measure).
        bound: the node's mismatch bound (``--mismatch-kl-max``, or the 16-bit one).
    Returns:
        "" when it passes, else why not.
    """
    if not versions or any(v != current_version for v in versions):
        return (f"sampled with policy version(s) {','.join(str(v) for v in sorted(set(versions)))}"
                f", not the current {current_version}")
    if kl is None:
        return "the check group has no token to measure"
    if not kl <= bound:
        return f"KL(behaviour || trainer) {kl:.2e} nats/token > {bound:g}"
    return ""
