"""A step's training batch from its rollouts, framework-free: admission, rewards, group
advantages.

    batch = build_batch(step, rollouts, items, prompt_ids, lineage=..., bound=...,
                        rewards=reward_set, scale_rewards=True, advantage_eps=1e-4)
    batch.sequences          # list[TrainSequence] for TrainerBackend.update
    batch.samples            # list[AdmittedSample]: where each sequence came from, its reward
    batch.per_node           # node -> NodeStepStats for the node monitor

Admission (:func:`gridrl.trainer.grpo.admission.admit`): a sample of policy version ``v`` was sampled
with the weights after step ``lineage[v]``; the batch trains the newest version of the lineage,
and the sample's staleness is the number of updates between the two (the lineage's versions
newer than ``v``; a step without an update adds none). A sample whose version is not in
the lineage (a killed run's last pushes, another run's adapter) or whose staleness exceeds
``bound`` is dropped and counted against its node; samples of flagged nodes are kept out.
Advantages are computed over the admitted samples of each group only
(:func:`gridrl.trainer.grpo.advantages.group_advantages` with a mask).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gridrl.trainer.envs.episode import reward_columns
from gridrl.trainer.grpo import advantages as grpo
from gridrl.trainer.grpo.admission import NodeStepStats, admit
from gridrl.trainer.grpo.sequences import TrainSequence
from gridrl.trainer.rewards import RewardError
from gridrl.trainer.rollouts import RolloutSample, StepRollouts


@dataclass(frozen=True)
class AdmittedSample:
    """A sample that passed admission, with what the step made of it.

    Attributes:
        group: index of its group (prompt) in the step.
        index: its index within the group.
        sample: the rollout sample as the node returned it (node, policy version, tokens,
            behaviour logprobs, text).
        staleness: trainer step minus the step of the sample's policy version (>= 0).
        reward: its combined reward.
        sequence: what the backend trains on (advantage included).
    """

    group: int
    index: int
    sample: RolloutSample
    staleness: int
    reward: float
    sequence: TrainSequence


@dataclass
class StepBatch:
    """Everything rank 0 gathered for one step before the update.

    Attributes:
        step: the step.
        rollouts: the step's groups and timings (:class:`~gridrl.trainer.rollouts.StepRollouts`).
        samples: the admitted samples, in group then sample order.
        per_node: node address (or ``"local"``) -> its samples, drops and staleness this step.
        sampled_tokens: completion tokens of every sample, admitted or not.
        reward_funcs: reward function name -> mean over admitted samples (None when a function
            returned no number for any of them).
        groups_with_signal: groups with a non-zero advantage (a group of equal rewards teaches
            nothing).
        excluded: flagged node -> its samples kept out of the step.
        reward_error_groups: groups left out because a reward function failed on them
            (``--on-reward-error drop``); ``reward_error``: the first such failure, in words.
    """

    step: int
    rollouts: StepRollouts
    samples: list[AdmittedSample] = field(default_factory=list)
    per_node: dict[str, NodeStepStats] = field(default_factory=dict)
    sampled_tokens: int = 0
    reward_funcs: dict[str, float | None] = field(default_factory=dict)
    groups_with_signal: int = 0
    excluded: dict[str, int] = field(default_factory=dict)
    reward_error_groups: int = 0
    reward_error: str = ""

    @property
    def sequences(self) -> list[TrainSequence]:
        """The training sequences, one per admitted sample, in the same order."""
        return [a.sequence for a in self.samples]

    @property
    def dropped(self) -> int:
        """Samples dropped by admission (too stale, or of an unknown version)."""
        return sum(ns.dropped for ns in self.per_node.values())

    @property
    def staleness(self) -> list[int]:
        """Staleness of each admitted sample."""
        return [a.staleness for a in self.samples]

    @property
    def reward_mean(self) -> float:
        """Mean reward over admitted samples (0 when none)."""
        return float(np.mean(self._rewards())) if self.samples else 0.0

    @property
    def reward_std(self) -> float:
        """Population std of the rewards over admitted samples (0 when none)."""
        return float(np.std(self._rewards())) if self.samples else 0.0

    @property
    def solved_fraction(self) -> float:
        """Fraction of admitted samples with reward >= 1."""
        if not self.samples:
            return 0.0
        return float(sum(a.reward >= 1.0 for a in self.samples) / len(self.samples))

    def _rewards(self) -> np.ndarray:
        return np.asarray([a.reward for a in self.samples], dtype=np.float64)

    def account_mismatch(self, per_sequence_kl: Sequence[float]) -> None:
        """Add each fresh (staleness 0) sample's mismatch KL to its node's stats, weighted by
        its tokens; ``per_sequence_kl`` is ``UpdateStats.per_sequence_mismatch_kl`` (one per
        :attr:`sequences` entry, same order; NaN for a sequence the update skipped)."""
        for a, kl in zip(self.samples, per_sequence_kl, strict=True):
            if a.staleness == 0 and kl == kl:  # NaN: a skipped group's, not measured
                ns = self.per_node[a.sample.node]
                ns.fresh_kl_sum += kl * a.sequence.trained_tokens
                ns.fresh_tokens += a.sequence.trained_tokens


def build_batch(step: int, rollouts: StepRollouts, items: Sequence[Any],
                prompt_ids: Sequence[Sequence[int]], *, lineage: Mapping[int, int], bound: int,
                rewards: Callable[..., tuple[list[float], dict[str, list[float]]]],
                scale_rewards: bool, advantage_eps: float,
                flagged: Mapping[str, str] | frozenset[str] = frozenset(),
                on_reward_error: str = "fail") -> StepBatch:
    """Admit, score and weigh the rollouts of ``step``.

    Args:
        step: the step (its weights are those after ``step - 1``).
        rollouts: the step's groups, one per prompt.
        items: the step's :class:`~gridrl.trainer.envs.base.TaskItem` s (prompt text, columns).
        prompt_ids: their prompt token ids.
        lineage: policy version -> the step whose weights it names.
        bound: the largest staleness admitted (``--max-staleness``).
        rewards: the run's :class:`~gridrl.trainer.rewards.RewardSet`:
            ``rewards(prompts, completions, columns) -> (combined, per_function)``.
        scale_rewards, advantage_eps: ``--scale-rewards``, ``--advantage-eps``.
        flagged: nodes whose samples are kept out.
        on_reward_error: ``--on-reward-error``: ``fail`` (a reward function's failure is
            raised) or ``drop`` (the groups it fails on are left out, counted).
    Raises:
        RewardError: a reward function failed (``fail``), naming it, its file and ``step``.
    """
    admission = admit(rollouts.groups, lineage=lineage, max_staleness=bound, flagged=flagged)
    admitted = [(b, j, s, age) for (b, j, s), age in zip(admission.kept, admission.staleness,
                                                         strict=True)]
    combined: list[float] = []
    per_func: dict[str, list[float]] = {}
    error_groups, error = 0, ""
    if admitted:
        try:
            combined, per_func = _score(admitted, items, rewards)
        except RewardError as e:
            if on_reward_error != "drop":
                raise e.at_step(step) from e
            # score group by group; leave out the groups a function fails on
            kept: list[Any] = []
            for b in dict.fromkeys(a[0] for a in admitted):
                group = [a for a in admitted if a[0] == b]
                try:
                    values, per = _score(group, items, rewards)
                except RewardError as ge:
                    error_groups += 1
                    error = error or str(ge.at_step(step))
                    continue
                kept += group
                combined += values
                for name, v in per.items():
                    per_func.setdefault(name, []).extend(v)
            admitted = kept
    g_max = max((len(g.samples) for g in rollouts.groups), default=0)
    reward_grid = np.zeros((len(rollouts.groups), max(g_max, 1)), dtype=np.float32)
    mask = np.zeros_like(reward_grid)
    for (b, j, _, _), r in zip(admitted, combined, strict=True):
        reward_grid[b, j] = r
        mask[b, j] = 1.0
    adv = grpo.group_advantages(reward_grid, scale_std=scale_rewards, eps=advantage_eps,
                                mask=mask)
    samples = [
        AdmittedSample(group=b, index=j, sample=s, staleness=age, reward=float(r),
                       sequence=TrainSequence(prompt_ids=tuple(prompt_ids[b]),
                                              completion_ids=tuple(s.token_ids),
                                              behaviour_logprobs=tuple(s.logprobs),
                                              advantage=float(adv[b, j]), group=b,
                                              loss_mask=None if s.loss_mask is None
                                              else tuple(s.loss_mask)))
        for (b, j, s, age), r in zip(admitted, combined, strict=True)]
    return StepBatch(
        step=step, rollouts=rollouts, samples=samples, per_node=admission.per_node,
        sampled_tokens=admission.sampled_tokens,
        reward_funcs={k: _nanmean(v) for k, v in per_func.items()},
        groups_with_signal=int(np.count_nonzero(np.any(np.abs(adv) > 0, axis=1))),
        excluded=admission.excluded, reward_error_groups=error_groups, reward_error=error)


def _score(admitted: Sequence[tuple[int, int, RolloutSample, int]], items: Sequence[Any],
           rewards: Callable[..., tuple[list[float], dict[str, list[float]]]]
           ) -> tuple[list[float], dict[str, list[float]]]:
    """The rewards of ``admitted`` samples (group, index, sample, staleness): the items'
    columns, ``completion_ids`` and the episode columns."""
    columns: dict[str, list[Any]] = {
        key: [items[b].columns.get(key) for b, _, _, _ in admitted]
        for key in items[0].columns}
    columns["completion_ids"] = [list(s.token_ids) for _, _, s, _ in admitted]
    if any(s.episode is not None for _, _, s, _ in admitted):  # multi-turn columns
        columns.update({k: v for k, v in reward_columns(
            [s.episode for _, _, s, _ in admitted]).items() if k not in columns})
    return rewards([items[b].prompt for b, _, _, _ in admitted],
                   [s.text for _, _, s, _ in admitted], columns)


def _nanmean(values: Sequence[float]) -> float | None:
    """Mean of the values that are not NaN; None when there are none."""
    if not values or np.all(np.isnan(values)):
        return None
    return float(np.nanmean(values))
