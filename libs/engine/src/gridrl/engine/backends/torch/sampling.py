"""The sampling transform of :mod:`gridrl.engine.contract` in torch, batched over rows.

:func:`transform_logits` turns float32 logits into the logprobs a token is drawn from;
``generate`` draws from them (:func:`draw_tokens`) and ``score`` reads them, so the behaviour
logprob of a sampled token and its teacher-forced score come from the same code. Every row
carries its own temperature / top-k / top-p (:class:`RowSampling`); when all rows share one
config (the common case: the n samples of a group) the transform runs on Python scalars with
no per-row work at all.

Semantics (identical to the MLX backend's ``mlx_sampling``): greedy rows get
``log_softmax(logits)``; other rows ``z = logits / T``; top-k keeps ``z >=`` the k-th largest
value (ties kept); top-p keeps ``z >=`` the value of the last token of the smallest
descending prefix whose softmax mass is ``>= top_p`` (at least one token; a token tied with it
is kept too); removed entries are ``-inf``; then ``log_softmax``.

Drawing is by inverse CDF over the vocabulary in id order with one uniform per row from the
row's counter-based stream (:mod:`gridrl.engine.rng`), so a row's token depends only on its
own logits and seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gridrl.engine.contract import SamplingConfig

_NO_TOP_P = 2.0  # a top_p that keeps every token (the mass before any token is <= 1)


@dataclass
class RowSampling:
    """Per-row sampling parameters of a batch, as tensors on the logits' device.

    Attributes:
        greedy: bool (N,), rows with temperature 0.
        temperature: float32 (N, 1), 1.0 on greedy rows.
        top_k: int64 (N,), ``vocab`` where top-k is disabled (and on greedy rows).
        top_p: float32 (N, 1), 2.0 where top-p is disabled (and on greedy rows).
        uniform: the config every row shares, or None when rows differ.
        vocab: vocabulary size V.
    """

    greedy: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    uniform: SamplingConfig | None
    vocab: int

    @classmethod
    def from_configs(cls, configs: Sequence[SamplingConfig], vocab: int,
                     device: torch.device | str = "cpu") -> RowSampling:
        """Build the row tensors of ``configs`` (one per row) for a vocabulary of ``vocab``."""
        first = configs[0]
        same = all(_key(c) == _key(first) for c in configs)
        greedy = [c.temperature == 0 for c in configs]
        temps = [1.0 if g else float(c.temperature) for g, c in zip(greedy, configs, strict=True)]
        top_k = [c.top_k if (not g and 0 < c.top_k < vocab) else vocab
                 for g, c in zip(greedy, configs, strict=True)]
        top_p = [float(c.top_p) if (not g and c.top_p < 1) else _NO_TOP_P
                 for g, c in zip(greedy, configs, strict=True)]
        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=torch.tensor(temps, dtype=torch.float32, device=device)[:, None],
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device)[:, None],
            uniform=first if same else None, vocab=vocab)

    def select(self, rows: torch.Tensor) -> RowSampling:
        """The parameters of ``rows`` (int64 indices), in that order."""
        if self.uniform is not None:
            n = int(rows.numel())
            return RowSampling(self.greedy[:n], self.temperature[:n], self.top_k[:n],
                               self.top_p[:n], self.uniform, self.vocab)
        return RowSampling(self.greedy[rows], self.temperature[rows], self.top_k[rows],
                           self.top_p[rows], None, self.vocab)

    @property
    def all_greedy(self) -> bool:
        if self.uniform is not None:
            return self.uniform.temperature == 0
        return bool(self.greedy.all())

    @property
    def any_greedy(self) -> bool:
        if self.uniform is not None:
            return self.uniform.temperature == 0
        return bool(self.greedy.any())


def _key(c: SamplingConfig) -> tuple[float, float, int]:
    return (c.temperature, c.top_p, c.top_k)


def transform_logits(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Logprobs of the distribution each row's next token is drawn from (contract.py steps 1-3).

    Args:
        logits: (N, V) next-token logits of any float dtype; computed in float32.
        rows: the rows' sampling parameters (N rows).
    Returns:
        float32 (N, V) natural-log probabilities, ``-inf`` outside the top-k / top-p support.
    """
    logits = logits.float()
    if rows.all_greedy:
        return torch.log_softmax(logits, dim=-1)
    vocab = logits.shape[-1]
    u = rows.uniform
    if u is not None:
        z = logits / u.temperature if u.temperature != 1.0 else logits
        k = u.top_k if 0 < u.top_k < vocab else 0
        p = u.top_p if u.top_p < 1 else None
        z = _truncate_uniform(z, k, p)
        return torch.log_softmax(z, dim=-1)
    z = logits / rows.temperature
    z = _truncate_rows(z, rows)
    out = torch.log_softmax(z, dim=-1)
    if rows.any_greedy:
        out = torch.where(rows.greedy[:, None], torch.log_softmax(logits, dim=-1), out)
    return out


def _truncate_uniform(z: torch.Tensor, k: int, p: float | None) -> torch.Tensor:
    """Top-k then top-p with the same k and p on every row."""
    neg_inf = float("-inf")
    if k:
        kth = torch.topk(z, k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, neg_inf)
    if p is not None:
        cut = _top_p_cut(_sorted_kept(z, bool(k)),
                         torch.tensor([[p]], dtype=z.dtype, device=z.device))
        z = z.masked_fill(z < cut, neg_inf)
    return z


def _truncate_rows(z: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Top-k then top-p with per-row k and p (disabled rows pass through)."""
    neg_inf = float("-inf")
    vocab = z.shape[-1]
    has_k = rows.top_k < vocab
    if bool(has_k.any()):
        kmax = int(rows.top_k[has_k].max())
        top = torch.topk(z, kmax, dim=-1).values
        kth = top.gather(-1, (rows.top_k.clamp(max=kmax) - 1)[:, None])
        kth = torch.where(has_k[:, None], kth, torch.full_like(kth, neg_inf))
        z = z.masked_fill(z < kth, neg_inf)
    if bool((rows.top_p < 1).any()):
        cut = _top_p_cut(_sorted_kept(z, bool(has_k.all())), rows.top_p)
        z = z.masked_fill(z < cut, neg_inf)
    return z


def _sorted_kept(z: torch.Tensor, truncated: bool) -> torch.Tensor:
    """``z`` sorted descending along the last axis; when every row is already truncated
    (top-k), only as many columns as the widest row keeps (the rest would be ``-inf``)."""
    if truncated:
        kept = int(torch.isfinite(z).sum(dim=-1).max())
        return torch.topk(z, max(kept, 1), dim=-1).values
    return torch.sort(z, dim=-1, descending=True).values


def _top_p_cut(desc: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(N, 1) value of the last token kept by top-p, from ``desc`` (N, K) sorted descending
    (``-inf`` for removed entries) and ``top_p`` (N, 1); rows with ``top_p`` >= 2 keep all."""
    probs = torch.softmax(desc, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    count = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    cut = desc.gather(-1, count - 1)
    return torch.where(top_p >= _NO_TOP_P, torch.full_like(cut, float("-inf")), cut)


def draw_tokens(logits: torch.Tensor, logprobs: torch.Tensor, rows: RowSampling,
                uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each row's token (contract.py step 4) and its logprob under ``logprobs``.

    Greedy rows take ``argmax(logits)``. Other rows draw by inverse CDF: the first id whose
    cumulative probability (vocabulary order) exceeds ``u * total``.

    Args:
        logits: (N, V) raw logits (greedy rows).
        logprobs: float32 (N, V) from :func:`transform_logits` with the same ``rows``.
        rows: the rows' sampling parameters.
        uniforms: float64 (N,) in [0, 1), one per row (:func:`gridrl.engine.rng.step_uniforms`).
    Returns:
        ``(tokens, token_logprobs)``: int64 (N,) ids and float32 (N,) ``logprobs[row, token]``.
    """
    if rows.all_greedy:
        tokens = torch.argmax(logits, dim=-1)
    else:
        probs = torch.exp(logprobs)
        # float32 (on CPU accumulated in float64): each bound is within 6e-8 of exact. No
        # float64 on the device (MPS has none).
        cdf = torch.cumsum(probs, dim=-1)
        target = uniforms.float().to(cdf.device)[:, None] * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        tokens = tokens.clamp_(max=logprobs.shape[-1] - 1)
        # Rounding can only push the search past the last kept token: fall back to the mode.
        lost = probs.gather(-1, tokens[:, None]).squeeze(-1) <= 0
        if bool(lost.any()):
            tokens = torch.where(lost, torch.argmax(logprobs, dim=-1), tokens)
        if rows.any_greedy:
            tokens = torch.where(rows.greedy, torch.argmax(logits, dim=-1), tokens)
    token_logprobs = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, token_logprobs
