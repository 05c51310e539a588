"""``--memory-mb`` on the MLX trainer (tiny llama, float32, MLX's CPU build): micro-batches
planned from token counts within the budget give the unbounded loss and gradients at float32
rounding (``float_bounds``), and budgets that cannot hold one sequence are refused naming the
least that fits: before step 1 (INVALID_ARGUMENT) or at the step (RESOURCE_EXHAUSTED, nothing
stepped)."""

from __future__ import annotations

import numpy as np
import pytest
from float_bounds import ROUNDING_REL, assert_close_to_largest, assert_within
from lora_gradients import capture_gradients, random_adapter

from gridrl.common.errors import Kind, StatusError
from gridrl.trainer.backends.base import TrainSequence, create_backend
from gridrl.trainer.backends.memory import MIB, RESERVE_BYTES
from gridrl.trainer.config import TrainConfig

pytestmark = pytest.mark.mlx
mx = pytest.importorskip("mlx.core")

VOCAB = 512


def _backend(model_dir, **settings):
    base = dict(model=str(model_dir), backend="mlx", lora_rank=4, lora_alpha=8.0, lr=1e-2,
                steps=4, max_tokens=8, device="cpu", dtype="float32", rollout=["local"],
                run_dir="unused", seed=0, memory_mb=1 << 20)
    return create_backend(TrainConfig(**{**base, **settings}).finalize())


def _sequences(widths, seed: int = 5) -> list[TrainSequence]:
    rng = np.random.default_rng(seed)
    seqs = []
    for i, (p, c) in enumerate(widths):
        prompt = tuple(int(t) for t in rng.integers(7, VOCAB, p))
        completion = tuple(int(t) for t in rng.integers(7, VOCAB, c))
        behaviour = tuple(float(x) for x in rng.uniform(-7.0, -5.0, c))
        seqs.append(TrainSequence(prompt, completion, behaviour, (-1.0) ** i * (1 + i % 3),
                                  i // 2))
    return seqs


def test_mlx_micro_batches_fit_the_budget_with_the_unbounded_loss_and_gradients(
        tiny_llama_dir):
    from gridrl.trainer.backends.mlx.memory import MlxUpdateMemory

    seqs = _sequences([(12, 20), (12, 9), (30, 12), (30, 40), (20, 60), (20, 15)])
    results = []
    for bounded in (False, True):
        backend = _backend(tiny_llama_dir)
        assert backend.memory is not None  # --memory-mb is honoured: measured at start-up
        backend.load_adapter_files(random_adapter(backend.adapter_files(), seed=7))
        if bounded:
            cost = MlxUpdateMemory(backend, 1 << 40, rss=lambda: 0).cost(128)
            assert cost.per_token > 0  # measured on the model, not guessed
            room = cost.bytes(2, 82)  # two of the longest: the six cannot share one
            backend.memory = MlxUpdateMemory(backend, int(room) + RESERVE_BYTES,
                                             rss=lambda: 0)
        else:
            backend.memory = None
        grads = capture_gradients(backend)
        results.append((backend.update(seqs), grads))
        backend.close()
    (want, want_grads), (got, got_grads) = results
    assert want.micro_batches == 1 and got.micro_batches >= 3
    assert got.peak_rss_bytes and got.peak_rss_bytes > 0
    assert_within(abs(got.loss - want.loss), ROUNDING_REL * abs(want.loss), "loss")
    assert set(got_grads) == set(want_grads) and want_grads
    for key, g in want_grads.items():
        assert np.abs(g).max() > 0, key
        assert_close_to_largest(got_grads[key], g, ROUNDING_REL, str(key))


def test_mlx_budgets_too_small_are_refused_naming_the_least_that_fits(tiny_llama_dir):
    from gridrl.trainer.backends.memory import current_rss_bytes
    from gridrl.trainer.backends.mlx.memory import MlxUpdateMemory

    # before step 1: the process as it is leaves no room for one sequence
    least = current_rss_bytes() // MIB + 1
    with pytest.raises(StatusError) as e:
        _backend(tiny_llama_dir, memory_mb=int(least))
    assert e.value.kind is Kind.INVALID_ARGUMENT and e.value.field == "--memory-mb"
    named = int(e.value.message.split("needs --memory-mb ")[1].split()[0])
    assert named > least
    # at the step: room for one short sequence, not for a long one
    backend = _backend(tiny_llama_dir)
    cost = MlxUpdateMemory(backend, 1 << 40, rss=lambda: 0).cost(128)
    # (1.2x: a new bound measures again, and MLX's peak varies by a few percent)
    backend.memory = MlxUpdateMemory(backend, int(1.2 * cost.bytes(1, 128)) + RESERVE_BYTES,
                                     rss=lambda: 0)
    before = backend.adapter_files()
    with pytest.raises(StatusError) as e:
        backend.update(_sequences([(10, 10), (100, 400)]))
    assert e.value.kind is Kind.RESOURCE_EXHAUSTED and e.value.field == "--memory-mb"
    assert "needs --memory-mb" in e.value.message
    assert backend.adapter_files() == before  # nothing stepped
    backend.close()
