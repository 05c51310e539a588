"""Each step's prompts and rollouts, sampled up to ``--async-steps`` steps ahead.

    source = EpisodeSource(env, backend.tokenizer, pool_or_local, limits)
    sampler = StepSampler(cfg, StepPrompts(cfg, source), source)
    sampled = sampler.get(step)    # SampledStep: items, prompt ids, the groups, timings
    sampler.close()

Step ``s`` takes ``--prompts-per-step`` items at data position ``(s - 1) * B`` from the
environment, renders them with the chat template (and the environment's tools) once
(:class:`StepPrompts`), and runs ``--group-size`` episodes of each through the episode source
(:class:`~gridrl.trainer.envs.source.EpisodeSource` over the node pool or the local sampler)
with the step's seed (:func:`step_seed`; each group's first turn then gets
:func:`gridrl.trainer.rollouts.group_seed`, exactly the single-turn group). Every task goes
this way; a single-turn task is the one-turn episode. The prompts travel with the groups and
the episodes' figures (:class:`SampledStep`): the loop takes them from one place.

``--async-steps K``: one background thread (:class:`Prefetcher`) asks for step after step, at
most K steps ahead of the step being trained; each step's groups carry the policy version they
were sampled with, and admission drops those older than ``--max-staleness``. With K = 0 the
rollouts of a step are requested when the step needs them (no thread). The loop and the
prefetch thread both ask for prompts, so their cache has a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.config import TrainConfig
from gridrl.trainer.envs.base import TaskItem
from gridrl.trainer.envs.source import EpisodeSource
from gridrl.trainer.rollouts import EpisodeStats, Group, StepRollouts, group_seed

#: a step's groups and the figures of their episodes
Sampled = tuple[list[Group], EpisodeStats]


def step_seed(seed: int, step: int) -> int:
    """Sampler seed of a step's rollout request (deterministic, distinct per step)."""
    return group_seed(seed, 1_000_000 + step)


@dataclass(frozen=True)
class SampledStep:
    """What a step trains on before admission: its prompts and their groups.

    Attributes:
        items: the task items (prompt text, reward columns), one per group.
        prompt_ids: their first turn's prompt token ids.
        rollouts: one group per prompt, in prompt order, the timings and the episodes'
            figures.
    """

    items: list[TaskItem]
    prompt_ids: list[list[int]]
    rollouts: StepRollouts


class StepPrompts:
    """The items and first-turn prompt token ids of each step (see the module docstring).

    Args:
        cfg: the run's settings (``--prompts-per-step``, ``--async-steps``).
        source: the episode source (its environment's items, its chat rendering).
    """

    def __init__(self, cfg: TrainConfig, source: EpisodeSource) -> None:
        self.per_step = cfg.prompts_per_step
        self.keep = cfg.async_steps + 1  # steps behind the asked one kept (the loop's)
        self.source = source
        self._cache: dict[int, tuple[list[TaskItem], list[list[int]]]] = {}
        self._lock = threading.Lock()

    def of(self, step: int) -> tuple[list[TaskItem], list[list[int]]]:
        """The task items and prompt token ids of ``step`` (tokenized once)."""
        with self._lock:
            for s in [s for s in self._cache if s < step - self.keep]:
                del self._cache[s]
            cached = self._cache.get(step)
            if cached is None:
                start = (step - 1) * self.per_step
                items = [self.source.env.train_item(i)
                         for i in range(start, start + self.per_step)]
                ids = self.source.prompt_ids(items)
                cached = self._cache[step] = (items, ids)
            return cached


class Prefetcher:
    """Produces :class:`StepRollouts` for increasing steps, up to ``depth`` steps ahead.

    Args:
        generate: ``generate(step) -> (groups, episode figures)`` (called on the background
            thread when ``depth > 0``; it must only touch thread-safe state, e.g. a
            ``NodePool``).
        depth: K, steps sampled ahead of the one being trained (0: no thread).
        last_step: no step after this one is requested.
    """

    def __init__(self, generate: Callable[[int], Sampled], *, depth: int,
                 last_step: int) -> None:
        self._generate = generate
        self.depth = depth
        self.last_step = last_step
        self._pending: dict[int, futures.Future[StepRollouts]] = {}
        self._executor = (futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-prefetch")
                          if depth > 0 else None)

    def _timed(self, step: int) -> StepRollouts:
        start = time.perf_counter()
        groups, episodes = self._generate(step)
        return StepRollouts(step=step, groups=groups, generate_s=time.perf_counter() - start,
                            episodes=episodes)

    def get(self, step: int) -> StepRollouts:
        """The rollouts of ``step``; also queues steps ``step+1 .. step+depth``.

        Raises:
            whatever the source raised for ``step`` (e.g. RuntimeError: no node can serve).
        """
        if self._executor is None:
            return self._timed(step)
        for s in range(step, min(step + self.depth, self.last_step) + 1):
            if s not in self._pending:
                self._pending[s] = self._executor.submit(self._timed, s)
        for s in [s for s in self._pending if s < step]:  # never used (should not happen)
            self._pending.pop(s).cancel()
        start = time.perf_counter()
        result = self._pending.pop(step).result()
        result.wait_s = time.perf_counter() - start
        return result

    def close(self) -> None:
        """Cancel queued steps and wait for the one in flight. Idempotent."""
        for f in self._pending.values():
            f.cancel()
        self._pending.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)


class StepSampler:
    """Each step's :class:`SampledStep` (see the module docstring).

    Args:
        cfg: the run's settings (sampling, seed, ``--async-steps``, ``--steps``).
        prompts: the steps' prompts.
        source: the episodes (over the node pool or the local sampler).
    """

    def __init__(self, cfg: TrainConfig, prompts: StepPrompts, source: EpisodeSource) -> None:
        self.cfg = cfg
        self.prompts = prompts
        self.source = source
        self._prefetcher = Prefetcher(self._sample, depth=cfg.async_steps, last_step=cfg.steps)

    def get(self, step: int) -> SampledStep:
        """The prompts and rollouts of ``step``; also queues the next ``--async-steps``.

        Raises:
            whatever the source raised for ``step`` (e.g. RuntimeError: no node can serve).
        """
        rollouts = self._prefetcher.get(step)
        items, prompt_ids = self.prompts.of(step)
        return SampledStep(items=items, prompt_ids=prompt_ids, rollouts=rollouts)

    def close(self) -> None:
        """Cancel queued steps and wait for the one in flight. Idempotent."""
        self._prefetcher.close()

    def _sample(self, step: int) -> Sampled:
        cfg = self.cfg
        items, prompt_ids = self.prompts.of(step)
        sampling = SamplingConfig(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                  top_p=cfg.top_p, top_k=cfg.top_k)
        return self.source.generate(items, sampling, prompt_ids=prompt_ids,
                                    group_size=cfg.group_size, seed=step_seed(cfg.seed, step))
