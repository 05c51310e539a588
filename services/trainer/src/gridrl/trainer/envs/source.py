"""A step's GRPO groups from an environment: ``G`` episodes per item, run over a turn sampler
(the in-process :class:`~gridrl.trainer.local.LocalRollout`, or a node pool whose requests of
one group go to one node), as :class:`~gridrl.trainer.rollouts.Group` s of episode samples for
:func:`gridrl.trainer.grpo.batch.build_batch`.

    source = EpisodeSource(env, tokenizer, sampler, EpisodeLimits(max_turns=2, max_tokens=24))
    groups, stats = source.generate(items, SamplingConfig(max_tokens=24), group_size=8,
                                    seed=step_seed)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.envs.base import Environment, TaskItem
from gridrl.trainer.envs.chat import ChatDelta, prompt_ids
from gridrl.trainer.envs.episode import EpisodeLimits, TurnRequest, run_episodes
from gridrl.trainer.rollouts import EpisodeStats, Group, RolloutSample


class TurnSampler(Protocol):
    """What samples episode turns: :class:`~gridrl.trainer.local.LocalRollout` or the node
    pool (:class:`~gridrl.trainer.fleet.pool.NodePool`)."""

    def sample_turns(self, requests: Sequence[TurnRequest], sampling: SamplingConfig
                     ) -> list[list[RolloutSample] | BaseException]:
        """Per request, its ``n`` samples (or the exception that failed it), sampled under
        ``sampling`` with the request's own ``max_tokens``."""
        ...

    def close(self) -> None:
        """Release threads and connections. Idempotent."""
        ...


class EpisodeSource:
    """Episodes of ``env`` sampled by ``sampler``, grouped for GRPO.

    Args:
        env: the environment (its :meth:`~gridrl.trainer.envs.base.Environment.prepare` is
            called here with ``tokenizer``).
        tokenizer: the run's tokenizer (chat template, decode).
        sampler: the turn sampler.
        limits: turns and tokens.
    """

    def __init__(self, env: Environment, tokenizer: Any, sampler: TurnSampler,
                 limits: EpisodeLimits) -> None:
        self.env = env
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.limits = limits
        env.prepare(tokenizer)
        self.tools = env.template_tools()
        self.delta = ChatDelta(tokenizer, self.tools)

    def prompt_ids(self, items: Sequence[TaskItem]) -> list[list[int]]:
        """The first turn's prompt of each item (its messages, the tools)."""
        return [prompt_ids(self.tokenizer, item.messages, self.tools) for item in items]

    def generate(self, items: Sequence[TaskItem], sampling: SamplingConfig, *, group_size: int,
                 seed: int = 0, prompt_ids: Sequence[Sequence[int]] | None = None
                 ) -> tuple[list[Group], EpisodeStats]:
        """Run ``group_size`` episodes of each item (``prompt_ids``: their
        :meth:`prompt_ids`, when the caller has them already), every model turn sampled under
        ``sampling`` (temperature, top-p, top-k, stop ids; a turn's new tokens are bounded by
        ``limits``, not ``sampling.max_tokens``).

        Returns:
            one :class:`Group` per item (``prompt_ids`` the first turn's; ``samples`` its
            episodes that were not dropped, each with its ``loss_mask`` and ``episode``;
            ``seconds`` the longest of its episodes' sampler time, which for one turn is the
            group's request), and the episodes' :class:`EpisodeStats` (dropped ones
            included).
        """
        prompts = [list(p) for p in prompt_ids] if prompt_ids is not None else \
            self.prompt_ids(items)

        def sample(requests: list[TurnRequest]) -> list[Any]:
            return self.sampler.sample_turns(requests, sampling)

        runs = run_episodes(self.env, items, prompts, sample, self.delta, self.limits,
                            group_size=group_size, seed=seed,
                            decode=lambda ids: self.tokenizer.decode(ids,
                                                                     skip_special_tokens=True))
        groups = []
        for i, episodes in enumerate(runs):
            kept = [ep.sample() for ep in episodes if not ep.dropped]
            groups.append(Group(prompt_index=i, prompt_ids=prompts[i], samples=kept,
                                node=kept[0].node if kept else "",
                                seconds=max((ep.seconds for ep in episodes), default=0.0)))
        return groups, EpisodeStats.of([ep for episodes in runs for ep in episodes])
