"""``--rollout local``: sample in-process with the trainer backend's own sampler
(:meth:`gridrl.trainer.backends.base.TrainerBackend.generate`), for a single machine.

The sampler shares the weights being trained, so every sample carries the trainer's current
policy version and there is nothing to push. Sampling semantics (temperature, top-k, top-p,
stop tokens, exact behaviour logprobs) are those of every rollout node
(``gridrl.engine.contract``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from gridrl.trainer.envs.episode import TurnRequest
from gridrl.trainer.rollouts import Group, RolloutSample, group_seed

LOCAL = "local"


class LocalRollout:
    """A :class:`gridrl.trainer.rollouts.RolloutSource` over the trainer's own model.

    Args:
        backend: the :class:`gridrl.trainer.backends.base.TrainerBackend` being trained.
        version: returns the trainer's current policy version (stamped on every sample).
    """

    def __init__(self, backend: Any, version: Callable[[], int]) -> None:
        self.backend = backend
        self.version = version

    def generate_groups(self, prompts: Sequence[Sequence[int]], *, group_size: int,
                        max_tokens: int, temperature: float, top_p: float = 1.0, top_k: int = 0,
                        seed: int = 0, stop_token_ids: Sequence[int] = ()) -> list[Group]:
        """See :meth:`gridrl.trainer.rollouts.RolloutSource.generate_groups`. All groups of the
        call are decoded together."""
        requests = [TurnRequest(tuple(p), group_seed(seed, i), group_size, max_tokens, group=i)
                    for i, p in enumerate(prompts)]
        start = time.perf_counter()
        results = self.sample_turns(requests, temperature=temperature, top_p=top_p,
                                    top_k=top_k, stop_token_ids=stop_token_ids)
        seconds = time.perf_counter() - start
        return [Group(prompt_index=i, prompt_ids=list(p), samples=samples,  # type: ignore[arg-type]
                      node=LOCAL, seconds=seconds)
                for i, (p, samples) in enumerate(zip(prompts, results, strict=True))]

    def sample_turns(self, requests: Sequence[TurnRequest], *, temperature: float,
                     top_p: float = 1.0, top_k: int = 0, stop_token_ids: Sequence[int] = (),
                     shared_prefix: bool = False) -> list[list[RolloutSample]]:
        """Sample every request (an episode runner's :data:`~gridrl.trainer.envs.episode.
        Sampler`): sample ``k`` of a request is seeded ``sequence_seed(request.seed, k)``, as a
        node's ``Generate`` seeds it; requests with the same ``max_tokens`` are decoded in one
        ``backend.generate`` call (a one-turn environment's turn: exactly the call
        :meth:`generate_groups` makes).

        Returns:
            per request, its ``n`` samples, stamped with the trainer's current version (and
            the seconds of the ``backend.generate`` call that sampled them).
        """
        from gridrl.engine.contract import SamplingConfig
        from gridrl.engine.rng import sequence_seed

        version = self.version()
        decode = self.backend.tokenizer.decode
        out: list[list[RolloutSample]] = [[] for _ in requests]
        for budget in dict.fromkeys(r.max_tokens for r in requests):
            config = SamplingConfig(max_tokens=budget, temperature=temperature, top_p=top_p,
                                    top_k=top_k, stop_token_ids=tuple(stop_token_ids))
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
