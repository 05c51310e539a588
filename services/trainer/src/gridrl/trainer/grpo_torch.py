"""The GRPO per-token maths in torch: completion logprobs, the clipped surrogate with the KL
to the reference, and the KL estimators. Pure torch, no model, no I/O; the torch backend's
update (``update.py``) uses it. What does not depend on a tensor framework (group advantages,
the aggregation weights) is in :mod:`gridrl.trainer.grpo`; another backend implements the
functions below with the same formulas.

Notation (shapes): ``N`` sequences, ``C`` completion positions (padded), ``V`` vocabulary
size. Masks are 1.0 on completion tokens and 0.0 on padding; every per-token function ignores
masked positions.

Sources:
- GRPO objective and the k3 KL to the reference policy: DeepSeekMath, Shao et al. 2024,
  arXiv:2402.03300, eq. (3)-(4).
- Decoupled clip range (clip-higher): DAPO, Yu et al. 2025, arXiv:2503.14476, eq. (10).
- k3 estimator ``r - 1 - log r``: J. Schulman, "Approximating KL Divergence", 2020,
  http://joschu.net/blog/kl-approx.html.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def completion_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                        temperature: float = 1.0) -> torch.Tensor:
    """Logprob of each completion token under ``softmax(logits / temperature)``.

    The trainer must score completions under the temperature they were sampled with (as TRL
    does), or its logprobs are not comparable with the behaviour logprobs of the Samples.

    Args:
        logits: (N, C, V) any float dtype; ``logits[:, t]`` is the distribution of
            ``tokens[:, t]`` (already shifted by one position against the input).
        tokens: (N, C) int64 token ids (padding positions may hold any valid id).
        temperature: > 0.
    Returns:
        (N, C) float32 natural-log probabilities, computed as
        ``z[token] - logsumexp(z)`` with ``z = logits.float() / temperature`` (no (N, C, V)
        log-softmax tensor is materialised besides ``z``).
    Raises:
        ValueError: temperature <= 0 or shapes do not match.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:2] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match tokens {tuple(tokens.shape)}")
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    picked = z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def k3_kl(logp: torch.Tensor, other_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of ``KL(p || q)`` per token, for tokens drawn from ``p``:
    ``r - 1 - log r`` with ``r = q/p = exp(other_logp - logp)``. Non-negative, unbiased.

    With ``p`` = the current policy and ``q`` = the reference this is DeepSeekMath's eq. (4)
    penalty ``pi_ref/pi_theta - log(pi_ref/pi_theta) - 1``.

    Args:
        logp: (...) float logprobs of the sampled tokens under ``p``.
        other_logp: same shape, under ``q``.
    Returns:
        same shape, float32 (float64 when an input is float64), nats. Computed as
        ``expm1(d) - d`` with ``d = other_logp - logp``: ``exp(d) - d - 1`` cancels to exactly
        0 in float32 for the ~1e-6 differences of numerically identical policies.
    """
    d = other_logp - logp
    if d.dtype != torch.float64:
        d = d.float()
    return torch.expm1(d) - d


def clipped_surrogate(logp: torch.Tensor, behaviour_logp: torch.Tensor,
                      advantages: torch.Tensor, *, eps_low: float = 0.2,
                      eps_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss of GRPO/PPO (to be minimised).

    ``ratio = exp(logp - behaviour_logp)``;
    ``loss = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``
    (DeepSeekMath eq. (3); DAPO eq. (10) decouples ``eps_high`` from ``eps_low``, clip-higher).

    Args:
        logp: (N, C) trainer logprobs of the sampled tokens (carry the gradient).
        behaviour_logp: (N, C) logprobs the rollout engine sampled with (no gradient).
        advantages: (N,) one advantage per sequence, broadcast over its tokens, or (N, C).
        eps_low: lower clip range, > 0.
        eps_high: upper clip range; None means ``eps_low`` (symmetric PPO clip).
    Returns:
        ``(loss, clipped)``: (N, C) float32 per-token loss, and (N, C) bool, True where the
        clipped branch was taken (the gradient is zero there).
    """
    eps_high = eps_low if eps_high is None else eps_high
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    ratio = torch.exp(logp.float() - behaviour_logp.float())
    unclipped = ratio * adv
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clipped_obj = clipped_ratio * adv
    loss = -torch.minimum(unclipped, clipped_obj)
    took_clip = clipped_obj < unclipped
    return loss, took_clip








@dataclass(frozen=True)
class TokenLoss:
    """Output of :func:`grpo_token_loss`; every tensor is (N, C) float32 (``clipped`` bool)."""

    loss: torch.Tensor  # surrogate + beta * KL to the reference; has the gradient
    clipped: torch.Tensor  # the clipped branch of the surrogate was taken
    ref_kl: torch.Tensor | None  # k3 KL(pi_theta || pi_ref) per token (None when beta == 0)


def grpo_token_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor,
                    advantages: torch.Tensor, *, eps_low: float = 0.2,
                    eps_high: float | None = None, beta: float = 0.0,
                    ref_logp: torch.Tensor | None = None) -> TokenLoss:
    """The GRPO per-token loss: clipped surrogate (:func:`clipped_surrogate`) plus, when
    ``beta > 0``, ``beta * k3(pi_theta || pi_ref)`` (DeepSeekMath eq. (3)-(4)).

    Args:
        logp, behaviour_logp: (N, C) trainer / behaviour logprobs of the sampled tokens.
        advantages: (N,) or (N, C).
        eps_low, eps_high: clip ranges (DAPO clip-higher when ``eps_high > eps_low``).
        beta: KL coefficient; 0 disables the reference term.
        ref_logp: (N, C) reference-policy logprobs; required when ``beta > 0``.
    Raises:
        ValueError: ``beta > 0`` without ``ref_logp``.
    """
    loss, clipped = clipped_surrogate(logp, behaviour_logp, advantages, eps_low=eps_low,
                                      eps_high=eps_high)
    ref_kl = None
    if beta:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        ref_kl = k3_kl(logp.float(), ref_logp.float())
        loss = loss + beta * ref_kl
    return TokenLoss(loss=loss, clipped=clipped, ref_kl=ref_kl)


def mismatch_kl(trainer_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How far the trainer's policy is from the policy that sampled: the k3 estimate of
    ``KL(pi_behaviour || pi_trainer)`` over the sampled tokens (they were drawn from the
    behaviour policy, so k3 with ``r = pi_trainer / pi_behaviour`` is unbiased).

    Near 0 (fp noise, ~1e-6 in fp32) when the node sampled with the trainer's weights; it grows
    with staleness, wrong or missing adapters, and precision differences (bf16 nodes).

    Args:
        trainer_logp: (N, C) trainer logprobs (any grad; detached here).
        behaviour_logp: (N, C) behaviour logprobs.
        mask: (N, C) completion mask.
    Returns:
        ``(mean, per_sequence)``: 0-d mean over all masked tokens and (N,) mean over each
        sequence's tokens (0 for empty sequences), float64 (fp noise of 1e-6 in the logprobs is
        a KL of ~1e-13, below float32's resolution near 1), nats per token.
    """
    m = mask.to(torch.float64)
    kl = k3_kl(behaviour_logp.detach().double(), trainer_logp.detach().double()) * m
    per_seq = kl.sum(dim=1) / m.sum(dim=1).clamp(min=1)
    return kl.sum() / m.sum().clamp(min=1), per_seq
