"""The torch backend on the bundled SmolLM2-135M-Instruct: the logprob invariant, and a pushed
adapter trained elsewhere (peft, or converted from mlx-lm) serving exactly what peft gives."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_helpers import (
    LiveNode,
    chat_ids,
    make_peft_adapter,
    peft_reference,
    push_dir,
    push_files,
    reference_greedy,
)

from gridrl.adapters import build_manifest, convert_files, read_dir
from gridrl.engine.contract import SamplingConfig, SequenceRequest

pytestmark = pytest.mark.real_model

CONFIGS = [SamplingConfig(max_tokens=6, temperature=1.0),
           SamplingConfig(max_tokens=6, temperature=0.7, top_k=50),
           SamplingConfig(max_tokens=6, temperature=1.0, top_p=0.9),
           SamplingConfig(max_tokens=6, temperature=0.0)]


@pytest.fixture(scope="module")
def smollm2_backend(smollm2_dir: Path):
    import torch

    from gridrl.engine.backends.torch import TorchBackend

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TorchBackend.from_pretrained(smollm2_dir)
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smollm2_adapter(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LoRA on q/v/o/up (r 8): "trained elsewhere", small enough to keep the model
    fluent, large enough to change its greedy output."""
    return make_peft_adapter(smollm2_dir, tmp_path_factory.mktemp("smol") / "lora", seed=3,
                             targets=["q_proj", "v_proj", "o_proj", "up_proj"], rank=8,
                             alpha=16, std=0.12)


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


def test_pushed_adapter_serves_what_peft_gives_smollm2(smollm2_backend, smollm2_dir,
                                                        smollm2_adapter, tmp_path) -> None:
    prompt = chat_ids(smollm2_backend.tokenizer, "Reverse the words: the cat sat on the mat")
    ref_tokens, ref_lps = reference_greedy(peft_reference(smollm2_dir, smollm2_adapter), prompt, 6)
    node = LiveNode(smollm2_backend, tmp_path)
    try:
        base = node.generate(prompt, max_tokens=6, temperature=0).samples[0]
        assert list(base.token_ids) != ref_tokens  # the adapter matters
        push_dir(node.stub, smollm2_adapter, "smol", 1)
        mlx_files = convert_files(read_dir(smollm2_adapter), "mlx", num_layers=30)
        for version in (1, 2):
            if version == 2:  # the same adapter pushed in mlx-lm format
                response = push_files(node.stub, mlx_files, build_manifest(
                    mlx_files, name="smol", version=2).to_dict())
                assert response.converted
            sample = node.generate(prompt, max_tokens=6, temperature=0).samples[0]
            assert sample.adapter_version == version
            assert list(sample.token_ids) == ref_tokens
            assert list(sample.logprobs) == pytest.approx(ref_lps, abs=1e-4)
    finally:
        node.close()
