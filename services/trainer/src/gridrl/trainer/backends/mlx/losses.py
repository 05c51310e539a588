"""The GRPO per-token maths in MLX: the same formulas as :mod:`gridrl.trainer.backends.torch.losses`
(completion logprobs, the clipped surrogate with clip-higher, the k3 KL to the reference), on
``mlx.core`` arrays so that ``mx.value_and_grad`` differentiates them. Pure MLX, no model, no
I/O; the MLX backend's update (:mod:`gridrl.trainer.backends.mlx.backend`) uses it. Advantages and the
aggregation weights are framework-free (:mod:`gridrl.trainer.grpo.advantages`).

Notation (shapes): ``N`` sequences, ``C`` completion positions (padded), ``V`` vocabulary
size. Masks are 1.0 on completion tokens and 0.0 on padding.

Sources (as in :mod:`gridrl.trainer.backends.torch.losses`):
- GRPO objective and the k3 KL to the reference policy: DeepSeekMath, Shao et al. 2024,
  arXiv:2402.03300, eq. (3)-(4).
- Decoupled clip range (clip-higher): DAPO, Yu et al. 2025, arXiv:2503.14476, eq. (10).
- k3 estimator ``r - 1 - log r``: J. Schulman, "Approximating KL Divergence", 2020,
  http://joschu.net/blog/kl-approx.html.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


def completion_logprobs(logits: mx.array, tokens: mx.array, temperature: float = 1.0) -> mx.array:
    """Logprob of each completion token under ``softmax(logits / temperature)``.

    Args:
        logits: (N, C, V) any float dtype; ``logits[:, t]`` is the distribution of
            ``tokens[:, t]``.
        tokens: (N, C) integer token ids (padding positions may hold any valid id).
        temperature: > 0.
    Returns:
        (N, C) float32 ``z[token] - logsumexp(z)`` with ``z = logits.astype(float32) / T``.
    Raises:
        ValueError: temperature <= 0 or shapes do not match.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if tuple(logits.shape[:2]) != tuple(tokens.shape):
        raise ValueError(f"logits {tuple(logits.shape)} do not match tokens "
                         f"{tuple(tokens.shape)}")
    z = logits.astype(mx.float32)
    if temperature != 1.0:
        z = z / temperature
    picked = mx.take_along_axis(z, tokens[..., None], axis=-1)[..., 0]
    return picked - mx.logsumexp(z, axis=-1)


def k3_kl(logp: mx.array, other_logp: mx.array) -> mx.array:
    """Schulman's k3 estimator of ``KL(p || q)`` per token for tokens drawn from ``p``:
    ``expm1(d) - d`` with ``d = other_logp - logp`` (:func:`gridrl.trainer.backends.torch.losses.k3_kl`).

    Returns:
        same shape as the inputs, float32, nats.
    """
    d = (other_logp - logp).astype(mx.float32)
    return mx.expm1(d) - d


@dataclass(frozen=True)
class TokenLoss:
    """Output of :func:`grpo_token_loss`; every array is (N, C) float32 (``clipped`` bool)."""

    loss: mx.array  # surrogate + beta * KL to the reference; differentiable
    clipped: mx.array  # the clipped branch of the surrogate was taken
    ref_kl: mx.array | None  # k3 KL(pi_theta || pi_ref) per token (None when beta == 0)


def grpo_token_loss(logp: mx.array, behaviour_logp: mx.array, advantages: mx.array, *,
                    eps_low: float = 0.2, eps_high: float | None = None, beta: float = 0.0,
                    ref_logp: mx.array | None = None) -> TokenLoss:
    """The GRPO per-token loss, as :func:`gridrl.trainer.backends.torch.losses.grpo_token_loss`:
    ``ratio = exp(logp - behaviour)``, ``-min(ratio * A, clip(ratio, 1 - eps_low,
    1 + eps_high) * A)`` plus, when ``beta > 0``, ``beta * k3(pi_theta || pi_ref)``.

    Args:
        logp, behaviour_logp: (N, C) trainer / behaviour logprobs of the sampled tokens.
        advantages: (N,) one per sequence, or (N, C).
        eps_low, eps_high: clip ranges (``eps_high`` None: ``eps_low``).
        beta: KL coefficient; 0 disables the reference term.
        ref_logp: (N, C) reference logprobs (no gradient); required when ``beta > 0``.
    Raises:
        ValueError: ``beta > 0`` without ``ref_logp``.
    """
    eps_high = eps_low if eps_high is None else eps_high
    adv = advantages.astype(mx.float32)
    if adv.ndim == 1:
        adv = adv[:, None]
    ratio = mx.exp(logp.astype(mx.float32) - behaviour_logp.astype(mx.float32))
    unclipped = ratio * adv
    clipped_obj = mx.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -mx.minimum(unclipped, clipped_obj)
    clipped = clipped_obj < unclipped
    ref_kl = None
    if beta:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        ref_kl = k3_kl(logp, ref_logp)
        loss = loss + beta * ref_kl
    return TokenLoss(loss=loss, clipped=clipped, ref_kl=ref_kl)
