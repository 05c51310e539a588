"""torch vs mlx on the bundled SmolLM2-135M-Instruct: the same greedy tokens and the same
logprobs (within float32 rounding across frameworks). (The mlx logprob invariant on this model
is in test_mlx_backend.py; a peft adapter pushed to an mlx node is in
tests/rollout/test_real_model.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import chat_ids

from gridrl.engine.contract import SamplingConfig, SequenceRequest

pytestmark = [pytest.mark.real_model, pytest.mark.mlx, pytest.mark.slow]

# Two float32 implementations (different matmul and attention kernels) of the same weights:
# logits agree to ~1e-5 relative; logprobs to a few 1e-4 after a few cached decode steps.
CROSS_TOL = 1e-3
GREEDY = SamplingConfig(max_tokens=6, temperature=0.0)
TRUNCATED = SamplingConfig(max_tokens=6, temperature=0.7, top_k=50, top_p=0.9)


@pytest.fixture(scope="module")
def backends(smollm2_dir: Path):
    pytest.importorskip("mlx.core")
    import torch

    from gridrl.engine.backends.mlx.backend import MlxBackend
    from gridrl.engine.backends.torch.backend import TorchBackend

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TorchBackend.from_pretrained(smollm2_dir), MlxBackend.from_pretrained(smollm2_dir,
                                                                                device="cpu")
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts(backends) -> list[list[int]]:
    tok = backends[0].tokenizer
    return [chat_ids(tok, "Reverse the words: the cat sat on the mat"),
            chat_ids(tok, "Name a colour.")]


def test_greedy_tokens_and_logprobs_agree(backends, prompts) -> None:
    torch_backend, mlx_backend = backends
    batch = [SequenceRequest(p, GREEDY, seed=0) for p in prompts]
    by_torch = torch_backend.generate(batch, None)
    by_mlx = mlx_backend.generate(batch, None)
    for t, m in zip(by_torch, by_mlx, strict=True):
        assert t.token_ids == m.token_ids
        assert t.finish_reason == m.finish_reason
        assert t.logprobs == pytest.approx(m.logprobs, abs=CROSS_TOL)
    # the same completions scored under a truncating transform
    for prompt, t in zip(prompts, by_torch, strict=True):
        st = torch_backend.score(prompt, t.token_ids, TRUNCATED, None)
        sm = mlx_backend.score(prompt, t.token_ids, TRUNCATED, None)
        assert st == pytest.approx(sm, abs=CROSS_TOL)
