"""Alternatives (``SamplingConfig.top_logprobs``, contract.py "Alternatives") in the torch
backend (lean and transformers forwards) and the MLX backend: beside each sampled token, the N
most likely tokens of the distribution it was drawn from (after temperature, top-k, top-p),
the same as teacher-forced ``score_top`` gives; the decode hooks carry them; a prompt scored
with ``score_top`` is the model's own distribution."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
from engine_helpers import PROMPT

from gridrl.engine.contract import MAX_TOP_LOGPROBS, SamplingConfig, SequenceRequest

# Cached decoding against one teacher-forced forward: float32 sums in another order
# (measured ~1e-6 on the tiny llama), as the logprob invariant tests compare them.
TOL = 1e-4

BATCH = [
    SequenceRequest(PROMPT, SamplingConfig(max_tokens=5, temperature=1.0, top_logprobs=5),
                    seed=1),
    # top-k 3 under 5 alternatives: the last two are outside the support (-inf)
    SequenceRequest([10, 11, 12], SamplingConfig(max_tokens=4, temperature=0.7, top_k=3,
                                                 top_logprobs=5), seed=2),
    SequenceRequest(PROMPT, SamplingConfig(max_tokens=4, temperature=0.0, top_logprobs=2),
                    seed=3),
    SequenceRequest(PROMPT, SamplingConfig(max_tokens=3, temperature=1.0, top_p=0.9,
                                           top_logprobs=MAX_TOP_LOGPROBS), seed=4),
    SequenceRequest([20, 21], SamplingConfig(max_tokens=3, temperature=1.0), seed=5),  # none
]


class Recorder:
    """Records each on_tokens call with its alternatives."""

    def __init__(self) -> None:
        self.top: dict[int, list] = {}
        self.calls_with_top = 0

    def on_tokens(self, rows: Sequence[int], token_ids: Sequence[int],
                  logprobs: Sequence[float], top=None) -> None:
        assert top is not None and len(top) == len(rows)
        self.calls_with_top += 1
        for row, pairs in zip(rows, top, strict=True):
            self.top.setdefault(row, []).append(pairs)

    def interrupted(self) -> bool:
        return False


def test_alternatives_are_the_top_of_the_distribution_each_token_was_drawn_from(backend
                                                                                ) -> None:
    recorder = Recorder()
    results = backend.generate(BATCH, None, recorder)
    for row, (req, res) in enumerate(zip(BATCH, results, strict=True)):
        n = req.sampling.top_logprobs
        if n == 0:
            assert res.top_logprobs == []
            assert all(pairs == [] for pairs in recorder.top[row])  # aligned, empty
            continue
        assert recorder.top[row] == res.top_logprobs  # the hooks carried the same
        assert len(res.top_logprobs) == len(res.token_ids)
        scores, top = backend.score_top(req.prompt_ids, res.token_ids, req.sampling, None, n)
        np.testing.assert_allclose(res.logprobs, scores, atol=TOL, rtol=0)
        for pos, (got, want) in enumerate(zip(res.top_logprobs, top, strict=True)):
            assert len(got) == len(want) == n, (row, pos)
            values = [v for _, v in got]
            assert values == sorted(values, reverse=True)
            finite = [t for t, v in got if math.isfinite(v)]
            assert finite == [t for t, v in want if math.isfinite(v)], (row, pos)
            np.testing.assert_allclose([v for _, v in got if math.isfinite(v)],
                                       [v for _, v in want if math.isfinite(v)], atol=TOL)
            # the sampled token is in the support; a greedy token is the most likely
            assert res.logprobs[pos] <= values[0] + TOL
            if req.sampling.temperature == 0:
                assert got[0][0] == res.token_ids[pos]
            if req.sampling.top_k:  # top-k 3: exactly 3 kept
                assert len(finite) == 3
            # a distribution: the kept alternatives' mass is at most 1
            assert sum(math.exp(v) for v in values) <= 1 + 1e-5
    assert recorder.calls_with_top == max(len(r.token_ids) for r in results)
    assert backend.generate(BATCH, None) == results  # observing changes nothing


def test_a_prompt_scored_is_the_models_own_distribution(backend) -> None:
    """``score_top(prompt[:1], prompt[1:], greedy, ...)``: each prompt token's logprob under
    log_softmax of the logits (no temperature, no truncation), and its alternatives; a batch
    asking for no alternatives computes none."""
    greedy = SamplingConfig(max_tokens=1, temperature=0.0)
    scores, top = backend.score_top(PROMPT[:1], PROMPT[1:], greedy, None, 3)
    assert scores == pytest.approx(backend.score(PROMPT[:1], PROMPT[1:], greedy, None),
                                   abs=1e-6)
    assert len(top) == len(PROMPT) - 1 and all(len(pairs) == 3 for pairs in top)
    assert backend.score_top(PROMPT[:1], PROMPT[1:], greedy, None, 0) == (
        scores, [[] for _ in PROMPT[1:]])
    for token, score, pairs in zip(PROMPT[1:], scores, top, strict=True):
        mass = sum(math.exp(v) for _, v in pairs)
        assert 0 < mass <= 1 + 1e-5
        if token == pairs[0][0]:
            assert score == pytest.approx(pairs[0][1], abs=1e-6)
        else:
            assert score <= pairs[0][1] + 1e-6
    assert backend.score_top(PROMPT, [], greedy, None, 3) == ([], [])
