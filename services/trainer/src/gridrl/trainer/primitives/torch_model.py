"""The training primitives on torch: :class:`TorchTrainableModel`, one training model of
``gridrl-trainer serve-api`` (:class:`gridrl.trainer.primitives.model.TrainableModel`).

It reuses the torch backend's pieces: the peft policy (:func:`~gridrl.trainer.backends.torch.
policy.load_policy`), the engine sampler over the live LoRA
(:meth:`~gridrl.trainer.backends.torch.backend.TorchTrainerBackend.generate`), the fused
output-projection logprobs (:func:`~gridrl.trainer.backends.torch.losses.head_logprobs`) and
the clipped surrogate (:func:`~gridrl.trainer.backends.torch.losses.clipped_surrogate`).

Per datum of N positions (datums that begin alike share one forward of their common prefix,
the others are right-padded into micro-batches of at most
:data:`MICRO_BATCH_TOKENS` tokens; right padding is exact under causal attention), ``logp[t]``
is the logprob of ``target_ids[t]`` under ``softmax(logits[t])`` (temperature 1) and the loss
(a sum over positions and datums, as Tinker's; tinker-docs.thinkingmachines.ai/losses):

* ``cross_entropy``: ``-weights[t] * logp[t]``;
* ``importance_sampling``: ``-exp(logp[t] - q[t]) * A[t]`` with ``q`` the sampling logprobs;
* ``ppo``: ``-min(r[t] A[t], clip(r[t], clip_low, clip_high) A[t])``, ``r = exp(logp - q)``
  (Schulman et al. 2017, arXiv:1707.06347, eq. 7, token-wise);
* ``cispo``: ``-sg(clip(r[t], clip_low, clip_high)) * logp[t] * A[t]``, ``sg`` a stop-gradient:
  the clipped ratio weighs the log-likelihood gradient instead of clipping the objective
  (MiniMax-M1, arXiv:2506.13585; as Tinker implements it,
  tinker-docs.thinkingmachines.ai/tinker/losses/cispo);
* ``dro``: ``-(logp[t] * A[t] - beta / 2 * (logp[t] - q[t])^2)``, a quadratic penalty on the
  log-ratio instead of a clip (Richemond et al. 2024, "Offline Regularised Reinforcement
  Learning for Large Language Models Alignment", arXiv:2405.19107; Kimi k1.5,
  arXiv:2501.12599; as Tinker implements it, tinker-docs.thinkingmachines.ai/tinker/
  losses/dro). The advantages are the client's (Tinker: a soft advantage estimate).

Gradients add up over forward-backward calls until :meth:`TorchTrainableModel.optim_step`
(``torch.optim.AdamW`` with the step's settings, Tinker's ``AdamParams``).
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch

from gridrl.common.errors import failed_precondition
from gridrl.trainer.backends.base import LoraSettings, UpdateConfig
from gridrl.trainer.backends.torch import losses
from gridrl.trainer.backends.torch.backend import TorchTrainerBackend, load_state_bytes
from gridrl.trainer.primitives.types import (
    CISPO,
    CROSS_ENTROPY,
    DRO,
    IMPORTANCE_SAMPLING,
    AdamSettings,
    Datum,
    ForwardResult,
    LossSpec,
    OptimResult,
    check_datums,
)

OPTIMIZER = "optimizer.pt"
# Tokens (datums x padded length) of one forward; bounds the activations kept for backward.
MICRO_BATCH_TOKENS = 8192
# Tokens two datums must share at their start to share one forward of them.
MIN_SHARED_PREFIX = 16


class TorchTrainableModel:
    """A peft LoRA on a transformers causal LM, its AdamW state and accumulated gradient.

    Args:
        backend: a :class:`TorchTrainerBackend` over the policy (its sampler and files).
        lora: the adapter's settings.
        model_path: the resolved base model.
    """

    def __init__(self, backend: TorchTrainerBackend, lora: LoraSettings, model_path: str) -> None:
        self.backend = backend
        self.policy = backend.policy
        self.tokenizer = backend.tokenizer
        self.identity = backend.identity
        self.model_path = model_path
        self.lora_rank = lora.rank
        self.lora_alpha = lora.alpha
        cfg = self.policy.model.peft_config["default"]
        self.target_modules = sorted(cfg.target_modules) if cfg.target_modules else []
        self.steps = 0
        self.pending_datums = 0

    @classmethod
    def load(cls, base_model: str, lora: LoraSettings, *, seed: int, device: str = "auto",
             dtype: str = "auto") -> TorchTrainableModel:
        """Load ``base_model`` (alias, directory or hub id) with a fresh adapter (A seeded with
        ``seed``, B zero) and an AdamW over it.

        Raises:
            StatusError: INVALID_ARGUMENT when no module matches ``lora.target_modules``.
        """
        from gridrl.models import resolve_model
        from gridrl.trainer.backends.torch.policy import load_policy

        policy = load_policy(base_model, lora=lora, device=device, dtype=dtype, seed=seed)
        backend = TorchTrainerBackend(policy, _adamw(policy.trainable_parameters()), None,
                                      UpdateConfig())
        return cls(backend, lora, str(resolve_model(base_model)))

    # ---------------------------------------------------------------- forward / backward

    def forward(self, data: Sequence[Datum], loss: LossSpec, *, backward: bool) -> ForwardResult:
        """See :meth:`gridrl.trainer.primitives.model.TrainableModel.forward`. Datums that
        begin alike (the samples of one prompt) share one forward of their common prefix
        (:func:`shared_prefixes`); the others run right-padded in micro-batches."""
        check_datums(data, loss, self.identity.vocab_size)
        model = self.policy.model
        model.train(backward)  # LoRA dropout only while training (0 here: same values)
        logprobs: list[Any] = [None] * len(data)
        total = 0.0
        if self.policy.head_weight is not None:
            shared, alone = shared_prefixes([d.input_ids for d in data])
        else:  # soft-capped or adapted heads: the full-logits path only
            shared, alone = [], list(range(len(data)))
        units: list[tuple[list[int], Any]] = [
            (rows, partial(self._shared_logprobs, prefix, [data[i] for i in rows]))
            for prefix, rows in shared]
        units += [(rows, partial(self._padded_logprobs, [data[i] for i in rows]))
                  for rows in _micro_batches([data[i].length for i in alone],
                                             MICRO_BATCH_TOKENS, alone)]
        with torch.set_grad_enabled(backward):
            for rows, run in units:
                logp = run()  # one (N,) float32 tensor per datum of the unit
                part = sum(_token_loss(loss, data[i], lp) for i, lp in zip(rows, logp,
                                                                            strict=True))
                if backward:
                    part.backward()
                total += float(part.detach())
                for i, lp in zip(rows, logp, strict=True):
                    logprobs[i] = lp.detach().cpu().numpy()
        if backward:
            self.pending_datums += len(data)
        model.eval()
        return ForwardResult(logprobs=logprobs, loss=total, datums=len(data))

    def _shared_logprobs(self, prefix: int, batch: Sequence[Datum]) -> list[torch.Tensor]:
        """Logprobs of datums whose first ``prefix`` input tokens are equal: the prefix runs
        once (batch 1) and its KV cache, repeated, serves every datum's rest (right-padded;
        the gradient flows into the prefix through the cache), as the GRPO update's
        shared-prefix forward (:meth:`Policy.shared_prefix_hidden`) does."""
        device = self.policy.device
        decoder = self.policy.model.get_base_model().get_decoder()
        head = self.policy.head_weight
        out = decoder(input_ids=torch.from_numpy(batch[0].input_ids[:prefix])[None].to(device),
                      use_cache=True)
        first = out.last_hidden_state[0]  # (P, H)
        cache = getattr(out, self.policy._cache_kw)
        cache.batch_repeat_interleave(len(batch))
        width = max(d.length for d in batch) - prefix
        rest = torch.full((len(batch), width), self.policy.pad_id, dtype=torch.long)
        for j, d in enumerate(batch):
            rest[j, :d.length - prefix] = torch.from_numpy(d.input_ids[prefix:])
        after = decoder(input_ids=rest.to(device), use_cache=True,
                        **{self.policy._cache_kw: cache}).last_hidden_state  # (B, W, H)
        hidden = torch.cat([torch.cat([first, after[j, :d.length - prefix]])
                            for j, d in enumerate(batch)])
        targets = torch.from_numpy(np.concatenate([d.target_ids for d in batch])).to(device)
        picked = losses.head_logprobs(hidden, head, targets)
        return list(picked.split([d.length for d in batch]))

    def _padded_logprobs(self, batch: Sequence[Datum]) -> list[torch.Tensor]:
        logp = self._logprobs(batch)
        return [logp[j, :d.length] for j, d in enumerate(batch)]

    def _logprobs(self, batch: Sequence[Datum]) -> torch.Tensor:
        """(B, W) logprobs of each datum's targets, right-padded to the longest (W)."""
        device = self.policy.device
        width = max(d.length for d in batch)
        ids = torch.full((len(batch), width), self.policy.pad_id, dtype=torch.long)
        targets = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, d in enumerate(batch):
            ids[j, :d.length] = torch.from_numpy(d.input_ids)
            targets[j, :d.length] = torch.from_numpy(d.target_ids)
            mask[j, :d.length] = 1
        ids, targets, mask = ids.to(device), targets.to(device), mask.to(device)
        head = self.policy.head_weight
        if head is None:  # soft-capped or adapted heads: full logits
            logits = self.policy.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            return losses.completion_logprobs(logits, targets) * mask
        hidden = self.policy.model.get_base_model().get_decoder()(
            input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        real = mask.reshape(-1).nonzero().squeeze(-1)
        picked = losses.head_logprobs(hidden.reshape(-1, hidden.shape[-1])[real], head,
                                      targets.reshape(-1)[real])
        flat = torch.zeros(ids.numel(), dtype=torch.float32, device=picked.device)
        return flat.index_put((real,), picked).reshape(ids.shape)

    # ---------------------------------------------------------------- optimizer

    def optim_step(self, adam: AdamSettings) -> OptimResult:
        """See :meth:`gridrl.trainer.primitives.model.TrainableModel.optim_step`."""
        adam.check()
        if self.pending_datums == 0:
            raise failed_precondition("optim_step: no forward_backward since the last step "
                                      "(nothing to apply)")
        params = self.policy.trainable_parameters()
        limit = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, limit))
        optimizer = self.backend.optimizer
        for group in optimizer.param_groups:
            group.update(lr=adam.lr, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        datums, self.pending_datums = self.pending_datums, 0
        self.steps += 1
        return OptimResult(grad_norm=grad_norm, steps=self.steps, datums=datums)

    # ---------------------------------------------------------------- files and sampling

    def adapter_files(self) -> dict[str, bytes]:
        return self.backend.adapter_files()

    def load_adapter_files(self, files: Mapping[str, bytes]) -> None:
        self.backend.load_adapter_files(files)

    def state_files(self) -> dict[str, bytes]:
        buf = io.BytesIO()
        torch.save({"optimizer": self.backend.optimizer.state_dict(), "steps": self.steps}, buf)
        return {**self.adapter_files(), OPTIMIZER: buf.getvalue()}

    def load_state_files(self, files: Mapping[str, bytes], *, with_optimizer: bool) -> None:
        self.load_adapter_files({k: v for k, v in files.items() if k.startswith("adapter_")})
        optimizer = self.backend.optimizer
        optimizer.zero_grad(set_to_none=True)
        self.pending_datums = 0
        if with_optimizer:
            saved = load_state_bytes(files[OPTIMIZER])
            optimizer.load_state_dict(saved["optimizer"])
            self.steps = int(saved["steps"])
        else:
            self.backend.optimizer = _adamw(self.policy.trainable_parameters())
            self.steps = 0

    def prompt_topk(self, prompt: Sequence[int], k: int) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`TrainableModel.prompt_topk`: one forward of ``prompt[:-1]``, a
        ``log_softmax`` over the whole vocabulary per position, its ``k`` largest."""
        ids = torch.tensor([list(prompt[:-1])], dtype=torch.long, device=self.policy.device)
        with torch.no_grad():
            logits = self.policy.model(input_ids=ids).logits[0].float()
            values, top = torch.log_softmax(logits, -1).topk(min(k, logits.shape[-1]), -1)
        return top.cpu().numpy().astype(np.int32), values.cpu().numpy().astype(np.float32)

    def generate(self, prompts: Sequence[Sequence[int]], config: Any,
                 seeds: Sequence[int]) -> list[Any]:
        return self.backend.generate(prompts, config, seeds)

    def close(self) -> None:
        self.backend.close()


def _adamw(params: Sequence[torch.nn.Parameter]) -> torch.optim.AdamW:
    """AdamW with Tinker's ``AdamParams`` defaults (each step sets its own)."""
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)


def shared_prefixes(inputs: Sequence[Any], min_shared: int = MIN_SHARED_PREFIX
                    ) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """Which datums share a forward of their common prefix, to save the most tokens.

    The inputs are sorted, so datums that begin alike are neighbours; groups are the runs of
    neighbours whose common prefix is at least a threshold, and the threshold is the one that
    saves the most prefix tokens (``sum (size - 1) x prefix`` over the groups): the samples of
    one prompt form a group of their own when their prompts are longer than what all prompts
    share (a system message), and all share one forward when that common part dominates. A
    group's prefix is its members' common prefix, less one token when it is a member's whole
    input; groups whose prefix is shorter than ``min_shared`` are not formed.

    Returns:
        ``([(prefix length, indices), ...], indices alone)``.
    """
    order = sorted(range(len(inputs)), key=lambda i: tuple(inputs[i]))

    def lcp(x: Any, y: Any) -> int:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    neighbours = [lcp(inputs[a], inputs[b]) for a, b in itertools.pairwise(order)]

    def grouping(threshold: int) -> list[tuple[int, list[int]]]:
        runs: list[tuple[int, list[int]]] = [(10**9, [order[0]])] if order else []
        for k, common in enumerate(neighbours):
            if common >= threshold:
                prefix, rows = runs[-1]
                runs[-1] = (min(prefix, common), [*rows, order[k + 1]])
            else:
                runs.append((10**9, [order[k + 1]]))
        return [(min(prefix, *(len(inputs[r]) - 1 for r in rows)), rows)
                for prefix, rows in runs]

    def saved(groups: list[tuple[int, list[int]]]) -> int:
        return sum((len(rows) - 1) * prefix for prefix, rows in groups if prefix >= min_shared)

    candidates = sorted({c for c in neighbours if c >= min_shared})
    best = max((grouping(t) for t in candidates), key=saved, default=[])
    shared = [(prefix, sorted(rows)) for prefix, rows in best
              if len(rows) > 1 and prefix >= min_shared]
    grouped = {i for _, rows in shared for i in rows}
    return shared, [i for i in range(len(inputs)) if i not in grouped]


def _micro_batches(lengths: Sequence[int], budget: int,
                   indices: Sequence[int] | None = None) -> Iterator[list[int]]:
    """Indices (``indices``, default ``0..n-1``) of datums grouped in order so that count x
    longest <= ``budget`` tokens (a datum longer than the budget goes alone)."""
    indices = list(range(len(lengths))) if indices is None else list(indices)
    batch: list[int] = []
    longest = 0
    for i, n in zip(indices, lengths, strict=True):
        if batch and (len(batch) + 1) * max(longest, n) > budget:
            yield batch
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, n)
    if batch:
        yield batch


def _token_loss(loss: LossSpec, d: Datum, logp: torch.Tensor) -> torch.Tensor:
    """The summed loss of one datum from its (N,) logprobs (see the module docstring)."""
    def tensor(values: Any) -> torch.Tensor:
        return torch.from_numpy(values).to(logp.device)

    if loss.name == CROSS_ENTROPY:
        return -(logp * tensor(d.weights)).sum() if d.weights is not None else -logp.sum()
    q, adv = tensor(d.sampling_logprobs), tensor(d.advantages)
    if loss.name == IMPORTANCE_SAMPLING:
        return -(torch.exp(logp - q) * adv).sum()
    if loss.name == CISPO:
        ratio = torch.exp(logp - q).clamp(loss.clip_low, loss.clip_high).detach()
        return -(ratio * logp * adv).sum()
    if loss.name == DRO:
        return -(logp * adv - 0.5 * loss.beta * (logp - q) ** 2).sum()
    token_loss, _ = losses.clipped_surrogate(logp.unsqueeze(0), q.unsqueeze(0), adv.unsqueeze(0),
                                             eps_low=1.0 - loss.clip_low,
                                             eps_high=loss.clip_high - 1.0)
    return token_loss.sum()
