"""``--memory-mb`` on the MLX trainer: the activation cost of a micro-batch measured on the real
model at start-up, and each step's micro-batches planned from the sequences' token counts by the
framework-free planner (:func:`gridrl.trainer.backends.memory.plan_micro_batches`).

Measured, not guessed: a probe forward and backward of 1 and then 2 random sequences of
``width`` tokens through the update's own loss (:meth:`MlxTrainerBackend._chunk_loss` under
``nn.value_and_grad``), evaluated, with MLX's own allocator counters: the peak of the bytes it
holds (``mx.get_peak_memory``, reset first) above what it held before (``mx.get_active_memory``).
The difference of the two peaks is the cost of ``width`` more tokens; what is left of the first
is the fixed part. MLX has no activation checkpointing in this trainer, so a sequence that does
not fit alone is refused, naming the least budget that holds it.

The resident base the room is above: the process's resident memory (``/proc``; on Apple
Silicon's GPU, whose buffers are not in it, plus MLX's active bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from gridrl.trainer.backends.base import TrainSequence
from gridrl.trainer.backends.memory import (
    MIB,
    RESERVE_BYTES,
    ActivationCost,
    MemoryBudgetError,
    MemoryPlan,
    current_rss_bytes,
    mib_up,
    plan_micro_batches,
)

#: The probe's sequence width (tokens) when the run gives none wider.
PROBE_WIDTH = 128


def _probe_sequences(n: int, width: int, vocab: int) -> list[TrainSequence]:
    """``n`` sequences of ``width`` tokens (half prompt, half completion), distinct prompts,
    tokens from a fixed generator (the run's RNGs are not touched)."""
    rng = np.random.default_rng(0)
    p = max(1, width // 2)
    c = max(1, width - p)
    seqs = []
    for g in range(n):
        ids = [int(t) for t in rng.integers(1, max(vocab, 2), p + c)]
        seqs.append(TrainSequence(tuple(ids[:p]), tuple(ids[p:]), (0.0,) * c, 1.0, g))
    return seqs


def probe_peak_bytes(backend: Any, n: int, width: int) -> int:
    """Peak bytes MLX holds above its base during the forward and backward of ``n`` random
    sequences ``width`` tokens wide through the update's loss (gradients included)."""
    seqs = _probe_sequences(n, width, backend.identity.vocab_size or 2)
    with mx.stream(backend.engine._device):
        mx.eval(backend.model.parameters())
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        backend.model.train()
        try:
            batch = backend._collate(seqs)
            loss_and_grad = nn.value_and_grad(backend.model,
                                              partial(backend._chunk_loss, seqs))
            ref_logp = (mx.zeros(batch["completion_ids"].shape, mx.float32)
                        if backend.update_cfg.beta else None)  # the loss's KL term's input
            (part, *_), grads = loss_and_grad(batch, mx.ones((n,), mx.float32), ref_logp)
            mx.eval(part, grads)
            peak = mx.get_peak_memory() - before
            del part, grads, batch
        finally:
            backend.model.eval()
            mx.clear_cache()
    return max(int(peak), 0)


def measure_cost(backend: Any, width: int) -> ActivationCost:
    """The :class:`ActivationCost` of the MLX update at ``width`` tokens, from probes of 1
    and 2 sequences (:func:`probe_peak_bytes`)."""
    one = probe_peak_bytes(backend, 1, width)
    two = probe_peak_bytes(backend, 2, width)
    per_token = max(two - one, 0) / width
    return ActivationCost(fixed=max(one - per_token * width, 0.0), per_token=per_token,
                          probe_width=width)


def _base_rss() -> int:
    """The resident memory the budget's room is above (module docstring)."""
    rss = current_rss_bytes()
    if mx.default_device() == mx.gpu:  # unified memory: MLX's buffers are not in the RSS
        rss += mx.get_active_memory()
    return rss


class MlxUpdateMemory:
    """The memory bound of an MLX trainer's update: its limit, the measured cost, and the plan
    of each step's micro-batches (:meth:`plan`); the same contract as the torch backend's
    :class:`~gridrl.trainer.backends.torch.memory.UpdateMemory`, without checkpointing.

    Args:
        backend: the :class:`~gridrl.trainer.backends.mlx.backend.MlxTrainerBackend`.
        limit_bytes: ``--memory-mb`` in bytes.
        width: the probe's width (a wider step is measured again at its width).
        rss: reads the resident base, bytes (tests pass their own).
    Raises:
        MemoryBudgetError: one sequence ``width`` wide does not fit (before step 1).
    """

    def __init__(self, backend: Any, limit_bytes: int, width: int = PROBE_WIDTH,
                 rss: Callable[[], int] = _base_rss) -> None:
        self.backend = backend
        self.limit_bytes = limit_bytes
        self._rss = rss
        self._width = width
        self._costs: dict[int, ActivationCost] = {}
        base = rss() + RESERVE_BYTES
        need = base + self.cost(width).bytes(1, width)
        if need > limit_bytes:
            raise MemoryBudgetError(mib_up(need),
                                    f"the model ({mib_up(base)} MiB resident) and one "
                                    f"sequence of {width} tokens do not fit "
                                    f"{limit_bytes // MIB} MiB")

    def cost(self, width: int) -> ActivationCost:
        """The cost measured at the smallest power of two >= ``width`` (on first use)."""
        bucket = max(1 << max(int(width) - 1, 1).bit_length(), self._width)
        if bucket not in self._costs:
            self._costs[bucket] = measure_cost(self.backend, bucket)
        return self._costs[bucket]

    def plan(self, seqs: Sequence[TrainSequence], indices: Sequence[int],
             max_sequences: int = 0) -> MemoryPlan:
        """The micro-batches of ``indices`` (sequences of ``seqs``) within the limit, above
        the resident memory now (rows as the padded layout counts them: the longest prompt
        plus the longest completion, at least the MLX rows' own width).

        Raises:
            MemoryBudgetError: a sequence does not fit alone.
        """
        if not indices:
            return MemoryPlan([], [], 0.0)
        prompt_lens = [len(s.prompt_ids) for s in seqs]
        completion_lens = [len(s.completion_ids) for s in seqs]
        cost = self.cost(max(prompt_lens[i] + max(completion_lens[i], 1) for i in indices))
        base = self._rss() + RESERVE_BYTES
        return plan_micro_batches(indices, prompt_lens, completion_lens,
                                  self.limit_bytes - base, cost, None,
                                  max_sequences=max_sequences, base_bytes=base)
