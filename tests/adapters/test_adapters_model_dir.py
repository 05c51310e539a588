"""The model directory gridrl writes (the converted cache of an alias, a merged model) has a
``config.json`` that every consumer reads the same way: top-level ``rope_theta`` (and the other
keys older readers take from the top level) beside transformers 5's ``rope_parameters``. A cache
converted before is rewritten when it is next resolved. On the bundled model, mlx-lm then loads
the directory and an mlx-lm adapter with no override and gives peft's greedy tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from adapters_testlib import make_peft_adapter

from gridrl.adapters import convert_files, read_dir, write_dir
from gridrl.models import make_config_portable, portable_config, resolve_model


def test_portable_config_repeats_rope_parameters_at_the_top_level() -> None:
    flat = {"model_type": "llama", "dtype": "bfloat16",
            "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
    assert portable_config(flat) == {"rope_theta": 100000.0, "torch_dtype": "bfloat16"}
    assert portable_config({**flat, **portable_config(flat)}) == {}
    scaled = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                  "original_max_position_embeddings": 8192},
              "partial_rotary_factor": 0.5}
    # transformers 5 takes a top-level rope_scaling as the whole of rope_parameters: all of it
    assert portable_config(scaled) == {
        "rope_theta": 5e5, "rope_scaling": {**scaled["rope_parameters"], "type": "llama3"}}
    nested = {"text_config": flat, "rope_parameters": {
        "full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}
    assert portable_config(nested) == {"text_config": {**flat, "rope_theta": 100000.0,
                                                       "torch_dtype": "bfloat16"}}


def test_transformers_reads_the_same_model_from_both(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from gridrl.models.testing import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "m", rope_theta=100000.0)
    before = AutoConfig.from_pretrained(model_dir).to_dict()
    assert make_config_portable(model_dir)
    after = AutoConfig.from_pretrained(model_dir).to_dict()
    assert after["rope_parameters"] == before["rope_parameters"] == {
        "rope_type": "default", "rope_theta": 100000.0}
    assert after["dtype"] == before["dtype"]


def test_a_cache_converted_before_is_rewritten_when_resolved(tiny_llama_dir: Path,
                                                             tmp_path: Path) -> None:
    """A cached alias directory whose config.json lacks ``rope_theta`` (converted by an
    earlier gridrl) gets it the next time the alias resolves; nothing else changes."""
    cached = tmp_path / "models" / "smollm2-135m-instruct"
    shutil.copytree(tiny_llama_dir, cached)
    old = json.loads((cached / "config.json").read_text())
    assert "rope_theta" not in old
    weights = (cached / "model.safetensors").read_bytes()
    assert resolve_model("smollm2-135m-instruct", cache_dir=tmp_path / "models") == cached
    new = json.loads((cached / "config.json").read_text())
    assert new == {**old, "rope_theta": old["rope_parameters"]["rope_theta"],
                   "torch_dtype": old["dtype"]}
    assert (cached / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in cached.iterdir()) == sorted(p.name
                                                              for p in tiny_llama_dir.iterdir())


@pytest.mark.real_model
@pytest.mark.mlx
def test_mlx_lm_loads_the_bundled_model_and_an_adapter_as_peft_does(tmp_path: Path) -> None:
    """``mlx_lm.load(resolve_model("smollm2-135m-instruct"), adapter_path=...)``, no
    ``model_config`` override: SmolLM2's rope base (100000, not mlx-lm's default 10000), and
    the greedy tokens of base + a random LoRA that peft gives."""
    import mlx.core as mx
    import torch
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = resolve_model("smollm2-135m-instruct")
    assert json.loads((Path(base) / "config.json").read_text())["rope_theta"] == 100000.0
    peft_dir = make_peft_adapter(Path(base), tmp_path / "peft", seed=3, b_std=0.02)
    mlx_dir = write_dir(convert_files(read_dir(peft_dir), "mlx"), tmp_path / "mlx")
    tokenizer = AutoTokenizer.from_pretrained(base)
    prompt = list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Words: red cat blue sky"}], add_generation_prompt=True,
        return_dict=True)["input_ids"])

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), peft_dir).eval()
    ids = list(prompt)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    mlx_model, _ = load(str(base), adapter_path=str(mlx_dir))
    got = [int(t) for t, _ in generate_step(mx.array(prompt), mlx_model, max_tokens=6)]
    assert got == ids[len(prompt):]
    mlx_logits = np.array(mlx_model(mx.array([prompt]))[0])
    # float32 sums in another order over 30 blocks (the base model alone: 1.0e-5 of the
    # largest logit, measured on an AVX2 EPYC), far under the 1e-1 the wrong rope base gives
    assert np.abs(mlx_logits - logits).max() <= 1e-4 * np.abs(logits).max()
