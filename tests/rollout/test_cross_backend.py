"""torch vs mlx on the bundled SmolLM2-135M-Instruct: the same greedy tokens and the same
logprobs (within float32 rounding across frameworks), and a peft adapter pushed to an mlx node
serving what peft gives locally. (The mlx logprob invariant on this model is in
test_mlx_backend.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_helpers import (
    LiveNode,
    chat_ids,
    make_peft_adapter,
    peft_reference,
    push_dir,
    reference_greedy,
)

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

    from gridrl.engine.backends.mlx import MlxBackend
    from gridrl.engine.backends.torch import TorchBackend

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


def test_peft_push_to_an_mlx_node(backends, prompts, smollm2_dir, tmp_path) -> None:
    """The node converts the peft push to mlx-lm and serves what peft gives locally."""
    _, mlx_backend = backends
    adapter = make_peft_adapter(smollm2_dir, tmp_path / "lora", seed=3,
                                targets=["q_proj", "v_proj", "o_proj", "up_proj"], rank=8,
                                alpha=16, std=0.12)
    ref_tokens, ref_lps = reference_greedy(peft_reference(smollm2_dir, adapter), prompts[0], 6)
    node = LiveNode(mlx_backend, tmp_path / "node")
    try:
        assert node.info().adapter_format == 2  # ADAPTER_FORMAT_MLX
        response = push_dir(node.stub, adapter, "smol", 1)
        assert response.converted and response.serving.version == 1
        sample = node.generate(prompts[0], max_tokens=6, temperature=0).samples[0]
        assert sample.adapter_version == 1
        assert list(sample.token_ids) == ref_tokens
        assert list(sample.logprobs) == pytest.approx(ref_lps, abs=CROSS_TOL)
    finally:
        node.close()
