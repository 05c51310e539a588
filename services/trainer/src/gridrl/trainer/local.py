"""``--rollout local``: sample in-process with the trainer backend's own sampler
(:meth:`gridrl.trainer.backend.TrainerBackend.generate`), for a single machine.

The sampler shares the weights being trained, so every sample carries the trainer's current
policy version and there is nothing to push. Sampling semantics (temperature, top-k, top-p,
stop tokens, exact behaviour logprobs) are those of every rollout node
(``gridrl.engine.contract``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from gridrl.trainer.rollouts import Group, RolloutSample, group_seed

LOCAL = "local"


class LocalRollout:
    """A :class:`gridrl.trainer.rollouts.RolloutSource` over the trainer's own model.

    Args:
        backend: the :class:`gridrl.trainer.backend.TrainerBackend` being trained.
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
        from gridrl.engine.contract import SamplingConfig
        from gridrl.engine.rng import sequence_seed

        config = SamplingConfig(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, stop_token_ids=tuple(stop_token_ids))
        flat_prompts, seeds = [], []
        for i, p in enumerate(prompts):
            g_seed = group_seed(seed, i)
            for j in range(group_size):
                flat_prompts.append(p)
                seeds.append(sequence_seed(g_seed, j))  # as the engine seeds sample j
        version = self.version()
        start = time.perf_counter()
        results = self.backend.generate(flat_prompts, config, seeds)
        seconds = time.perf_counter() - start
        decode = self.backend.tokenizer.decode
        groups = []
        for i, p in enumerate(prompts):
            samples = [RolloutSample(token_ids=list(r.token_ids), logprobs=list(r.logprobs),
                                     text=decode(r.token_ids, skip_special_tokens=True),
                                     finish_reason=r.finish_reason, policy_version=version,
                                     node=LOCAL)
                       for r in results[i * group_size:(i + 1) * group_size]]
            groups.append(Group(prompt_index=i, prompt_ids=list(p), samples=samples, node=LOCAL,
                                seconds=seconds))
        return groups

    def close(self) -> None:
        """Nothing to release (the model belongs to the backend)."""
