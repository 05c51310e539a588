"""``gridrl-adapters merge``: the adapter folded into the base gives a plain Hugging Face model
that computes what base + adapter computes, from either adapter layout; dtypes and shards are
kept; adapters that are not a pure LoRA product are refused, naming the field, and nothing is
written."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from adapters_testlib import ALL_LINEAR, make_mlx_adapter, make_peft_adapter
from click.testing import CliRunner

from gridrl.adapters import AdapterError, convert_files, merge_dir, read_dir, write_dir
from gridrl.adapters.cli import main
from gridrl.models import portable_config

# Logits of the merged model against peft's unmerged base + adapter: the same sums in another
# order, so they agree to float32 rounding (measured ~1e-6 of the largest logit; 2**-23 = 1.2e-7
# per operation, accumulated over two blocks). The adapter itself moves them by ~1.
LOGIT_RTOL = 1e-5
MIN_EFFECT = 0.1


def _logits(model_dir: Path, adapter_dir: Path | None = None, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = torch.tensor([[1, 5, 9, 20, 33, 100, 7, 8, 300, 42, 6, 2]])
    with torch.no_grad():
        return model(ids).logits[0].float().numpy()


def _check_same_model(merged: Path, base: Path, peft_dir: Path) -> float:
    """Assert the merged model's logits are base + adapter's to fp32 rounding; return the error
    relative to the largest logit."""
    got, want, plain = _logits(merged), _logits(base, peft_dir), _logits(base)
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    assert np.abs(want - plain).max() > MIN_EFFECT, "the adapter must change the model"
    assert err <= LOGIT_RTOL * scale, f"max |merged - peft| = {err:.3g} (logits up to {scale:.3g})"
    return err / scale


@pytest.fixture(scope="module")
def lora_dir(tiny_llama_dir: Path, tmp_path_factory) -> Path:
    """A random peft LoRA on every linear layer, non-zero B, rsLoRA scaling."""
    return make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("merge") / "peft", seed=7,
                             r=8, lora_alpha=16, use_rslora=True, target_modules=ALL_LINEAR)


def test_merged_model_computes_base_plus_adapter(tiny_llama_dir: Path, lora_dir: Path,
                                                 tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    result = merge_dir(tiny_llama_dir, lora_dir, tmp_path / "merged")
    assert len(result.modules) == 2 * len(ALL_LINEAR)
    assert result.adapter_format == "peft" and result.dtypes == ["float32"]
    assert result.compute_dtype == "float32" and result.skipped == []
    # a full model directory: every base file, the weights replaced, no adapter left
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == sorted(
        p.name for p in tiny_llama_dir.iterdir())
    for name in ("tokenizer.json", "generation_config.json"):
        assert (tmp_path / "merged" / name).read_bytes() == (tiny_llama_dir / name).read_bytes()
    # the base's config, with the top-level keys mlx-lm and llama.cpp read (rope_theta...)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    base_config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert config == {**base_config, **portable_config(base_config)}
    assert config["rope_theta"] == base_config["rope_parameters"]["rope_theta"]
    _check_same_model(tmp_path / "merged", tiny_llama_dir, lora_dir)

    # the weights are peft's own merge_and_unload to float32 rounding, the rest bit for bit
    ours = load_file(tmp_path / "merged" / "model.safetensors")
    base = load_file(tiny_llama_dir / "model.safetensors")
    peft_merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32),
        lora_dir).merge_and_unload().state_dict()
    assert ours.keys() == base.keys()
    eps = torch.finfo(torch.float32).eps
    for name, w in ours.items():
        assert w.dtype == base[name].dtype and w.shape == base[name].shape
        if name.removesuffix(".weight") in result.modules:
            assert not torch.equal(w, base[name])
            assert (w - peft_merged[name]).abs().max() <= 4 * eps * w.abs().max(), name
        else:
            assert torch.equal(w, base[name]), name


def test_mlx_layout_merges_to_the_same_bytes(tiny_llama_dir: Path, lora_dir: Path,
                                             tmp_path: Path) -> None:
    mlx_dir = write_dir(convert_files(read_dir(lora_dir), "mlx"), tmp_path / "mlx")
    from_peft = merge_dir(tiny_llama_dir, lora_dir, tmp_path / "a")
    from_mlx = merge_dir(tiny_llama_dir, mlx_dir, tmp_path / "b")
    assert from_mlx.adapter_format == "mlx" and from_mlx.modules == from_peft.modules
    assert read_dir(tmp_path / "a") == read_dir(tmp_path / "b")


@pytest.mark.mlx
def test_adapter_written_by_mlx_lm(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """An adapter as ``mlx_lm.lora`` saves it (last block, three keys, scale 3)."""
    mlx_dir = make_mlx_adapter(tiny_llama_dir, tmp_path / "mlx", num_layers=1, seed=2,
                               keys=["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"])
    result = merge_dir(tiny_llama_dir, mlx_dir, tmp_path / "merged")
    assert result.adapter_format == "mlx"
    assert result.modules == sorted(f"model.layers.1.{k}" for k in (
        "self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"))
    peft_dir = write_dir(convert_files(read_dir(mlx_dir), "peft"), tmp_path / "peft")
    _check_same_model(tmp_path / "merged", tiny_llama_dir, peft_dir)


def test_layer_subsets_and_per_module_ranks(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """rank_pattern / alpha_pattern give per-module scales; layers_to_transform leaves the
    other block untouched."""
    peft_dir = make_peft_adapter(tiny_llama_dir, tmp_path / "peft", seed=11, r=4, lora_alpha=8,
                                 target_modules=["q_proj", "o_proj", "up_proj"],
                                 layers_to_transform=[1], rank_pattern={"o_proj": 2},
                                 alpha_pattern={"up_proj": 32})
    result = merge_dir(tiny_llama_dir, peft_dir, tmp_path / "merged")
    assert all(m.startswith("model.layers.1.") for m in result.modules)
    assert len(result.modules) == 3
    _check_same_model(tmp_path / "merged", tiny_llama_dir, peft_dir)


def test_bfloat16_sharded_base(tiny_llama_dir: Path, lora_dir: Path, tmp_path: Path) -> None:
    """A bf16 base saved in several shards: same shards, same index, bf16 kept, each folded
    weight the float32 fold rounded once to bf16."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base-bf16"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    model.save_pretrained(base, max_shard_size="100KB")
    for p in tiny_llama_dir.iterdir():  # the tokenizer
        if not (base / p.name).exists() and p.suffix != ".safetensors":
            shutil.copy(p, base / p.name)
    (base / "pytorch_model.bin").write_bytes(b"stale weights in another format")
    shards = sorted(p.name for p in base.glob("*.safetensors"))
    assert len(shards) > 2

    result = merge_dir(base, lora_dir, tmp_path / "merged")
    assert result.weight_files == shards and result.dtypes == ["bfloat16"]
    assert result.skipped == ["pytorch_model.bin"]
    out = tmp_path / "merged"
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    index = "model.safetensors.index.json"
    assert (out / index).read_bytes() == (base / index).read_bytes()
    assert not (out / "pytorch_model.bin").exists()

    peft_sd = load_file(lora_dir / "adapter_model.safetensors")
    scale = 16 / 8 ** 0.5  # rsLoRA: alpha / sqrt(r)
    folded = 0
    for shard in shards:
        ours, theirs = load_file(out / shard), load_file(base / shard)
        for name, w in ours.items():
            assert w.dtype == torch.bfloat16
            module = name.removesuffix(".weight")
            if module not in result.modules:
                assert torch.equal(w, theirs[name])
                continue
            a = peft_sd[f"base_model.model.{module}.lora_A.weight"].float()
            b = peft_sd[f"base_model.model.{module}.lora_B.weight"].float()
            fold = theirs[name].float() + (b @ a) * scale
            # bf16 spacing at |x| is 2**(floor(log2|x|) - 7): rounding the float32 fold once to
            # nearest stays within half of it, plus the fold's own float32 rounding (which only
            # shows where W + delta nearly cancels)
            ulp = torch.exp2(torch.floor(torch.log2(fold.abs().clamp_min(1e-30))) - 7)
            f32 = 8 * torch.finfo(torch.float32).eps * fold.abs().max()
            assert ((w.float() - fold).abs() <= 0.5 * ulp + f32).all(), name
            folded += 1
    assert folded == len(result.modules)

    import numpy as np  # the merged bf16 model runs and differs from the bf16 base

    merged_logits, base_logits = _logits(out, dtype="bfloat16"), _logits(base, dtype="bfloat16")
    assert np.abs(merged_logits - base_logits).max() > MIN_EFFECT


_EDITS = {
    "init_lora_weights": ("pissa", "init_lora_weights='pissa'"),
    "fan_in_fan_out": (True, "fan_in_fan_out=true"),
    "modules_to_save": (["lm_head"], 'modules_to_save=["lm_head"]'),
    "bias": ("all", "bias='all'"),
    "alora_invocation_tokens": ([5, 6], "alora_invocation_tokens=[5, 6]"),
    "layer_replication": ([[0, 2], [1, 2]], "layer_replication="),
}


@pytest.mark.parametrize("field", list(_EDITS))
def test_refuses_config_fields_it_cannot_fold(field: str, tiny_llama_dir: Path, lora_dir: Path,
                                              tmp_path: Path) -> None:
    value, message = _EDITS[field]
    files = read_dir(lora_dir)
    cfg = json.loads(files["adapter_config.json"])
    cfg[field] = value
    files["adapter_config.json"] = json.dumps(cfg).encode()
    adapter = write_dir(files, tmp_path / "edited")
    with pytest.raises(AdapterError, match="cannot merge this peft adapter") as e:
        merge_dir(tiny_llama_dir, adapter, tmp_path / "out")
    assert message in str(e.value)
    assert not (tmp_path / "out").exists()


def test_refuses_dora_in_both_layouts(tiny_llama_dir: Path, tmp_path: Path) -> None:
    peft_dir = make_peft_adapter(tiny_llama_dir, tmp_path / "peft", use_dora=True)
    with pytest.raises(AdapterError, match=r"peft adapter: use_dora=true: DoRA rescales"):
        merge_dir(tiny_llama_dir, peft_dir, tmp_path / "out")
    mlx_dir = write_dir(convert_files(read_dir(peft_dir), "mlx"), tmp_path / "mlx")
    with pytest.raises(AdapterError, match=r"mlx adapter: fine_tune_type='dora'"):
        merge_dir(tiny_llama_dir, mlx_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("targets, named", [(["embed_tokens", "q_proj"], "model.embed_tokens"),
                                            (["lm_head"], "lm_head")])
def test_refuses_lora_outside_the_blocks(targets: list[str], named: str, tiny_llama_dir: Path,
                                         tmp_path: Path) -> None:
    peft_dir = make_peft_adapter(tiny_llama_dir, tmp_path / "peft", target_modules=targets)
    with pytest.raises(AdapterError, match=f"LoRA on {named}: only linear layers inside"):
        merge_dir(tiny_llama_dir, peft_dir, tmp_path / "out")


def test_refuses_bases_it_cannot_merge_into(tiny_llama_dir: Path, lora_dir: Path,
                                            tmp_path: Path) -> None:
    from gridrl.models.testing import make_tiny_llama

    other = make_tiny_llama(tmp_path / "other", hidden_size=32)
    with pytest.raises(AdapterError, match="adapter does not fit the base model: hidden_size: "
                                           "adapter 64, base model 32"):
        merge_dir(other, lora_dir, tmp_path / "out")

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", no_weights)
    (no_weights / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(AdapterError, match="the base model's weights must be safetensors"):
        merge_dir(no_weights, lora_dir, tmp_path / "out")

    quantized = tmp_path / "quantized"
    shutil.copytree(tiny_llama_dir, quantized)
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=r"quantization_config \(bitsandbytes\)"):
        merge_dir(quantized, lora_dir, tmp_path / "out")

    from safetensors.numpy import load_file, save_file

    missing = tmp_path / "missing"
    shutil.copytree(tiny_llama_dir, missing)
    weights = load_file(missing / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, missing / "model.safetensors")
    with pytest.raises(AdapterError, match=re.escape(
            "adapts model.layers.1.mlp.up_proj, but the base model has no tensor "
            "model.layers.1.mlp.up_proj.weight")):
        merge_dir(missing, lora_dir, tmp_path / "out")

    with pytest.raises(AdapterError, match="the output directory is the base model's"):
        merge_dir(missing, lora_dir, missing)
    with pytest.raises(AdapterError, match="the output directory is inside the base model's"):
        merge_dir(missing, lora_dir, missing / "merged")
    assert not (tmp_path / "out").exists()


def test_cli(tiny_llama_dir: Path, lora_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "merged"
    args = ["merge", "--base", str(tiny_llama_dir), "--adapter", str(lora_dir), "--out", str(out)]
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    assert (f"{lora_dir} (peft) + {tiny_llama_dir} -> {out}: folded 14 LoRA modules into 1 "
            "weight file(s), computed in float32, stored as float32") in res.output
    res = runner.invoke(main, args)
    assert res.exit_code == 1 and "exists; pass --force" in res.output
    assert runner.invoke(main, [*args, "--force"]).exit_code == 0

    dora = make_peft_adapter(tiny_llama_dir, tmp_path / "dora", use_dora=True)
    res = runner.invoke(main, ["merge", "--base", str(tiny_llama_dir), "--adapter", str(dora),
                               "--out", str(tmp_path / "x")])
    assert res.exit_code == 1
    assert "Error: cannot merge this peft adapter: use_dora=true" in res.output
    assert not (tmp_path / "x").exists()
    assert "GRIDRL_ADAPTERS_BASE" in runner.invoke(main, ["merge", "--help"]).output


def test_cli_takes_the_alias_every_other_command_takes(tiny_llama_dir: Path, lora_dir: Path,
                                                       tmp_path: Path, monkeypatch) -> None:
    """``--base smollm2-135m-instruct`` resolves as ``--model`` does (here a cache holding the
    tiny llama under the alias' name, so nothing is converted); a misspelt alias or a hub id
    is one line naming --base."""
    cached = tmp_path / "cache" / "models" / "smollm2-135m-instruct"
    shutil.copytree(tiny_llama_dir, cached)
    monkeypatch.setenv("GRIDRL_CACHE_DIR", str(tmp_path / "cache"))
    runner = CliRunner()
    out = tmp_path / "merged"
    res = runner.invoke(main, ["merge", "--base", "smollm2-135m-instruct", "--adapter",
                               str(lora_dir), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert f"+ {cached} -> {out}: folded 14 LoRA modules" in res.output
    merge_dir(tiny_llama_dir, lora_dir, tmp_path / "by-path")
    assert read_dir(out) == read_dir(tmp_path / "by-path")
    for base, said in (("smollm2-135m-instuct", "did you mean 'smollm2-135m-instruct'?"),
                       ("HuggingFaceTB/SmolLM2-135M-Instruct", "is not a local directory")):
        res = runner.invoke(main, ["merge", "--base", base, "--adapter", str(lora_dir),
                                   "--out", str(tmp_path / "x")])
        assert res.exit_code == 2 and "Invalid value for '--base'" in res.output, res.output
        assert said in res.output, res.output
    assert not (tmp_path / "x").exists()
