"""``--async-steps K``: sample the next K steps' rollouts while the current step trains.

One background thread asks the rollout source for step after step, at most K steps ahead of
the step being trained; each step's groups carry the policy version they were sampled with,
and the loop drops those older than ``--max-staleness``. With K = 0 the rollouts of a step are
requested when the step needs them (no thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any


@dataclass
class StepRollouts:
    """The rollouts of one step.

    Attributes:
        step: the step they are for.
        groups: one :class:`gridrl.trainer.rollouts.Group` per prompt, in prompt order.
        generate_s: wall-clock seconds the source took to produce them.
        wait_s: seconds the training loop waited for them (0 when prefetched in time).
    """

    step: int
    groups: list[Any]
    generate_s: float
    wait_s: float = 0.0


class Prefetcher:
    """Produces :class:`StepRollouts` for increasing steps, up to ``depth`` steps ahead.

    Args:
        generate: ``generate(step) -> list[Group]`` (called on the background thread when
            ``depth > 0``; it must only touch thread-safe state, e.g. a ``NodePool``).
        depth: K, steps sampled ahead of the one being trained (0: no thread).
        last_step: no step after this one is requested.
    """

    def __init__(self, generate: Callable[[int], list[Any]], *, depth: int, last_step: int) -> None:
        self._generate = generate
        self.depth = depth
        self.last_step = last_step
        self._pending: dict[int, futures.Future] = {}
        self._executor = (futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-prefetch")
                          if depth > 0 else None)

    def _timed(self, step: int) -> StepRollouts:
        start = time.perf_counter()
        groups = self._generate(step)
        return StepRollouts(step=step, groups=groups, generate_s=time.perf_counter() - start)

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
