"""Parity of the MLX trainer backend with the torch one on the tiny llama, float32: the same
adapter, batch and settings give the same loss (1e-5), the same LoRA gradients (rtol 1e-4)
and, after one AdamW step, the same adapter in both layouts (peft, and mlx-lm after
``gridrl.adapters.convert_files``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gridrl.trainer.backend import TrainSequence, create_backend
from gridrl.trainer.config import TrainConfig

pytestmark = pytest.mark.mlx
mx = pytest.importorskip("mlx.core")

VOCAB = 512


def _make(model_dir, backend: str, **settings):
    base = dict(model=str(model_dir), backend=backend, lora_rank=4, lora_alpha=8.0, lr=1e-2,
                steps=4, max_tokens=8, device="cpu", dtype="float32", rollout=["local"],
                run_dir="unused", seed=0)
    return create_backend(TrainConfig(**{**base, **settings}).finalize())


def _random_adapter(files: dict[str, bytes], seed: int) -> dict[str, bytes]:
    """The same peft files with every tensor redrawn (B no longer zero, so A gets a gradient)."""
    from gridrl.adapters.tensors import Tensor, dump, load

    rng = np.random.default_rng(seed)
    parsed = load(files["adapter_model.safetensors"])
    state = {}
    for name, t in parsed.tensors.items():
        arr = (rng.standard_normal(t.shape) * 0.1).astype("<f4")
        state[name] = Tensor("F32", tuple(arr.shape), arr.tobytes())
    return {**files, "adapter_model.safetensors": dump(state, {"format": "pt"})}


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


def _torch_grads(backend) -> dict[tuple[str, str], np.ndarray]:
    """Wrap the torch optimizer's step: (module path, "A"/"B") -> gradient (peft orientation)
    as it is when AdamW steps (after clipping)."""
    captured: dict[tuple[str, str], np.ndarray] = {}
    step = backend.optimizer.step

    def capture(*args, **kwargs):
        for name, p in backend.policy.model.named_parameters():
            if p.requires_grad:
                path, leaf = name.removeprefix("base_model.model.").split(".lora_")
                captured[(path, leaf[0])] = p.grad.detach().numpy().copy()
        return step(*args, **kwargs)

    backend.optimizer.step = capture
    return captured


def _mlx_grads(backend) -> dict[tuple[str, str], np.ndarray]:
    """Wrap the MLX optimizer's update the same way (transposed to peft's orientation)."""
    from mlx.utils import tree_flatten

    captured: dict[tuple[str, str], np.ndarray] = {}
    update = backend.optimizer.update

    def capture(model, grads):
        for name, g in tree_flatten(grads):
            path, leaf = name.rsplit(".lora_", 1)
            captured[(path, leaf.upper())] = np.array(g).T.copy()
        return update(model, grads)

    backend.optimizer.update = capture
    return captured


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
    adapter = _random_adapter(torch_backend.adapter_files(), seed=7)
    torch_backend.load_adapter_files(adapter)
    mlx_backend.load_adapter_files(adapter)
    loaded = _tensors(mlx_backend.adapter_files(), "adapter_model.safetensors")
    given = _tensors(adapter, "adapter_model.safetensors")
    assert set(loaded) == set(given)
    assert all(np.array_equal(loaded[k], given[k]) for k in given)  # loaded bit for bit

    seqs = _sequences()
    torch_lp = torch_backend.logprobs(seqs)
    mlx_lp = mlx_backend.logprobs(seqs)
    np.testing.assert_allclose(np.concatenate(mlx_lp), np.concatenate(torch_lp), atol=1e-5)
    batch = _off_policy(seqs, torch_lp)

    torch_grads, mlx_grads = _torch_grads(torch_backend), _mlx_grads(mlx_backend)
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
        np.testing.assert_allclose(mlx_grads[key], g, rtol=1e-4, atol=1e-4 * np.abs(g).max(),
                                   err_msg=str(key))

    # the same adapter after the step: peft files, and mlx-lm files after conversion
    torch_files, mlx_files = torch_backend.adapter_files(), mlx_backend.adapter_files()
    assert json.loads(mlx_files["adapter_config.json"]) == {
        k: v for k, v in json.loads(torch_files["adapter_config.json"]).items()
        if k in json.loads(mlx_files["adapter_config.json"])}
    want_t = _tensors(torch_files, "adapter_model.safetensors")
    got_t = _tensors(mlx_files, "adapter_model.safetensors")
    assert set(got_t) == set(want_t)
    # AdamW's first step moves each entry by lr * g / (|g| + eps) (+ decay): where |g| is near
    # eps = 1e-8 that ratio amplifies float rounding of g, so those entries (few) are held
    # only to the step's size bound lr; the others to rtol 1e-4.
    conditioned = 0
    for name, w in want_t.items():
        path, leaf = name.removeprefix("base_model.model.").rsplit(".lora_", 1)
        g = torch_grads[(path, leaf[0])]
        sharp = np.abs(g) > 1e-6
        conditioned += int(sharp.sum())
        np.testing.assert_allclose(got_t[name][sharp], w[sharp], rtol=1e-4, atol=1e-7,
                                   err_msg=name)
        assert np.abs(got_t[name] - w).max() <= want.lr * 1.01, name
    assert conditioned > 0.9 * sum(w.size for w in want_t.values())
    torch_as_mlx = convert_files(torch_files, "mlx", torch_backend.identity.num_layers)
    native = mlx_backend.mlx_adapter_files()
    assert json.loads(native["adapter_config.json"]) == json.loads(
        torch_as_mlx["adapter_config.json"])
    want_m = _tensors(torch_as_mlx, "adapters.safetensors")
    got_m = _tensors(native, "adapters.safetensors")
    arrays = mlx_backend.lora_arrays()
    for name, w in want_m.items():
        path, leaf = name.rsplit(".", 1)
        sharp = np.abs(torch_grads[(path, leaf[-1].upper())].T) > 1e-6
        np.testing.assert_allclose(got_m[name][sharp], w[sharp], rtol=1e-4, atol=1e-7,
                                   err_msg=name)
        assert np.array_equal(got_m[name], arrays[path][0 if leaf == "lora_a" else 1])
    # and the policies agree after the step
    np.testing.assert_allclose(np.concatenate(mlx_backend.logprobs(seqs)),
                               np.concatenate(torch_backend.logprobs(seqs)), atol=1e-4)
    torch_backend.close()
    mlx_backend.close()


def test_shared_prefix_and_padded_rows_agree(tiny_llama_dir):
    """The MLX backend's two forwards (each prompt once with its KV cache repeated, or one
    padded row per sequence) give the same logprobs and the same update."""
    import dataclasses

    seqs = _sequences()
    results = []
    for shared in (True, False):
        backend = _make(tiny_llama_dir, "mlx", kl_beta=0.05)
        backend.update_cfg = dataclasses.replace(backend.update_cfg, shared_prefix=shared)
        lp = backend.logprobs(seqs)
        stats = backend.update(_off_policy(seqs, lp))
        results.append((np.concatenate(lp), stats, np.concatenate(backend.logprobs(seqs))))
        backend.close()
    (lp_a, st_a, after_a), (lp_b, st_b, after_b) = results
    np.testing.assert_allclose(lp_a, lp_b, atol=1e-5)
    assert st_a.loss == pytest.approx(st_b.loss, abs=1e-6)
    assert st_a.grad_norm == pytest.approx(st_b.grad_norm, rel=1e-4)
    np.testing.assert_allclose(after_a, after_b, atol=1e-4)
