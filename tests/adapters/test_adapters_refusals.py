"""Everything one format cannot express in the other is refused with a clear message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from adapters_testlib import make_peft_adapter
from safetensors.numpy import save as np_save

from gridrl.adapters import AdapterError, convert_files, read_adapter, read_dir
from gridrl.adapters import tensors as st


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("refusals")


def _peft(tiny_llama_dir: Path, root: Path, name: str, **kw) -> dict[str, bytes]:
    return read_dir(make_peft_adapter(tiny_llama_dir, root / name, **kw))


def _without(files: dict[str, bytes], name_part: str) -> dict[str, bytes]:
    parsed = st.load(files["adapter_model.safetensors"])
    kept = {k: t for k, t in parsed.tensors.items() if name_part not in k}
    assert len(kept) < len(parsed.tensors)
    return {**files, "adapter_model.safetensors": st.dump(kept, parsed.metadata)}


def test_dora_magnitudes_on_only_some_modules(tiny_llama_dir: Path, root: Path) -> None:
    files = _peft(tiny_llama_dir, root, "dora", use_dora=True)
    partial = _without(files, "layers.1.self_attn.v_proj.lora_magnitude_vector")
    with pytest.raises(AdapterError, match=r"cannot convert to mlx: DoRA magnitudes on 3 modules "
                       r"\(e\.g\. model\.layers\.0\.self_attn\.q_proj\) but not on 1 "
                       r"\(e\.g\. model\.layers\.1\.self_attn\.v_proj\); the mlx config "
                       r"applies DoRA to every module or none"):
        convert_files(partial, "mlx")


def test_dora_magnitude_without_dora_in_mlx() -> None:
    cfg = {"fine_tune_type": "lora", "num_layers": 1,
           "lora_parameters": {"rank": 2, "scale": 1.0, "dropout": 0.0}}
    weights = {"model.layers.0.mlp.up_proj.lora_a": st_np((8, 2)),
               "model.layers.0.mlp.up_proj.lora_b": st_np((2, 16)),
               "model.layers.0.mlp.up_proj.m": st_np((16,))}
    files = {"adapter_config.json": json.dumps(cfg).encode(),
             "adapters.safetensors": np_save(weights)}
    with pytest.raises(AdapterError, match=r"model\.layers\.0\.mlp\.up_proj\.m is a DoRA "
                       r"magnitude but fine_tune_type is 'lora'"):
        convert_files(files, "peft")


def st_np(shape):
    import numpy as np

    return np.ones(shape, np.float32)


def test_dora_on_an_embedding(tiny_llama_dir: Path, root: Path) -> None:
    files = _peft(tiny_llama_dir, root, "dora_emb", use_dora=True,
                  target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(AdapterError, match=r"cannot convert this peft adapter to mlx: .*"
                       r"embedding LoRA on model\.embed_tokens is not supported: mlx-lm's "
                       r"LoRAEmbedding also adapts the output projection when embeddings are "
                       r"tied"):
        convert_files(files, "mlx")


def test_non_uniform_rank_pattern(tiny_llama_dir: Path, root: Path) -> None:
    files = _peft(tiny_llama_dir, root, "rank_pattern", rank_pattern={"v_proj": 2})
    with pytest.raises(AdapterError, match=r"cannot convert to mlx: non-uniform ranks \(4: "
                       r"model\.layers\.0\.self_attn\.q_proj and 1 more, 2: model\.layers\.0\."
                       r"self_attn\.v_proj and 1 more; peft rank_pattern=\{'v_proj': 2\}\); "
                       r"the mlx config has one rank for all modules"):
        convert_files(files, "mlx")
    # A pattern that changes nothing is not a reason to refuse.
    same = _peft(tiny_llama_dir, root, "rank_pattern_same", rank_pattern={"v_proj": 4})
    assert json.loads(convert_files(same, "mlx")["adapter_config.json"])["lora_parameters"][
        "rank"] == 4


def test_non_uniform_alpha_pattern(tiny_llama_dir: Path, root: Path) -> None:
    files = _peft(tiny_llama_dir, root, "alpha_pattern", alpha_pattern={"q_proj": 32})
    with pytest.raises(AdapterError, match=r"cannot convert to mlx: non-uniform scales \(8\.0: "
                       r"model\.layers\.0\.self_attn\.q_proj and 1 more, 2\.0: .*peft "
                       r"alpha_pattern=\{'q_proj': 32\}\); the mlx config has one scale"):
        convert_files(files, "mlx")


def test_modules_to_save(tiny_llama_dir: Path, root: Path) -> None:
    files = _peft(tiny_llama_dir, root, "mts", modules_to_save=["lm_head"])
    with pytest.raises(AdapterError, match=r"modules_to_save \['lm_head'\] \(full trained copies "
                       r"of modules\) cannot be expressed in an mlx-lm LoRA adapter"):
        convert_files(files, "mlx")


def test_trained_biases(tiny_llama_dir: Path, root: Path) -> None:
    files = _peft(tiny_llama_dir, root, "lora_bias", lora_bias=True)
    with pytest.raises(AdapterError, match="lora_bias=true trains a bias on lora_B; mlx-lm LoRA "
                       "has no bias"):
        convert_files(files, "mlx")
    # bias="lora_only" on a model whose q/k/v/o have biases saves them: refused by name.
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(tiny_llama_dir)
    cfg.attention_bias, cfg.num_hidden_layers = True, 1
    biased = root / "biased-llama"
    LlamaForCausalLM(cfg).save_pretrained(biased)
    files = _peft(biased, root, "bias_lora_only", bias="lora_only")
    with pytest.raises(AdapterError, match=r"trained biases base_model\.model\.model\.layers\.0"
                       r"\.self_attn\.q_proj\.base_layer\.bias and 1 more \(bias='lora_only'\) "
                       r"cannot be expressed in an mlx-lm LoRA adapter"):
        convert_files(files, "mlx")


def test_embedding_lora(tiny_llama_dir: Path, root: Path) -> None:
    files = _peft(tiny_llama_dir, root, "emb", target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(AdapterError, match=r"embedding LoRA on model\.embed_tokens is not "
                       r"supported"):
        convert_files(files, "mlx")


def test_the_output_head_with_only_some_blocks_has_no_peft_config(tiny_llama_dir: Path,
                                                                  root: Path) -> None:
    """LoRA on lm_head converts (test_adapters_parity's output_head case): mlx-lm names it
    by the key "lm_head" whichever blocks are adapted, but peft's layers_to_transform would
    leave lm_head (no block index) out, so an mlx adapter of the last block and the head has
    no peft config."""
    files = _peft(tiny_llama_dir, root, "lm_head", target_modules=["q_proj", "lm_head"],
                  layers_to_transform=[1])
    assert set(read_adapter(files).modules) == {"model.layers.1.self_attn.q_proj", "lm_head"}
    mlx = convert_files(files, "mlx", num_layers=2)
    assert json.loads(mlx["adapter_config.json"])["lora_parameters"]["keys"] == [
        "self_attn.q_proj", "lm_head"]
    assert {"lm_head.lora_a", "lm_head.lora_b"} <= set(st.load(
        mlx["adapters.safetensors"]).tensors)
    pair = {"model.layers.1.self_attn.q_proj.lora_a": st_np((8, 2)),
            "model.layers.1.self_attn.q_proj.lora_b": st_np((2, 8)),
            "lm_head.lora_a": st_np((8, 2)), "lm_head.lora_b": st_np((2, 16))}
    with pytest.raises(AdapterError, match=r"cannot convert to peft: the adapter adapts blocks "
                       r"\[1\] and lm_head; peft's layers_to_transform would leave lm_head"):
        convert_files(_mlx({}, pair), "peft")


def test_blocks_that_are_not_the_last_n(tiny_llama_dir: Path, root: Path) -> None:
    files = _peft(tiny_llama_dir, root, "first_block", layers_to_transform=[0])
    with pytest.raises(AdapterError, match=r"cannot convert to mlx: the adapter adapts blocks "
                       r"\[0\] of 2, which are not the last 1; mlx-lm's num_layers adapts only "
                       r"the last N blocks"):
        convert_files(files, "mlx", num_layers=2)


def test_blocks_adapting_different_modules(tiny_llama_dir: Path, root: Path) -> None:
    files = _peft(tiny_llama_dir, root, "uneven", target_modules=(
        r"model\.layers\.0\.self_attn\.q_proj|model\.layers\.1\.self_attn\.(q|v)_proj"))
    with pytest.raises(AdapterError, match=r"cannot convert to mlx: the config applies the same "
                       r"modules \['self_attn\.q_proj', 'self_attn\.v_proj'\] to every adapted "
                       r"block, but block 0 adapts \['self_attn\.q_proj'\]"):
        convert_files(files, "mlx", num_layers=2)


def _mlx(cfg_extra: dict, weights: dict) -> dict[str, bytes]:
    cfg = {"fine_tune_type": "lora", "num_layers": 2,
           "lora_parameters": {"rank": 2, "scale": 1.0, "dropout": 0.0}, **cfg_extra}
    return {"adapter_config.json": json.dumps(cfg).encode(),
            "adapters.safetensors": np_save(weights)}


def test_mlx_side_refusals() -> None:
    pair = {"model.layers.1.self_attn.q_proj.lora_a": st_np((8, 2)),
            "model.layers.1.self_attn.q_proj.lora_b": st_np((2, 8))}
    with pytest.raises(AdapterError, match="fine_tune_type 'full' is not a LoRA adapter"):
        convert_files(_mlx({"fine_tune_type": "full"}, pair), "peft")
    moe = {"model.layers.1.mlp.switch_mlp.up_proj.lora_a": st_np((4, 2, 8)),
           "model.layers.1.mlp.switch_mlp.up_proj.lora_b": st_np((4, 8, 2))}
    with pytest.raises(AdapterError, match=r"LoRA on model\.layers\.1\.mlp\.switch_mlp\.up_proj "
                       r"has 3-D lora_a \(a mixture-of-experts SwitchLinear\); peft has no "
                       r"equivalent layer"):
        convert_files(_mlx({}, {**pair, **moe}), "peft")
    embed = {"model.embed_tokens.lora_a": st_np((8, 2)), "model.embed_tokens.lora_b":
             st_np((2, 16))}
    with pytest.raises(AdapterError, match=r"embedding LoRA on model\.embed_tokens is not "
                       r"supported"):
        convert_files(_mlx({}, {**pair, **embed}), "peft")
    with pytest.raises(AdapterError, match=r"tensor model\.layers\.1\.self_attn\.q_proj\.bias is "
                       r"not a LoRA tensor \(lora_a, lora_b, m\)"):
        convert_files(_mlx({}, {**pair, "model.layers.1.self_attn.q_proj.bias": st_np((8,))}),
                      "peft")
    with pytest.raises(AdapterError, match=r"lora_parameters\.scale is missing \(mlx-lm uses "
                       r"'scale', not 'alpha'\)"):
        convert_files(_mlx({"lora_parameters": {"rank": 2, "alpha": 16}}, pair), "peft")
    with pytest.raises(AdapterError, match=r"model\.layers\.1\.self_attn\.q_proj is not "
                       r"addressed by lora_parameters\.keys \['mlp\.up_proj'\]"):
        convert_files(_mlx({"lora_parameters": {"rank": 2, "scale": 1.0,
                                                "keys": ["mlp.up_proj"]}}, pair), "peft")
    assert json.loads(convert_files(_mlx({}, pair), "peft")["adapter_config.json"])["r"] == 2
