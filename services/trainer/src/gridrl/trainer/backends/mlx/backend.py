"""``--backend mlx``: the :class:`~gridrl.trainer.backends.base.TrainerBackend` on MLX (Apple
Silicon; Linux CPU through ``mlx[cpu]``), for a shop of Macs.

The model is loaded by the inference engine's MLX backend
(:meth:`gridrl.engine.backends.mlx.backend.MlxBackend.from_pretrained`: mlx-lm's loader with the
config fixes transformers 5 needs) and trained with mlx-lm's own LoRA layers:
``mlx_lm.tuner.utils.linear_to_lora_layers`` wraps the target linears of every block in
``mlx_lm.tuner.lora.LoRALinear`` (``y = linear(x) + scale * ((dropout(x) @ lora_a) @
lora_b)``, ``lora_a`` (in, r) uniform in ``+-1/sqrt(in)`` as peft's kaiming-uniform A,
``lora_b`` (r, out) zero), after ``model.freeze()``, so the LoRA arrays are the only trainable
parameters. ``scale`` is ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA). The same engine
object samples from the live weights for ``--rollout local`` and the eval.

One GRPO step (:meth:`MlxTrainerBackend.update`): per micro-batch, the completion logits from
the shared-prefix forward (each group's prompt once, its KV cache repeated for the group's
completions: :meth:`MlxTrainerBackend._shared_prefix_hidden`) or, for architectures whose head
is not plain, from prompt + completion in one right-padded row per sequence (positions from 0
in every row, so neither RoPE nor the causal mask sees the padding), then the per-token loss of
:mod:`gridrl.trainer.backends.mlx.losses` weighted by :func:`gridrl.trainer.grpo.advantages.sequence_weights`;
gradients by ``nn.value_and_grad`` summed over micro-batches, clipped with
``mlx.optimizers.clip_grad_norm``, and ``mlx.optimizers.AdamW`` with bias correction (torch's
AdamW) on the schedule :func:`gridrl.trainer.grpo.advantages.lr_factor`. The reference policy (``beta >
0``) is the same model with every LoRA ``scale`` set to 0 (``y + 0 * z == y`` exactly).

Adapters leave as peft files (the :class:`TrainerBackend` contract: ``lora_A = lora_a.T``,
``lora_B = lora_b.T``, bit for bit); :meth:`MlxTrainerBackend.mlx_adapter_files` gives the
mlx-lm layout as it is trained, which is what mlx rollout nodes are sent.

Checkpoint files: the peft adapter files, ``optimizer.safetensors`` (the AdamW state: step,
learning rate, ``m`` and ``v`` of every LoRA array) and ``rng.json`` (python and numpy RNG
states). MLX's global key (LoRA dropout) is re-seeded from ``(seed, optimizer step)`` at every
update, so it needs no saving to resume exactly.

Data parallelism is not implemented: ``--backend mlx`` trains in one process.

The module holds the trainer's steps (set-up, sampling, scoring, the update); its forward
passes are in :mod:`gridrl.trainer.backends.mlx.forward`, its files (adapter, checkpoint) in
:mod:`gridrl.trainer.backends.mlx.files`, ``--memory-mb``'s probe and plan in
:mod:`gridrl.trainer.backends.mlx.memory`.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from gridrl.common.errors import invalid_argument, resource_exhausted
from gridrl.engine.contract import SequenceRequest
from gridrl.models import model_identity, resolve_model
from gridrl.trainer.backends.base import (
    LoraSettings,
    TrainerBackend,
    TrainSequence,
    UpdateConfig,
    UpdateStats,
)
from gridrl.trainer.backends.memory import (
    MIB,
    MemoryBudgetError,
    is_out_of_memory,
    out_of_memory_advice,
    peak_rss_bytes,
    reset_peak_rss,
    resolve_memory_mb,
)
from gridrl.trainer.backends.mlx import losses as grpo_mlx
from gridrl.trainer.backends.mlx.files import OPTIMIZER, RNG, MlxAdapterFiles
from gridrl.trainer.backends.mlx.forward import PLAIN_HEAD_TYPES, MlxForwardPasses
from gridrl.trainer.backends.mlx.memory import MlxUpdateMemory, cache_limited
from gridrl.trainer.grpo import advantages as grpo

__all__ = ["OPTIMIZER", "RNG", "MlxTrainerBackend"]


def _lora_modules(model: nn.Module) -> dict[str, Any]:
    """Full module path -> every mlx-lm ``LoRALinear`` of ``model``, sorted by path."""
    from mlx_lm.tuner.lora import LoRALinear

    return dict(sorted((p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear)))


def _lora_keys(model: nn.Module, target_modules: str) -> list[str]:
    """mlx-lm ``keys`` (module paths inside a block) of ``--lora-target-modules``.

    ``"all-linear"``: every Linear of the blocks (peft's ``all-linear`` takes every linear but
    the output head, which lives outside the blocks). A list: the block linears whose last name
    is one of its entries (peft's suffix match).

    Raises:
        StatusError: INVALID_ARGUMENT ``--lora-target-modules`` when nothing matches.
    """
    linears = sorted({p for layer in model.layers for p, m in layer.named_modules()
                      if p and isinstance(m, (nn.Linear, nn.QuantizedLinear))})
    if target_modules == "all-linear":
        keys = linears
    else:
        names = {t.strip() for t in target_modules.split(",") if t.strip()}
        keys = [p for p in linears if p.rsplit(".", 1)[-1] in names]
    if not keys:
        raise invalid_argument("--lora-target-modules",
                               f"{target_modules!r} matches no linear layer of the model's "
                               f"blocks (they have {', '.join(linears) or 'none'})")
    return keys


def _check_single_process() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise invalid_argument("--backend", "mlx trains in one process; data parallelism "
                                            "(torchrun) needs --backend torch")


class MlxTrainerBackend(MlxForwardPasses, MlxAdapterFiles, TrainerBackend):
    """The MLX implementation (see the module docstring).

    Args:
        engine: the :class:`gridrl.engine.backends.mlx.backend.MlxBackend` whose model carries the LoRA
            layers (it samples ``--rollout local`` and the eval).
        lora: the LoRA settings the layers were made with.
        optimizer: ``mlx.optimizers.AdamW`` over the LoRA arrays, its learning rate scheduled.
        update_cfg: the loss settings.
        model_id: the ``--model`` string (``base_model_name_or_path`` of the adapter).
        identity: the base model's identity.
        lr, schedule, warmup_steps, total_steps: the learning-rate schedule
            (:func:`gridrl.trainer.grpo.advantages.lr_factor`).
        seed: the run's seed (dropout keys are drawn from ``(seed, step)``).
        max_batch: sequences :meth:`generate` decodes together.
    """

    name = "mlx"

    def __init__(self, engine: Any, lora: LoraSettings, optimizer: optim.Optimizer,
                 update_cfg: UpdateConfig, model_id: str, identity: Any, *, lr: float,
                 schedule: str = "constant", warmup_steps: int = 0, total_steps: int = 1,
                 seed: int = 0, max_batch: int = 64,
                 memory: MlxUpdateMemory | None = None) -> None:
        self.engine = engine
        self.model: nn.Module = engine.model
        self.lora = lora
        self.optimizer = optimizer
        self.update_cfg = update_cfg
        self.model_id = model_id
        self.identity = identity
        self.tokenizer = engine.tokenizer
        self.low_precision = engine.dtype in ("bfloat16", "float16")
        self.lr, self.schedule = lr, schedule
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.seed = seed
        self.max_batch = max_batch
        #: ``--memory-mb``'s bound (:class:`~gridrl.trainer.backends.mlx.memory.
        #: MlxUpdateMemory`): micro-batches planned from token counts; None: of
        #: ``micro_batch_size``.
        self.memory = memory
        self.modules = _lora_modules(self.model)
        model_type = getattr(getattr(self.model, "args", None), "model_type", "")
        self._plain_head = model_type in PLAIN_HEAD_TYPES and hasattr(self.model, "model")
        self.model.eval()

    @classmethod
    def from_config(cls, cfg: Any) -> MlxTrainerBackend:
        """See :meth:`TrainerBackend.from_config`. ``--device``: ``auto`` (MLX's default
        device: the GPU on Apple Silicon), ``cpu``/``mlx-cpu``, ``gpu``/``mlx-gpu``.
        ``--dtype``: ``auto`` keeps the stored dtype; ``float32``, ``bfloat16``, ``float16``
        cast the base weights (LoRA arrays stay float32). ``--threads`` is not used (MLX sizes
        its own CPU pool).

        Raises:
            StatusError: INVALID_ARGUMENT on ``--device``, ``--dtype``,
                ``--lora-target-modules``, or ``--backend`` under torchrun.
        """
        from mlx_lm.tuner.utils import linear_to_lora_layers

        from gridrl.engine.backends.mlx.backend import MlxBackend
        _check_single_process()
        dtypes = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
        if cfg.dtype != "auto" and cfg.dtype not in dtypes:
            raise invalid_argument("--dtype", f"{cfg.dtype!r} is not one of auto, "
                                              f"{', '.join(dtypes)} for --backend mlx")
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % (2 ** 32))
        mx.random.seed(cfg.seed % (2 ** 32))
        path = resolve_model(cfg.model)
        try:
            engine = MlxBackend.from_pretrained(path, device=cfg.device)
        except ValueError as e:
            if "--device" in str(e):
                raise invalid_argument("--device", str(e).removeprefix("--device: ")) from e
            raise
        model = engine.model
        if cfg.dtype != "auto":
            model.set_dtype(dtypes[cfg.dtype])
            engine.dtype = cfg.dtype
        lora = LoraSettings.from_config(cfg)
        keys = _lora_keys(model, lora.target_modules)
        scale = lora.alpha / (math.sqrt(lora.rank) if lora.rslora else lora.rank)
        model.freeze()
        with mx.stream(engine._device):
            linear_to_lora_layers(model, len(model.layers), {
                "rank": lora.rank, "scale": scale, "dropout": lora.dropout, "keys": keys})
        mx.eval(model.parameters())
        identity = model_identity(path, model_id=cfg.model)
        update_cfg = UpdateConfig.from_config(cfg)
        settings = dict(lr=cfg.lr, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                        total_steps=cfg.steps)
        grpo.lr_factor(0, cfg.lr_schedule, cfg.warmup_steps, cfg.steps)  # validates the name

        def learning_rate(step: mx.array) -> mx.array:
            return mx.array(cfg.lr * grpo.lr_factor(int(step.item()), cfg.lr_schedule,
                                                    cfg.warmup_steps, cfg.steps), mx.float32)

        optimizer = optim.AdamW(learning_rate=learning_rate, betas=[0.9, 0.999], eps=1e-8,
                                weight_decay=cfg.weight_decay, bias_correction=True)
        backend = cls(engine, lora, optimizer, update_cfg, cfg.model, identity, seed=cfg.seed,
                      **settings)
        limit_mb = resolve_memory_mb(getattr(cfg, "memory_mb", 0))
        if limit_mb:  # measured on the model as loaded, before step 1
            try:
                backend.memory = MlxUpdateMemory(backend, limit_mb * MIB)
            except MemoryBudgetError as e:
                raise invalid_argument("--memory-mb", str(e)) from e
        return backend

    def _chunks(self, seqs: Sequence[TrainSequence], indices: list[int]
                ) -> tuple[list[list[int]], int | None]:
        """The micro-batches of ``indices``: planned within ``--memory-mb`` (:attr:`memory`,
        ``micro_batch_size`` still caps their sequences), else of ``micro_batch_size``; and the
        bytes MLX's buffer cache may keep while they run
        (:meth:`~gridrl.trainer.backends.mlx.memory.MlxUpdateMemory.cache_limit_bytes`; None
        without a budget: MLX's own limit).

        Raises:
            StatusError: RESOURCE_EXHAUSTED ``--memory-mb``: a sequence does not fit alone.
        """
        cfg = self.update_cfg
        if self.memory is not None:
            try:
                plan = self.memory.plan(seqs, indices, cfg.micro_batch_size)
            except MemoryBudgetError as e:
                raise resource_exhausted(str(e), field="--memory-mb") from e
            return plan.chunks, self.memory.cache_limit_bytes(plan)
        mb = cfg.micro_batch_size or max(len(indices), 1)
        return [indices[i:i + mb] for i in range(0, len(indices), mb)], None

    # ---------------------------------------------------------------- sampling and scoring

    def generate(self, prompts: Sequence[Sequence[int]], config: Any,
                 seeds: Sequence[int], *, shared_prefix: bool = False) -> list[Any]:
        """See :meth:`TrainerBackend.generate`: the engine's MLX backend over the live model
        (eval mode: no dropout), ``max_batch`` sequences at a time (``shared_prefix`` is not
        used: every prompt is prefilled whole)."""
        requests = [SequenceRequest(prompt_ids=list(p), sampling=config, seed=s)
                    for p, s in zip(prompts, seeds, strict=True)]
        self.model.eval()
        results: list[Any] = []
        for i in range(0, len(requests), self.max_batch):
            results.extend(self.engine.generate(requests[i:i + self.max_batch], None))
        return results

    def logprobs(self, seqs: Sequence[TrainSequence]) -> list[list[float]]:
        """See :meth:`TrainerBackend.logprobs`: eval mode, in the update's micro-batches
        (:meth:`_chunks`)."""
        if not seqs:
            return []
        self.model.eval()
        cfg = self.update_cfg
        out: list[list[float]] = []
        chunks, cache_limit = self._chunks(seqs, list(range(len(seqs))))
        with mx.stream(self.engine._device), cache_limited(cache_limit):
            for idx in chunks:
                chunk = [seqs[i] for i in idx]
                batch = self._collate(chunk, behaviour=False)
                logits = self._completion_logits(chunk, batch)
                if cfg.truncated:
                    lp = self._sampler_logprobs(logits, batch["completion_ids"])
                else:
                    lp = grpo_mlx.completion_logprobs(logits, batch["completion_ids"],
                                                      cfg.temperature)
                rows = np.array(lp.astype(mx.float32)) * np.array(batch["mask"])
                out.extend(rows[i, :len(s.completion_ids)].tolist()
                           for i, s in enumerate(chunk))
        return out

    # ---------------------------------------------------------------- training

    def _chunk_loss(self, seqs: Sequence[TrainSequence], batch: dict[str, mx.array],
                    coef: mx.array, ref_logp: mx.array | None) -> tuple[mx.array, ...]:
        """The weighted loss of one micro-batch (differentiated) and, as auxiliary outputs,
        its trainer logprobs, clipped mask and reference KL (zeros when beta == 0)."""
        cfg = self.update_cfg
        logits = self._completion_logits(seqs, batch)
        logp = grpo_mlx.completion_logprobs(logits, batch["completion_ids"], cfg.temperature)
        out = grpo_mlx.grpo_token_loss(logp, batch["behaviour"], batch["advantages"],
                                       eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                       beta=cfg.beta, ref_logp=ref_logp)
        valid = batch["mask"] > 0
        token_loss = mx.where(valid, out.loss, mx.zeros_like(out.loss))
        part = (token_loss * coef[:, None]).sum()
        ref_kl = out.ref_kl if out.ref_kl is not None else mx.zeros_like(logp)
        return part, logp, out.clipped, ref_kl

    def _micro_batch(self, chunk: Sequence[TrainSequence], coef: mx.array, grads: Any
                     ) -> tuple[dict[str, mx.array], tuple[mx.array, ...], Any]:
        """The forward and backward of one micro-batch of :meth:`update`, evaluated (also
        what ``--memory-mb``'s probe runs: :func:`gridrl.trainer.backends.mlx.memory.
        probe_peak_bytes`): the reference forward first (beta > 0), then the loss and its
        gradients in train mode (dropout on), the sampler's logprobs when it truncates.

        Args:
            chunk: the micro-batch's sequences.
            coef: (n,) float32 loss weights of its sequences.
            grads: the gradients of the micro-batches before it (None: the first).
        Returns:
            ``(batch, (part, seen, clipped, ref_kl), grads)``: the collated batch
            (:meth:`_collate`), the micro-batch's weighted loss (scalar), the logprobs the
            mismatch KL reads (n, C), the clipped mask (n, C) bool, the reference KL (n, C),
            and the gradients summed with ``grads``.
        """
        cfg = self.update_cfg
        batch = self._collate(chunk)
        ref_logp = None
        if cfg.beta:
            self.model.eval()
            with self._adapter_disabled():
                ref_logits = self._completion_logits(chunk, batch)
                ref_logp = mx.stop_gradient(grpo_mlx.completion_logprobs(
                    ref_logits, batch["completion_ids"], cfg.temperature))
                mx.eval(ref_logp)
        self.model.train()
        loss_and_grad = nn.value_and_grad(self.model, partial(self._chunk_loss, chunk))
        (part, logp, took, ref_kl), g = loss_and_grad(batch, coef, ref_logp)
        seen = (self._sampler_logprobs(mx.stop_gradient(self._completion_logits(chunk, batch)),
                                       batch["completion_ids"]) if cfg.truncated else logp)
        grads = g if grads is None else tree_map(mx.add, grads, g)
        mx.eval(part, seen, took, ref_kl, grads)
        return batch, (part, seen, took, ref_kl), grads

    def update(self, seqs: Sequence[TrainSequence]) -> UpdateStats:
        """See :meth:`TrainerBackend.update` (module docstring for the MLX specifics).

        Raises:
            ValueError: ``seqs`` is empty.
            StatusError: RESOURCE_EXHAUSTED ``--memory-mb``: a sequence does not fit the
                budget alone (nothing stepped).
            UpdateOutOfMemory: MLX's allocator refused anyway (a RuntimeError naming the
                setting to lower; before the optimizer step the weights are untouched).
        """
        if not seqs:
            raise ValueError("no sequences to train on")
        reset_peak_rss()
        cfg = self.update_cfg
        n = len(seqs)
        coef_all = grpo.sequence_weights([s.trained_tokens for s in seqs],
                                         cfg.aggregation, cfg.max_tokens)  # type: ignore[arg-type]
        kept = (set(grpo.groups_with_signal([s.group for s in seqs],
                                            [s.advantage for s in seqs], beta=cfg.beta))
                if cfg.skip_no_signal else {s.group for s in seqs})
        trained = [i for i, s in enumerate(seqs) if s.group in kept]  # the rest: gradient 0
        chunks, cache_limit = self._chunks(seqs, trained)
        step = int(self.optimizer.step.item())
        mx.random.seed((self.seed * 1_000_003 + step) % (2 ** 32))  # dropout of this step
        loss_sum, clipped, ref_kl_sum = 0.0, 0.0, 0.0
        per_seq_kl = np.full(n, np.nan, np.float64)  # NaN: skipped, not measured
        ntok = np.array([s.trained_tokens for s in seqs], np.float64)
        grads: Any = None

        def out_of_memory(weights_untouched: bool) -> Exception:
            self.model.eval()
            mx.clear_cache()
            return out_of_memory_advice(
                limit_mb=self.memory.limit_bytes // MIB if self.memory else None,
                micro_batch_size=cfg.micro_batch_size,
                largest_micro_batch=max((len(c) for c in chunks), default=0),
                micro_batches=len(chunks), weights_untouched=weights_untouched)

        with mx.stream(self.engine._device), cache_limited(cache_limit):
            try:
                for idx in chunks:
                    chunk = [seqs[i] for i in idx]
                    batch, (part, seen, took, ref_kl), grads = self._micro_batch(
                        chunk, mx.array(coef_all[idx]), grads)
                    mask = np.array(batch["mask"])
                    kl = grpo.mismatch_kl_per_sequence(np.array(seen), np.array(batch["behaviour"]),
                                                       mask)
                    per_seq_kl[idx] = kl
                    loss_sum += float(part.item())
                    clipped += float((np.array(took) & (mask > 0)).sum())
                    ref_kl_sum += float((np.array(ref_kl).astype(np.float64) * mask).sum())
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                grads = None
                raise out_of_memory(True) from e
            self.model.eval()
            if grads is None:  # no group with signal: a zero gradient, AdamW still steps
                grads = tree_map(mx.zeros_like, self.model.trainable_parameters())
            lr = float(self.lr * grpo.lr_factor(step, self.schedule, self.warmup_steps,
                                                self.total_steps))
            if cfg.max_grad_norm > 0:
                grads, norm = optim.clip_grad_norm(grads, cfg.max_grad_norm)
            else:
                norm = mx.sqrt(sum((g.astype(mx.float32) ** 2).sum()
                                   for _, g in tree_flatten(grads)))
            try:
                self.optimizer.update(self.model, grads)
                mx.eval(self.model.parameters(), self.optimizer.state, norm)
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                raise out_of_memory(False) from e
        tokens = max(float(ntok.sum()), 1.0)
        forwarded = max(float(ntok[trained].sum()), 1.0)
        return UpdateStats(
            loss=loss_sum,
            mismatch_kl=float((per_seq_kl[trained] * ntok[trained]).sum()) / forwarded,
            per_sequence_mismatch_kl=[float(v) for v in per_seq_kl],
            clip_fraction=clipped / tokens,
            ref_kl=ref_kl_sum / forwarded if cfg.beta else None,
            grad_norm=float(norm.item()), lr=lr, tokens=int(ntok.sum()),
            skipped_groups=len({s.group for s in seqs} - kept),
            skipped_sequences=n - len(trained), micro_batches=len(chunks),
            peak_rss_bytes=peak_rss_bytes())

    # ---------------------------------------------------------------- files

    def close(self, wait: bool = True) -> None:
        """Nothing to leave (one process); frees MLX's buffer cache."""
        mx.clear_cache()
