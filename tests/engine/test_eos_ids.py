"""End-of-sequence ids: every backend derives the same set from one function
(gridrl.engine.tokens), so their samples stop at the same tokens and cross-backend behaviour
logprobs can agree."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from gridrl.engine.tokens import eos_token_ids, model_dir_configs


def test_union_of_tokenizer_config_and_generation_config() -> None:
    tokenizer = SimpleNamespace(eos_token_id=2)
    assert eos_token_ids(tokenizer, {"eos_token_id": [2, 7]}, SimpleNamespace(eos_token_id=9),
                         None, {"eos_token_id": True}) == {2, 7, 9}
    assert eos_token_ids(SimpleNamespace(eos_token_id=None)) == frozenset()


@pytest.fixture
def eos_model_dir(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """The tiny llama with eos ids spread over its files: the tokenizer's, config.json's and
    a generation_config.json listing two more."""
    model = tmp_path / "tiny-eos"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    return model


def test_every_backend_derives_the_same_eos_ids(eos_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from gridrl.engine.backends.torch.backend import TorchBackend

    tokenizer = AutoTokenizer.from_pretrained(str(eos_model_dir))
    from_files = eos_token_ids(tokenizer, *model_dir_configs(eos_model_dir))  # mlx, vllm
    assert {5, 7} <= from_files
    assert tokenizer.eos_token_id in from_files
    for lean in (True, False):  # torch reads the same values from the loaded configs
        assert TorchBackend.from_pretrained(eos_model_dir, lean=lean).eos_token_ids == from_files
    pytest.importorskip("mlx_lm")
    from gridrl.engine.backends.mlx.backend import MlxBackend

    assert MlxBackend.from_pretrained(eos_model_dir, device="cpu").eos_token_ids == from_files
