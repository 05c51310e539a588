"""Nodes on the bundled SmolLM2-135M-Instruct: a pushed adapter trained elsewhere (peft, or
converted from mlx-lm) serving exactly what peft gives, on a torch node and on an mlx node.
(The backends' logprob invariant on this model is in tests/engine/test_smollm2_backend.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import chat_ids, make_peft_adapter, peft_reference, reference_greedy
from rollout_helpers import LiveNode, push_dir, push_files

from gridrl.adapters import build_manifest, convert_files, read_dir

pytestmark = pytest.mark.real_model

# Two float32 implementations (different matmul and attention kernels) of the same weights:
# logits agree to ~1e-5 relative; logprobs to a few 1e-4 after a few cached decode steps.
CROSS_TOL = 1e-3


@pytest.fixture(scope="module")
def smollm2_adapter(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LoRA on q/v/o/up (r 8): "trained elsewhere", small enough to keep the model
    fluent, large enough to change its greedy output."""
    return make_peft_adapter(smollm2_dir, tmp_path_factory.mktemp("smol") / "lora", seed=3,
                             targets=["q_proj", "v_proj", "o_proj", "up_proj"], rank=8,
                             alpha=16, std=0.12)


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


@pytest.mark.mlx
@pytest.mark.slow
def test_peft_push_to_an_mlx_node(smollm2_dir, tmp_path) -> None:
    """The node converts the peft push to mlx-lm and serves what peft gives locally (within
    float32 rounding across frameworks)."""
    pytest.importorskip("mlx.core")
    from gridrl.engine.backends.mlx.backend import MlxBackend

    mlx_backend = MlxBackend.from_pretrained(smollm2_dir, device="cpu")
    prompt = chat_ids(mlx_backend.tokenizer, "Reverse the words: the cat sat on the mat")
    adapter = make_peft_adapter(smollm2_dir, tmp_path / "lora", seed=3,
                                targets=["q_proj", "v_proj", "o_proj", "up_proj"], rank=8,
                                alpha=16, std=0.12)
    ref_tokens, ref_lps = reference_greedy(peft_reference(smollm2_dir, adapter), prompt, 6)
    node = LiveNode(mlx_backend, tmp_path / "node")
    try:
        assert node.info().adapter_format == 2  # ADAPTER_FORMAT_MLX
        response = push_dir(node.stub, adapter, "smol", 1)
        assert response.converted and response.serving.version == 1
        sample = node.generate(prompt, max_tokens=6, temperature=0).samples[0]
        assert sample.adapter_version == 1
        assert list(sample.token_ids) == ref_tokens
        assert list(sample.logprobs) == pytest.approx(ref_lps, abs=CROSS_TOL)
    finally:
        node.close()
