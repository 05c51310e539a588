"""GRPO maths on fixed arrays and tensors against values computed by hand: the framework-free
part (advantages, aggregation weights: numpy) and torch's per-token loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gridrl.trainer.backends.torch import losses as grpo_torch
from gridrl.trainer.grpo import advantages as grpo


def test_advantages_std_scaled_unbiased_std_and_eps():
    # row 0: mean 0.5, centred (+-0.5), unbiased var = 4*0.25/3 = 1/3, std = 0.577350
    # A = 0.5 / (0.577350 + 1e-4) = 0.865876; row 1: equal rewards -> 0
    adv = grpo.group_advantages([[1.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.2, 0.2]])
    expected = [[0.865876, -0.865876, -0.865876, 0.865876], [0.0, 0.0, 0.0, 0.0]]
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, expected, atol=1e-5)


def test_advantages_without_std_scaling_dr_grpo():
    adv = grpo.group_advantages(np.array([[1.0, 0.0, 0.0, 0.0]]), scale_std=False)
    np.testing.assert_allclose(adv, [[0.75, -0.25, -0.25, -0.25]])


def test_advantages_with_mask_leave_dropped_samples_out():
    # valid [1, 0, 3]: mean 4/3, centred (-1/3, -4/3, 5/3), var = (1+16+25)/9/2 = 7/3,
    # std = 1.527525 -> A = (-0.218207, -0.872826, 1.091033); the dropped sample gets 0.
    rewards = np.array([[1.0, 0.0, 3.0, 99.0]])
    mask = np.array([[1, 1, 1, 0]])
    adv = grpo.group_advantages(rewards, mask=mask, eps=0.0)
    np.testing.assert_allclose(adv, [[-0.218218, -0.872872, 1.091089, 0.0]], atol=1e-5)
    unscaled = grpo.group_advantages(rewards, mask=mask, scale_std=False)
    np.testing.assert_allclose(unscaled, [[-1 / 3, -4 / 3, 5 / 3, 0.0]], rtol=1e-6)


def test_group_with_one_valid_sample_has_no_signal():
    adv = grpo.group_advantages([[1.0, 0.0]], mask=[[1, 0]])
    assert np.array_equal(adv, np.zeros((1, 2)))
    with pytest.raises(ValueError, match="rewards must be"):
        grpo.group_advantages([1.0, 0.0])
    with pytest.raises(ValueError, match="mask shape"):
        grpo.group_advantages([[1.0, 0.0]], mask=[[1, 0, 1]])


def test_advantages_equal_the_torch_formula_on_random_groups():
    """The numpy advantages are those of the same formula in torch (the trainer's before the
    backend seam), to float32 rounding."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6, 8, generator=g)
    mask = (torch.rand(6, 8, generator=g) > 0.2).float()
    n = mask.sum(1, keepdim=True)
    centred = (rewards - (rewards * mask).sum(1, keepdim=True) / n.clamp(min=1)) * mask
    std = ((centred ** 2).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    want = torch.where(n >= 2, centred / (std + 1e-4), torch.zeros_like(centred))
    got = grpo.group_advantages(rewards.numpy(), mask=mask.numpy())
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)


def test_completion_logprobs_apply_temperature():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # (1, 2, V=2)
    tokens = torch.tensor([[1, 0]])
    # T=1: softmax = (0.25, 0.75)
    lp1 = grpo_torch.completion_logprobs(logits, tokens, 1.0)
    assert torch.allclose(lp1, torch.tensor([[math.log(0.75), math.log(0.25)]]))
    # T=2: z = (0, ln3/2), p1 = sqrt3 / (1 + sqrt3) = 0.633975
    lp2 = grpo_torch.completion_logprobs(logits, tokens, 2.0)
    assert torch.allclose(lp2, torch.tensor([[math.log(0.633975), math.log(0.366025)]]),
                          atol=1e-6)
    with pytest.raises(ValueError):
        grpo_torch.completion_logprobs(logits, tokens, 0.0)


def test_completion_logprobs_match_log_softmax_in_bf16_input():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17).to(torch.bfloat16)
    tokens = torch.randint(0, 17, (3, 5))
    ref = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tokens[..., None])[..., 0]
    assert torch.allclose(grpo_torch.completion_logprobs(logits, tokens, 0.7), ref, atol=1e-5)


def _ratios(ratios):
    behaviour = torch.zeros(len(ratios))
    return torch.log(torch.tensor(ratios)), behaviour


def test_clipped_surrogate_four_cases():
    logp, behaviour = _ratios([1.5, 1.5, 0.5, 0.5])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, clipped = grpo_torch.clipped_surrogate(logp[:, None], behaviour[:, None], adv, eps_low=0.2)
    # r=1.5,A=+1: min(1.5, 1.2)=1.2 (clipped); r=1.5,A=-1: min(-1.5,-1.2)=-1.5;
    # r=0.5,A=+1: min(0.5, 0.8)=0.5;           r=0.5,A=-1: min(-0.5,-0.8)=-0.8 (clipped)
    assert torch.allclose(loss[:, 0], torch.tensor([-1.2, 1.5, -0.5, 0.8]), atol=1e-6)
    assert clipped[:, 0].tolist() == [True, False, False, True]


def test_clipped_surrogate_gradient_is_zero_where_clipped():
    logp, behaviour = _ratios([1.5, 1.5, 0.5, 0.5])
    logp = logp[:, None].clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, _ = grpo_torch.clipped_surrogate(logp, behaviour[:, None], adv, eps_low=0.2)
    loss.sum().backward()
    # d/dlogp of -ratio*A = -ratio*A where unclipped
    assert torch.allclose(logp.grad[:, 0], torch.tensor([0.0, 1.5, -0.5, 0.0]), atol=1e-6)


def test_clip_higher_dapo():
    logp, behaviour = _ratios([1.25, 0.75])
    logp, behaviour = logp[:, None], behaviour[:, None]
    adv = torch.tensor([1.0, -1.0])
    sym, sym_clip = grpo_torch.clipped_surrogate(logp, behaviour, adv, eps_low=0.2)
    assert torch.allclose(sym[:, 0], torch.tensor([-1.2, 0.8]))
    assert sym_clip[:, 0].tolist() == [True, True]
    hi, hi_clip = grpo_torch.clipped_surrogate(logp, behaviour, adv, eps_low=0.2, eps_high=0.28)
    assert torch.allclose(hi[:, 0], torch.tensor([-1.25, 0.8]))  # upper bound moved to 1.28
    assert hi_clip[:, 0].tolist() == [False, True]


MASK = np.array([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
LOSS = np.array([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])


@pytest.mark.parametrize(("aggregation", "expected"), [
    ("sequence", 3.0),  # (6/3 + 4/1) / 2
    ("token", 2.5),  # (1+2+3+4) / 4
    ("constant", 1.25),  # 10 / (2 sequences * 4 max_tokens)
])
def test_aggregation_and_masking(aggregation, expected):
    got = float((grpo.loss_weights(MASK, aggregation, max_tokens=4) * LOSS).sum())
    assert got == pytest.approx(expected)


def test_weights_are_additive_over_micro_batches():
    for aggregation in grpo.AGGREGATIONS:
        w = grpo.loss_weights(MASK, aggregation, max_tokens=4)
        parts = sum((w[i:i + 1] * LOSS[i:i + 1]).sum() for i in range(2))
        assert parts == pytest.approx((w * LOSS).sum())
        c = grpo.sequence_weights(MASK.sum(axis=1), aggregation, max_tokens=4)
        assert c.dtype == np.float32 and np.array_equal(w, MASK * c[:, None])


def test_unknown_aggregation_and_constant_without_max_tokens():
    with pytest.raises(ValueError):
        grpo.loss_weights(MASK, "mean")
    with pytest.raises(ValueError):
        grpo.loss_weights(MASK, "constant")


def test_k3_kl_value_and_zero_at_equality():
    # p = 0.5, q = 0.25: r = 0.5, k3 = 0.5 - 1 - ln 0.5 = 0.193147
    got = grpo_torch.k3_kl(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert got.item() == pytest.approx(0.193147, abs=1e-6)
    assert grpo_torch.k3_kl(torch.tensor([-1.3]), torch.tensor([-1.3])).item() == 0.0


def test_grpo_token_loss_adds_beta_times_reference_kl():
    logp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    out = grpo_torch.grpo_token_loss(logp, logp, torch.tensor([2.0]), beta=0.1, ref_logp=ref)
    # surrogate at ratio 1: -A = -2; plus 0.1 * 0.193147
    assert out.loss.item() == pytest.approx(-2.0 + 0.0193147, abs=1e-6)
    with pytest.raises(ValueError):
        grpo_torch.grpo_token_loss(logp, logp, torch.tensor([2.0]), beta=0.1)
    assert grpo_torch.grpo_token_loss(logp, logp, torch.tensor([2.0])).ref_kl is None


def test_mismatch_kl_mean_and_per_sequence():
    behaviour = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.9]]))
    trainer = torch.log(torch.tensor([[0.25, 0.5], [0.5, 0.1]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    mean, per_seq = grpo_torch.mismatch_kl(trainer, behaviour, mask)
    # token (0,0): r = 0.25/0.5 -> 0.193147; others equal -> 0; masked token ignored
    assert per_seq.tolist() == pytest.approx([0.193147 / 2, 0.0], abs=1e-6)
    assert mean.item() == pytest.approx(0.193147 / 3, abs=1e-6)


def test_mismatch_kl_resolves_fp_noise():
    # d = 1e-6 nats per token: KL ~ d^2 / 2 = 5e-13, which exp(d) - d - 1 in float32 rounds to 0
    behaviour = torch.tensor([[-2.0]])
    trainer = behaviour + 1e-6
    mean, _ = grpo_torch.mismatch_kl(trainer, behaviour, torch.ones(1, 1))
    assert mean.item() == pytest.approx(5e-13, rel=0.1)


# Importance-sampling correction: trainer/behaviour ratios 0.5, 1, 3 (row 0) and 4 + padding
# (row 1); cap C = 2.
IS_BEHAVIOUR = torch.log(torch.tensor([[0.4, 0.2, 0.1], [0.1, 0.3, 0.3]]))
IS_TRAINER = torch.log(torch.tensor([[0.2, 0.2, 0.3], [0.4, 0.9, 0.9]]))
IS_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(("correction", "level", "weights", "ratio", "limited"), [
    # token: rho = (0.5, 1, 3 | 4, -, -); TIS min(rho, 2), MIS rho if rho <= 2 else 0
    ("tis", "token", [[0.5, 1.0, 2.0], [2.0, 0.0, 0.0]], [[0.5, 1.0, 3.0], [4.0, 1.0, 1.0]],
     [[False, False, True], [True, False, False]]),
    ("mis", "token", [[0.5, 1.0, 0.0], [0.0, 0.0, 0.0]], [[0.5, 1.0, 3.0], [4.0, 1.0, 1.0]],
     [[False, False, True], [True, False, False]]),
    # sequence: rho_0 = 0.5 * 1 * 3 = 1.5 (kept), rho_1 = 4 (padding does not count)
    ("tis", "sequence", [[1.5, 1.5, 1.5], [2.0, 0.0, 0.0]], [1.5, 4.0], [False, True]),
    ("mis", "sequence", [[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]], [1.5, 4.0], [False, True]),
])
def test_importance_weights_truncate_or_mask_by_hand(correction, level, weights, ratio, limited):
    iw = grpo_torch.importance_weights(IS_TRAINER, IS_BEHAVIOUR, IS_MASK, correction=correction,
                                       level=level, cap=2.0)
    assert torch.allclose(iw.weights, torch.tensor(weights), atol=1e-6)
    assert torch.allclose(iw.ratio, torch.tensor(ratio), atol=1e-6)
    assert iw.limited.tolist() == limited
    assert iw.units.tolist() == ([[True] * 3, [True, False, False]] if level == "token"
                                 else [True, True])
    assert iw.weights.dtype == torch.float32 and not iw.weights.requires_grad


def test_importance_weights_refuse_bad_settings():
    with pytest.raises(ValueError, match="correction"):
        grpo_torch.importance_weights(IS_TRAINER, IS_BEHAVIOUR, IS_MASK, correction="none")
    with pytest.raises(ValueError, match="level"):
        grpo_torch.importance_weights(IS_TRAINER, IS_BEHAVIOUR, IS_MASK, correction="tis",
                                      level="geometric")
    with pytest.raises(ValueError, match="cap"):
        grpo_torch.importance_weights(IS_TRAINER, IS_BEHAVIOUR, IS_MASK, correction="mis",
                                      cap=0.0)


def test_weighted_loss_ratio_runs_against_the_trainer_and_scales_the_gradient():
    """With IS weights the surrogate's ratio is pi/sg(pi) = 1 (the behaviour ratio 3 would have
    been clipped), the loss is -w*A and its gradient in logp is -w*A (TRL: per_token_loss *
    importance_sampling_ratio)."""
    logp = IS_TRAINER.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    iw = grpo_torch.importance_weights(logp, IS_BEHAVIOUR, IS_MASK, correction="tis", cap=2.0)
    out = grpo_torch.grpo_token_loss(logp, IS_BEHAVIOUR, adv, eps_low=0.2, is_weights=iw.weights)
    want = -torch.tensor([[0.5, 1.0, 2.0], [-4.0, 0.0, 0.0]])
    assert torch.allclose(out.loss, want, atol=1e-6)
    assert not out.clipped.any()
    (out.loss * IS_MASK).sum().backward()
    assert torch.allclose(logp.grad, want, atol=1e-6)
    # without weights: the behaviour ratio 3 with A = +1 takes the clipped branch, no gradient
    plain = grpo_torch.grpo_token_loss(IS_TRAINER, IS_BEHAVIOUR, adv, eps_low=0.2)
    assert plain.clipped[0, 2] and plain.loss[0, 2].item() == pytest.approx(-1.2)


def test_framework_free_mismatch_kl_over_ragged_sequences():
    """grpo.mismatch_kl (lists, a flagged node's fresh check) is grpo_torch.mismatch_kl's
    mean over the same tokens."""
    behaviour = [[math.log(0.5), math.log(0.5)], [math.log(0.5)]]
    trainer = [[math.log(0.25), math.log(0.5)], [math.log(0.5)]]
    assert grpo.mismatch_kl(trainer, behaviour) == pytest.approx(0.193147 / 3, abs=1e-6)
    assert grpo.mismatch_kl([[-2.0 + 1e-6]], [[-2.0]]) == pytest.approx(5e-13, rel=0.1)
    assert grpo.mismatch_kl([[], []], [[], []]) is None
    with pytest.raises(ValueError):
        grpo.mismatch_kl([[-1.0]], [[-1.0, -2.0]])
