"""The torch backend on the bundled SmolLM2-135M-Instruct: the logprob invariant."""

from __future__ import annotations

import pytest
from engine_helpers import chat_ids

from gridrl.engine.contract import SamplingConfig, SequenceRequest

pytestmark = pytest.mark.real_model

CONFIGS = [SamplingConfig(max_tokens=6, temperature=1.0),
           SamplingConfig(max_tokens=6, temperature=0.7, top_k=50),
           SamplingConfig(max_tokens=6, temperature=1.0, top_p=0.9),
           SamplingConfig(max_tokens=6, temperature=0.0)]


def test_logprob_invariant_smollm2(smollm2_backend) -> None:
    tok = smollm2_backend.tokenizer
    prompts = [chat_ids(tok, "Reverse the words: the cat sat on the mat"),
               chat_ids(tok, "Name a colour.")]
    for config in CONFIGS:
        batch = [SequenceRequest(prompts[i % 2], config, seed=i) for i in range(3)]
        for req, res in zip(batch, smollm2_backend.generate(batch, None), strict=True):
            scored = smollm2_backend.score(req.prompt_ids, res.token_ids, config, None)
            diff = max(abs(a - b) for a, b in zip(scored, res.logprobs, strict=True))
            assert diff < 1e-4, (config, diff)
