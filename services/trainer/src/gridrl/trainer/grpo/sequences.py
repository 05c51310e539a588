"""What the backend trains on: one completion with its advantage (:class:`TrainSequence`),
built by :func:`gridrl.trainer.grpo.batch.build_batch` and handed to
:meth:`gridrl.trainer.backends.base.TrainerBackend.update` (which re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainSequence:
    """One completion to train on.

    Attributes:
        prompt_ids: the prompt's token ids.
        completion_ids: the sampled token ids (stop token included).
        behaviour_logprobs: one per completion token, from the sampler.
        advantage: the group-relative advantage of the completion.
        group: index of its group in the step (data-parallel sharding is by group).
        loss_mask: a multi-turn episode's mask over ``completion_ids``: 1 on the model's
            tokens (trained, their behaviour logprobs real), 0 on the environment's (in the
            forward as context, no loss, no gradient, left out of every statistic and of the
            aggregation's token counts); None: every completion token is the model's.
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    advantage: float
    group: int
    loss_mask: tuple[int, ...] | None = None

    @property
    def trained_tokens(self) -> int:
        """Completion tokens that carry a loss (the model's)."""
        return len(self.completion_ids) if self.loss_mask is None else int(sum(self.loss_mask))

    def mask_row(self) -> list[float]:
        """The loss mask over ``completion_ids`` as floats (all ones without a mask)."""
        if self.loss_mask is None:
            return [1.0] * len(self.completion_ids)
        return [float(m) for m in self.loss_mask]
