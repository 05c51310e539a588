"""The sampling transform and the per-sequence RNG, on hand-made logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gridrl.engine import rng
from gridrl.engine.backends.torch.sampling import RowSampling, draw_tokens, transform_logits
from gridrl.engine.contract import SamplingConfig

NEG = float("-inf")


def _lp(logits: list[float], **cfg) -> list[float]:
    config = SamplingConfig(max_tokens=1, **cfg)
    rows = RowSampling.from_configs([config], len(logits))
    return transform_logits(torch.tensor([logits]), rows)[0].tolist()


def _expected(z: list[float], keep: list[bool]) -> list[float]:
    mass = math.log(sum(math.exp(v) for v, k in zip(z, keep, strict=True) if k))
    return [v - mass if k else NEG for v, k in zip(z, keep, strict=True)]


def test_temperature_and_greedy() -> None:
    logits = [2.0, 1.0, 0.0, -1.0]
    assert _lp(logits, temperature=0.5) == pytest.approx(_expected([4, 2, 0, -2], [True] * 4))
    # greedy: log_softmax at temperature 1, top-k / top-p ignored
    assert _lp(logits, temperature=0, top_k=1, top_p=0.1) == pytest.approx(
        _expected(logits, [True] * 4))


def test_top_k_keeps_ties() -> None:
    logits = [3.0, 1.0, 1.0, 0.0, -2.0]
    got = _lp(logits, temperature=1.0, top_k=2)
    assert got == pytest.approx(_expected(logits, [True, True, True, False, False]))
    # k >= vocab disables it
    assert _lp(logits, temperature=1.0, top_k=5) == pytest.approx(_expected(logits, [True] * 5))


def test_top_p_smallest_prefix() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = [math.log(p) for p in probs]
    # 0.5 < 0.6 -> need the second token; 0.8 >= 0.6 -> stop there
    assert _lp(logits, temperature=1.0, top_p=0.6) == pytest.approx(
        _expected(logits, [True, True, False, False]))
    # 0.5 + 0.3 = 0.8 >= 0.79: two tokens
    assert _lp(logits, temperature=1.0, top_p=0.79) == pytest.approx(
        _expected(logits, [True, True, False, False]))
    # at least one token
    assert _lp(logits, temperature=1.0, top_p=0.01) == pytest.approx([0.0, NEG, NEG, NEG])
    # top-p applies to the distribution after top-k
    assert _lp(logits, temperature=1.0, top_k=3, top_p=0.9) == pytest.approx(
        _expected(logits, [True, True, True, False]))


def test_per_row_configs_equal_uniform_ones() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    configs = [SamplingConfig(1, temperature=0.7, top_k=5), SamplingConfig(1, temperature=0),
               SamplingConfig(1, temperature=1.3, top_p=0.8),
               SamplingConfig(1, temperature=0.9, top_k=10, top_p=0.5),
               SamplingConfig(1, temperature=1.0), SamplingConfig(1, temperature=0.5, top_k=50)]
    mixed = transform_logits(logits, RowSampling.from_configs(configs, 50))
    for i, c in enumerate(configs):
        alone = transform_logits(logits[i:i + 1], RowSampling.from_configs([c], 50))
        torch.testing.assert_close(mixed[i:i + 1], alone, rtol=0, atol=1e-6)


def test_draw_matches_the_distribution() -> None:
    """Inverse-CDF draws with the row's uniforms follow exp(logprobs); greedy is argmax."""
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, -5.0]])
    config = SamplingConfig(1, temperature=1.0, top_k=4)
    rows = RowSampling.from_configs([config], 5)
    logprobs = transform_logits(logits, rows)
    n = 20000
    u = torch.from_numpy(rng.step_uniforms(np.arange(n, dtype=np.uint64), 0))
    tokens, lps = draw_tokens(logits.expand(n, 5), logprobs.expand(n, 5),
                              RowSampling.from_configs([config] * n, 5), u)
    freq = torch.bincount(tokens, minlength=5).double() / n
    probs = logprobs[0].exp().double()
    assert freq[4] == 0  # outside top-k: never drawn
    assert torch.allclose(freq, probs, atol=0.015)
    assert torch.equal(lps, logprobs[0][tokens])
    greedy = RowSampling.from_configs([SamplingConfig(1, temperature=0)], 5)
    tok, lp = draw_tokens(logits, transform_logits(logits, greedy), greedy,
                          torch.tensor([0.99], dtype=torch.float64))
    assert tok.tolist() == [3] and lp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 3])


def test_draws_over_a_full_vocabulary_follow_the_softmax() -> None:
    """At SmolLM2's vocabulary size (49152 ids, float32 cumulative sums), the draws of
    independent sequence streams (``rng.sequence_seed``, steps 0-3) follow ``softmax(logits)``:
    chi-square over the 50 likeliest ids and 20 ranges of the others, 16k draws. A biased
    sampler would change what GRPO learns from without any logprob check noticing; this one
    gives chi2 59, uniforms scaled by 0.99 (the CDF's last 1% never drawn) give 176 and one
    stream shared by every row 82075."""
    torch.manual_seed(0)
    vocab, chunk = 49152, 1000
    logits = torch.randn(vocab) * 3.0  # an LM-like spread: the top id ~18%, half the mass in the tail
    rows = RowSampling.from_configs([SamplingConfig(1, temperature=1.0)] * chunk, vocab)
    logprobs = transform_logits(logits[None], RowSampling.from_configs(
        [SamplingConfig(1, temperature=1.0)], vocab)).expand(chunk, vocab)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for start in range(0, 4 * chunk, chunk):
        seeds = rng.seeds_array([rng.sequence_seed(7, i) for i in range(start, start + chunk)])
        for step in range(4):
            u = torch.from_numpy(rng.step_uniforms(seeds, step))
            tokens, _ = draw_tokens(logits.expand(chunk, vocab), logprobs, rows, u)
            counts += torch.bincount(tokens, minlength=vocab).double()
    n = float(counts.sum())
    probs = torch.softmax(logits.double(), -1)
    # bins: each of the 50 likeliest ids alone, the other ids in 20 ranges of the vocabulary
    # order (the order the CDF accumulates in, so a lost or misplaced tail shows)
    top = torch.argsort(probs, descending=True)[:50]
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[top] = False
    ranges = torch.arange(vocab) * 20 // vocab
    observed = torch.cat([counts[top], torch.zeros(20, dtype=torch.float64).index_add_(
        0, ranges[rest], counts[rest])])
    expected = n * torch.cat([probs[top], torch.zeros(20, dtype=torch.float64).index_add_(
        0, ranges[rest], probs[rest])])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 111.2, chi2  # the 99.9th percentile of chi-square with 69 degrees of freedom


def test_rng_streams() -> None:
    seeds = rng.seeds_array([1, 2, 2**64 + 1])
    u0 = rng.step_uniforms(seeds, 0)
    assert u0[0] == u0[2]  # seeds are taken mod 2**64
    assert u0[0] != u0[1] and ((u0 >= 0) & (u0 < 1)).all()
    assert rng.step_uniforms(seeds, 1)[0] != u0[0]
    # a row's uniforms do not depend on the other rows
    assert rng.step_uniforms(seeds[1:2], 5)[0] == rng.step_uniforms(seeds, 5)[1]
    many = rng.step_uniforms(np.arange(50000, dtype=np.uint64), 3)
    assert abs(many.mean() - 0.5) < 0.01 and abs(many.var() - 1 / 12) < 0.005
    assert rng.sequence_seed(7, 0) != rng.sequence_seed(7, 1) != rng.sequence_seed(8, 0)
    assert rng.sequence_seed(7, 3) == rng.sequence_seed(7, 3)
