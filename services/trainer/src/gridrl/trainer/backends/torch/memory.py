"""The torch update's memory bound (``--memory-mb``): the activation cost of a micro-batch
measured on the real model, and the plan of each step's micro-batches from it
(:func:`gridrl.trainer.backends.memory.plan_micro_batches`).

Measured, not guessed: probe forwards and backwards of random sequences (one ``width // 2``
tokens wide, two of them, one ``width`` wide) through the update's own code path (the same
logprob path, autocast and frozen-weight copies, the loss's backward), under
:class:`LiveTensorBytes`, which follows every tensor storage the probe allocates (not views of
what existed before it) until it is freed and keeps the peak of the bytes alive at once. The
cost per token is the larger of a second sequence's and a wider sequence's; the fixed part what
does not grow with the sequences, at least what the wide probe leaves above its tokens
(:func:`~gridrl.trainer.backends.memory.cost_from_probes`, shared with the MLX backend). No
probe holds more than ``width`` tokens, one sequence of the step's widest: the smallest
micro-batch its plan can run, so measuring inside a step cannot overrun the budget (probing
two full-width sequences did: a 0.5B model's 4 GB update peaked 38 MiB over). The same again
with activation checkpointing gives the cost of a sequence that would not fit otherwise. Counting tensors rather than reading the resident
memory keeps the figure exact whatever the allocator holds; the planner adds
:data:`~gridrl.trainer.backends.memory.ALLOCATOR_SLACK` for what it holds.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gridrl.common.errors import invalid_argument
from gridrl.trainer.backends.base import TrainSequence, UpdateConfig
from gridrl.trainer.backends.memory import (
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
)
from gridrl.trainer.backends.packing import pack_layout

#: The probe's sequence width (tokens) when the run gives none wider.
PROBE_WIDTH = 128


class LiveTensorBytes(TorchDispatchMode):
    """Within the block, the bytes of the tensor storages created in it that are still alive
    (:attr:`live`) and their peak (:attr:`peak`). Every op's outputs go through
    ``__torch_dispatch__`` (the backward's too: on the CPU autograd runs on the calling
    thread); a storage is counted once, until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: dict[int, tuple[Any, int]] = {}

    def _freed(self, key: int) -> None:
        entry = self._alive.pop(key, None)
        if entry is not None:
            self.live -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (a view such as the transposed weight ``linear``
        # decomposes into, or an in-place result) allocated nothing: skip it.
        inputs = {t.untyped_storage().data_ptr()
                  for t in tree_flatten((args, kwargs or {}))[0]
                  if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                key = id(storage)
                if key in self._alive or (storage.nbytes() and storage.data_ptr() in inputs):
                    continue
                nbytes = storage.nbytes()
                self._alive[key] = (weakref.ref(storage, lambda _r, k=key: self._freed(k)),
                                    nbytes)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
        return out


def _probe_sequences(n: int, width: int, vocab: int) -> list[TrainSequence]:
    """``n`` sequences of ``width`` tokens (half prompt, half completion), distinct prompts,
    tokens from a fixed generator (the run's RNG is not touched)."""
    gen = torch.Generator().manual_seed(0)
    p = max(1, width // 2)
    c = max(1, width - p)
    seqs = []
    for g in range(n):
        ids = torch.randint(1, max(vocab, 2), (p + c,), generator=gen).tolist()
        seqs.append(TrainSequence(tuple(ids[:p]), tuple(ids[p:]), (0.0,) * c, 1.0, g))
    return seqs


def probe_peak_bytes(policy: Any, cfg: UpdateConfig, n: int, width: int, *,
                     checkpoint: bool) -> int:
    """Peak bytes of tensors alive at once during the forward and backward of ``n`` random
    sequences ``width`` tokens wide through the update's logprob path (the gradients of the
    LoRA parameters included; they are dropped after). The RNG state is restored."""
    from gridrl.trainer.backends.torch.distributed import SingleProcess
    from gridrl.trainer.backends.torch.update import (
        _frozen_weights_cast,
        _logprobs,
        checkpointable,
        collate,
    )

    seqs = _probe_sequences(n, width, policy.identity.vocab_size or 2)
    run_cfg = checkpointable(cfg) if checkpoint else cfg
    params = policy.trainable_parameters()
    was_training = policy.model.training
    policy.model.train()
    with torch.random.fork_rng(devices=[]), _frozen_weights_cast(policy, cfg):
        batch = collate(seqs, policy.pad_id, policy.device)
        for p in params:
            p.grad = None
        tracker = LiveTensorBytes()
        with torch.enable_grad(), policy.activation_checkpointing(checkpoint), tracker:
            logp, _ = _logprobs(policy, seqs, batch, run_cfg, SingleProcess(policy.model),
                                amp=True)
            (logp * batch["completion_mask"]).sum().backward()
            del logp
        for p in params:
            p.grad = None
    if not was_training:
        policy.model.eval()
    return tracker.peak


def measure_cost(policy: Any, cfg: UpdateConfig, width: int, *,
                 checkpoint: bool) -> ActivationCost:
    """The :class:`ActivationCost` of the update at ``width`` tokens from three probes of at
    most ``width`` tokens each (:func:`probe_peak_bytes`): one sequence ``width // 2`` wide,
    two of them, one ``width`` wide (:func:`~gridrl.trainer.backends.memory.probe_shapes`),
    combined by :func:`~gridrl.trainer.backends.memory.cost_from_probes` (the larger of the
    second sequence's and the wider sequence's cost per token)."""
    peaks = [probe_peak_bytes(policy, cfg, n, w, checkpoint=checkpoint)
             for n, w in probe_shapes(width)]
    return cost_from_probes(width, *peaks)


class UpdateMemory:
    """The memory bound of a torch trainer's update: its limit and the measured costs, and the
    plan of each step's micro-batches (:meth:`plan`).

    Args:
        policy: the :class:`~gridrl.trainer.backends.torch.policy.Policy`.
        cfg: the update settings (their path and dtype are what is measured).
        limit_bytes: ``--memory-mb`` in bytes.
        width: the widest sequence expected (the probe's width; a wider step is measured
            again at its width).
        rss: reads the process's resident memory, bytes (tests pass their own).
        optimizer: the update's optimizer (AdamW): what its step adds is kept free
            (:meth:`optimizer_reserve_bytes`); None counts nothing for it.
    Raises:
        MemoryBudgetError: one sequence ``width`` wide does not fit even with activation
            checkpointing (before step 1).
    """

    def __init__(self, policy: Any, cfg: UpdateConfig, limit_bytes: int,
                 width: int = PROBE_WIDTH, rss: Callable[[], int] = current_rss_bytes,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.policy = policy
        self.optimizer = optimizer
        self.cfg = cfg
        self.limit_bytes = limit_bytes
        self._rss = rss
        self._width = width  # narrower steps use this probe (a wider one costs more a token)
        return_freed_memory_to_the_system()  # resident memory that follows the tensors
        self._plain = CostsByWidth(
            lambda w: measure_cost(self.policy, self.cfg, w, checkpoint=False), width)
        self._checkpointed = CostsByWidth(
            lambda w: measure_cost(self.policy, self.cfg, w, checkpoint=True), width)
        base = rss() + RESERVE_BYTES + self.optimizer_reserve_bytes()
        need = base + self.plain_cost(width).bytes(1, width)
        if need > limit_bytes:  # then only checkpointed; measured when needed, as here
            need = base + self.checkpointed_cost(width).bytes(1, width)
        if need > limit_bytes:
            raise MemoryBudgetError(mib_up(need),
                                    f"the model ({mib_up(base)} MiB resident) and one "
                                    f"sequence of {width} tokens do not fit "
                                    f"{limit_bytes // MIB} MiB")

    def optimizer_reserve_bytes(self) -> int:
        """Bytes the optimizer's step adds above the micro-batches' peak that the resident
        memory does not hold yet: AdamW's two moments per trainable parameter until its first
        step allocates them (``exp_avg``, ``exp_avg_sq``), and one parameter-sized set of the
        step's temporaries. (The gradients are in the probe's fixed part.) On a 0.5B model
        with rank-16 LoRA on every linear layer that is ~105 MB before step 1, ~35 MB after."""
        if self.optimizer is None:
            return 0
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        size = sum(p.numel() * p.element_size() for p in params)
        moments_pending = not any(self.optimizer.state.get(p) for p in params)
        return adamw_reserve_bytes(size, moments_pending=moments_pending)

    def plain_cost(self, width: int) -> ActivationCost:
        """The cost without checkpointing: the one measured at the widest width so far when
        that covers ``width``, else measured now at ``width`` rounded up to
        :data:`~gridrl.trainer.backends.memory.WIDTH_STEP` tokens
        (:class:`~gridrl.trainer.backends.memory.CostsByWidth`)."""
        return self._plain(width)

    def checkpointed_cost(self, width: int) -> ActivationCost:
        """:meth:`plain_cost` with activation checkpointing."""
        return self._checkpointed(width)

    def costs(self, width: int) -> tuple[ActivationCost, ActivationCost]:
        """(plain, checkpointed) costs at ``width``."""
        return self.plain_cost(width), self.checkpointed_cost(width)

    def plan(self, seqs: Sequence[TrainSequence], indices: Sequence[int],
             max_sequences: int = 0) -> MemoryPlan:
        """The micro-batches of ``indices`` (sequences of ``seqs``) within the limit, above
        the resident memory now.

        Raises:
            MemoryBudgetError: a sequence does not fit even with activation checkpointing.
        """
        if not indices:
            return MemoryPlan([], [], 0.0)
        packed = self.cfg.pack and getattr(self.policy, "packs", False)
        keys = [s.prompt_ids for s in seqs] if packed else None
        prompt_lens = [len(s.prompt_ids) for s in seqs]
        completion_lens = [len(s.completion_ids) for s in seqs]
        widest = max(prompt_lens[i] + max(completion_lens[i], 1) for i in indices)
        if keys is not None:  # a packed row is as wide as its longest group
            widest = max(widest, pack_layout(indices, keys, prompt_lens, completion_lens).width)
        plain = self.plain_cost(widest)  # (a probe first: the base is read after it)
        base = self._rss() + RESERVE_BYTES + self.optimizer_reserve_bytes()

        def plan(checkpointed: ActivationCost | None) -> MemoryPlan:
            return plan_micro_batches(indices, prompt_lens, completion_lens,
                                      self.limit_bytes - base, plain,
                                      checkpointed, max_sequences=max_sequences,
                                      base_bytes=base, prompt_keys=keys)

        try:
            return plan(None)
        except MemoryBudgetError:  # some sequence needs checkpointing: measure it now
            checkpointed = self.checkpointed_cost(widest)
            base = max(base, self._rss() + RESERVE_BYTES + self.optimizer_reserve_bytes())
            return plan(checkpointed)


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def weights_bytes(model_dir: Any, dtype: str = "auto") -> int | None:
    """Bytes the weights of the model directory ``model_dir`` will take loaded in ``dtype``
    (``"auto"``: float32, the CPU's): its ``*.safetensors`` (else ``*.bin``) files, scaled from
    the checkpoint's dtype (``config.json``'s ``dtype`` / ``torch_dtype``; float32 when it names
    none). None when there are no weight files to read."""

    path = Path(str(model_dir))
    if not path.is_dir():
        return None
    files = list(path.glob("*.safetensors")) or list(path.glob("*.bin"))
    if not files:
        return None
    stored = "float32"
    try:
        config = json.loads((path / "config.json").read_text())
        stored = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    except (OSError, ValueError):
        pass
    scale = (_DTYPE_BYTES.get("float32" if dtype == "auto" else dtype, 4)
             / _DTYPE_BYTES.get(stored, 4))
    return int(sum(f.stat().st_size for f in files) * scale)


def check_weights_fit(model: str, dtype: str, limit_mb: int) -> None:
    """Refuse a ``--memory-mb`` that cannot hold the process and the model's weights, before
    the model loads (the exact check, with one sequence's activations, follows the load:
    :class:`UpdateMemory`).

    Raises:
        StatusError: INVALID_ARGUMENT ``--memory-mb``, naming the least that could work.
    """
    from gridrl.models import resolve_model

    try:
        size = weights_bytes(resolve_model(model), dtype)
    except Exception:  # the load reports a bad --model itself
        return
    if size is None:
        return
    need = current_rss_bytes() + size
    if need > limit_mb * MIB:
        raise invalid_argument("--memory-mb", f"{limit_mb} MiB cannot hold the model's "
                               f"weights ({mib_up(size)} MiB) beside the process "
                               f"({mib_up(current_rss_bytes())} MiB): needs --memory-mb "
                               f"{mib_up(need)} or more, and more for the activations")
