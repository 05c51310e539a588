"""The GRPO maths that does not depend on a tensor framework (numpy): group-relative
advantages and the loss aggregation weights. The training loop computes advantages here for
every backend, and every backend's update weighs its per-token loss with
:func:`sequence_weights`, so the same rollouts give the same targets on torch and on MLX. The
per-token loss itself runs on the backend's framework (torch: :mod:`gridrl.trainer.backends.torch.losses`).

Notation (shapes): ``B`` prompts per step, ``G`` completions per prompt (a group), ``N = B*G``
sequences, ``C`` completion positions (padded). Masks are 1.0 on completion tokens and 0.0 on
padding.

Sources:
- Group-normalised advantages: DeepSeekMath, Shao et al. 2024, arXiv:2402.03300, §4.1.2;
  per-sequence mean (eq. (3)).
- Mean-centred advantages without std scaling and the constant length normaliser:
  Dr. GRPO ("Understanding R1-Zero-Like Training"), Liu et al. 2025, arXiv:2503.20783, §3.
- Token-level aggregation: DAPO, Yu et al. 2025, arXiv:2503.14476, eq. (8).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

Aggregation = Literal["sequence", "token", "constant"]
AGGREGATIONS: tuple[str, ...] = ("sequence", "token", "constant")


def group_advantages(rewards: ArrayLike, *, scale_std: bool = True, eps: float = 1e-4,
                     mask: ArrayLike | None = None) -> np.ndarray:
    """Group-relative advantages ``A_ij = (r_ij - mean_j r_ij) / (std_j r_ij + eps)``.

    DeepSeekMath (arXiv:2402.03300, §4.1.2) scales by the group's std; Dr. GRPO
    (arXiv:2503.20783) drops the scaling (``scale_std=False``: ``A_ij = r_ij - mean_j r_ij``)
    because it over-weights groups whose rewards barely differ. ``std`` is the unbiased
    (Bessel-corrected) std of the group, as in TRL's GRPOTrainer; ``eps`` keeps groups of equal
    rewards at advantage 0 rather than 0/0.

    Args:
        rewards: (B, G) rewards, one row per prompt (any array-like; computed in float32).
        scale_std: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: added to the std before dividing.
        mask: optional (B, G) bool/float, 1 for samples that take part (others, e.g. dropped as
            too stale, get advantage 0 and do not enter the group's mean or std).
    Returns:
        (B, G) float32 advantages; a group with fewer than 2 valid samples gets all zeros
        (no relative signal).
    Raises:
        ValueError: ``rewards`` is not 2-D or ``mask`` has another shape.
    """
    r = np.asarray(rewards, dtype=np.float32)
    if r.ndim != 2:
        raise ValueError(f"rewards must be (B, G), got shape {r.shape}")
    m = np.ones_like(r) if mask is None else np.asarray(mask, dtype=np.float32)
    if m.shape != r.shape:
        raise ValueError(f"mask shape {m.shape} != rewards shape {r.shape}")
    n = m.sum(axis=1, keepdims=True)
    mean = (r * m).sum(axis=1, keepdims=True) / np.maximum(n, np.float32(1))
    centred = (r - mean) * m
    if scale_std:
        var = (centred ** 2).sum(axis=1, keepdims=True) / np.maximum(n - 1, np.float32(1))
        centred = centred / (np.sqrt(var) + np.float32(eps))
    return np.where(n >= 2, centred, np.float32(0)).astype(np.float32)


def sequence_weights(lengths: ArrayLike, aggregation: Aggregation,
                     max_tokens: int | None = None) -> np.ndarray:
    """Weight of every token of each sequence, so that the step's loss is
    ``sum_i sum_t c_i * m_it * loss_it`` (see :func:`loss_weights`). Fixed once over the whole
    step, it makes the loss additive over micro-batches and data-parallel ranks.

    Args:
        lengths: (N,) number of completion tokens of each sequence of the whole step.
        aggregation, max_tokens: as in :func:`loss_weights`.
    Returns:
        (N,) float32 ``c_i``: ``1 / (|o_i| N)`` (sequence), ``1 / sum|o|`` (token),
        ``1 / (N max_tokens)`` (constant); 0 for empty sequences.
    Raises:
        ValueError: unknown aggregation, or ``"constant"`` without ``max_tokens``.
    """
    n_tok = np.asarray(lengths, dtype=np.float32).reshape(-1)
    n = np.float32(max(int(n_tok.shape[0]), 1))
    one = np.float32(1)
    if aggregation == "sequence":
        c = one / (np.maximum(n_tok, one) * n)
    elif aggregation == "token":
        c = np.full_like(n_tok, one) / np.maximum(n_tok.sum(dtype=np.float32), one)
    elif aggregation == "constant":
        if not max_tokens or max_tokens < 1:
            raise ValueError("aggregation 'constant' needs max_tokens >= 1")
        c = np.full_like(n_tok, one / (n * np.float32(max_tokens)))
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    return np.where(n_tok > 0, c, np.float32(0)).astype(np.float32)


def lr_factor(step: int, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """The learning-rate multiplier of update ``step`` (0-based): linear warmup over
    ``warmup_steps`` (``(step + 1) / warmup_steps``), then ``"constant"`` 1, ``"linear"`` decay
    to 0 at ``total_steps``, or ``"cosine"`` half-period decay to 0. Every backend's schedule
    is ``lr * lr_factor(step, ...)`` for its ``step``-th optimizer step.

    Raises:
        ValueError: unknown schedule.
    """
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"unknown lr schedule {schedule!r}")
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def loss_weights(mask: ArrayLike, aggregation: Aggregation,
                 max_tokens: int | None = None) -> np.ndarray:
    """Per-token weights ``w`` such that the step's loss is ``sum(w * per_token_loss)``.

    - ``"sequence"`` (GRPO, arXiv:2402.03300 eq. (3)): mean over each sequence's tokens, then
      mean over sequences: ``w_it = m_it / (|o_i| * N)``.
    - ``"token"`` (DAPO, arXiv:2503.14476 eq. (8)): every token of the batch counts the same:
      ``w_it = m_it / sum(m)``.
    - ``"constant"`` (Dr. GRPO, arXiv:2503.20783 §3): a constant normaliser independent of
      lengths: ``w_it = m_it / (N * max_tokens)``.

    Args:
        mask: (N, C) float/bool completion mask of the whole step.
        aggregation: ``"sequence"``, ``"token"`` or ``"constant"``.
        max_tokens: the sampling ``max_tokens`` (required for ``"constant"``).
    Returns:
        (N, C) float32 weights; zeros where ``mask`` is 0. Empty sequences weigh nothing.
    Raises:
        ValueError: unknown aggregation, or ``"constant"`` without ``max_tokens``.
    """
    m = np.asarray(mask, dtype=np.float32)
    return m * sequence_weights(m.sum(axis=1), aggregation, max_tokens)[:, None]


def mismatch_kl_per_sequence(trainer_logp: ArrayLike, behaviour_logp: ArrayLike,
                             mask: ArrayLike) -> np.ndarray:
    """Per-sequence k3 estimate of ``KL(pi_behaviour || pi_trainer)`` over the sampled tokens,
    in float64 (the numpy form of :func:`gridrl.trainer.backends.torch.losses.mismatch_kl`):
    ``mean_t (expm1(d_t) - d_t)`` with ``d = trainer_logp - behaviour_logp``.

    Args:
        trainer_logp, behaviour_logp, mask: (N, C).
    Returns:
        (N,) float64 nats per token (0 for empty sequences).
    """
    m = np.asarray(mask, dtype=np.float64)
    d = (np.asarray(trainer_logp, dtype=np.float64)
         - np.asarray(behaviour_logp, dtype=np.float64))
    kl = (np.expm1(d) - d) * m
    return kl.sum(axis=1) / np.maximum(m.sum(axis=1), 1.0)


def mismatch_kl(trainer_logprobs: Sequence[Sequence[float]],
                behaviour_logprobs: Sequence[Sequence[float]]) -> float | None:
    """Mean per token of the k3 estimate of ``KL(pi_behaviour || pi_trainer)`` over sampled
    tokens: ``expm1(d) - d`` with ``d = trainer - behaviour`` (Schulman's k3, the same estimate
    as the update's, :func:`gridrl.trainer.backends.torch.losses.mismatch_kl`), accumulated in float64.

    Args:
        trainer_logprobs: per sequence, the trainer's logprob of each completion token.
        behaviour_logprobs: per sequence, the sampler's, same lengths.
    Returns:
        nats per token over all tokens, or None when there are no tokens.
    Raises:
        ValueError: a sequence's two lists differ in length, or the counts differ.
    """
    if len(trainer_logprobs) != len(behaviour_logprobs):
        raise ValueError(f"{len(trainer_logprobs)} trainer vs {len(behaviour_logprobs)} "
                         "behaviour sequences")
    d_parts = []
    for t, b in zip(trainer_logprobs, behaviour_logprobs, strict=True):
        if len(t) != len(b):
            raise ValueError(f"logprobs of {len(t)} vs {len(b)} tokens")
        d_parts.append(np.asarray(t, dtype=np.float64) - np.asarray(b, dtype=np.float64))
    d = np.concatenate(d_parts) if d_parts else np.zeros(0)
    if d.size == 0:
        return None
    return float(np.mean(np.expm1(d) - d))


def groups_with_signal(groups: Sequence[int], advantages: Sequence[float], *,
                       beta: float = 0.0) -> list[int]:
    """The groups an update must forward and back-propagate, in order of first appearance.

    A group whose advantages are all 0 (its rewards were equal: :func:`group_advantages` gives
    exactly 0 there) adds exactly 0 to the clipped surrogate's loss and gradient
    (``ratio * 0``), so the update may leave it out: the same gradient for none of its
    forward and backward cost. With a KL penalty (``beta > 0``) every sequence carries a
    gradient, so every group is kept.

    Args:
        groups: each sequence's group index.
        advantages: each sequence's advantage (same length).
        beta: the KL-to-reference coefficient.
    Returns:
        the group indices to train, each once, in the order they first appear.
    """
    order = list(dict.fromkeys(groups))
    if beta:
        return order
    loud = {g for g, a in zip(groups, advantages, strict=True) if a != 0.0}
    return [g for g in order if g in loud]
