"""The training primitives on the tiny llama, without RPC: losses against their formulas,
gradients that add up over calls, AdamW steps, saved states, snapshots and who samples them.

Logprobs and gradients are compared at float32 rounding of each tensor's largest entry
(``tests/float_bounds.py``), never weights after an optimizer step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from float_bounds import ROUNDING_REL, assert_close_to_largest, assert_tensors_close_to_largest

from gridrl.common.errors import Kind, StatusError
from gridrl.trainer.backends.base import LoraSettings
from gridrl.trainer.primitives import paths
from gridrl.trainer.primitives.serve import torch_loader
from gridrl.trainer.primitives.service import PrimitivesService, SampleTarget
from gridrl.trainer.primitives.torch_model import TorchTrainableModel
from gridrl.trainer.primitives.types import (
    AdamSettings,
    Datum,
    LoraRequest,
    LossSpec,
    SamplingSpec,
)

SEQS = [([5, 9, 12, 7, 30], [9, 12, 7, 30, 2]), ([3, 4, 8], [4, 8, 2]),
        ([11, 6, 6, 19, 21, 40, 41], [6, 6, 19, 21, 40, 41, 2])]


@pytest.fixture
def model(tiny_llama_dir: Path) -> Iterator[TorchTrainableModel]:
    m = TorchTrainableModel.load(str(tiny_llama_dir), LoraSettings(rank=4, alpha=8), seed=3,
                                 device="cpu")
    with torch.no_grad():  # B != 0: the adapter changes the logits and gets gradients on A
        for p in m.policy.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    yield m
    m.close()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[PrimitivesService]:
    svc = PrimitivesService(root=tmp_path / "api", load_model=torch_loader("cpu", "auto"),
                            lora_alpha=8.0)
    yield svc
    svc.close()


def reference_logprobs(m: TorchTrainableModel, d: Datum) -> np.ndarray:
    """logp of each target under the peft model's own full-logits forward."""
    with torch.no_grad():
        logits = m.policy.model(input_ids=torch.from_numpy(d.input_ids)[None]).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(d.length),
                                          torch.tensor(d.target_ids)].numpy()


def grads(m: TorchTrainableModel) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for p in m.policy.trainable_parameters()]


def test_forward_logprobs_are_the_models_own_and_the_losses_follow_their_formulas(
        model: TorchTrainableModel) -> None:
    rng = np.random.default_rng(0)
    data = []
    for ids, targets in SEQS:
        n = len(ids)
        data.append(Datum.of(ids, targets, weights=rng.uniform(0, 1, n),
                             advantages=rng.normal(size=n), sampling_logprobs=-rng.uniform(0, 8, n)))
    out = model.forward(data, LossSpec("cross_entropy"), backward=False)
    for d, lp in zip(data, out.logprobs, strict=True):
        assert_close_to_largest(lp, reference_logprobs(model, d), ROUNDING_REL,
                                "logprobs vs the full-logits forward")
    lp = out.logprobs
    ce = -sum(float((d.weights * p).sum()) for d, p in zip(data, lp, strict=True))
    ratios = [np.exp(p - d.sampling_logprobs) for d, p in zip(data, lp, strict=True)]
    is_ = -sum(float((r * d.advantages).sum()) for d, r in zip(data, ratios, strict=True))
    ppo = -sum(float(np.minimum(r * d.advantages, np.clip(r, 0.9, 1.1) * d.advantages).sum())
               for d, r in zip(data, ratios, strict=True))
    cispo = -sum(float((np.clip(r, 0.9, 1.1) * p * d.advantages).sum())
                 for d, r, p in zip(data, ratios, lp, strict=True))
    dro = -sum(float((p * d.advantages - 0.5 * 0.3 * (p - d.sampling_logprobs) ** 2).sum())
               for d, p in zip(data, lp, strict=True))
    for loss, want in ((LossSpec("cross_entropy"), ce), (LossSpec("importance_sampling"), is_),
                       (LossSpec("ppo", 0.9, 1.1), ppo), (LossSpec("cispo", 0.9, 1.1), cispo),
                       (LossSpec("dro", beta=0.3), dro)):
        got = model.forward(data, loss, backward=False).loss
        assert got == pytest.approx(want, rel=1e-5, abs=1e-4), loss.name
    assert model.pending_datums == 0


def test_gradients_add_up_over_calls_and_importance_sampling_on_policy_is_weighted_ce(
        model: TorchTrainableModel) -> None:
    data = [Datum.of(ids, t, weights=np.linspace(0.2, 1.0, len(ids))) for ids, t in SEQS]
    model.forward(data, LossSpec("cross_entropy"), backward=True)
    whole = grads(model)
    model.backend.optimizer.zero_grad(set_to_none=True)
    model.forward(data[:1], LossSpec("cross_entropy"), backward=True)
    model.forward(data[1:], LossSpec("cross_entropy"), backward=True)
    assert model.pending_datums == 6
    assert_tensors_close_to_largest(grads(model), whole, ROUNDING_REL, "gradient in two calls")
    assert max(float(g.abs().max()) for g in whole) > 0
    # on-policy (q = logp) the ratio is 1 and its gradient A * dlogp: CE with weights = A
    model.backend.optimizer.zero_grad(set_to_none=True)
    lp = model.forward(data, LossSpec("cross_entropy"), backward=False).logprobs
    on_policy = [Datum.of(d.input_ids, d.target_ids, advantages=d.weights, sampling_logprobs=p)
                 for d, p in zip(data, lp, strict=True)]
    model.forward(on_policy, LossSpec("importance_sampling"), backward=True)
    assert_tensors_close_to_largest(grads(model), whole, ROUNDING_REL,
                                    "importance_sampling on policy vs weighted cross_entropy")


def test_ppo_sends_no_gradient_through_clipped_tokens(model: TorchTrainableModel) -> None:
    d = Datum.of(*SEQS[0])
    lp = model.forward([d], LossSpec("cross_entropy"), backward=False).logprobs[0]
    # every ratio is e^1 > clip_high with a positive advantage: the clipped branch everywhere
    clipped = Datum.of(d.input_ids, d.target_ids, advantages=np.ones(d.length),
                       sampling_logprobs=lp - 1.0)
    model.forward([clipped], LossSpec("ppo", 0.8, 1.2), backward=True)
    assert all(float(g.abs().max()) == 0 for g in grads(model))


def test_cispo_weighs_the_likelihood_gradient_by_the_clipped_ratio_and_dro_on_policy_is_ce(
        model: TorchTrainableModel) -> None:
    """CISPO's ratio is a constant weight (stop-gradient): with every ratio e^1 clipped to
    clip_high its gradient is clip_high x that of cross_entropy weighted by the advantages,
    where PPO's is zero. DRO on policy (q = logp): the penalty and its gradient vanish, what
    is left is cross_entropy weighted by the advantages."""
    d = Datum.of(*SEQS[0])
    adv = np.linspace(0.5, 1.5, d.length)
    lp = model.forward([d], LossSpec("cross_entropy"), backward=False).logprobs[0]
    model.forward([Datum.of(d.input_ids, d.target_ids, weights=adv)], LossSpec("cross_entropy"),
                  backward=True)
    weighted_ce = grads(model)
    model.backend.optimizer.zero_grad(set_to_none=True)
    model.forward([Datum.of(d.input_ids, d.target_ids, advantages=adv, sampling_logprobs=lp - 1.0)],
                  LossSpec("cispo", 0.8, 1.2), backward=True)
    assert_tensors_close_to_largest(grads(model), [1.2 * g for g in weighted_ce], ROUNDING_REL,
                                    "cispo with every ratio clipped vs 1.2 x weighted CE")
    model.backend.optimizer.zero_grad(set_to_none=True)
    model.forward([Datum.of(d.input_ids, d.target_ids, advantages=adv, sampling_logprobs=lp)],
                  LossSpec("dro", beta=0.7), backward=True)
    assert_tensors_close_to_largest(grads(model), weighted_ce, ROUNDING_REL,
                                    "dro on policy vs weighted CE")
    model.backend.optimizer.zero_grad(set_to_none=True)


def test_an_optimizer_step_needs_a_gradient_and_applies_the_steps_settings(
        model: TorchTrainableModel) -> None:
    with pytest.raises(StatusError) as e:
        model.optim_step(AdamSettings())
    assert e.value.kind == Kind.FAILED_PRECONDITION
    d = [Datum.of(*SEQS[0])]
    before = model.forward(d, LossSpec("cross_entropy"), backward=True).loss
    result = model.optim_step(AdamSettings(lr=1e-2, beta2=0.999, eps=1e-8, grad_clip_norm=0.5))
    assert result.steps == 1 and result.datums == 1 and result.grad_norm > 0
    group = model.backend.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"]) == (1e-2, (0.9, 0.999), 1e-8)
    assert model.pending_datums == 0
    assert all(p.grad is None for p in model.policy.trainable_parameters())
    assert model.forward(d, LossSpec("cross_entropy"), backward=False).loss < before


def test_saved_state_restores_adapter_and_optimizer_exactly(service: PrimitivesService,
                                                            tiny_llama_dir: Path) -> None:
    base = str(tiny_llama_dir)
    data = [Datum.of(ids, t) for ids, t in SEQS]
    ce, adam = LossSpec("cross_entropy"), AdamSettings(lr=1e-2)
    first = service.create_model(base, LoraRequest(rank=4, seed=1)).result().model_id
    for _ in range(2):
        service.forward(first, data, ce, backward=True).result()
        service.optim_step(first, adam).result()
    uri = service.save_state(first, "two-steps").result()
    assert uri == f"tinker://{first}/weights/two-steps"
    restored = service.create_model(None, LoraRequest(), state=paths.parse(uri),
                                    with_optimizer=True).result()
    assert (restored.base_model, restored.lora_rank, restored.steps) == (base, 4, 2)
    for mid in (first, restored.model_id):  # the same third step on both
        service.forward(mid, data, ce, backward=True).result()
        service.optim_step(mid, adam).result()
    a = service.forward(first, data, ce, backward=False).result().logprobs
    b = service.forward(restored.model_id, data, ce, backward=False).result().logprobs
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)  # same float operations in the same order
    with pytest.raises(StatusError) as e:
        service.create_model(None, LoraRequest(),
                             state=paths.parse(f"tinker://{first}/weights/none")).result()
    assert e.value.kind == Kind.NOT_FOUND


def test_a_snapshot_samples_its_own_weights_after_training_moved_on(
        service: PrimitivesService, tiny_llama_dir: Path) -> None:
    base = str(tiny_llama_dir)
    mid = service.create_model(base, LoraRequest(rank=4, seed=2)).result().model_id
    spec = SamplingSpec(n=3, max_tokens=6, temperature=1.0, seed=11)
    prompt = [5, 9, 12]
    base_samples = service.sample(service.base_target(mid, 0), prompt, spec).result()
    data = [Datum.of(ids, t) for ids, t in SEQS]
    service.forward(mid, data, LossSpec("cross_entropy"), backward=True).result()
    service.optim_step(mid, AdamSettings(lr=5e-2)).result()
    snap = service.save_for_sampler(mid).result()
    assert snap.version == 1 and snap.mlx_dir is None and (snap.peft_dir / "adapter_model.safetensors").is_file()
    v1 = service.sample(service.base_target(mid, 1), prompt, spec).result()
    assert v1.sampled_by == "trainer" and {s.policy_version for s in v1.sequences} == {1}
    service.forward(mid, data, LossSpec("cross_entropy"), backward=True).result()
    service.optim_step(mid, AdamSettings(lr=5e-2)).result()
    again = service.sample(service.base_target(mid, 1), prompt, spec).result()  # swapped in
    assert [s.token_ids for s in again.sequences] == [s.token_ids for s in v1.sequences]
    assert_close_to_largest([x for s in again.sequences for x in s.logprobs],
                            [x for s in v1.sequences for x in s.logprobs], ROUNDING_REL,
                            "version 1's logprobs, swapped back in")
    base_again = service.sample(service.base_target(mid, 0), prompt, spec).result()
    assert [s.token_ids for s in base_again.sequences] == [s.token_ids for s in base_samples.sequences]
    fresh = service.sample(SampleTarget(base), prompt, spec).result()  # the base, no model
    assert [s.token_ids for s in fresh.sequences] == [s.token_ids for s in base_samples.sequences]
    # a named snapshot is on disk in both layouts and samples by its path
    named = service.save_for_sampler(mid, "final").result()
    assert (named.mlx_dir / "adapters.safetensors").is_file()
    target = service.sampler_target(named.uri)
    assert (target.model_id, target.version) == (mid, 2)
    with pytest.raises(StatusError) as e:
        service.base_target(mid, 9)
    assert e.value.kind == Kind.NOT_FOUND


def test_processed_logprobs_prompt_logprobs_and_stop_strings(service: PrimitivesService,
                                                             tiny_llama_dir: Path) -> None:
    base = str(tiny_llama_dir)
    mid = service.create_model(base, LoraRequest(rank=4)).result().model_id
    target, prompt = service.base_target(mid, 0), [5, 9, 12, 7]
    hot = service.sample(target, prompt, SamplingSpec(n=2, max_tokens=5, temperature=1.0,
                                                      seed=4)).result()
    cold = service.sample(target, prompt, SamplingSpec(n=2, max_tokens=5, temperature=0.5,
                                                       top_k=5, seed=4),
                          prompt_logprobs=True).result()
    # processed: the log of the probability each token was drawn with, softmax(logits / 0.5)
    # over the 5 most likely tokens
    peft_model = service._entry(mid).model.policy.model
    for seq in cold.sequences:
        for j, (token, lp) in enumerate(zip(seq.token_ids, seq.logprobs, strict=True)):
            with torch.no_grad():
                logits = peft_model(input_ids=torch.tensor([prompt + seq.token_ids[:j]])
                                    ).logits[0, -1].float() / 0.5
            kept = torch.topk(logits, 5)
            want = torch.log_softmax(kept.values, -1)[kept.indices == token]
            # 1e-4: the sampler's forward against peft's, far below the O(1) gap between
            # processed and temperature-1 logprobs
            assert want.numel() == 1 and abs(float(want) - lp) < 1e-4
    assert hot.prompt_logprobs is None
    ref = service.forward(mid, [Datum.of(prompt[:-1], prompt[1:])], LossSpec("cross_entropy"),
                          backward=False).result().logprobs[0]
    assert cold.prompt_logprobs[0] is None
    assert_close_to_largest(cold.prompt_logprobs[1:], ref, ROUNDING_REL, "prompt logprobs")
    tokenizer = service.tokenizer(base)
    text = tokenizer.decode(hot.sequences[0].token_ids, skip_special_tokens=False)
    stop = text.split()[1] if len(text.split()) > 1 else text.split()[0]
    cut = service.sample(target, prompt, SamplingSpec(n=2, max_tokens=5, temperature=1.0, seed=4,
                                                      stop_strings=(stop,))).result()
    first = cut.sequences[0]
    assert first.finish_reason == "stop"
    assert stop in tokenizer.decode(first.token_ids, skip_special_tokens=False)
    assert first.token_ids == hot.sequences[0].token_ids[:len(first.token_ids)]
    assert first.logprobs == hot.sequences[0].logprobs[:len(first.logprobs)]


def test_datums_that_begin_alike_share_one_prefix_forward() -> None:
    from gridrl.trainer.primitives.torch_model import shared_prefixes

    system = list(range(100, 120))
    a, b = system + list(range(200, 230)), system + list(range(300, 330))
    inputs = [[*a, 9, 9], [*b, 8], [*a, 7], [1, 2, 3], [*b, 6, 6, 6], [*a, 9, 8]]
    shared, alone = shared_prefixes(inputs)
    # the samples of prompt a, and of prompt b (longer than the system part they all share)
    assert shared == [(len(a), [0, 2, 5]), (len(b), [1, 4])] and alone == [3]
    # when the common part dominates, one forward of it serves everything
    short_a, short_b = [*system, 1], [*system, 2]
    assert shared_prefixes([[*short_a, 5], [*short_b, 6], [*short_a, 7]]) == (
        [(len(system), [0, 1, 2])], [])
    assert shared_prefixes([a, [*a, 1]]) == ([(len(a) - 1, [0, 1])], [])  # keep a token to run
    assert shared_prefixes([[1, 2, 3, 4], [1, 2, 3, 5]]) == ([], [0, 1])  # too short to share


def test_the_shared_prefix_forward_computes_the_padded_one(model: TorchTrainableModel,
                                                           monkeypatch) -> None:
    from gridrl.trainer.primitives import torch_model

    rng = np.random.default_rng(1)
    prompt = list(rng.integers(3, 500, 24))
    data = []
    for k in range(4):
        completion = list(rng.integers(3, 500, 3 + k))
        tokens = prompt + completion
        n = len(tokens) - 1
        data.append(Datum.of(tokens[:-1], tokens[1:], advantages=[0] * 23 + [1.0 - k] * (n - 23),
                             sampling_logprobs=-rng.uniform(0, 5, n)))
    data.append(Datum.of(*SEQS[0], advantages=[0.5] * 5, sampling_logprobs=[-2.0] * 5))
    assert torch_model.shared_prefixes([d.input_ids for d in data])[0]  # the path is taken
    loss = LossSpec("ppo", 0.8, 1.2)
    shared = model.forward(data, loss, backward=True)
    shared_grads = grads(model)
    model.backend.optimizer.zero_grad(set_to_none=True)
    monkeypatch.setattr(torch_model, "shared_prefixes",
                        lambda inputs: ([], list(range(len(inputs)))))
    padded = model.forward(data, loss, backward=True)
    for x, y in zip(shared.logprobs, padded.logprobs, strict=True):
        assert_close_to_largest(x, y, ROUNDING_REL, "logprobs, shared prefix vs padded")
    assert shared.loss == pytest.approx(padded.loss, rel=ROUNDING_REL)
    assert_tensors_close_to_largest(shared_grads, grads(model), ROUNDING_REL,
                                    "gradients, shared prefix vs padded")
