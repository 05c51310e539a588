"""Groups without signal (every advantage 0, no KL penalty) are left out of the update's
forward and backward on every backend: the gradient is the one of the whole batch, the skip
shows in :class:`~gridrl.trainer.backends.base.UpdateStats`, and a step with no signal runs no
forward at all yet still steps the optimizer and the schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from float_bounds import ROUNDING_REL, assert_close_to_largest
from lora_gradients import capture_gradients, random_adapter

from gridrl.trainer.backends.base import TrainSequence, create_backend
from gridrl.trainer.config import TrainConfig
from gridrl.trainer.grpo import advantages as grpo

VOCAB = 512  # the tiny llama's


@pytest.fixture(params=[pytest.param("torch", id="torch"),
                        pytest.param("mlx", id="mlx", marks=pytest.mark.mlx)])
def make_backend(request, tiny_llama_dir):
    made = []

    def make(**settings):
        base = dict(model=str(tiny_llama_dir), backend=request.param, lora_rank=4,
                    lora_alpha=8.0, lr=1e-2, steps=4, max_tokens=8, device="cpu",
                    dtype="float32", rollout=["local"], run_dir="unused", seed=0)
        backend = create_backend(TrainConfig(**{**base, **settings}).finalize())
        backend.load_adapter_files(random_adapter(backend.adapter_files(), seed=7))
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


def _sequences(advantages) -> list[TrainSequence]:
    """Six sequences in three groups of two, ragged prompts and completions, behaviour
    logprobs off the policy's (so ratios are not 1)."""
    rng = np.random.default_rng(3)
    prompts = [tuple(int(t) for t in rng.integers(7, VOCAB, p)) for p in (5, 9, 4)]
    seqs = []
    for i, c in enumerate((3, 6, 2, 5, 1, 4)):
        completion = tuple(int(t) for t in rng.integers(7, VOCAB, c))
        behaviour = tuple(float(x) for x in rng.uniform(-7.0, -5.0, c))
        seqs.append(TrainSequence(prompts[i // 2], completion, behaviour, advantages[i],
                                  i // 2))
    return seqs


def test_groups_with_signal_is_pure_and_keeps_everything_under_a_kl_penalty():
    groups, adv = [0, 0, 1, 1, 2, 2], [1.0, -1.0, 0.0, 0.0, 0.0, 0.5]
    assert grpo.groups_with_signal(groups, adv) == [0, 2]
    assert grpo.groups_with_signal(groups, adv, beta=0.05) == [0, 1, 2]
    assert grpo.groups_with_signal([4, 4], [0.0, 0.0]) == []


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_a_group_without_signal_is_skipped_with_the_same_gradient(make_backend, aggregation):
    seqs = _sequences((1.0, -1.0, 0.0, 0.0, 0.5, -0.5))  # group 1 has no signal
    skipping = make_backend(loss_aggregation=aggregation, skip_no_signal=True)
    got_grads = capture_gradients(skipping)
    got = skipping.update(seqs)

    full = make_backend(loss_aggregation=aggregation)  # --no-skip-no-signal, the default
    want_grads = capture_gradients(full)
    want = full.update(seqs)

    assert (got.skipped_groups, got.skipped_sequences) == (1, 2)
    assert (want.skipped_groups, want.skipped_sequences) == (0, 0)
    assert got.loss == pytest.approx(want.loss, rel=1e-5, abs=1e-7)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
    assert got.tokens == want.tokens == 21
    assert got.clip_fraction == pytest.approx(want.clip_fraction)
    kl = got.per_sequence_mismatch_kl
    assert math.isnan(kl[2]) and math.isnan(kl[3])  # not measured
    np.testing.assert_allclose([kl[i] for i in (0, 1, 4, 5)],
                               [want.per_sequence_mismatch_kl[i] for i in (0, 1, 4, 5)],
                               rtol=1e-4)
    assert set(got_grads) == set(want_grads) and got_grads
    for key, g in want_grads.items():
        assert np.abs(g).max() > 0, key
        assert_close_to_largest(got_grads[key], g, ROUNDING_REL, str(key))


def test_a_step_without_signal_forwards_nothing_and_still_steps(make_backend, monkeypatch):
    backend = make_backend(lr_schedule="linear", warmup_steps=0, skip_no_signal=True)
    grads = capture_gradients(backend)
    seqs = _sequences((0.0,) * 6)
    forwards = _count_forwards(backend, monkeypatch)
    first = backend.update(seqs)
    second = backend.update(seqs)
    assert (first.skipped_groups, first.skipped_sequences) == (3, 6)
    assert forwards() == 0
    assert first.grad_norm == 0.0 and first.loss == 0.0
    assert all(not np.any(g) for g in grads.values()) and grads
    assert second.lr < first.lr  # the schedule moved: the optimizer stepped
    assert all(math.isnan(v) for v in first.per_sequence_mismatch_kl)


def _count_forwards(backend, monkeypatch):
    """A counter of the update's model forwards (torch: collated micro-batches; MLX: calls of
    its completion logits)."""
    calls = []
    if backend.name == "torch":
        from gridrl.trainer.backends.torch import update

        collate = update.collate

        def counting(*args, **kwargs):
            calls.append(1)
            return collate(*args, **kwargs)

        monkeypatch.setattr(update, "collate", counting)
    else:
        logits = backend._completion_logits

        def counting_mlx(*args, **kwargs):
            calls.append(1)
            return logits(*args, **kwargs)

        monkeypatch.setattr(backend, "_completion_logits", counting_mlx)
    return lambda: len(calls)
