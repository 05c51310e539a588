"""The weights' fingerprint (gridrl.models.weights_fingerprint, issue 13): two fine-tunes of one
architecture differ, a copy in another float dtype or sharding of the same weights does not, and
the torch and MLX backends report what the directory's fingerprint is."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gridrl.models import model_identity, weights_fingerprint
from gridrl.models.testing import make_tiny_llama


@pytest.fixture(scope="module")
def other_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-seed1"), seed=1)


def test_two_fine_tunes_of_one_architecture_differ(tiny_llama_dir: Path,
                                                   other_seed: Path) -> None:
    mine, theirs = model_identity(tiny_llama_dir), model_identity(other_seed)
    same_shape = ("architecture", "hidden_size", "num_layers", "vocab_size", "max_context")
    assert [getattr(mine, k) for k in same_shape] == [getattr(theirs, k) for k in same_shape]
    assert mine.weights_fingerprint.startswith("wfp1:") and len(mine.weights_fingerprint) == 37
    assert theirs.weights_fingerprint.startswith("wfp1:")
    assert mine.weights_fingerprint != theirs.weights_fingerprint
    assert weights_fingerprint(tiny_llama_dir) == mine.weights_fingerprint  # stable


def test_one_changed_tensor_changes_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    with torch.no_grad():  # a fine-tune of one projection of one block
        model.model.layers[1].self_attn.v_proj.weight.add_(1e-2)
    model.save_pretrained(tmp_path / "tuned")
    assert weights_fingerprint(tmp_path / "tuned") != weights_fingerprint(tiny_llama_dir)


def test_dtype_and_sharding_copies_agree(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert weights_fingerprint(tmp_path / "sharded") == weights_fingerprint(tiny_llama_dir)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    bf16 = weights_fingerprint(tmp_path / "bf16")
    assert bf16 == weights_fingerprint(tiny_llama_dir)


def test_no_weights_or_a_broken_header(tiny_llama_dir: Path, tmp_path: Path) -> None:
    assert weights_fingerprint(tmp_path) == ""  # unknown: not compared
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors "
                                         r"header"):
        weights_fingerprint(tmp_path)


def test_backends_report_it(tiny_llama_dir: Path) -> None:
    from gridrl.engine.backends.torch.backend import TorchBackend

    expected = weights_fingerprint(tiny_llama_dir)
    assert TorchBackend.from_pretrained(tiny_llama_dir).identity.weights_fingerprint == expected


@pytest.mark.mlx
def test_mlx_backend_reports_it(tiny_llama_dir: Path) -> None:
    pytest.importorskip("mlx.core")
    from gridrl.engine.backends.mlx.backend import MlxBackend

    backend = MlxBackend.from_pretrained(tiny_llama_dir, device="cpu")
    assert backend.identity.weights_fingerprint == weights_fingerprint(tiny_llama_dir)
