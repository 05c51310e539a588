"""The torch backend's adapter strategies (backends/torch_adapters.py): which one a backend
runs and says so in its start-up line, and DoRA adapters (peft beside lean factors or merged
weights) served exactly as peft serves them, alternating with plain LoRA adapters."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from engine_helpers import PROMPT, make_peft_adapter, peft_reference, reference_greedy

from gridrl.engine.backends.torch.adapters import (
    LeanFactors,
    LivePeftFactors,
    MergedWeights,
    PeftAdapters,
    WithPeftFallback,
)
from gridrl.engine.contract import SamplingConfig, SequenceRequest

GREEDY = SamplingConfig(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def dora_adapter(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("dora") / "d", seed=5,
                             targets=["q_proj", "v_proj", "down_proj"], dora=True)


def _start_up_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "gridrl.engine.backends.torch.backend" and "adapters:" in r.getMessage()]


def test_each_backend_names_its_forward_and_strategy_in_one_line(
        tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gridrl.engine.backends.torch.backend import TorchBackend

    monkeypatch.setenv("GRIDRL_CPU_KERNELS", "1")  # the kernels, faster or not on this CPU
    caplog.set_level(logging.INFO, logger="gridrl.engine.backends.torch.backend")
    cases = [
        (lambda: TorchBackend.from_pretrained(tiny_llama_dir), LeanFactors,
         r"forward: lean \(llama model, fused C kernel products\); adapters: lean LoRA factors "
         r"\(the node runs the lean forward\); DoRA and other LoRA it cannot hold as peft "
         r"adapters \(on a transformers copy of the model loaded for them\); context 512 tokens$"),
        (lambda: TorchBackend.from_pretrained(tiny_llama_dir, lean=False), MergedWeights,
         r"forward: transformers \(lean forward: disabled \(--forward transformers\)\); "
         r"adapters: merged weights \(the node runs the transformers forward\); DoRA and other "
         r"LoRA it cannot hold as peft adapters \(on the node's model\); context 512 tokens$"),
    ]
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)),
                                LoraConfig(r=4, target_modules=["q_proj"]))
    cases += [
        (lambda: TorchBackend.from_model(peft_model, None), LivePeftFactors,
         r"forward: lean .*; adapters: live peft LoRA factors \(a peft model wrapped "
         r"in-process, base weights frozen, on the lean forward\); context 512 tokens$"),
        (lambda: TorchBackend.from_model(peft_model, None, lean=False), PeftAdapters,
         r"forward: transformers \(lean forward: disabled\); adapters: peft adapters \(a peft "
         r"model wrapped in-process on the transformers forward\); context 512 tokens$"),
    ]
    for build, kind, pattern in cases:
        caplog.clear()
        backend = build()
        primary = backend.adapters.primary if isinstance(backend.adapters, WithPeftFallback) \
            else backend.adapters
        assert type(primary) is kind
        lines = _start_up_lines(caplog)
        assert len(lines) == 1, lines
        assert lines[0].startswith("torch backend: ")
        assert re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_dora_goes_through_peft_and_alternates_with_plain_lora(
        lean: bool, tiny_llama_dir: Path, tiny_adapters: dict[str, Path], dora_adapter: Path
) -> None:
    """On a node, plain LoRA is held by the primary strategy (lean factors / merged weights),
    DoRA by peft beside it; switching between them never mixes one into the other."""
    from gridrl.engine.backends.torch.backend import TorchBackend

    backend = TorchBackend.from_pretrained(tiny_llama_dir, lean=lean)
    want = {name: reference_greedy(peft_reference(tiny_llama_dir, path), PROMPT, 8)
            for name, path in (("base", None), ("a", tiny_adapters["a"]), ("d", dora_adapter))}
    a = backend.load_adapter(tiny_adapters["a"], "a")
    files = {p.name: p.read_bytes() for p in dora_adapter.iterdir() if p.is_file()}
    d = backend.load_adapter_files(files, "d")  # a push's path: peft reads a temporary copy
    assert backend.adapters.strategy_of("a") != backend.adapters.strategy_of("d") == \
        "peft adapters"
    for name, handle in (("a", a), ("d", d), ("base", None), ("d", d), ("a", a), ("base", None)):
        res = backend.generate([SequenceRequest(PROMPT, GREEDY, 0)], handle)[0]
        tokens, logprobs = want[name]
        assert res.token_ids == tokens, name
        assert res.logprobs == pytest.approx(logprobs, abs=1e-4), name
        assert backend.score(PROMPT, tokens, GREEDY, handle) == pytest.approx(logprobs,
                                                                               abs=1e-4)
    assert want["d"][0] != want["base"][0]  # the DoRA adapter does change the model
    # a lean node holds no transformers weights of its own (one copy, the packed one): peft
    # got a copy of the model for its adapter, freed with it
    assert (backend.adapters.fallback.model is not backend._hf) is lean
    backend.unload_adapter(d)
    assert (backend.adapters.fallback.model is None) is lean
    with pytest.raises(ValueError, match="not loaded"):
        backend.generate([SequenceRequest(PROMPT, GREEDY, 0)], d)
    assert backend.generate([SequenceRequest(PROMPT, GREEDY, 0)], a)[0].token_ids == want["a"][0]
    backend.unload_adapter(a)
    assert backend.generate([SequenceRequest(PROMPT, GREEDY, 0)], None)[0].token_ids == \
        want["base"][0]
