"""The torch backend's pieces: policy forward passes, adapter serialization, and one GRPO
optimizer step on a tiny llama."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import pytest
import torch
from float_bounds import (
    ROUNDING_REL,
    assert_tensors_close_to_largest,
    assert_within,
    largest_relative_difference,
    max_abs,
)

from gridrl.trainer.backends.base import TrainSequence, UpdateConfig
from gridrl.trainer.backends.torch import losses as grpo_torch
from gridrl.trainer.backends.torch.policy import LoraSettings, load_policy
from gridrl.trainer.backends.torch.update import (
    collate,
    grpo_update,
    make_optimizer,
    make_scheduler,
)


@pytest.fixture(scope="module")
def policy(tiny_llama_dir):
    return load_policy(str(tiny_llama_dir), lora=LoraSettings(rank=4, alpha=8), seed=0)


@pytest.fixture(scope="module")
def adapted(policy):
    """``policy`` with non-zero LoRA B factors: every LoRA factor gets a gradient (B starts at
    0, where A's gradient is exactly 0)."""
    pol = copy.deepcopy(policy)
    with torch.no_grad():
        for name, p in pol.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(len(name)))
    return pol


def _sequences(vocab: int = 512, seed: int = 1) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i, (p, c) in enumerate([(5, 3), (9, 6), (3, 1), (7, 4)]):
        prompt = torch.randint(7, vocab, (p,), generator=g).tolist()
        comp = torch.randint(7, vocab, (c,), generator=g).tolist()
        seqs.append(TrainSequence(tuple(prompt), tuple(comp), tuple([-3.0] * c),
                                  advantage=[1.0, -1.0, 0.5, -0.5][i], group=i // 2))
    return seqs


def _unpadded_logprobs(policy, seq, temperature):
    ids = torch.tensor([list(seq.prompt_ids) + list(seq.completion_ids)])
    with torch.no_grad():
        logits = policy.model(input_ids=ids).logits[:, len(seq.prompt_ids) - 1:-1]
    return grpo_torch.completion_logprobs(logits, torch.tensor([seq.completion_ids]), temperature)[0]


def test_padded_batch_logprobs_equal_unpadded(policy):
    seqs = _sequences()
    batch = collate(seqs, policy.pad_id, policy.device)
    policy.model.eval()
    with torch.no_grad():
        logits = policy.completion_logits(batch["input_ids"], batch["attention_mask"],
                                          batch["completion_mask"].shape[1])
    lp = grpo_torch.completion_logprobs(logits, batch["completion_ids"], 0.7)
    for i, s in enumerate(seqs):
        n = len(s.completion_ids)
        assert torch.allclose(lp[i, :n], _unpadded_logprobs(policy, s, 0.7), atol=1e-5)
        assert batch["completion_mask"][i].sum() == n


def _lora_b(model):
    """Every LoRA B factor of ``model``."""
    return [p for name, p in model.named_parameters() if "lora_B" in name]


def _fresh(policy):
    return copy.deepcopy(policy)


def test_update_moves_logprobs_in_the_direction_of_the_advantage(policy):
    pol = _fresh(policy)
    seqs = _sequences()
    before = [_unpadded_logprobs(pol, s, 1.0).sum().item() for s in seqs]
    opt = make_optimizer(pol.trainable_parameters(), lr=1e-2)
    stats = grpo_update(pol, opt, None, seqs, UpdateConfig(temperature=1.0, max_tokens=8))
    pol.model.eval()
    after = [_unpadded_logprobs(pol, s, 1.0).sum().item() for s in seqs]
    assert after[0] > before[0] and after[1] < before[1]  # A = +1 up, A = -1 down
    assert stats.tokens == 14 and stats.lr == pytest.approx(1e-2)
    assert stats.grad_norm > 0 and math.isfinite(stats.loss)


def test_on_policy_behaviour_gives_zero_mismatch_and_unit_ratio(policy):
    pol = _fresh(policy)
    pol.model.eval()
    seqs = [TrainSequence(s.prompt_ids, s.completion_ids,
                          tuple(_unpadded_logprobs(pol, s, 0.8).tolist()), s.advantage, s.group)
            for s in _sequences()]
    opt = make_optimizer(pol.trainable_parameters(), lr=1e-3)
    stats = grpo_update(pol, opt, None, seqs, UpdateConfig(temperature=0.8, max_tokens=8))
    assert stats.mismatch_kl < 1e-6 and stats.clip_fraction == 0.0
    assert max(stats.per_sequence_mismatch_kl) < 1e-6
    # ratio 1 everywhere: loss = -sum_i A_i / N with sequence aggregation = -(1-1+.5-.5)/4 = 0,
    # up to the ratios' distance from 1: the padded and unpadded logprobs' rounding
    # (ROUNDING_REL of the largest), weighted by sum_i |A_i| / N
    rounding = ROUNDING_REL * max(max_abs(s.behaviour_logprobs) for s in seqs)
    assert_within(abs(stats.loss), sum(abs(s.advantage) for s in seqs) / len(seqs) * rounding,
                  "on-policy loss")


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant"])
def test_micro_batches_give_the_same_update(adapted, aggregation):
    """Micro-batches accumulate the one-pass gradient: the same loss and norm, and every LoRA
    gradient within float32 summation-order rounding (float_bounds.ROUNDING_REL of its
    tensor's largest entry). The gradients are compared, not the weights after an AdamW step:
    Adam's g / (|g| + eps) magnifies the rounding of entries near eps ~1e4-fold, so a bound
    on the stepped weights measured the CPU's summation order (an AVX-512 EPYC moved one
    entry by 1.03e-6 against a 1e-6 bound with the code unchanged)."""
    seqs = _sequences()
    cfg = UpdateConfig(temperature=1.0, max_tokens=8, aggregation=aggregation, beta=0.05)
    results = []
    for mb in (0, 1, 3):
        pol = _fresh(adapted)
        rec = _GradientRecorder(pol.trainable_parameters())
        stats = grpo_update(pol, rec, None, seqs,
                            UpdateConfig(**{**cfg.__dict__, "micro_batch_size": mb}))
        results.append((stats, rec.grads))
    ref_stats, ref_grads = results[0]
    assert ref_stats.ref_kl is not None
    for stats, grads in results[1:]:
        assert stats.loss == pytest.approx(ref_stats.loss, rel=1e-5, abs=1e-7)
        assert stats.grad_norm == pytest.approx(ref_stats.grad_norm, rel=1e-5)
        _assert_same_gradients(ref_grads, grads)


def test_adapter_files_round_trip_and_load_with_peft(policy, tmp_path, tiny_llama_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    pol = _fresh(policy)
    opt = make_optimizer(pol.trainable_parameters(), lr=1e-2)
    grpo_update(pol, opt, None, _sequences(), UpdateConfig(max_tokens=8))
    files = pol.adapter_files()
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    from safetensors.torch import save  # the bytes peft's save_pretrained writes
    assert files["adapter_model.safetensors"] == save(pol.adapter_state(),
                                                      metadata={"format": "pt"})
    other = _fresh(policy)
    other.load_adapter_files(files)
    for k, v in pol.adapter_state().items():
        assert torch.equal(other.adapter_state()[k], v)
    pol.save_adapter(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.tensor([[1, 20, 30, 40]])
    pol.model.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, pol.model(input_ids=ids).logits,
                              atol=1e-5)


def test_adapter_state_follows_updates_and_loads(policy):
    """adapter_state() maps peft's keys to the parameters once; later calls must still give
    what peft's own state dict gives after optimizer steps and after load_adapter_files."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save

    def assert_matches_peft() -> None:
        want = get_peft_model_state_dict(pol.model, save_embedding_layers=False)
        got = pol.adapter_state()
        assert set(got) == set(want)
        for k, v in want.items():
            assert torch.equal(got[k], v), k

    pol = _fresh(policy)
    before = {k: v.clone() for k, v in pol.adapter_state().items()}  # builds the mapping
    opt = make_optimizer(pol.trainable_parameters(), lr=1e-2)
    grpo_update(pol, opt, None, _sequences(), UpdateConfig(max_tokens=8))
    assert_matches_peft()
    assert any(not torch.equal(pol.adapter_state()[k], v) for k, v in before.items())
    pol.load_adapter_files({**pol.adapter_files(), "adapter_model.safetensors": save(before)})
    assert_matches_peft()
    for k, v in before.items():
        assert torch.equal(pol.adapter_state()[k], v), k


def test_reference_logits_are_the_base_model(policy, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    pol = _fresh(policy)
    opt = make_optimizer(pol.trainable_parameters(), lr=1e-2)
    grpo_update(pol, opt, None, _sequences(), UpdateConfig(max_tokens=8))
    batch = collate(_sequences(), pol.pad_id, pol.device)
    width = batch["completion_mask"].shape[1]
    pol.model.eval()
    ref = pol.reference_logits(batch["input_ids"], batch["attention_mask"], width)
    with torch.no_grad():
        cur = pol.completion_logits(batch["input_ids"], batch["attention_mask"], width)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=pos).logits[:, -width - 1:-1]
    m = batch["completion_mask"].bool()
    assert torch.allclose(ref[m], want[m], atol=1e-5)
    assert not torch.allclose(cur[m], want[m], atol=1e-3)  # the adapter did change the policy


def test_lr_schedules():
    p = torch.nn.Parameter(torch.zeros(1))
    for schedule, want in [("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
                           # decay over steps 3..5: progress 0, 1/3, 2/3 (0 after the last)
                           ("linear", [0.5, 1.0, 1.0, 2 / 3, 1 / 3]),
                           ("cosine", [0.5, 1.0, 1.0, 0.75, 0.25])]:
        opt = torch.optim.SGD([p], lr=1.0)
        sched = make_scheduler(opt, schedule=schedule, warmup_steps=2, total_steps=5)
        got = []
        for _ in range(5):
            got.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert got == pytest.approx(want), schedule


def test_mismatch_kl_uses_the_samplers_truncation(policy):
    from gridrl.engine.contract import SamplingConfig
    from gridrl.trainer.backends.torch.backend import TorchTrainerBackend
    from gridrl.trainer.envs.episode import TurnRequest
    from gridrl.trainer.local import LocalRollout
    from gridrl.trainer.rollouts import group_seed

    pol = _fresh(policy)
    prompts = [list(s.prompt_ids) for s in _sequences()[:2]]
    sampler = TorchTrainerBackend(pol, make_optimizer(pol.trainable_parameters(), lr=1e-3), None,
                                  UpdateConfig())
    requests = [TurnRequest(tuple(p), group_seed(3, i), 3, 6, group=i)
                for i, p in enumerate(prompts)]
    groups = LocalRollout(sampler, lambda: 0).sample_turns(
        requests, SamplingConfig(max_tokens=6, temperature=0.8, top_k=5, top_p=0.9))
    seqs = [TrainSequence(tuple(prompts[b]), tuple(s.token_ids), tuple(s.logprobs),
                          advantage=0.5 - j % 2, group=b)
            for b, samples in enumerate(groups) for j, s in enumerate(samples)]
    cfg = UpdateConfig(temperature=0.8, max_tokens=6, top_k=5, top_p=0.9)
    stats = grpo_update(pol, make_optimizer(pol.trainable_parameters(), lr=1e-3), None, seqs,
                        cfg)
    assert stats.mismatch_kl < 1e-6  # the sampler drew exactly what the trainer's would
    # without the sampler's transform the renormalised behaviour logprobs look mismatched
    plain = _fresh(policy)
    untruncated = grpo_update(plain, make_optimizer(plain.trainable_parameters(), lr=1e-3), None,
                              seqs, UpdateConfig(temperature=0.8, max_tokens=6))
    assert untruncated.mismatch_kl > 1e-3


# (prompt lengths, shared leading tokens, sequence -> prompt, completion lengths): the shared
# prefix path's cases. "none": random prompts; "system": prompts that begin alike, of
# different lengths, groups of unequal size, interleaved rows; "nested": one prompt is the
# other's prefix; "one": a single group; "three": three prompts, one completion token each.
_PREFIX_CASES = {
    "none": ((6, 11), 0, (0, 1, 0, 1, 0, 1), (1, 4, 6, 2, 5, 3)),
    "system": ((9, 12), 7, (0, 1, 1, 0, 1, 1, 1), (3, 1, 6, 2, 5, 4, 2)),
    "nested": ((8, 8), 8, (1, 0, 1, 0), (2, 5, 3, 1)),
    "one": ((7,), 0, (0, 0, 0), (4, 2, 5)),
    "three": ((10, 12, 10), 6, (2, 0, 1, 2, 1, 0), (1, 1, 1, 1, 1, 1)),
}


@pytest.mark.parametrize("case", list(_PREFIX_CASES))
def test_shared_prefix_logits_and_gradient_equal_the_padded_path(tiny_llama_dir, case):
    """One prompt forward per group (KV cache repeated for the group) == padded per-sequence:
    logprobs and LoRA gradients, through the logits and through the hidden states, for every
    case above.

    In float64: the two paths sum in different orders, and float32 rounding of gradients up to
    ~20 differs by CPU kernel (AVX2 vs AVX-512) by more than the tolerance below (logprobs are
    float32 by design, see grpo_torch.completion_logprobs)."""
    policy = load_policy(str(tiny_llama_dir), lora=LoraSettings(rank=4, alpha=8), seed=0,
                         dtype="float64")
    lengths, shared, which, comp_lengths = _PREFIX_CASES[case]
    g = torch.Generator().manual_seed(3)
    head = torch.randint(7, 512, (shared,), generator=g).tolist()
    prompts = [tuple(head + torch.randint(7, 512, (p - shared,), generator=g).tolist())
               for p in lengths]
    if case == "nested":
        prompts[1] = prompts[0]
        prompts[0] = prompts[0][:5]
    seqs = [TrainSequence(prompts[w], tuple(torch.randint(7, 512, (c,), generator=g).tolist()),
                          tuple([-3.0] * c), advantage=1.0, group=w)
            for w, c in zip(which, comp_lengths, strict=True)]
    batch = collate(seqs, policy.pad_id, policy.device)
    width = batch["completion_mask"].shape[1]
    with torch.no_grad():  # a non-zero adapter, so the gradient reaches both A and B
        for p in _lora_b(policy.model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    results = []
    for path in ("padded", "shared", "shared hidden"):
        policy.model.zero_grad(set_to_none=True)
        if path == "padded":
            logits = policy.completion_logits(batch["input_ids"], batch["attention_mask"], width)
        elif path == "shared":
            logits = policy.shared_prefix_logits([s.prompt_ids for s in seqs],
                                                 batch["completion_ids"])
        else:
            logits = policy.shared_prefix_hidden([s.prompt_ids for s in seqs],
                                                 batch["completion_ids"]) @ policy.head_weight.T
        lp = grpo_torch.completion_logprobs(logits, batch["completion_ids"], 0.9)
        (lp * batch["completion_mask"]).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in policy.trainable_parameters()])
        results.append((lp.detach() * batch["completion_mask"], grads))
    (lp_a, g_a) = results[0]
    assert g_a.dtype == torch.float64
    assert g_a.abs().sum() > 0
    for lp_b, g_b in results[1:]:
        assert torch.allclose(lp_a, lp_b, atol=1e-5)
        assert torch.allclose(g_a, g_b, rtol=1e-4, atol=1e-6)
    policy.model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p in _lora_b(policy.model):
            p.zero_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_stored_tensor_dumps_what_safetensors_writes(dtype):
    """stored_tensor + gridrl.adapters.tensors.dump == safetensors.torch.save, byte for byte,
    for every dtype a LoRA state can hold, mixed in one file, scalars included."""
    from safetensors.torch import save

    from gridrl.adapters.tensors import dump
    from gridrl.trainer.backends.torch.policy import stored_tensor

    gen = torch.Generator().manual_seed(0)
    state = {f"base_model.model.layers.{i}.q_proj.lora_A.weight":
             torch.randn(4, 8 + i, generator=gen).to(dtype) for i in range(3)}
    state["scale"] = torch.tensor(2.5, dtype=dtype)
    state["other"] = torch.randn(5, generator=gen).to(torch.float32)
    want = save(state, metadata={"format": "pt"})
    assert dump({k: stored_tensor(v) for k, v in state.items()}, {"format": "pt"}) == want


def test_stored_tensor_refuses_what_it_cannot_store():
    from gridrl.trainer.backends.torch.policy import stored_tensor

    with pytest.raises(ValueError, match="int64"):
        stored_tensor(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous"):
        stored_tensor(torch.zeros(3, 4).t())


def test_rng_state_round_trip():
    """rng.pt of a torch checkpoint: python, numpy and torch streams continue where they were."""
    import random

    import numpy as np

    from gridrl.trainer.backends.torch.backend import rng_state, set_rng_state

    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    state = rng_state()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def _behaviour_shifted(pol, shift_first: float) -> list[TrainSequence]:
    """The test sequences with the policy's own logprobs as behaviour, the first sequence's
    lowered by ``shift_first`` (its importance ratio is exp(shift_first) on every token)."""
    pol.model.eval()
    out = []
    for i, s in enumerate(_sequences()):
        lp = _unpadded_logprobs(pol, s, 1.0) - (shift_first if i == 0 else 0.0)
        out.append(TrainSequence(s.prompt_ids, s.completion_ids, tuple(lp.tolist()),
                                 s.advantage, s.group))
    return out


def _gradients(policy, seqs, **cfg):
    """One update's statistics and LoRA gradients (unclipped, as the optimizer would get
    them) from a copy of ``policy``."""
    pol = _fresh(policy)
    rec = _GradientRecorder(pol.trainable_parameters())
    stats = grpo_update(pol, rec, None, seqs, UpdateConfig(temperature=1.0, max_tokens=8,
                                                           max_grad_norm=0.0, **cfg))
    return stats, rec.grads


def _assert_same_gradients(want, got):
    """Every LoRA gradient within float32 rounding of its path (float_bounds.ROUNDING_REL of
    its tensor's largest entry), and every one non-zero (else 0 <= 0 would pass)."""
    assert all(max_abs(w) > 0 for w in want)
    assert_tensors_close_to_largest(got, want, ROUNDING_REL, "LoRA gradient")


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_is_drops_the_off_policy_sequence(adapted, level):
    """Sequence 0 sampled by a policy e times less likely on each of its 3 tokens (ratio
    e > cap 2, token or sequence level): MIS removes it, which is the uncorrected update of the
    other, on-policy sequences with sequence 0's advantage set to 0 (the same gradients)."""
    seqs = _behaviour_shifted(adapted, 1.0)
    stats, grads = _gradients(adapted, seqs, is_correction="mis", is_level=level, is_cap=2.0)
    zeroed = [dataclasses.replace(seqs[0], advantage=0.0), *seqs[1:]]
    ref_stats, ref_grads = _gradients(adapted, zeroed)
    _assert_same_gradients(ref_grads, grads)
    e3 = math.exp(3.0) if level == "sequence" else math.e
    units = 4 if level == "sequence" else 14
    assert stats.is_weight_max == pytest.approx(e3, rel=1e-4)
    assert stats.is_limited_fraction == pytest.approx((1 if level == "sequence" else 3) / units)
    assert stats.is_weight_mean == pytest.approx(
        (e3 * (1 if level == "sequence" else 3) + units - (1 if level == "sequence" else 3))
        / units, rel=1e-4)
    assert ref_stats.is_weight_mean is None and ref_stats.is_limited_fraction is None
    _, kept = _gradients(adapted, seqs, is_correction="tis", is_level=level, is_cap=2.0)
    assert largest_relative_difference(kept, grads) > 0.1  # TIS keeps it (weight 2): far off


def test_truncated_is_caps_the_weight_where_the_clip_would_zero_the_gradient(adapted):
    """Without correction, sequence 0 (ratio e, advantage +1) takes the PPO clip: no gradient.
    TIS (cap 2) weighs it 2: the gradients of the update of on-policy sequences with its
    advantage doubled."""
    seqs = _behaviour_shifted(adapted, 1.0)
    plain, plain_grads = _gradients(adapted, seqs)
    assert plain.clip_fraction == pytest.approx(3 / 14)
    stats, grads = _gradients(adapted, seqs, is_correction="tis", is_cap=2.0)
    on_policy = _behaviour_shifted(adapted, 0.0)
    doubled = [dataclasses.replace(on_policy[0], advantage=2.0), *on_policy[1:]]
    _, ref_grads = _gradients(adapted, doubled)
    _assert_same_gradients(ref_grads, grads)
    assert stats.clip_fraction == 0.0 and stats.is_limited_fraction == pytest.approx(3 / 14)
    assert largest_relative_difference(plain_grads, grads) > 0.1  # the clip's zero, far off


def test_on_policy_is_correction_changes_nothing(adapted):
    seqs = _behaviour_shifted(adapted, 0.0)
    _, ref_grads = _gradients(adapted, seqs)
    for correction in ("tis", "mis"):
        stats, grads = _gradients(adapted, seqs, is_correction=correction, is_level="sequence")
        _assert_same_gradients(ref_grads, grads)
        assert stats.is_weight_mean == pytest.approx(1.0, abs=1e-5)
        assert stats.is_limited_fraction == 0.0


class _GradientRecorder(torch.optim.SGD):
    """Records the gradients at ``step`` and changes nothing (lr 0)."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.params, self.grads = params, []

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for p in self.params]


def test_bfloat16_update_keeps_float32_master_weights_and_close_gradients(policy):
    """--update-dtype bfloat16: the forward/backward under autocast gives the float32 update's
    gradient to bfloat16 rounding (cosine > 0.99), and the LoRA weights, their gradients and
    AdamW's state stay float32."""
    seqs = _behaviour_shifted(policy, 0.0)
    grads = {}
    for dtype in ("float32", "bfloat16"):
        pol = _fresh(policy)
        with torch.no_grad():  # non-zero B so that every LoRA factor has a gradient
            for p in _lora_b(pol.model):
                p.fill_(0.01)
        rec = _GradientRecorder(pol.trainable_parameters())
        stats = grpo_update(pol, rec, None, seqs, UpdateConfig(
            temperature=1.0, max_tokens=8, update_dtype=dtype, max_grad_norm=0.0))
        assert all(g.dtype == torch.float32 for g in rec.grads)
        grads[dtype] = torch.cat([g.reshape(-1) for g in rec.grads])
        if dtype == "bfloat16":
            assert 0 < stats.mismatch_kl < 0.1  # bf16 rounding, within --mismatch-kl-max-16bit
    cos = torch.nn.functional.cosine_similarity(grads["float32"], grads["bfloat16"], dim=0)
    assert cos > 0.99
    assert not torch.equal(grads["float32"], grads["bfloat16"])  # bf16 products did run
    pol = _fresh(policy)
    opt = make_optimizer(pol.trainable_parameters(), lr=1e-2)
    grpo_update(pol, opt, None, seqs, UpdateConfig(max_tokens=8, update_dtype="bfloat16"))
    assert all(p.dtype == torch.float32 for p in pol.trainable_parameters())
    assert all(v.dtype == torch.float32 for st in opt.state.values() for k, v in st.items()
               if k in ("exp_avg", "exp_avg_sq"))


def test_the_bfloat16_update_reads_cast_copies_of_the_frozen_weights(policy, monkeypatch):
    """A bfloat16 update reads bfloat16 copies of the frozen Linear weights and of the output
    head, made once (Policy.frozen_weights_as), instead of autocast casting them at every
    product: the same gradients and statistics bit for bit, the float32 weights back
    afterwards (after an error too), the embedding and the output head never swapped (the
    head's copy is only read by the head's products)."""
    import gridrl.trainer.backends.torch.update as update

    seqs = _behaviour_shifted(policy, 0.0)
    results = {}
    for swap in (False, True):
        pol = _fresh(policy)
        with torch.no_grad():
            for p in _lora_b(pol.model):
                p.fill_(0.01)
        if not swap:
            monkeypatch.setattr(update, "_frozen_weights_cast",
                                lambda *_: contextlib.nullcontext())
        else:
            monkeypatch.undo()
        frozen = {n: p.detach().clone() for n, p in pol.model.named_parameters()
                  if not p.requires_grad}
        heads: list[torch.dtype] = []
        real_head = update.grpo_torch.head_logprobs
        monkeypatch.setattr(update.grpo_torch, "head_logprobs",
                            lambda h, w, *a, heads=heads, real_head=real_head, **k:
                            heads.append(w.dtype) or real_head(h, w, *a, **k))
        rec = _GradientRecorder(pol.trainable_parameters())
        stats = grpo_update(pol, rec, None, seqs, UpdateConfig(
            temperature=1.0, max_tokens=8, update_dtype="bfloat16", max_grad_norm=0.0))
        results[swap] = (stats, rec.grads)
        assert heads == [torch.bfloat16 if swap else torch.float32]
        for n, p in pol.model.named_parameters():  # the float32 weights are back, unchanged
            if not p.requires_grad:
                assert p.dtype == torch.float32 and torch.equal(p, frozen[n]), n
    swapped = pol._cast_weights[torch.bfloat16]
    linears = [m for m in pol.model.modules()
               if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    assert 0 < len(swapped) <= len(linears)
    kept = {m.weight.data_ptr() for m in pol.model.modules() if isinstance(m, torch.nn.Embedding)}
    assert all(param.data_ptr() not in kept for param, _ in swapped)
    assert pol.head_weight is None or all(param is not pol.head_weight for param, _ in swapped)
    assert pol.head_weight is not None  # the tiny llama's head is plain: its copy was used
    assert pol._cast_heads[torch.bfloat16].dtype == torch.bfloat16 and pol.update_head is None
    (plain, plain_grads), (cast, cast_grads) = results[False], results[True]
    # the same update: every statistic but the process's peak resident memory (a reading)
    assert dataclasses.replace(plain, peak_rss_bytes=0) == dataclasses.replace(cast,
                                                                               peak_rss_bytes=0)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, cast_grads, strict=True))
    with pytest.raises(RuntimeError), pol.frozen_weights_as(torch.bfloat16):
        assert all(param.dtype == torch.bfloat16 for param, _ in swapped)
        raise RuntimeError("inside")
    assert all(param.dtype == torch.float32 for param, _ in swapped)


@pytest.mark.parametrize("native", [True, False], ids=["bf16-cpu", "avx2-cpu"])
def test_a_bfloat16_update_without_bf16_instructions_is_warned_at_start(tiny_llama_dir,
                                                                       monkeypatch, caplog,
                                                                       native):
    """On a CPU where oneDNN has no bfloat16 path (measured 21x slower than float32 on an AVX2
    EPYC), ``--update-dtype bfloat16`` starts with a warning naming the flag; a CPU with one,
    and a float32 update, start without it."""
    import logging

    from gridrl.trainer.backends.base import create_backend
    from gridrl.trainer.backends.torch import backend as torch_backend
    from gridrl.trainer.config import TrainConfig

    monkeypatch.setattr(torch_backend, "cpu_has_bf16_compute", lambda: native)
    caplog.set_level(logging.WARNING, logger=torch_backend.__name__)
    for dtype in ("float32", "bfloat16"):
        caplog.clear()
        create_backend(TrainConfig(
            model=str(tiny_llama_dir), backend="torch", lora_rank=4, lora_alpha=8.0, steps=2,
            max_tokens=8, device="cpu", dtype="float32", rollout=["local"], run_dir="unused",
            update_dtype=dtype).finalize()).close()
        warned = [r.getMessage() for r in caplog.records if "--update-dtype" in r.getMessage()]
        assert len(warned) == (dtype == "bfloat16" and not native), warned
    if not native:
        assert "--update-dtype float32" in warned[0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_equal_the_full_logits_path_and_its_gradient(temperature):
    """The chunked, fused head gives completion_logprobs(hidden @ W.T) and, over ragged
    chunks, the gradient of the float64 log-softmax to float32 rounding, with and without
    autograd."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g) * 3
    tokens = torch.randint(0, 11, (7,), generator=g)
    want = grpo_torch.completion_logprobs((hidden @ weight.t())[None], tokens[None],
                                          temperature)[0]
    got = grpo_torch.head_logprobs(hidden, weight, tokens, temperature, chunk_rows=3)
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(grpo_torch.head_logprobs(hidden, weight, tokens, temperature,
                                                    chunk_rows=3), got.detach())
    upstream = torch.randn(7, dtype=torch.float64, generator=g)
    exact = torch.log_softmax((hidden @ weight.t()) / temperature, -1)  # all float64
    (exact.gather(-1, tokens[:, None])[:, 0] * upstream).sum().backward()
    grad_want, hidden.grad = hidden.grad.clone(), None
    (grpo_torch.head_logprobs(hidden, weight, tokens, temperature, chunk_rows=3).double()
     * upstream).sum().backward()
    assert torch.allclose(hidden.grad, grad_want, rtol=1e-5, atol=1e-6)  # float32 softmax


def test_head_logprobs_refuses_a_trained_head_and_bad_shapes():
    h, w, t = torch.randn(3, 4), torch.randn(6, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="frozen"):
        grpo_torch.head_logprobs(h, w.requires_grad_(), t)
    with pytest.raises(ValueError, match="temperature"):
        grpo_torch.head_logprobs(h, w.detach(), t, 0.0)
    with pytest.raises(ValueError, match="do not match"):
        grpo_torch.head_logprobs(h, w.detach()[:, :3], t)


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_the_update_from_hidden_states_is_the_update_from_logits(tiny_llama_dir, shared_prefix):
    """grpo_update through the fused head (Policy.head_weight set) and through full logits
    (head_weight None): same loss, mismatch KL and LoRA gradients, to float32 rounding."""
    base = load_policy(str(tiny_llama_dir), lora=LoraSettings(rank=4, alpha=8), seed=0,
                       dtype="float64")
    assert base.head_weight is base.model.get_base_model().lm_head.weight
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a non-zero adapter, so the gradient reaches both A and B
        for p in _lora_b(base.model):
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    seqs = _behaviour_shifted(base, 0.3)
    runs = []
    for fused in (True, False):
        pol = _fresh(base)
        if not fused:
            pol.head_weight = None
        rec = _GradientRecorder(pol.trainable_parameters())
        stats = grpo_update(pol, rec, None, seqs, UpdateConfig(
            temperature=0.8, max_tokens=8, max_grad_norm=0.0, shared_prefix=shared_prefix))
        runs.append((stats, torch.cat([gr.reshape(-1) for gr in rec.grads])))
    (fused_stats, fused_grad), (plain_stats, plain_grad) = runs
    assert plain_grad.abs().sum() > 0
    # both paths take a float32 softmax (grpo_torch's logprobs are float32 by design): 6e-8
    # apart at most on gradients up to 0.6
    assert torch.allclose(fused_grad, plain_grad, rtol=1e-5, atol=1e-6)
    assert fused_stats.loss == pytest.approx(plain_stats.loss, abs=1e-6)  # a sum of +-terms
    assert fused_stats.mismatch_kl == pytest.approx(plain_stats.mismatch_kl, rel=1e-4)
    assert fused_stats.tokens == plain_stats.tokens


def test_plain_head_weight_only_for_a_plain_frozen_head(tiny_llama_dir, tmp_path):
    """The fused head is used only where logits are hidden @ W.T with W frozen: not for
    gemma2 (soft-capped logits) nor when LoRA trains the head."""
    from engine_helpers import make_tiny_model

    gemma = make_tiny_model(tmp_path / "gemma2", "gemma2", tiny_llama_dir)
    assert load_policy(str(gemma), lora=LoraSettings(rank=4, alpha=8)).head_weight is None
    lora_head = load_policy(str(tiny_llama_dir), lora=LoraSettings(
        rank=4, alpha=8, target_modules="q_proj,lm_head"))
    assert lora_head.head_weight is None
