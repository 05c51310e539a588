"""Sequences of a micro-batch packed without padding (torch update): the layout (pure), the
same loss, gradients and logprobs as the padded paths at float32 rounding (``float_bounds``),
and the memory planner counting packed tokens.

Tolerance: the packed and padded forwards compute the same products over the same context;
they differ in the order of their sums only (other row layouts for the matrix kernels, other
attention widths), so the loss and each LoRA gradient agree to ``ROUNDING_REL`` of their
largest entry (float_bounds.py's derivation for the tiny llama).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from float_bounds import ROUNDING_REL, assert_close_to_largest, assert_within
from lora_gradients import capture_gradients, random_adapter

from gridrl.trainer.backends.base import TrainSequence, create_backend
from gridrl.trainer.backends.memory import ALLOCATOR_SLACK, ActivationCost, plan_micro_batches
from gridrl.trainer.backends.packing import pack_layout
from gridrl.trainer.config import TrainConfig

VOCAB = 512


def _config(model_dir, **settings) -> TrainConfig:
    base = dict(model=str(model_dir), backend="torch", lora_rank=4, lora_alpha=8.0, lr=1e-2,
                steps=4, max_tokens=8, device="cpu", dtype="float32", rollout=["local"],
                run_dir="unused", seed=0)
    return TrainConfig(**{**base, **settings}).finalize()


# ---------------------------------------------------------------- the layout (pure)


def test_a_group_s_prompt_is_packed_once_before_its_completions_and_rows_fill_first_fit():
    keys = ["a", "a", "a", "b", "c", "c"]
    prompts = [10, 10, 10, 4, 6, 6]
    completions = [5, 1, 3, 30, 2, 0]
    layout = pack_layout(range(6), keys, prompts, completions)
    # segments: a = 10 + 9 = 19, b = 34, c = 6 + 2 = 8 -> rows [b], [a, c] of width 34
    assert layout.width == 34 and layout.tokens == 19 + 34 + 8
    assert [[s.members for s in row] for row in layout.rows] == [[(3,)], [(0, 1, 2), (4, 5)]]
    a, c = layout.rows[1]
    assert (a.start, a.prompt_len, a.completion_starts()) == (0, 10, [10, 15, 16])
    assert (c.start, c.completion_starts()) == (19, [25, 27])
    assert layout.padded_tokens == 2 * 34
    # the padded layout of the same sequences: 6 rows of 10 + 30 tokens
    assert layout.padded_tokens < 6 * (10 + 30)
    with pytest.raises(ValueError, match="empty prompt"):
        pack_layout([0], ["x"], [0], [3])


def test_the_planner_counts_packed_tokens_not_padded_ones():
    cost = ActivationCost(fixed=0.0, per_token=100.0, probe_width=64)
    # one group: a 40-token prompt, completions of 2, 2 and 30 tokens
    prompts, completions, keys = [40, 40, 40], [2, 2, 30], [(1,)] * 3
    room = 80 * 100 * (1 + ALLOCATOR_SLACK)  # 80 tokens
    packed = plan_micro_batches(range(3), prompts, completions, room, cost, prompt_keys=keys)
    assert packed.chunks == [[0, 1, 2]]  # 40 + 34 = 74 tokens in one row
    assert packed.peak_bytes == cost.bytes(1, 74)
    padded = plan_micro_batches(range(3), prompts, completions, room, cost)
    assert padded.chunks == [[0], [1], [2]]  # two rows of 42 already exceed 80


# ---------------------------------------------------------------- the torch update


def _sequences(seed: int = 3) -> list[TrainSequence]:
    """Three groups of unequal completions (one empty), multi-turn loss masks on some."""
    rng = np.random.default_rng(seed)
    prompts = [tuple(int(t) for t in rng.integers(7, VOCAB, p)) for p in (12, 30, 5)]
    seqs = []
    for i, (g, c) in enumerate([(0, 20), (0, 3), (0, 9), (1, 12), (1, 40), (2, 7), (2, 1),
                                (2, 0)]):
        completion = tuple(int(t) for t in rng.integers(7, VOCAB, c))
        mask = tuple(int(m) for m in rng.random(c) > 0.3) if c and i % 2 == 0 else None
        behaviour = tuple(float(x) for x in rng.uniform(-7.0, -5.0, c))
        seqs.append(TrainSequence(prompts[g], completion, behaviour, (-1.0) ** i * (1 + i % 3),
                                  g, loss_mask=mask))
    return seqs


def _update(model_dir, seqs, **update):
    backend = create_backend(_config(model_dir))
    assert backend.policy.packs
    backend.update_cfg = dataclasses.replace(backend.update_cfg, **update)
    backend.load_adapter_files(random_adapter(backend.adapter_files(), seed=7))
    grads = capture_gradients(backend)
    stats = backend.update(seqs)
    backend.close()
    return stats, grads


@pytest.mark.parametrize("segments", [True, False], ids=["per-segment", "dense-mask"])
@pytest.mark.parametrize("top_k", [0, 20], ids=["head-path", "full-logits"])
def test_packed_update_gives_the_padded_loss_and_gradients(tiny_llama_dir, top_k, segments):
    seqs = _sequences()
    want, want_grads = _update(tiny_llama_dir, seqs, pack=False, shared_prefix=False,
                               top_k=top_k)
    for shared_prefix in (True, False):  # packing replaces either padded path
        got, got_grads = _update(tiny_llama_dir, seqs, pack=True, shared_prefix=shared_prefix,
                                 top_k=top_k, segment_attention=segments)
        assert_within(abs(got.loss - want.loss), ROUNDING_REL * abs(want.loss), "loss")
        assert_close_to_largest(got.per_sequence_mismatch_kl, want.per_sequence_mismatch_kl,
                                ROUNDING_REL, "mismatch kl")
        assert got.tokens == want.tokens
        assert set(got_grads) == set(want_grads) and want_grads
        for key, g in want_grads.items():
            assert np.abs(g).max() > 0, key
            assert_close_to_largest(got_grads[key], g, ROUNDING_REL, str(key))


@pytest.mark.parametrize("segments", [True, False], ids=["per-segment", "dense-mask"])
def test_packed_logprobs_equal_the_padded_ones(tiny_llama_dir, segments):
    backend = create_backend(_config(tiny_llama_dir))
    seqs = _sequences(seed=4)
    backend.update_cfg = dataclasses.replace(backend.update_cfg, pack=True,
                                             segment_attention=segments)
    got = backend.logprobs(seqs)
    backend.update_cfg = dataclasses.replace(backend.update_cfg, pack=False,
                                             shared_prefix=False)
    want = backend.logprobs(seqs)
    backend.close()
    assert [len(x) for x in got] == [len(s.completion_ids) for s in seqs]
    flat_got = np.concatenate([np.asarray(x, dtype=np.float64) for x in got])
    flat_want = np.concatenate([np.asarray(x, dtype=np.float64) for x in want])
    assert_close_to_largest(flat_got, flat_want, ROUNDING_REL, "logprobs")


def test_a_packed_row_attends_within_its_sequence_and_its_group_s_prompt():
    from gridrl.trainer.backends.torch.packed import pack

    seqs = [TrainSequence((5, 6), (7, 8, 9), (0.0,) * 3, 1.0, 0),
            TrainSequence((5, 6), (10,), (0.0,), 1.0, 0),
            TrainSequence((4,), (11, 12), (0.0,) * 2, 1.0, 1)]
    packed = pack(seqs, 0, 3, torch.device("cpu"))
    # segments: (5 6 | 7 8 9 | 10) = 6 tokens, (4 | 11 12) = 3 tokens -> rows of 6
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10], [4, 11, 12, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 2], [0, 1, 2, 0, 0, 0]]
    allowed = packed.allowed[:, 0].int().tolist()
    assert allowed[0][5] == [1, 1, 0, 0, 0, 1]  # token 10 sees the prompt and itself
    assert allowed[0][4] == [1, 1, 1, 1, 1, 0]
    assert allowed[1][2] == [1, 1, 1, 0, 0, 0]
    assert allowed[1][4] == [0, 0, 0, 0, 1, 0]  # padding: itself only
    # completion token t of sequence i is predicted at the flat position before it
    assert packed.predicts.tolist() == [[1, 2, 3], [1, 0, 0], [6, 7, 0]]


def test_the_segment_units_see_exactly_what_the_dense_mask_allows():
    from gridrl.trainer.backends.torch.packed import pack

    rng = np.random.default_rng(0)
    extra = TrainSequence((3,), tuple(int(t) for t in rng.integers(7, 99, 4)), (0.0,) * 4, 1.0, 3)
    seqs = [*_sequences(seed=5), extra]
    packed = pack(seqs, 0, max(len(s.completion_ids) for s in seqs), torch.device("cpu"))
    seg = packed.segments
    rows, width = packed.input_ids.shape
    dense = packed.allowed[:, 0].reshape(rows, width, width)
    # every real token is the query of exactly one unit's real slot
    real = {r * width + q for r in range(rows) for q in range(width)
            if packed.layout.rows[r] and any(s.start <= q < s.start + s.length
                                             for s in packed.layout.rows[r])}
    assert sorted(seg.tokens.tolist()) == sorted(real)
    q_of_slot = seg.q_index.reshape(-1)
    for slot, token in zip(seg.slots.tolist(), seg.tokens.tolist(), strict=True):
        assert q_of_slot[slot] == token
        u, q = divmod(slot, seg.q_index.shape[1])
        seen = set(seg.k_index[u][seg.allowed[u, 0, q]].tolist())
        r, col = divmod(token, width)
        want = {r * width + k for k in dense[r, col].nonzero().squeeze(-1).tolist()}
        assert seen == want, token
        assert len(seen) == int(seg.allowed[u, 0, q].sum())  # no key slot twice


def _episodes(seed: int = 6) -> list[TrainSequence]:
    """Two groups of four two-turn episodes shaped like reverse-words-retry's: a model turn,
    the environment's feedback (no loss), a second model turn; some stop after one turn."""
    rng = np.random.default_rng(seed)
    prompts = [tuple(int(t) for t in rng.integers(7, VOCAB, p)) for p in (21, 14)]
    seqs = []
    for i in range(8):
        first, env, second = (int(x) for x in rng.integers(3, 12, 3))
        if i % 4 == 3:
            env = second = 0
        mask = (1,) * first + (0,) * (env + 6) + (1,) * second if env else None
        c = first + (env + 6 + second if env else 0)
        seqs.append(TrainSequence(prompts[i // 4], tuple(int(t) for t in
                                                         rng.integers(7, VOCAB, c)),
                                  tuple(float(x) for x in rng.uniform(-7.0, -5.0, c)),
                                  float(rng.standard_normal()), i // 4, loss_mask=mask))
    return seqs


def test_multi_turn_episodes_packed_per_segment_give_the_default_update(tiny_llama_dir):
    seqs = _episodes()
    assert any(s.loss_mask for s in seqs) and any(s.loss_mask is None for s in seqs)
    want, want_grads = _update(tiny_llama_dir, seqs, pack=False)  # shared-prefix, padded
    got, got_grads = _update(tiny_llama_dir, seqs, pack=True, segment_attention=True)
    assert_within(abs(got.loss - want.loss), ROUNDING_REL * abs(want.loss), "loss")
    assert_close_to_largest(got.per_sequence_mismatch_kl, want.per_sequence_mismatch_kl,
                            ROUNDING_REL, "mismatch kl")
    assert got.tokens == want.tokens == sum(s.trained_tokens for s in seqs)
    assert set(got_grads) == set(want_grads) and want_grads
    for key, g in want_grads.items():
        assert np.abs(g).max() > 0, key
        assert_close_to_largest(got_grads[key], g, ROUNDING_REL, str(key))


def test_attention_per_segment_refuses_activation_checkpointing(tiny_llama_dir):
    from gridrl.trainer.backends.torch.packed import pack

    backend = create_backend(_config(tiny_llama_dir))
    policy = backend.policy
    packed = pack(_episodes(), policy.pad_id, 40, policy.device, dense_mask=False)
    assert packed.allowed is None
    try:
        with policy.activation_checkpointing(), pytest.raises(ValueError, match="checkpointing"):
            policy.packed_hidden(packed.input_ids, packed.position_ids, None, packed.segments)
        config = policy.model.get_base_model().config
        assert config._attn_implementation == "sdpa"  # restored (never switched here)
        hidden = policy.packed_hidden(packed.input_ids, packed.position_ids, None,
                                      packed.segments)
        assert hidden.shape[:2] == packed.input_ids.shape and torch.isfinite(hidden).all()
        assert config._attn_implementation == "sdpa"  # restored after the forward
    finally:
        backend.close()
