"""``--rollout local``: sample in-process with the trainer backend's own sampler
(:meth:`gridrl.trainer.backends.base.TrainerBackend.generate`), for a single machine.

The sampler shares the weights being trained, so every sample carries the trainer's current
policy version and there is nothing to push. Sampling semantics (temperature, top-k, top-p,
stop tokens, exact behaviour logprobs) are those of every rollout node
(``gridrl.engine.contract``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from gridrl.engine.contract import SamplingConfig
from gridrl.engine.rng import sequence_seed
from gridrl.trainer.envs.episode import TurnRequest
from gridrl.trainer.rollouts import RolloutSample

LOCAL = "local"


class LocalRollout:
    """A turn sampler (:class:`gridrl.trainer.envs.source.TurnSampler`) over the trainer's own
    model.

    Args:
        backend: the :class:`gridrl.trainer.backends.base.TrainerBackend` being trained.
        version: returns the trainer's current policy version (stamped on every sample).
    """

    def __init__(self, backend: Any, version: Callable[[], int]) -> None:
        self.backend = backend
        self.version = version

    def sample_turns(self, requests: Sequence[TurnRequest], sampling: SamplingConfig, *,
                     shared_prefix: bool = False) -> list[list[RolloutSample]]:
        """Sample every request (an episode runner's :data:`~gridrl.trainer.envs.episode.
        Sampler`) under ``sampling`` (temperature, top-p, top-k, stop ids; each request's own
        ``max_tokens`` replaces ``sampling.max_tokens``): sample ``k`` of a request is seeded
        ``sequence_seed(request.seed, k)``, as a node's ``Generate`` seeds it; requests with the
        same ``max_tokens`` are decoded in one ``backend.generate`` call (a one-turn
        environment's step: one call for all its groups).

        Returns:
            per request, its ``n`` samples, stamped with the trainer's current version (and
            the seconds of the ``backend.generate`` call that sampled them).
        """
        version = self.version()
        decode = self.backend.tokenizer.decode
        out: list[list[RolloutSample]] = [[] for _ in requests]
        for budget in dict.fromkeys(r.max_tokens for r in requests):
            config = dataclasses.replace(sampling, max_tokens=budget)
            chosen = [i for i, r in enumerate(requests) if r.max_tokens == budget]
            flat_prompts, seeds = [], []
            for i in chosen:
                for k in range(requests[i].n):
                    flat_prompts.append(list(requests[i].prompt_ids))
                    seeds.append(sequence_seed(requests[i].seed, k))  # as the engine seeds it
            start = time.perf_counter()
            results = iter(self.backend.generate(flat_prompts, config, seeds,
                                                 **({"shared_prefix": True}
                                                    if shared_prefix else {})))
            seconds = time.perf_counter() - start
            for i in chosen:
                out[i] = [RolloutSample(token_ids=list(r.token_ids), logprobs=list(r.logprobs),
                                        text=decode(r.token_ids, skip_special_tokens=True),
                                        finish_reason=r.finish_reason, policy_version=version,
                                        node=LOCAL, seconds=seconds)
                          for r in (next(results) for _ in range(requests[i].n))]
        return out

    def close(self) -> None:
        """Nothing to release (the model belongs to the backend)."""
