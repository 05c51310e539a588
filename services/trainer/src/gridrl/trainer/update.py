"""One GRPO optimizer step over the training sequences of a step.

The trainer's logprobs of every sequence come from padded forward passes (prompts left-padded,
completions right-padded, positions from the attention mask), in micro-batches of
``micro_batch_size`` sequences (0: all at once); no per-token Python loop. The loss weights are
fixed over the whole step first (:func:`gridrl.trainer.grpo.sequence_weights`), so micro-batches
and data-parallel ranks add up to exactly the full-batch loss and gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gridrl.trainer import grpo
from gridrl.trainer.distributed import SingleProcess


@dataclass(frozen=True)
class TrainSequence:
    """One completion to train on.

    Attributes:
        prompt_ids: the prompt's token ids.
        completion_ids: the sampled token ids (stop token included).
        behaviour_logprobs: one per completion token, from the sampler.
        advantage: the group-relative advantage of the completion.
        group: index of its group in the step (data-parallel sharding is by group).
    """

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    advantage: float
    group: int


@dataclass(frozen=True)
class UpdateConfig:
    """Loss and optimisation settings of a step (see ``grpo.py`` for the formulas).

    Attributes:
        temperature: the sampling temperature; trainer logprobs use ``logits / temperature``.
        eps_low, eps_high: clip range (``eps_high`` None: symmetric).
        beta: KL-to-reference coefficient (0: off, no reference forward).
        aggregation: ``"sequence"``, ``"token"`` or ``"constant"``.
        max_tokens: sampling ``max_tokens`` (the ``"constant"`` normaliser).
        micro_batch_size: sequences per forward/backward; 0 = the whole share at once.
        max_grad_norm: clip the LoRA gradient's global L2 norm to this; 0 = no clipping.
        shared_prefix: run each group's prompt once and repeat its KV cache for the group's
            completions (:meth:`~gridrl.trainer.policy.Policy.shared_prefix_logits`); False:
            one padded forward over prompt + completion per sequence. Same maths, different
            float rounding.
        top_p, top_k: the sampler's truncation. The loss uses the untruncated policy
            ``softmax(logits / T)`` (as TRL does); the mismatch KL compares the behaviour
            logprobs with the trainer's logprobs under the sampler's own transform
            (``gridrl.engine.backends.torch_sampling``), so truncation is not reported as a
            node mismatch.
    """

    temperature: float = 1.0
    eps_low: float = 0.2
    eps_high: float | None = None
    beta: float = 0.0
    aggregation: str = "sequence"
    max_tokens: int = 256
    micro_batch_size: int = 0
    max_grad_norm: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    shared_prefix: bool = True

    @property
    def truncated(self) -> bool:
        """True when the sampler drops tokens (top-k or top-p)."""
        return self.top_k > 0 or self.top_p < 1.0


@dataclass
class UpdateStats:
    """What a step did. Scalars are over all ranks' sequences.

    Attributes:
        loss: the aggregated loss (surrogate + beta * KL).
        mismatch_kl: k3 KL(behaviour || trainer) per token, nats (before the update).
        per_sequence_mismatch_kl: (N,) the same per sequence, in input order.
        clip_fraction: fraction of completion tokens where the clipped branch was taken.
        ref_kl: mean k3 KL(trainer || reference) per token, or None when beta == 0.
        grad_norm: the LoRA gradient's L2 norm before clipping.
        lr: learning rate used by this step.
        tokens: completion tokens trained on.
    """

    loss: float
    mismatch_kl: float
    per_sequence_mismatch_kl: list[float] = field(default_factory=list)
    clip_fraction: float = 0.0
    ref_kl: float | None = None
    grad_norm: float = 0.0
    lr: float = 0.0
    tokens: int = 0


def collate(seqs: Sequence[TrainSequence], pad_id: int,
            device: torch.device) -> dict[str, torch.Tensor]:
    """Pad sequences into tensors: prompts left-padded to the longest prompt (width P),
    completions right-padded to the longest completion (width C).

    Returns:
        ``input_ids`` (n, P + C) int64, ``attention_mask`` (n, P + C) int64,
        ``completion_ids`` (n, C) int64, ``completion_mask`` (n, C) float32,
        ``behaviour`` (n, C) float32 (0 on padding), ``advantages`` (n,) float32.
    """
    p_width = max(len(s.prompt_ids) for s in seqs)
    c_width = max(max(len(s.completion_ids) for s in seqs), 1)
    n = len(seqs)
    input_ids = torch.full((n, p_width + c_width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, p_width + c_width), dtype=torch.long)
    comp_mask = torch.zeros((n, c_width), dtype=torch.float32)
    behaviour = torch.zeros((n, c_width), dtype=torch.float32)
    for i, s in enumerate(seqs):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, p_width - p:p_width] = torch.tensor(s.prompt_ids, dtype=torch.long)
        attention[i, p_width - p:p_width + c] = 1
        if c:
            input_ids[i, p_width:p_width + c] = torch.tensor(s.completion_ids, dtype=torch.long)
            comp_mask[i, :c] = 1.0
            behaviour[i, :c] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    return {
        "input_ids": input_ids.to(device), "attention_mask": attention.to(device),
        "completion_ids": input_ids[:, p_width:].to(device),
        "completion_mask": comp_mask.to(device), "behaviour": behaviour.to(device),
        "advantages": torch.tensor([s.advantage for s in seqs], dtype=torch.float32,
                                   device=device),
    }


def grpo_update(policy: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                seqs: Sequence[TrainSequence], cfg: UpdateConfig,
                parallel: SingleProcess | None = None) -> UpdateStats:
    """Compute the GRPO loss of ``seqs``, back-propagate, clip, and step the optimizer and the
    learning-rate schedule once.

    Args:
        policy: a :class:`gridrl.trainer.policy.Policy`.
        optimizer: over ``policy.trainable_parameters()``.
        scheduler: a ``torch.optim.lr_scheduler`` (stepped once), or None.
        seqs: the step's sequences, identical on every rank.
        cfg: loss settings.
        parallel: :class:`~gridrl.trainer.distributed.DataParallel` under torchrun; this rank
            trains on its share of the groups and DDP averages gradients (the loss is scaled by
            the world size so the average equals the full-batch gradient).
    Returns:
        :class:`UpdateStats` (identical on every rank).
    Raises:
        ValueError: ``seqs`` is empty or this rank's share is empty.
    """
    par = parallel or SingleProcess(policy.model)
    if not seqs:
        raise ValueError("no sequences to train on")
    device = policy.device
    lengths = torch.tensor([len(s.completion_ids) for s in seqs], dtype=torch.float32)
    coef = grpo.sequence_weights(lengths, cfg.aggregation, cfg.max_tokens)  # type: ignore[arg-type]
    local = par.local_share([s.group for s in seqs])
    if not local:
        raise ValueError(f"rank {par.rank} has no group to train on: use at least "
                         f"{par.world_size} prompts per step")
    mb = cfg.micro_batch_size or len(local)
    chunks = [local[i:i + mb] for i in range(0, len(local), mb)]

    policy.model.train()
    optimizer.zero_grad(set_to_none=True)
    n = len(seqs)
    # [loss, clipped tokens, tokens, mismatch kl sum, ref kl sum] + per-sequence mismatch kl
    totals = torch.zeros(5 + n, dtype=torch.float64)
    for k, idx in enumerate(chunks):
        batch = collate([seqs[i] for i in idx], policy.pad_id, device)
        mask = batch["completion_mask"]
        width = mask.shape[1]
        sync = k == len(chunks) - 1
        ctx = par.no_sync() if not sync else contextlib.nullcontext()
        with ctx:
            if cfg.shared_prefix:  # one prompt forward per group, its cache repeated
                logits = policy.shared_prefix_logits([seqs[i].prompt_ids for i in idx],
                                                     batch["completion_ids"], model=par.model)
            else:
                logits = policy.completion_logits(batch["input_ids"], batch["attention_mask"],
                                                  width, model=par.model)
            logp = grpo.completion_logprobs(logits, batch["completion_ids"], cfg.temperature)
            seen = (sampler_logprobs(logits.detach(), batch["completion_ids"], cfg)
                    if cfg.truncated else logp)
            del logits
            ref_logp = None
            if cfg.beta:
                ref_logits = policy.reference_logits(batch["input_ids"], batch["attention_mask"],
                                                     width)
                ref_logp = grpo.completion_logprobs(ref_logits, batch["completion_ids"],
                                                    cfg.temperature)
                del ref_logits
            out = grpo.grpo_token_loss(logp, batch["behaviour"], batch["advantages"],
                                       eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                       beta=cfg.beta, ref_logp=ref_logp)
            valid = mask > 0
            token_loss = torch.where(valid, out.loss, torch.zeros_like(out.loss))
            part = (token_loss * coef[idx].to(device).unsqueeze(-1)).sum()
            (part * par.world_size).backward()
        with torch.no_grad():
            _, per_seq_kl = grpo.mismatch_kl(seen, batch["behaviour"], mask)
            ntok = mask.sum(dim=1)
            totals[0] += float(part.detach())
            totals[1] += float((out.clipped & valid).sum())
            totals[2] += float(ntok.sum())
            totals[3] += float((per_seq_kl * ntok).sum())
            if out.ref_kl is not None:
                totals[4] += float((out.ref_kl * mask).sum())
            totals[5 + torch.tensor(idx)] = per_seq_kl.double().cpu()
    par.all_reduce_sum(totals)

    params = policy.trainable_parameters()
    limit = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
    lr = float(optimizer.param_groups[0]["lr"])
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = max(float(totals[2]), 1.0)
    return UpdateStats(
        loss=float(totals[0]), mismatch_kl=float(totals[3]) / tokens,
        per_sequence_mismatch_kl=[float(v) for v in totals[5:]],
        clip_fraction=float(totals[1]) / tokens,
        ref_kl=float(totals[4]) / tokens if cfg.beta else None,
        grad_norm=grad_norm, lr=lr, tokens=int(totals[2]))


def sampler_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                     cfg: UpdateConfig) -> torch.Tensor:
    """Logprobs of ``tokens`` under the rollout sampler's transform (temperature, then top-k,
    then top-p, renormalised; ``gridrl.engine.backends.torch_sampling.transform_logits``).

    Args:
        logits: (n, C, V) completion logits (no gradient needed).
        tokens: (n, C) int64.
    Returns:
        (n, C) float32; tokens outside the kept support get -100 (a KL of ~100 nats: a node
        that sampled a token the trainer's sampler never would is unmistakable).
    """
    from gridrl.engine.backends.torch_sampling import RowSampling, transform_logits
    from gridrl.engine.contract import SamplingConfig

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
    import math

    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr schedule {schedule!r}")

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(total_steps - warmup_steps, 1)
        progress = min((step - warmup_steps) / span, 1.0)
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
