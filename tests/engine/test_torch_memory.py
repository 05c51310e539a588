"""One resident copy of each weight in a node (backends/torch_llama.py ``take_weights``,
backends/torch_memory.py): a node on the lean forward keeps only the packed projections (the
model's own are released to ``meta``), with tied and untied heads, and decodes exactly as
before; models wrapped in-process and the transformers forward keep theirs; pages of a mapped
file are handed back without changing what the tensor reads, and a mapped output head chunk by
chunk as it is packed."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_helpers import PROMPT, reference_greedy

from gridrl.engine.backends.torch.memory import drop_mapped_pages
from gridrl.engine.contract import SamplingConfig, SequenceRequest

GREEDY = SamplingConfig(max_tokens=8, temperature=0.0)
SAMPLED = SamplingConfig(max_tokens=8, temperature=0.7, top_k=20)


@pytest.fixture(scope="module", params=["untied", "tied"])
def model_dir(request: pytest.FixtureRequest, tiny_llama_dir: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama, and the same with its output head tied to the embeddings."""
    if request.param == "untied":
        return tiny_llama_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    out = tmp_path_factory.mktemp("tied")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(tiny_llama_dir)).save_pretrained(out)
    return out


def _projections(model) -> list[torch.nn.Linear]:
    return [m for layer in model.model.layers for m in layer.modules()
            if isinstance(m, torch.nn.Linear)]


def test_a_lean_node_holds_the_packed_weights_only(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from gridrl.engine.backends.torch.backend import TorchBackend

    reference = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tied = reference.lm_head.weight is reference.model.embed_tokens.weight
    backend = TorchBackend.from_pretrained(model_dir)
    model = backend._hf
    assert backend.forward_kind == "lean"
    assert all(m.weight.device.type == "meta" for m in _projections(model))
    assert (model.lm_head.weight.device.type == "meta") is not tied
    kept = {n: p for n, p in model.named_parameters() if p.device.type != "meta"}
    assert set(kept) == {n for n, _ in model.named_parameters()
                         if "norm" in n or "embed_tokens" in n}
    torch.testing.assert_close(kept["model.embed_tokens.weight"],
                               reference.model.embed_tokens.weight, rtol=0, atol=0)
    # what it decodes is what the model gives
    tokens, logprobs = reference_greedy(reference, PROMPT, 8)
    got = backend.generate([SequenceRequest(PROMPT, GREEDY, 0)], None)[0]
    assert got.token_ids == tokens
    assert got.logprobs == pytest.approx(logprobs, abs=1e-4)
    sampled = backend.generate([SequenceRequest(PROMPT, SAMPLED, 3)], None)[0]
    assert backend.score(PROMPT, sampled.token_ids, SAMPLED, None) == pytest.approx(
        sampled.logprobs, abs=1e-4)


def test_other_forwards_and_wrapped_models_keep_their_weights(tiny_llama_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gridrl.engine.backends.torch.backend import TorchBackend

    node = TorchBackend.from_pretrained(tiny_llama_dir, lean=False)
    assert all(p.device.type == "cpu" for p in node._hf.parameters())
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)),
                                LoraConfig(r=4, target_modules=["q_proj"]))
    wrapped = TorchBackend.from_model(peft_model, None)
    assert wrapped.forward_kind == "lean"
    assert all(p.device.type == "cpu" for p in peft_model.parameters())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise through glibc")
def test_dropping_mapped_pages_keeps_the_data(tmp_path: Path) -> None:
    data = np.arange(3 * 2**20, dtype=np.float32)  # 12 MiB: whole pages inside
    data.tofile(tmp_path / "w.bin")
    mapped = torch.from_numpy(np.memmap(tmp_path / "w.bin", dtype=np.float32, mode="c"))
    assert torch.equal(mapped, torch.from_numpy(data))  # every page read in
    dropped = drop_mapped_pages([mapped])
    assert 0 < dropped <= mapped.numel() * 4
    assert torch.equal(mapped, torch.from_numpy(data))  # read again from the file
    ordinary = torch.from_numpy(data.copy())
    assert drop_mapped_pages([ordinary]) == 0
    assert torch.equal(ordinary, torch.from_numpy(data))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise through glibc")
@pytest.mark.parametrize("swiglu", [False, True])
def test_packing_a_mapped_weight_hands_its_pages_back_chunk_by_chunk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swiglu: bool) -> None:
    """An output head packed with ``drop_source`` (a node's own model): the same packed
    values, and every source row's pages handed back, in more than one chunk (the source
    and the packed copy are never both resident in full)."""
    from gridrl.engine.backends.torch import cpu_kernels
    from gridrl.engine.backends.torch.cpu_kernels import kernels

    rows, cols = 2 * 8200, 576  # ~38 MB: several 8 MB chunks, a width not a multiple of 16
    data = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    data.tofile(tmp_path / "head.bin")
    mapped = torch.from_numpy(np.memmap(tmp_path / "head.bin", dtype=np.float32, mode="c",
                                        shape=(rows, cols)))
    scale = torch.rand(cols) + 0.5
    chunks: list[tuple[int, int]] = []
    base = mapped.data_ptr()

    def record(tensors):
        tensors = list(tensors)
        chunks.extend(((t.data_ptr() - base) // (4 * cols), t.shape[0]) for t in tensors)
        return drop_mapped_pages(tensors)

    monkeypatch.setattr(kernels, "drop_mapped_pages", record)  # what pack_weight calls
    packed = cpu_kernels.pack_weight(mapped, swiglu=swiglu, in_scale=scale, drop_source=True)
    want = cpu_kernels.pack_weight(torch.from_numpy(data), swiglu=swiglu, in_scale=scale)
    assert torch.equal(packed, want)
    assert torch.equal(mapped, torch.from_numpy(data))  # the source still reads the same
    covered = sorted(r for start, n in chunks for r in range(start, start + n))
    assert covered == list(range(rows))
    assert len(chunks) > (2 if swiglu else 1) * 2
    chunks.clear()
    cpu_kernels.pack_weight(mapped, swiglu=swiglu, in_scale=scale)  # default: not dropped
    assert chunks == []
