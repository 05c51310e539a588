"""Parity of the MLX trainer backend with the torch one on the tiny llama, float32: the same
adapter, batch and settings give the same loss (1e-5), the same LoRA gradients (1e-4 of each
tensor's largest entry) and, AdamW stepping on the same gradients, the same adapter in both
layouts (peft, and mlx-lm after ``gridrl.adapters.convert_files``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from float_bounds import (
    EPS32,
    ROUNDING_REL,
    assert_close_to_largest,
    assert_within,
    max_abs,
    max_error,
)
from lora_gradients import capture_gradients, random_adapter

from gridrl.trainer.backends.base import TrainSequence, create_backend
from gridrl.trainer.config import TrainConfig

pytestmark = pytest.mark.mlx
mx = pytest.importorskip("mlx.core")

VOCAB = 512


def _make(model_dir, backend: str, **settings):
    base = dict(model=str(model_dir), backend=backend, lora_rank=4, lora_alpha=8.0, lr=1e-2,
                steps=4, max_tokens=8, device="cpu", dtype="float32", rollout=["local"],
                run_dir="unused", seed=0)
    return create_backend(TrainConfig(**{**base, **settings}).finalize())


def _sequences(seed: int = 1) -> list[TrainSequence]:
    """Six sequences in three groups: ragged prompts and completions, mixed advantages."""
    rng = np.random.default_rng(seed)
    prompts = [tuple(int(t) for t in rng.integers(7, VOCAB, p)) for p in (5, 9, 3)]
    advantages = (1.0, -1.0, 0.5, -0.5, 0.0, 2.0)
    seqs = []
    for i, c in enumerate((3, 6, 1, 4, 7, 2)):
        completion = tuple(int(t) for t in rng.integers(7, VOCAB, c))
        seqs.append(TrainSequence(prompts[i // 2], completion, (), advantages[i], i // 2))
    return seqs


def _off_policy(seqs, logprobs, seed: int = 2) -> list[TrainSequence]:
    """Behaviour logprobs a little off the trainer's, so ratios spread over both clip edges."""
    rng = np.random.default_rng(seed)
    return [TrainSequence(s.prompt_ids, s.completion_ids,
                          tuple(float(x) for x in np.array(lp) + rng.uniform(-0.6, 0.6, len(lp))),
                          s.advantage, s.group)
            for s, lp in zip(seqs, logprobs, strict=True)]


def _tensors(files: dict[str, bytes], weights: str) -> dict[str, np.ndarray]:
    from gridrl.adapters.tensors import load, to_float64

    return {k: to_float64(t) for k, t in load(files[weights]).tensors.items()}


@pytest.mark.parametrize("aggregation, micro", [("sequence", 0), ("token", 2), ("constant", 4)])
def test_one_update_is_the_same_in_torch_and_mlx(tiny_llama_dir, aggregation, micro):
    from gridrl.adapters import convert_files

    settings = dict(kl_beta=0.05, clip_eps=0.2, clip_eps_high=0.28, temperature=0.9,
                    loss_aggregation=aggregation, micro_batch_size=micro, max_grad_norm=1.0,
                    weight_decay=0.01, lr_schedule="cosine", warmup_steps=2)
    torch_backend = _make(tiny_llama_dir, "torch", **settings)
    mlx_backend = _make(tiny_llama_dir, "mlx", **settings)
    adapter = random_adapter(torch_backend.adapter_files(), seed=7)
    torch_backend.load_adapter_files(adapter)
    mlx_backend.load_adapter_files(adapter)
    loaded = _tensors(mlx_backend.adapter_files(), "adapter_model.safetensors")
    given = _tensors(adapter, "adapter_model.safetensors")
    assert set(loaded) == set(given)
    assert all(np.array_equal(loaded[k], given[k]) for k in given)  # loaded bit for bit

    seqs = _sequences()
    torch_lp = torch_backend.logprobs(seqs)
    mlx_lp = mlx_backend.logprobs(seqs)
    assert_close_to_largest(np.concatenate(mlx_lp), np.concatenate(torch_lp), ROUNDING_REL,
                            "logprobs")
    batch = _off_policy(seqs, torch_lp)

    torch_grads = capture_gradients(torch_backend)
    mlx_grads = capture_gradients(mlx_backend, replace_with=torch_grads)
    want = torch_backend.update(batch)
    got = mlx_backend.update(batch)

    assert got.loss == pytest.approx(want.loss, abs=1e-5)
    assert 0 < got.clip_fraction == want.clip_fraction < 1
    assert got.tokens == want.tokens == 23
    assert got.lr == pytest.approx(want.lr, rel=1e-7)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
    assert got.ref_kl == pytest.approx(want.ref_kl, rel=1e-4) and got.ref_kl > 0
    assert got.mismatch_kl == pytest.approx(want.mismatch_kl, rel=1e-4)
    np.testing.assert_allclose(got.per_sequence_mismatch_kl, want.per_sequence_mismatch_kl,
                               rtol=1e-4)

    assert set(mlx_grads) == set(torch_grads) and len(torch_grads) == 2 * 7 * 2
    for key, g in torch_grads.items():
        assert np.abs(g).max() > 0, key  # B is not zero: A and B both learn
        # two frameworks' kernels: 1e-4 (840 eps) of each tensor's largest entry, the gradient
        # bound of float_bounds widened 10x for kernels that share no code
        assert_close_to_largest(mlx_grads[key], g, 10 * ROUNDING_REL, str(key))

    # The same adapter after the step: the MLX AdamW stepped on torch's gradients (above: the
    # gradients agree to rounding; stepped on its own, Adam's g / (|g| + eps) would move an
    # entry whose gradient is within rounding of zero by +-lr). AdamW's first step is
    # element-wise, w (1 - lr wd) - lr g / (|g| + eps): two implementations round its ~8
    # operations to half an ulp of w or of the update (<= lr), so 8 eps (max|w| + lr).
    torch_files, mlx_files = torch_backend.adapter_files(), mlx_backend.adapter_files()
    assert json.loads(mlx_files["adapter_config.json"]) == {
        k: v for k, v in json.loads(torch_files["adapter_config.json"]).items()
        if k in json.loads(mlx_files["adapter_config.json"])}
    want_t = _tensors(torch_files, "adapter_model.safetensors")
    got_t = _tensors(mlx_files, "adapter_model.safetensors")
    assert set(got_t) == set(want_t)
    for name, w in want_t.items():
        assert_within(max_error(got_t[name], w), 8 * EPS32 * (max_abs(w) + want.lr), name)
        assert max_error(w, given[name]) > 0, name  # the step moved it
    torch_as_mlx = convert_files(torch_files, "mlx", torch_backend.identity.num_layers)
    native = mlx_backend.mlx_adapter_files()
    assert json.loads(native["adapter_config.json"]) == json.loads(
        torch_as_mlx["adapter_config.json"])
    want_m = _tensors(torch_as_mlx, "adapters.safetensors")
    got_m = _tensors(native, "adapters.safetensors")
    arrays = mlx_backend.lora_arrays()
    for name, w in want_m.items():
        path, leaf = name.rsplit(".", 1)
        assert_within(max_error(got_m[name], w), 8 * EPS32 * (max_abs(w) + want.lr), name)
        assert np.array_equal(got_m[name], arrays[path][0 if leaf == "lora_a" else 1])
    # and the policies agree after the step, as before it
    assert_close_to_largest(np.concatenate(mlx_backend.logprobs(seqs)),
                            np.concatenate(torch_backend.logprobs(seqs)), ROUNDING_REL,
                            "logprobs after the step")
    torch_backend.close()
    mlx_backend.close()


def test_shared_prefix_and_padded_rows_agree(tiny_llama_dir):
    """The MLX backend's two forwards (each prompt once with its KV cache repeated, or one
    padded row per sequence) give the same logprobs and the same update: the same gradients,
    and (the second stepping on the first's gradients, so that Adam's g / (|g| + eps) does not
    magnify their rounding) the same logprobs after it."""
    import dataclasses

    seqs = _sequences()
    results = []
    for shared in (True, False):
        backend = _make(tiny_llama_dir, "mlx", kl_beta=0.05)
        backend.update_cfg = dataclasses.replace(backend.update_cfg, shared_prefix=shared)
        grads = capture_gradients(backend, replace_with=results[0][3] if results else None)
        lp = backend.logprobs(seqs)
        stats = backend.update(_off_policy(seqs, lp))
        results.append((np.concatenate(lp), stats, np.concatenate(backend.logprobs(seqs)),
                        grads))
        backend.close()
    (lp_a, st_a, after_a, grads_a), (lp_b, st_b, after_b, grads_b) = results
    assert_close_to_largest(lp_b, lp_a, ROUNDING_REL, "logprobs")
    assert st_a.loss == pytest.approx(st_b.loss, abs=1e-6)
    assert st_a.grad_norm == pytest.approx(st_b.grad_norm, rel=1e-4)
    assert grads_a.keys() == grads_b.keys()
    for key, g in grads_a.items():
        assert_close_to_largest(grads_b[key], g, ROUNDING_REL, str(key))
    assert_close_to_largest(after_b, after_a, ROUNDING_REL, "logprobs after the step")


def test_a_masked_episode_batch_is_the_same_in_torch_and_mlx(tiny_llama_dir):
    """Multi-turn episodes' sequences (environment tokens inside the completion, masked out):
    the same logprobs and loss (1e-5 absolute: float32 sums of ~30 terms of size ~1) and the
    same LoRA gradients (to the unmasked parity's bound) in both backends, token counts of the
    model's tokens only; gradients compared, not stepped weights."""
    settings = dict(kl_beta=0.05, clip_eps=0.2, clip_eps_high=0.28, temperature=0.9,
                    loss_aggregation="sequence", max_grad_norm=0.0)
    torch_backend = _make(tiny_llama_dir, "torch", **settings)
    mlx_backend = _make(tiny_llama_dir, "mlx", **settings)
    adapter = random_adapter(torch_backend.adapter_files(), seed=7)
    torch_backend.load_adapter_files(adapter)
    mlx_backend.load_adapter_files(adapter)
    rng = np.random.default_rng(5)
    seqs = []
    for s in _sequences():
        c = len(s.completion_ids)
        mask = tuple(int(m) for m in rng.integers(0, 2, c))
        mask = (1, *mask[1:]) if c else mask  # every episode starts with a model turn
        seqs.append(TrainSequence(s.prompt_ids, s.completion_ids, (), s.advantage, s.group,
                                  loss_mask=mask))
    torch_lp = torch_backend.logprobs(seqs)
    assert_close_to_largest(np.concatenate(mlx_backend.logprobs(seqs)), np.concatenate(torch_lp),
                            ROUNDING_REL, "logprobs")
    off = _off_policy(seqs, torch_lp)
    batch = [TrainSequence(o.prompt_ids, o.completion_ids, o.behaviour_logprobs, o.advantage,
                           o.group, loss_mask=s.loss_mask) for o, s in zip(off, seqs, strict=True)]
    torch_grads = capture_gradients(torch_backend)
    mlx_grads = capture_gradients(mlx_backend)
    want = torch_backend.update(batch)
    got = mlx_backend.update(batch)
    assert got.tokens == want.tokens == sum(sum(s.loss_mask) for s in seqs) < 23
    assert got.loss == pytest.approx(want.loss, abs=1e-5)
    assert got.mismatch_kl == pytest.approx(want.mismatch_kl, rel=1e-4)
    for key, g in torch_grads.items():
        assert np.abs(g).max() > 0, key
        # as the unmasked parity: 10x float_bounds' gradient bound (kernels sharing no code)
        assert_close_to_largest(mlx_grads[key], g, 10 * ROUNDING_REL, str(key))
    torch_backend.close()
    mlx_backend.close()
