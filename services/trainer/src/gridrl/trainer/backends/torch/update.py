"""The torch backend's GRPO step: one optimizer step over the training sequences of a step,
and the trainer's behaviour-aligned logprobs of sequences.

The trainer's logprobs of every sequence come from packed forward passes where the model allows
(:mod:`gridrl.trainer.backends.torch.packed`: each group's prompt once, its completions after it,
no padding but each row's tail) and otherwise from padded ones (prompts left-padded,
completions right-padded, positions from the attention mask), in micro-batches of
``micro_batch_size`` sequences (0: all at once); no per-token Python loop. The loss weights are
fixed over the whole step first (:func:`gridrl.trainer.grpo.advantages.sequence_weights`), so micro-batches
and data-parallel ranks add up to exactly the full-batch loss and gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from gridrl.engine.backends.torch.sampling import RowSampling, transform_logits
from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.backends.base import TrainSequence, UpdateConfig, UpdateStats
from gridrl.trainer.backends.memory import (
    MemoryPlanner,
    is_out_of_memory,
    out_of_memory_advice,
    peak_rss_bytes,
    reset_peak_rss,
    trim_free_memory,
)
from gridrl.trainer.backends.torch import losses as grpo_torch
from gridrl.trainer.backends.torch.distributed import SingleProcess
from gridrl.trainer.backends.torch.packed import pack
from gridrl.trainer.grpo import advantages as grpo

if TYPE_CHECKING:
    from gridrl.engine.backends.torch.cores import ThreadGovernor


def collate(seqs: Sequence[TrainSequence], pad_id: int, device: torch.device, *,
            behaviour: bool = True) -> dict[str, torch.Tensor]:
    """Pad sequences into tensors: prompts left-padded to the longest prompt (width P),
    completions right-padded to the longest completion (width C).

    Args:
        behaviour: read the behaviour logprobs (False: for scoring only; ``behaviour`` is 0).
    Returns:
        ``input_ids`` (n, P + C) int64, ``attention_mask`` (n, P + C) int64 (1 on every real
        token, environment turns included: they are context), ``completion_ids`` (n, C)
        int64, ``completion_mask`` (n, C) float32 (1 on the tokens that carry a loss: the
        model's; 0 on padding and on a multi-turn episode's environment tokens,
        :attr:`TrainSequence.loss_mask`), ``behaviour`` (n, C) float32 (0 where the mask is),
        ``advantages`` (n,) float32.
    """
    p_width = max(len(s.prompt_ids) for s in seqs)
    c_width = max(max(len(s.completion_ids) for s in seqs), 1)
    n = len(seqs)
    input_ids = torch.full((n, p_width + c_width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, p_width + c_width), dtype=torch.long)
    comp_mask = torch.zeros((n, c_width), dtype=torch.float32)
    behaviour_lp = torch.zeros((n, c_width), dtype=torch.float32)
    for i, s in enumerate(seqs):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, p_width - p:p_width] = torch.tensor(s.prompt_ids, dtype=torch.long)
        attention[i, p_width - p:p_width + c] = 1
        if c:
            input_ids[i, p_width:p_width + c] = torch.tensor(s.completion_ids, dtype=torch.long)
            comp_mask[i, :c] = torch.tensor(s.mask_row(), dtype=torch.float32)
            if behaviour:
                behaviour_lp[i, :c] = torch.tensor(s.behaviour_logprobs,
                                                   dtype=torch.float32) * comp_mask[i, :c]
    return {
        "input_ids": input_ids.to(device), "attention_mask": attention.to(device),
        "completion_ids": input_ids[:, p_width:].to(device),
        "completion_mask": comp_mask.to(device), "behaviour": behaviour_lp.to(device),
        "advantages": torch.tensor([s.advantage for s in seqs], dtype=torch.float32,
                                   device=device),
    }


def grpo_update(policy: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                seqs: Sequence[TrainSequence], cfg: UpdateConfig,
                parallel: SingleProcess | None = None,
                memory: MemoryPlanner | None = None,
                cores: ThreadGovernor | None = None) -> UpdateStats:
    """Compute the GRPO loss of ``seqs``, back-propagate, clip, and step the optimizer and the
    learning-rate schedule once.

    Args:
        policy: a :class:`gridrl.trainer.backends.torch.policy.Policy`.
        optimizer: over ``policy.trainable_parameters()``.
        scheduler: a ``torch.optim.lr_scheduler`` (stepped once), or None.
        seqs: the step's sequences, identical on every rank.
        cfg: loss settings.
        parallel: :class:`~gridrl.trainer.backends.torch.distributed.DataParallel` under torchrun; this rank
            trains on its share of the groups and DDP averages gradients (the loss is scaled by
            the world size so the average equals the full-batch gradient).
        memory: ``--memory-mb``'s bound (:class:`~gridrl.trainer.backends.torch.memory.UpdateMemory`):
            the micro-batches are cut to fit it (``micro_batch_size`` still caps their
            sequences), a sequence that fits only with activation checkpointing runs alone
            with it; None: micro-batches of ``micro_batch_size``.
        cores: ``--threads 0``'s core sharing
            (:class:`~gridrl.engine.backends.torch.cores.ThreadGovernor`): the torch threads
            are re-decided from what other processes leave free after each micro-batch (from
            the update's own window: the wait between updates is not counted); None: as set.
    Returns:
        :class:`UpdateStats` (identical on every rank but ``peak_rss_bytes``, this
        process's).
    Raises:
        ValueError: ``seqs`` is empty or this rank's share is empty.
        MemoryBudgetError: a sequence does not fit ``memory`` even with checkpointing (the
            weights are untouched).
        UpdateOutOfMemory: the allocator refused anyway (a RuntimeError saying which setting
            to lower, :func:`gridrl.trainer.backends.memory.out_of_memory_advice`); before the
            optimizer step the gradients are dropped and the weights untouched.
    """
    par = parallel or SingleProcess(policy.model)
    if not seqs:
        raise ValueError("no sequences to train on")
    coef = torch.from_numpy(grpo.sequence_weights(
        [s.trained_tokens for s in seqs], cfg.aggregation, cfg.max_tokens))  # type: ignore[arg-type]
    reset_peak_rss()
    local, skipped = _trained_share(seqs, cfg, par)
    if memory is not None:
        plan = memory.plan(seqs, local, cfg.micro_batch_size)
        chunks, checkpointed = plan.chunks, plan.checkpointed
    else:
        mb = cfg.micro_batch_size or max(len(local), 1)
        chunks = [local[i:i + mb] for i in range(0, len(local), mb)]
        checkpointed = [False] * len(chunks)

    policy.model.train()
    optimizer.zero_grad(set_to_none=True)
    n = len(seqs)
    correct = cfg.is_correction != "none"
    # [loss, clipped tokens, tokens, mismatch kl sum, ref kl sum, IS ratio sum, IS units,
    #  IS limited units] + per-sequence mismatch kl
    totals = torch.zeros(_TOTALS + n, dtype=torch.float64)
    totals[_TOTALS + torch.tensor(sorted(skipped), dtype=torch.long)] = float("nan")
    ratio_max = torch.zeros(1, dtype=torch.float64)
    if cores is not None:
        cores.begin()

    def out_of_memory(weights_untouched: bool) -> Exception:
        optimizer.zero_grad(set_to_none=True)
        trim_free_memory()
        return out_of_memory_advice(
            limit_mb=getattr(memory, "limit_bytes", 0) // (1 << 20) if memory else None,
            micro_batch_size=cfg.micro_batch_size,
            largest_micro_batch=max((len(c) for c in chunks), default=0),
            micro_batches=len(chunks), weights_untouched=weights_untouched)

    try:
        _micro_batches(policy, seqs, cfg, par, chunks, checkpointed, coef, totals, ratio_max,
                       memory, cores)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        raise out_of_memory(True) from e
    par.all_reduce_sum(totals)
    if correct:
        par.all_reduce_max(ratio_max)

    params = policy.trainable_parameters()
    for p in params:  # skipped groups (or a step without signal): exact zeros, so AdamW
        if p.grad is None:  # still steps every parameter (moments and weight decay)
            p.grad = torch.zeros_like(p)
    limit = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
    lr = float(optimizer.param_groups[0]["lr"])
    try:
        optimizer.step()
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        raise out_of_memory(False) from e
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    forwarded = max(float(totals[2]), 1.0)  # tokens of the sequences trained on
    all_tokens = sum(s.trained_tokens for s in seqs)  # skipped ones too (never clipped)
    tokens = max(float(all_tokens), 1.0)
    units = max(float(totals[6]), 1.0)
    return UpdateStats(
        loss=float(totals[0]), mismatch_kl=float(totals[3]) / forwarded,
        per_sequence_mismatch_kl=[float(v) for v in totals[_TOTALS:]],
        clip_fraction=float(totals[1]) / tokens,
        ref_kl=float(totals[4]) / forwarded if cfg.beta else None,
        grad_norm=grad_norm, lr=lr, tokens=all_tokens,
        is_weight_mean=float(totals[5]) / units if correct else None,
        is_weight_max=float(ratio_max[0]) if correct else None,
        is_limited_fraction=float(totals[7]) / units if correct else None,
        skipped_groups=len({seqs[i].group for i in skipped}), skipped_sequences=len(skipped),
        micro_batches=len(chunks), checkpointed_micro_batches=sum(checkpointed),
        peak_rss_bytes=peak_rss_bytes(), threads=torch.get_num_threads())


#: Called with the micro-batch's index before each micro-batch's forward (None: nothing): where
#: tests inject a failure (an allocator's refusal) into a real update.
before_micro_batch: Callable[[int], None] | None = None


def _micro_batches(policy: Any, seqs: Sequence[TrainSequence], cfg: UpdateConfig, par: Any,
                   chunks: list[list[int]], checkpointed: list[bool], coef: torch.Tensor,
                   totals: torch.Tensor, ratio_max: torch.Tensor,
                   memory: MemoryPlanner | None, cores: ThreadGovernor | None) -> None:
    """The forward and backward of each micro-batch of :func:`grpo_update` (gradients
    accumulated in the LoRA parameters, statistics added into ``totals`` / ``ratio_max``)."""
    device = policy.device
    correct = cfg.is_correction != "none"
    with _frozen_weights_cast(policy, cfg):
        for k, idx in enumerate(chunks):
            if before_micro_batch is not None:
                before_micro_batch(k)
            batch = collate([seqs[i] for i in idx], policy.pad_id, device)
            mask = batch["completion_mask"]
            width = mask.shape[1]
            sync = k == len(chunks) - 1
            ctx = par.no_sync() if not sync else contextlib.nullcontext()
            recompute = checkpointed[k]
            with ctx, policy.activation_checkpointing(recompute):
                logp, seen = _logprobs(policy, [seqs[i] for i in idx], batch,
                                       checkpointable(cfg) if recompute else cfg, par,
                                       amp=True)
                ref_logp = None
                if cfg.beta:
                    with autocast(cfg, device):
                        ref_logits = policy.reference_logits(batch["input_ids"],
                                                             batch["attention_mask"], width)
                    ref_logp = grpo_torch.completion_logprobs(ref_logits, batch["completion_ids"],
                                                              cfg.temperature)
                    del ref_logits
                iw = (grpo_torch.importance_weights(
                    seen, batch["behaviour"], mask, correction=cfg.is_correction,  # type: ignore[arg-type]
                    level=cfg.is_level, cap=cfg.is_cap) if correct else None)  # type: ignore[arg-type]
                out = grpo_torch.grpo_token_loss(logp, batch["behaviour"], batch["advantages"],
                                                 eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                                 beta=cfg.beta, ref_logp=ref_logp,
                                                 is_weights=iw.weights if iw else None)
                valid = mask > 0
                token_loss = torch.where(valid, out.loss, torch.zeros_like(out.loss))
                part = (token_loss * coef[idx].to(device).unsqueeze(-1)).sum()
                (part * par.world_size).backward()
            with torch.no_grad():
                _, per_seq_kl = grpo_torch.mismatch_kl(seen, batch["behaviour"], mask)
                ntok = mask.sum(dim=1)
                totals[0] += float(part.detach())
                totals[1] += float((out.clipped & valid).sum())
                totals[2] += float(ntok.sum())
                totals[3] += float((per_seq_kl * ntok).sum())
                if out.ref_kl is not None:
                    totals[4] += float((out.ref_kl * mask).sum())
                if iw is not None:
                    totals[5] += float(iw.ratio[iw.units].double().sum())
                    totals[6] += float(iw.units.sum())
                    totals[7] += float(iw.limited.sum())
                    if bool(iw.units.any()):
                        ratio_max[0] = max(float(ratio_max[0]), float(iw.ratio[iw.units].max()))
                totals[_TOTALS + torch.tensor(idx)] = per_seq_kl.double().cpu()
            if memory is not None:
                del batch, logp, seen, out, token_loss, ref_logp, iw
                trim_free_memory()  # the next micro-batch starts from the base again
            if cores is not None:
                cores.step()  # between micro-batches: the threads others leave free


def _trained_share(seqs: Sequence[TrainSequence], cfg: UpdateConfig,
                   par: Any) -> tuple[list[int], set[int]]:
    """``(local, skipped)``: indices of the sequences this rank forwards and back-propagates,
    and of the sequences no rank does (groups without signal:
    :func:`gridrl.trainer.grpo.advantages.groups_with_signal`; their gradient is exactly 0).

    The kept groups are dealt to ranks renumbered densely, so ranks share the groups with
    signal. Under data parallelism with fewer groups with signal than ranks (but some), every
    group is kept: each rank must run a backward for DDP's all-reduce. Identical on every rank
    (the sequences are).

    Raises:
        ValueError: some rank would have no group to train on.
    """
    groups = [s.group for s in seqs]
    kept = (grpo.groups_with_signal(groups, [s.advantage for s in seqs], beta=cfg.beta)
            if cfg.skip_no_signal else list(dict.fromkeys(groups)))
    if 0 < len(kept) < par.world_size:
        kept = list(dict.fromkeys(groups))
    dense = {g: k for k, g in enumerate(kept)}
    trained = [i for i, g in enumerate(groups) if g in dense]
    skipped = set(range(len(seqs))) - set(trained)
    if not trained:
        return [], skipped
    share = par.local_share([dense[groups[i]] for i in trained])
    if not share:
        raise ValueError(f"rank {par.rank} has no group to train on: use at least "
                         f"{par.world_size} prompts per step")
    return [trained[k] for k in share], skipped


_TOTALS = 8  # scalar slots of grpo_update's totals before the per-sequence mismatch KL


def _frozen_weights_cast(policy: Any, cfg: UpdateConfig) -> contextlib.AbstractContextManager:
    """A bfloat16 update reads the frozen weights as bfloat16 copies made once
    (:meth:`Policy.frozen_weights_as`: the same products as autocast casting them anew)."""
    if cfg.update_dtype == "bfloat16":
        return policy.frozen_weights_as(torch.bfloat16)
    return contextlib.nullcontext()


def checkpointable(cfg: UpdateConfig) -> UpdateConfig:
    """``cfg`` for a forward under activation checkpointing: no shared-prefix cache (a
    checkpointed layer drops it) and a packed batch's dense mask rather than attention per
    segment (the recomputation in the backward runs after the forward's attention
    implementation is restored: :meth:`Policy.packed_hidden`)."""
    return dataclasses.replace(cfg, shared_prefix=False, segment_attention=False)


def autocast(cfg: UpdateConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to bfloat16 on ``device`` when ``cfg.update_dtype`` is
    ``"bfloat16"`` (products in bfloat16, parameters and their gradients stay float32), else a
    no-op context."""
    if cfg.update_dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _logits(policy: Any, seqs: Sequence[TrainSequence], batch: dict[str, torch.Tensor],
            cfg: UpdateConfig, par: Any) -> torch.Tensor:
    """(n, C, V) completion logits of ``seqs`` (collated as ``batch``), one forward through
    ``par`` (:meth:`SingleProcess.run`)."""
    if cfg.shared_prefix:  # one prompt forward per group, its cache repeated
        return par.run(policy, "shared_prefix_logits", [s.prompt_ids for s in seqs],
                       batch["completion_ids"])
    return par.run(policy, "completion_logits", batch["input_ids"], batch["attention_mask"],
                   batch["completion_mask"].shape[1])


def _logprobs(policy: Any, seqs: Sequence[TrainSequence], batch: dict[str, torch.Tensor],
              cfg: UpdateConfig, par: Any, *, amp: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, seen)``: (n, C) float32 logprobs of the completion tokens under
    ``softmax(logits / T)`` (with the gradient when enabled) and under the sampler's transform
    (:func:`sampler_logprobs`; ``logp`` itself when the run does not truncate). With ``amp``,
    the model's forward and its output projection run under :func:`autocast`; the
    log-softmax of full logits runs outside it, in float32.

    The forward runs through ``par`` (:meth:`SingleProcess.run`: one call, which under DDP
    goes through its wrapper). When the run does not truncate and the policy's head is plain
    (:attr:`Policy.head_weight`), the logprobs come from the final hidden states through
    :func:`grpo_torch.head_logprobs`, on the completion tokens only; padding positions are 0
    there (every consumer masks them). Otherwise from the full logits.
    """
    def mixed() -> contextlib.AbstractContextManager:
        return autocast(cfg, policy.device) if amp else contextlib.nullcontext()

    head = getattr(policy, "head_weight", None)
    if amp and getattr(policy, "update_head", None) is not None:
        head = policy.update_head  # its bfloat16 copy (Policy.frozen_weights_as)
    if cfg.pack and getattr(policy, "packs", False):
        return _packed_logprobs(policy, seqs, batch, cfg, par, mixed, head)
    if cfg.truncated or head is None:
        with mixed():
            logits = _logits(policy, seqs, batch, cfg, par)
        logp = grpo_torch.completion_logprobs(logits, batch["completion_ids"], cfg.temperature)
        seen = (sampler_logprobs(logits.detach(), batch["completion_ids"], cfg)
                if cfg.truncated else logp)
        return logp, seen
    tokens = batch["completion_ids"]
    n, width = tokens.shape
    real = batch["completion_mask"].reshape(-1).nonzero().squeeze(-1)
    with mixed():
        if cfg.shared_prefix:
            hidden = par.run(policy, "shared_prefix_hidden", [s.prompt_ids for s in seqs],
                             tokens)
        else:
            hidden = par.run(policy, "completion_hidden", batch["input_ids"],
                             batch["attention_mask"], width)
        picked = grpo_torch.head_logprobs(hidden.reshape(n * width, -1)[real], head,
                                          tokens.reshape(-1)[real], cfg.temperature)
    logp = torch.zeros(n * width, dtype=torch.float32, device=picked.device)
    logp = logp.index_put((real,), picked).reshape(n, width)
    return logp, logp


def _packed_logprobs(policy: Any, seqs: Sequence[TrainSequence], batch: dict[str, torch.Tensor],
                     cfg: UpdateConfig, par: Any,
                     mixed: Callable[[], contextlib.AbstractContextManager],
                     head: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_logprobs` from one packed forward (:func:`gridrl.trainer.backends.torch.packed.
    pack`: no padding but each row's tail, each group's prompt once); the outputs that predict
    each completion token are gathered back into the collated (n, C) layout."""
    tokens = batch["completion_ids"]
    n, width = tokens.shape
    per_segment = cfg.segment_attention and getattr(policy, "attends_per_segment", False)
    packed = pack(seqs, policy.pad_id, width, policy.device, dense_mask=not per_segment)
    args = (packed.input_ids, packed.position_ids, packed.allowed,
            packed.segments if per_segment else None)
    if cfg.truncated or head is None:
        with mixed():
            out = par.run(policy, "packed_logits", *args)
        logits = out.reshape(-1, out.shape[-1])[packed.predicts.reshape(-1)].reshape(n, width, -1)
        del out
        logp = grpo_torch.completion_logprobs(logits, tokens, cfg.temperature)
        seen = (sampler_logprobs(logits.detach(), tokens, cfg) if cfg.truncated else logp)
        return logp, seen
    real = batch["completion_mask"].reshape(-1).nonzero().squeeze(-1)
    with mixed():
        hidden = par.run(policy, "packed_hidden", *args)
        rows = packed.predicts.reshape(-1)[real]
        picked = grpo_torch.head_logprobs(hidden.reshape(-1, hidden.shape[-1])[rows], head,
                                          tokens.reshape(-1)[real], cfg.temperature)
    logp = torch.zeros(n * width, dtype=torch.float32, device=picked.device)
    logp = logp.index_put((real,), picked).reshape(n, width)
    return logp, logp


@torch.no_grad()
def sequence_logprobs(policy: Any, seqs: Sequence[TrainSequence],
                      cfg: UpdateConfig, memory: MemoryPlanner | None = None
                      ) -> list[list[float]]:
    """The policy's logprobs of each completion of ``seqs`` under the sampler's transform
    (:func:`sampler_logprobs` when the run truncates, else ``log_softmax(logits / T)``), in
    eval mode (no dropout), no gradient, in micro-batches of ``cfg.micro_batch_size`` (or
    those ``memory`` plans).

    Args:
        policy: a :class:`gridrl.trainer.backends.torch.policy.Policy`.
        seqs: the sequences (their behaviour logprobs and advantages are not used).
    Returns:
        one list of ``len(completion_ids)`` float logprobs per sequence, in order.
    """
    if not seqs:
        return []
    was_training = policy.model.training
    policy.model.eval()
    try:
        out: list[list[float]] = []
        if memory is not None:  # the update's plan: no gradient needs less, never more
            chunks = memory.plan(seqs, range(len(seqs)), cfg.micro_batch_size).chunks
        else:
            mb = cfg.micro_batch_size or len(seqs)
            chunks = [list(range(i, min(i + mb, len(seqs)))) for i in range(0, len(seqs), mb)]
        for idx in chunks:
            chunk = [seqs[i] for i in idx]
            batch = collate(chunk, policy.pad_id, policy.device, behaviour=False)
            _, lp = _logprobs(policy, chunk, batch, cfg, SingleProcess(policy.model))
            lp = lp * batch["completion_mask"]  # 0 on environment tokens, on either path
            out.extend(lp[i, :len(s.completion_ids)].tolist() for i, s in enumerate(chunk))
        return out
    finally:
        if was_training:
            policy.model.train()


def sampler_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                     cfg: UpdateConfig) -> torch.Tensor:
    """Logprobs of ``tokens`` under the rollout sampler's transform (temperature, then top-k,
    then top-p, renormalised; ``gridrl.engine.backends.torch.sampling.transform_logits``).

    Args:
        logits: (n, C, V) completion logits (no gradient needed).
        tokens: (n, C) int64.
    Returns:
        (n, C) float32; tokens outside the kept support get -100 (a KL of ~100 nats: a node
        that sampled a token the trainer's sampler never would is unmistakable).
    """
    n, c, v = logits.shape
    config = SamplingConfig(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                            top_p=cfg.top_p, top_k=cfg.top_k)
    rows = RowSampling.from_configs([config] * (n * c), v, device=logits.device)
    lp = transform_logits(logits.reshape(n * c, v), rows)
    return lp.gather(-1, tokens.reshape(-1, 1)).reshape(n, c).clamp(min=-100.0)


def make_optimizer(params: Sequence[torch.nn.Parameter], *, lr: float, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
                   ) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter, arXiv:1711.05101) over the LoRA parameters."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)


def make_scheduler(optimizer: torch.optim.Optimizer, *, schedule: str, warmup_steps: int,
                   total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Learning-rate schedule: linear warmup over ``warmup_steps``, then ``"constant"``,
    ``"linear"`` decay to 0 at ``total_steps``, or ``"cosine"`` decay to 0 (half a period).

    Raises:
        ValueError: unknown schedule.
    """
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr schedule {schedule!r}")

    def factor(step: int) -> float:
        return grpo.lr_factor(step, schedule, warmup_steps, total_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
