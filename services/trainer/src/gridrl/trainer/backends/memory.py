"""The update's memory bound (``--memory-mb``), framework-free: the process's resident memory
(read from ``/proc``), the activation cost of a micro-batch, and the micro-batches of a step
sized to fit.

    budget = MemoryBudget(limit_bytes=resolve_memory_mb(cfg.memory_mb) * MIB, ...)
    plan = plan_micro_batches(widths, budget.available(current_rss_bytes()), costs)
    plan.chunks        # list[list[int]]: sequence indices of each micro-batch, in order
    plan.checkpointed  # list[bool]: which micro-batches recompute their activations

A micro-batch of ``n`` rows of ``width`` tokens (padded: a sequence a row, prompt +
completion; packed: :mod:`gridrl.trainer.backends.packing`'s rows) holds
``fixed + per_token * n * width`` bytes of activations at its peak (:class:`ActivationCost`).
Both numbers are measured once at start-up on a probe forward and backward of the real model
(:mod:`gridrl.trainer.backends.torch.memory`), with and without activation checkpointing; the
planner here only adds up. Micro-batching never changes the loss or the gradient beyond float
rounding (the loss weights are fixed over the whole step first,
:func:`gridrl.trainer.grpo.advantages.sequence_weights`).

Resident memory: ``VmRSS`` / ``VmHWM`` of ``/proc/self/status``; the peak is reset at the start
of a step by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), so the peak of a step is
that step's. Elsewhere (macOS) the peak is ``getrusage``'s ``ru_maxrss`` (never reset).
"""

from __future__ import annotations

import math
import os
import resource
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gridrl.trainer.backends.packing import pack_layout

MIB = 1024 * 1024

#: ``--memory-mb 0``: this share of the memory the machine has available at start-up
#: (``MemAvailable``: free memory plus what the kernel can reclaim).
DEFAULT_MEMORY_SHARE = 0.6

#: Resident memory kept free of activations under every budget: what the allocator and the
#: libraries take around a micro-batch whatever its size (on the tiny llama a plan that
#: filled its room peaked 1-2 MiB over it, at 5 and at 8 micro-batches alike; with 8 MiB kept
#: free, one run in eight still peaked 3 MiB over its 64 MiB room: a thread's stack or a
#: malloc arena more or less, so twice that is kept).
RESERVE_BYTES = 16 * MIB

#: Resident memory the allocator holds beyond the tensors' own bytes (freed blocks kept,
#: fragmentation, the small allocations around the products), as a share of the activations:
#: the plan counts activations times ``1 + ALLOCATOR_SLACK``.
ALLOCATOR_SLACK = 0.5


class MemoryBudgetError(Exception):
    """The budget cannot hold what must fit.

    Attributes:
        least_mb: the smallest ``--memory-mb`` that would fit (MiB, rounded up).
        what: what did not fit, in words.
    """

    def __init__(self, least_mb: int, what: str) -> None:
        super().__init__(f"{what}: needs --memory-mb {least_mb} or more")
        self.least_mb = least_mb
        self.what = what


class UpdateOutOfMemory(RuntimeError):
    """The update ran out of memory anyway (the allocator refused: a planned budget the
    machine no longer had, or no ``--memory-mb`` plan at all), saying which setting to lower.

    A RuntimeError, so a run fails as on any other runtime error (exit 1) and, when the
    weights are untouched, first checkpoints the steps it finished
    (:func:`gridrl.trainer.run.driver.train`); the checkpoints already written are kept.

    Attributes:
        setting: the flag to lower first (``--memory-mb`` or ``--micro-batch-size``).
        weights_untouched: True when it failed before the optimizer step (the forward or the
            backward of a micro-batch; the gradients are dropped): the weights and the
            optimizer's state are the last finished step's.
    """

    def __init__(self, message: str, setting: str, weights_untouched: bool) -> None:
        super().__init__(message)
        self.setting = setting
        self.weights_untouched = weights_untouched


#: What the allocators' refusals say: torch's CPU allocator (``DefaultCPUAllocator: can't
#: allocate memory``), CUDA's and MPS's (``... out of memory``), MLX's (``[malloc] Unable to
#: allocate``, ``[metal::malloc] ... out of memory``).
OUT_OF_MEMORY_WORDS = ("out of memory", "can't allocate memory", "unable to allocate",
                       "cannot allocate memory")


def is_out_of_memory(error: BaseException) -> bool:
    """True for an allocation failure: a :class:`MemoryError`, or a RuntimeError whose
    message is an allocator's refusal (:data:`OUT_OF_MEMORY_WORDS`; ``torch.OutOfMemoryError``
    is a RuntimeError saying ``out of memory``)."""
    if isinstance(error, MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(w in text for w in OUT_OF_MEMORY_WORDS)


def out_of_memory_advice(*, limit_mb: int | None, micro_batch_size: int,
                         largest_micro_batch: int, micro_batches: int,
                         weights_untouched: bool) -> UpdateOutOfMemory:
    """The :class:`UpdateOutOfMemory` of an update that failed to allocate.

    Args:
        limit_mb: the ``--memory-mb`` the micro-batches were planned for (None: no plan).
        micro_batch_size: ``--micro-batch-size`` (0: the whole batch).
        largest_micro_batch: sequences in the step's largest micro-batch.
        micro_batches: the step's micro-batches.
        weights_untouched: it failed before the optimizer step.
    """
    half = max(1, largest_micro_batch // 2)
    if limit_mb:
        setting = "--memory-mb"
        advice = (f"lower --memory-mb (now {limit_mb} MiB: the machine had less free than the "
                  f"plan of {micro_batches} micro-batch(es) of up to {largest_micro_batch} "
                  f"sequences assumed), or set --micro-batch-size {half}")
    else:
        setting = "--micro-batch-size"
        advice = (f"lower --micro-batch-size (now "
                  f"{micro_batch_size or 'the whole batch'}: {micro_batches} micro-batch(es) "
                  f"of up to {largest_micro_batch} sequences; try {half}), or set --memory-mb "
                  f"so the micro-batches are planned to fit")
    state = ("the weights are the last finished step's" if weights_untouched else
             "it failed in the optimizer step, so the weights in memory may be half stepped")
    return UpdateOutOfMemory(f"the update ran out of memory: {advice}; {state}, and the "
                             f"checkpoints written are kept (--resume continues from the "
                             f"latest)", setting, weights_untouched)


def _status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def current_rss_bytes() -> int:
    """This process's resident memory now, bytes (``VmRSS``; elsewhere the peak so far)."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak resident memory since :func:`reset_peak_rss` (or its start), bytes."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; Linux: KiB


def reset_peak_rss() -> bool:
    """Set the peak resident memory to the current one (Linux: ``/proc/self/clear_refs``);
    False where it cannot be reset (the peak then stays the process's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (bytes), else the physical memory; None when
    neither can be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def resolve_memory_mb(memory_mb: int) -> int:
    """``--memory-mb`` as a number of MiB: itself when > 0; for 0,
    :data:`DEFAULT_MEMORY_SHARE` of the available memory plus what this process already holds
    (0 when nothing can be read: no bound)."""
    if memory_mb > 0:
        return memory_mb
    available = available_memory_bytes()
    if available is None:
        return 0
    return int((DEFAULT_MEMORY_SHARE * available + current_rss_bytes()) // MIB)


def mib_up(nbytes: float) -> int:
    """Bytes as whole MiB, rounded up."""
    return max(1, math.ceil(nbytes / MIB))


@dataclass(frozen=True)
class ActivationCost:
    """Peak bytes a micro-batch adds to the resident memory during its forward and backward:
    ``(fixed + per_token * n * width) * (1 + ALLOCATOR_SLACK)`` for ``n`` sequences padded
    to ``width`` tokens, measured at ``probe_width`` tokens (a wider batch is measured again:
    attention grows faster than linearly in the width).

    Attributes:
        fixed: bytes that do not grow with the tokens (head chunks, gradient buffers).
        per_token: bytes per padded token.
        probe_width: the width it was measured at.
    """

    fixed: float
    per_token: float
    probe_width: int

    def bytes(self, n: int, width: int) -> float:
        """Bytes of a micro-batch of ``n`` sequences ``width`` tokens wide."""
        return (self.fixed + self.per_token * n * width) * (1.0 + ALLOCATOR_SLACK)


#: A step wider than every measurement is measured again at its width rounded up to this
#: (tokens): one probe serves every width up to it.
WIDTH_STEP = 32


def probe_shapes(width: int) -> list[tuple[int, int]]:
    """The probes that measure the cost at ``width`` tokens, as ``(sequences, tokens a
    sequence)``: one sequence ``h = width // 2`` wide, two of them, one ``width`` wide. None
    holds more than ``width`` tokens, one sequence of the width measured: the smallest
    micro-batch a plan at that width can run, so a probe inside a step never needs more
    memory than the step's own micro-batches may take (probing two sequences of the width
    did: docs/benchmarks.md section 19)."""
    half = max(width // 2, 1)
    return [(1, half), (2, half), (1, max(width, 1))]


def cost_from_probes(width: int, short: float, two_short: float,
                     wide: float) -> ActivationCost:
    """The :class:`ActivationCost` at ``width`` from the peaks (bytes) of the three probes of
    :func:`probe_shapes`: ``short`` (one sequence ``h = width // 2`` wide), ``two_short``
    (two of them) and ``wide`` (one ``width`` wide).

    ``per_token`` is the larger of the second sequence's cost per token
    (``(two_short - short) / h``) and the wider sequence's (``(wide - short) / (width - h)``);
    ``fixed`` is the larger of what does not grow with the sequences
    (``2 * short - two_short``) and what the wide probe leaves above ``per_token * width``
    (never below 0), so the cost is at least every probe's peak. For a peak that grows as
    ``F + n * (a * w + b * w**2)`` in ``n`` sequences ``w`` tokens wide (``a, b >= 0``; ``b``:
    attention's scores), the probes give ``fixed = F`` and ``per_token = a + b * (width +
    h) >= a + b * w``: the cost bounds every micro-batch of sequences up to ``width + h``
    wide from above, the one-sequence ones included. (Taking ``fixed`` as only what
    the probes leave above ``per_token`` times their tokens gives ``F - b * width * h``: one
    sequence much narrower than ``h`` would be under-counted.)
    """
    half = max(width // 2, 1)
    marginals = [max(two_short - short, 0.0) / half]
    if width > half:
        marginals.append(max(wide - short, 0.0) / (width - half))
    per_token = max(marginals)
    fixed = max(2 * short - two_short, wide - per_token * width, 0.0)
    return ActivationCost(fixed=fixed, per_token=per_token, probe_width=width)


class CostsByWidth:
    """Activation costs measured at the widths steps have met: a step no wider than the
    widest measurement reuses it (:func:`cost_from_probes` at ``width`` bounds narrower
    sequences too), a wider one is measured now at its width rounded up to
    :data:`WIDTH_STEP` tokens, and never below ``floor`` (the start-up probe's width).

    Args:
        measure: measures the cost at a width (tokens), e.g. from the probes of
            :func:`probe_shapes` through :func:`cost_from_probes`.
        floor: the narrowest width measured (tokens).
    """

    def __init__(self, measure: Callable[[int], ActivationCost], floor: int) -> None:
        self._measure = measure
        self._floor = floor
        self.measured: dict[int, ActivationCost] = {}

    @staticmethod
    def width_to_measure(width: int, widest: int, floor: int) -> int | None:
        """The width (tokens) to measure for a step ``width`` wide when the widest measurement
        so far is ``widest`` (0: none): None when that one serves."""
        if widest and widest >= width:
            return None
        return max(-(-int(width) // WIDTH_STEP) * WIDTH_STEP, floor)

    def __call__(self, width: int) -> ActivationCost:
        """The cost for a step whose widest sequence is ``width`` tokens (measured first when
        no measurement is that wide)."""
        widest = max(self.measured, default=0)
        at = self.width_to_measure(width, widest, self._floor)
        if at is None:
            return self.measured[widest]
        self.measured[at] = self._measure(at)
        return self.measured[at]


def adamw_reserve_bytes(param_bytes: int, *, moments_pending: bool,
                        gradient_copies: int = 0) -> int:
    """Bytes an AdamW step adds above the micro-batches' measured peak, for trainable
    parameters of ``param_bytes`` bytes: its two moments (``exp_avg``, ``exp_avg_sq``) while
    ``moments_pending`` (before the first step allocates them), one parameter-sized set of the
    step's temporaries always, and ``gradient_copies`` parameter-sized sets of gradients the
    backend keeps beyond the one its probe counts (MLX: the running sum of the micro-batches'
    gradients and the clipped copy; torch accumulates and clips in place: 0)."""
    return param_bytes * ((2 if moments_pending else 0) + 1 + gradient_copies)


@dataclass(frozen=True)
class MemoryPlan:
    """The micro-batches of a step (:func:`plan_micro_batches`).

    Attributes:
        chunks: sequence indices of each micro-batch, in order.
        checkpointed: per micro-batch, whether it recomputes its activations in the backward.
        peak_bytes: the planned peak of the largest micro-batch above the resident base.
    """

    chunks: list[list[int]]
    checkpointed: list[bool]
    peak_bytes: float


class MemoryPlanner(Protocol):
    """Cuts an update's sequences into micro-batches within ``--memory-mb``
    (:class:`gridrl.trainer.backends.torch.memory.UpdateMemory` on torch)."""

    def plan(self, seqs: Sequence[Any], indices: Sequence[int],
             max_sequences: int = 0) -> MemoryPlan: ...


def plan_micro_batches(indices: Sequence[int], prompt_lens: Sequence[int],
                       completion_lens: Sequence[int], room_bytes: float,
                       plain: ActivationCost, checkpointed: ActivationCost | None = None,
                       max_sequences: int = 0, base_bytes: float = 0.0,
                       prompt_keys: Sequence[Hashable] | None = None) -> MemoryPlan:
    """Cut ``indices`` (in order) into micro-batches whose activations fit ``room_bytes``.

    A micro-batch grows while it fits. Padded (``prompt_keys`` None), it is as many rows as
    sequences, as wide as its longest prompt plus its longest completion (prompts
    left-padded, completions right-padded); packed, its rows and width are those of
    :func:`gridrl.trainer.backends.packing.pack_layout` (each group's prompt once, its
    completions unpadded). A sequence that does not fit alone runs alone with activation
    checkpointing (``checkpointed`` cost) when that fits.

    Args:
        indices: the sequences to train, in the order to keep.
        prompt_lens, completion_lens: token counts, indexed by the entries of ``indices``.
        room_bytes: bytes the micro-batch may add to the resident memory.
        plain, checkpointed: measured costs without and with activation checkpointing (None:
            no checkpointing available).
        max_sequences: most sequences a micro-batch (``--micro-batch-size``; 0: no limit).
        base_bytes: the resident memory the room is above (for the error's least budget).
        prompt_keys: for a packed update, a key per sequence equal for equal prompts (the
            prompt's token ids); None: padded.
    Returns:
        a :class:`MemoryPlan`.
    Raises:
        MemoryBudgetError: a sequence does not fit even with checkpointing; ``least_mb`` is
            the budget that would hold it.
    """

    def extent(chunk: list[int]) -> tuple[int, int]:  # (rows, tokens a row)
        if prompt_keys is not None:
            layout = pack_layout(chunk, prompt_keys, prompt_lens, completion_lens)
            return len(layout.rows), layout.width
        return len(chunk), (max(prompt_lens[i] for i in chunk)
                            + max(max(completion_lens[i], 1) for i in chunk))

    chunks: list[list[int]] = []
    flags: list[bool] = []
    peak = 0.0
    current: list[int] = []
    for i in indices:
        if current and (not max_sequences or len(current) < max_sequences):
            need = plain.bytes(*extent([*current, i]))
            if need <= room_bytes:
                current.append(i)
                continue
        if current:
            chunks.append(current)
            flags.append(False)
            peak = max(peak, plain.bytes(*extent(current)))
        width = prompt_lens[i] + max(completion_lens[i], 1)
        if plain.bytes(1, width) <= room_bytes:
            current = [i]
            continue
        if checkpointed is not None and checkpointed.bytes(1, width) <= room_bytes:
            chunks.append([i])
            flags.append(True)
            peak = max(peak, checkpointed.bytes(1, width))
            current = []
            continue
        cost = checkpointed or plain
        raise MemoryBudgetError(mib_up(base_bytes + cost.bytes(1, width)),
                                f"one sequence of {width} tokens does not fit the update's "
                                f"memory{' even with activation checkpointing' if checkpointed else ''}")
    if current:
        chunks.append(current)
        flags.append(False)
        peak = max(peak, plain.bytes(*extent(current)))
    return MemoryPlan(chunks, flags, peak)


#: glibc's ``mallopt`` parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Allocations from this size up get their own mapping, given back to the system when freed.
MMAP_THRESHOLD_BYTES = 1 << 20


def _libc() -> Any:
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def return_freed_memory_to_the_system() -> bool:
    """Make the C allocator (glibc) give freed tensor memory back at once, so the resident
    memory follows the tensors alive: blocks of :data:`MMAP_THRESHOLD_BYTES` and more get
    their own mappings (glibc otherwise raises that threshold to 32 MiB after the first free
    and keeps freed blocks resident in its heap), and the heap's free top is trimmed past
    1 MiB. Process-wide. False where the allocator is not glibc's."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD_BYTES))


def trim_free_memory() -> None:
    """Give the free memory inside the C allocator's heaps back to the system
    (glibc ``malloc_trim(0)``); a no-op elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
