"""``--memory-mb`` on the MLX trainer: the activation cost of a micro-batch measured on the real
model, and each step's micro-batches planned from the sequences' token counts by the
framework-free planner (:func:`gridrl.trainer.backends.memory.plan_micro_batches`).

Measured, not guessed: probe forwards and backwards of random sequences (one ``width // 2``
tokens wide, two of them, one ``width`` wide:
:func:`~gridrl.trainer.backends.memory.probe_shapes`) through the update's own micro-batch
(:meth:`MlxTrainerBackend._micro_batch`: the reference forward, the loss under
``nn.value_and_grad``, the sampler's logprobs, evaluated), with MLX's own allocator counters:
the peak of the bytes it holds (``mx.get_peak_memory``, reset first) above what it held before
(``mx.get_active_memory``). The cost per token is the larger of a second sequence's and a wider
sequence's, the fixed part what the probes leave above it
(:func:`~gridrl.trainer.backends.memory.cost_from_probes`). No probe holds more than ``width``
tokens, one sequence of the step's widest (rounded up to
:data:`~gridrl.trainer.backends.memory.WIDTH_STEP`): the smallest micro-batch its plan can run,
so measuring inside a step cannot overrun the budget; a narrower step reuses the widest
measurement (:class:`~gridrl.trainer.backends.memory.CostsByWidth`). (It had probed 1 and then
2 sequences at the next power of two above the step's width: up to four times the tokens of
the one-sequence micro-batches a tight budget leaves room for, the defect the torch probe had:
docs/benchmarks.md section 19.) MLX has no activation checkpointing in this trainer, so a
sequence that does not fit alone is refused, naming the least budget that holds it.

The resident base the room is above: the process's resident memory (``/proc``; on Apple
Silicon's GPU, whose buffers are not in it, plus MLX's active bytes), plus what the optimizer's
step adds (:meth:`MlxUpdateMemory.optimizer_reserve_bytes`). MLX's buffer cache, resident too,
is held to the plan's allocator slack while a bounded step runs and to nothing during a probe
(:func:`cache_limited`), and what a probe freed is trimmed before the base is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from gridrl.trainer.backends.base import TrainSequence
from gridrl.trainer.backends.memory import (
    ALLOCATOR_SLACK,
    MIB,
    RESERVE_BYTES,
    ActivationCost,
    CostsByWidth,
    MemoryBudgetError,
    MemoryPlan,
    adamw_reserve_bytes,
    cost_from_probes,
    current_rss_bytes,
    mib_up,
    plan_micro_batches,
    probe_shapes,
    return_freed_memory_to_the_system,
    trim_free_memory,
)

#: The probe's sequence width (tokens) when the run gives none wider.
PROBE_WIDTH = 128

#: Parameter-sized sets of gradients the MLX update holds beyond the one its probe counts: the
#: running sum of the micro-batches' gradients (``grads``, alive until the optimizer's step)
#: and the copy ``mlx.optimizers.clip_grad_norm`` returns (torch sums and clips in place).
GRADIENT_COPIES = 2


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


@contextmanager
def cache_limited(limit_bytes: int | None) -> Iterator[None]:
    """MLX's buffer cache (freed buffers it keeps for reuse, resident memory all the same)
    held within ``limit_bytes`` for the block (``mx.set_cache_limit``; None: left as it is),
    the previous limit restored after. Its default is MLX's memory limit: with micro-batches
    of changing shapes the cache kept growing beside the planned arrays (tiny llama, 64
    sequences of 20-450 tokens: 32 MiB cached, the step's peak 3 MiB over a 48 MiB room)."""
    if limit_bytes is None:
        yield
        return
    previous = mx.set_cache_limit(max(int(limit_bytes), 0))
    try:
        yield
    finally:
        mx.set_cache_limit(previous)


def probe_peak_bytes(backend: Any, n: int, width: int) -> int:
    """Peak bytes MLX holds above its base during one micro-batch of the update
    (:meth:`~gridrl.trainer.backends.mlx.backend.MlxTrainerBackend._micro_batch`: its
    forwards and backward, the gradients included) on ``n`` random sequences ``width``
    tokens wide. (Its dropout draws from MLX's global key, which every update re-seeds from
    ``(seed, step)`` after planning, so runs stay reproducible.)"""
    seqs = _probe_sequences(n, width, backend.identity.vocab_size or 2)
    with mx.stream(backend.engine._device), cache_limited(0):  # resident: the arrays alone
        mx.eval(backend.model.parameters())
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        try:
            out = backend._micro_batch(seqs, mx.ones((n,), mx.float32), None)
            peak = mx.get_peak_memory() - before
            del out
        finally:
            backend.model.eval()
            mx.clear_cache()
            trim_free_memory()  # what the probe freed leaves the resident base
    return max(int(peak), 0)


def measure_cost(backend: Any, width: int) -> ActivationCost:
    """The :class:`ActivationCost` of the MLX update at ``width`` tokens from three probes of
    at most ``width`` tokens each (:func:`probe_peak_bytes` at
    :func:`~gridrl.trainer.backends.memory.probe_shapes`), combined by
    :func:`~gridrl.trainer.backends.memory.cost_from_probes`."""
    peaks = [probe_peak_bytes(backend, n, w) for n, w in probe_shapes(width)]
    return cost_from_probes(width, *peaks)


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
        backend: the :class:`~gridrl.trainer.backends.mlx.backend.MlxTrainerBackend` (its
            ``optimizer``, AdamW, is what :meth:`optimizer_reserve_bytes` counts).
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
        return_freed_memory_to_the_system()  # resident memory that follows MLX's buffers
        self._costs = CostsByWidth(lambda w: measure_cost(self.backend, w), width)
        cost = self.cost(width)  # (a probe first: the base is read after it)
        base = rss() + RESERVE_BYTES + self.optimizer_reserve_bytes()
        need = base + cost.bytes(1, width)
        if need > limit_bytes:
            raise MemoryBudgetError(mib_up(need),
                                    f"the model ({mib_up(base)} MiB resident) and one "
                                    f"sequence of {width} tokens do not fit "
                                    f"{limit_bytes // MIB} MiB")

    def optimizer_reserve_bytes(self) -> int:
        """Bytes the update holds beyond the micro-batches' measured peak that the resident
        memory does not hold yet (:func:`~gridrl.trainer.backends.memory.adamw_reserve_bytes`):
        AdamW's two moments per LoRA parameter until its first step allocates them (``m``,
        ``v``), one parameter-sized set of the step's temporaries, and
        :data:`GRADIENT_COPIES` sets of gradients. On the tiny llama's rank-4 LoRA the first
        step measured 3.8 and the later ones 1.8 parameter-sized sets above the summed
        gradients (MLX's peak counter), within the 4 and 2 counted besides the running sum."""
        optimizer = getattr(self.backend, "optimizer", None)
        if optimizer is None:
            return 0
        size = sum(v.nbytes for _, v in tree_flatten(self.backend.model.trainable_parameters()))
        moments_pending = not any(k not in ("step", "learning_rate") for k in optimizer.state)
        return adamw_reserve_bytes(size, moments_pending=moments_pending,
                                   gradient_copies=GRADIENT_COPIES)

    @staticmethod
    def cache_limit_bytes(plan: MemoryPlan) -> int:
        """Bytes MLX's buffer cache may keep while ``plan`` runs (:func:`cache_limited`): the
        part of the planned peak beyond the arrays' own bytes,
        :data:`~gridrl.trainer.backends.memory.ALLOCATOR_SLACK` of them, so arrays and cache
        together stay within the plan."""
        return int(plan.peak_bytes * ALLOCATOR_SLACK / (1.0 + ALLOCATOR_SLACK))

    def cost(self, width: int) -> ActivationCost:
        """The cost for a step whose widest sequence is ``width`` tokens: the widest
        measurement so far when it covers ``width``, else measured now at ``width`` rounded
        up to :data:`~gridrl.trainer.backends.memory.WIDTH_STEP` tokens
        (:class:`~gridrl.trainer.backends.memory.CostsByWidth`)."""
        return self._costs(width)

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
        base = self._rss() + RESERVE_BYTES + self.optimizer_reserve_bytes()
        return plan_micro_batches(indices, prompt_lens, completion_lens,
                                  self.limit_bytes - base, cost, None,
                                  max_sequences=max_sequences, base_bytes=base)
