"""gridrl.engine.families: which layers are served, the sliding window, the context cap and
its refusals, read from config dicts as transformers writes them; and the backends keeping to
the cap."""

from __future__ import annotations

from pathlib import Path

import pytest

from gridrl.engine.contract import SamplingConfig, SequenceRequest
from gridrl.engine.families import context_limit, sliding_window, unsupported_layers

FULL, SLIDING = "full_attention", "sliding_attention"

#: (config, sliding window, context limit)
CASES = {
    "llama": ({"max_position_embeddings": 2048}, None, 2048),
    "no positions given": ({}, None, 2048),
    "mistral 7b v0.1": ({"sliding_window": 4096, "max_position_embeddings": 32768}, 4096, 4096),
    "window wider than the positions": ({"sliding_window": 8192,
                                         "max_position_embeddings": 4096}, 8192, 4096),
    "qwen2, window off": ({"sliding_window": 4096, "use_sliding_window": False,
                           "max_position_embeddings": 32768}, None, 32768),
    "qwen2, all layers full": ({"sliding_window": 4096, "layer_types": [FULL, FULL],
                                "max_position_embeddings": 32768}, None, 32768),
    "gemma2": ({"sliding_window": 4096, "layer_types": [SLIDING, FULL],
                "max_position_embeddings": 8192}, 4096, 4096),
    "gemma3 (text_config)": ({"text_config": {"sliding_window": 512,
                                              "layer_types": [SLIDING] * 5 + [FULL],
                                              "max_position_embeddings": 32768}}, 512, 512),
}


@pytest.mark.parametrize("name", list(CASES))
def test_window_and_limit(name: str) -> None:
    config, window, limit = CASES[name]
    assert unsupported_layers(config) is None
    assert sliding_window(config) == window
    got, note = context_limit(config)
    assert got == limit
    assert (note is not None) == (limit == window)
    if note is not None:
        assert f"capped at the sliding window, {window} tokens" in note
    assert context_limit(config, needed=limit)[0] == limit


def test_refusals() -> None:
    hybrid = {"layer_types": [FULL, "linear_attention", "chunked_attention"]}
    assert unsupported_layers(hybrid) == ("layer_types chunked_attention, linear_attention: "
                                          "only attention layers (full or sliding window) are "
                                          "served")
    with pytest.raises(ValueError, match=r"4097 tokens does not fit.*sliding window of 4096"):
        context_limit(CASES["mistral 7b v0.1"][0], needed=4097)
    with pytest.raises(ValueError, match=r"2049 tokens does not fit.*2048 positions"):
        context_limit(CASES["llama"][0], needed=2049)


def test_the_torch_backend_keeps_to_the_cap(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from engine_helpers import make_tiny_model

    from gridrl.engine.backends.torch.backend import TorchBackend

    mistral = make_tiny_model(tmp_path / "mistral", "mistral", tiny_llama_dir)  # window 48
    backend = TorchBackend.from_pretrained(mistral)
    assert backend.identity.max_context == 48 and backend.forward_kind == "lean"
    fits = SequenceRequest(list(range(5, 45)), SamplingConfig(max_tokens=8), seed=0)
    assert len(backend.generate([fits], None)[0].token_ids) == 8
    too_long = SequenceRequest(list(range(5, 46)), SamplingConfig(max_tokens=8), seed=0)
    with pytest.raises(ValueError, match=r"batch\[1\]: prompt \(41 tokens\) \+ max_tokens "
                                         r"\(8\) exceeds the model's context of 48 tokens"):
        backend.generate([fits, too_long], None)
    with pytest.raises(ValueError, match="does not fit this model: its sliding window of 48"):
        TorchBackend.from_pretrained(mistral, max_context=64)
    assert TorchBackend.from_pretrained(mistral, max_context=48).identity.max_context == 48
