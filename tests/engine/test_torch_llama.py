"""The lean llama-family forward (backends/torch_llama.py) against transformers and peft:
same logits for scoring, prefill and padded batch decode, qkv biases (qwen2), every peft
LoRA scaling (rank/alpha patterns, rsLoRA, lm_head), and the architectures it refuses."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from gridrl.engine.backends.torch.cache import SlabCache
from gridrl.engine.backends.torch.llama import LeanLlama
from gridrl.engine.backends.torch.llama_model import unsupported_reason
from gridrl.engine.backends.torch.merge import read_lora


def _tiny(kind: str = "llama", **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False)
    fields.update(overrides)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **fields)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def _decode_reference(model, prompts: list[list[int]], steps: list[list[int]]) -> torch.Tensor:
    """transformers logits after each prompt + its step tokens, full forward per row."""
    out = []
    for prompt, extra in zip(prompts, steps, strict=True):
        ids = torch.tensor([prompt + extra])
        out.append(model(ids).logits[0, -1])
    return torch.stack(out)


def _score_prefill_and_decode_like(lean: LeanLlama, model) -> None:
    """``lean`` gives ``model``'s float32 logits (to 1e-5) when scoring a sequence, when
    prefilling two prompts alone, and when decoding both from a left-padded cache."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    with torch.inference_mode():
        # scoring: causal forward over the whole sequence, every position
        ids = torch.tensor([prompts[0]])
        got = lean.forward(ids, torch.arange(7)[None])
        assert got.dtype == torch.float32
        assert torch.allclose(got, model(ids).logits, atol=1e-5, rtol=1e-5)
        # prefill each prompt alone, then decode both rows together from a left-padded cache
        kvs = []
        for p in prompts:
            layers: list = []
            logits = lean.forward(torch.tensor([p]), torch.arange(len(p))[None], cache=layers,
                                  logits_at=torch.tensor([len(p) - 1]))
            assert torch.allclose(logits[0, -1], model(torch.tensor([p])).logits[0, -1],
                                  atol=1e-5, rtol=1e-5)
            kvs.append(layers)
        cache = SlabCache.from_prefills(kvs, [len(p) for p in prompts], [0, 1], 5, torch.float32)
        steps: list[list[int]] = [[], []]
        for t in range(3):
            tokens = torch.tensor([[30 + t], [40 + t]])
            for row in range(2):
                steps[row].append(int(tokens[row, 0]))
            positions = (cache.layers[0].length - cache.pad)[:, None]
            got = lean.forward(tokens, positions, cache=cache,
                               attention_mask=cache.next_step(always=True))[:, -1]
            want = _decode_reference(model, prompts, steps)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


#: head_dim 16 (attention scaling 1/4, a power of two) and head_dim 24 with llama3 rope scaling.
SHAPES = {"d16": {}, "d24-llama3-rope": dict(
    hidden_size=96, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64})}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("products", ["kernel", "onednn", "plain"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_lean_forward_matches_transformers(kind: str, products: str, shape: str,
                                           monkeypatch) -> None:
    """Each way of running the products: the fused C kernels (float32 CPU, the default where
    they build), oneDNN-prepacked weights (16-bit, or no compiler), plain weights (GPUs, MPS,
    non-x86 CPUs)."""
    from gridrl.engine.backends.torch import llama as torch_llama
    from gridrl.engine.backends.torch import projection as torch_projection

    if products == "kernel":  # whether or not they are the faster path on this CPU
        monkeypatch.setenv("GRIDRL_CPU_KERNELS", "1")
    else:
        monkeypatch.setattr(torch_llama, "_decode_kernels", lambda dtype, device: None)
    if products == "plain":
        monkeypatch.setattr(torch_projection, "_packable", lambda weight: False)
    model = _tiny(kind, **SHAPES[shape])
    lean = LeanLlama(model)
    assert {layer.qkv.kind for layer in lean.layers} == {products}
    _score_prefill_and_decode_like(lean, model)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_bfloat16_follows_transformers(shape: str, monkeypatch) -> None:
    """Without the kernels (oneDNN or torch products in bfloat16)."""
    from gridrl.engine.backends.torch import llama as torch_llama

    monkeypatch.setattr(torch_llama, "_decode_kernels", lambda dtype, device: None)
    model = _tiny(**SHAPES[shape]).to(torch.bfloat16)
    lean = LeanLlama(model)
    assert lean.compute_dtype == torch.bfloat16
    # the scaling goes into bf16 q weights only when that rounds nothing (a power of two)
    assert lean._attn_scale == (1.0 if shape == "d16" else 24 ** -0.5)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        got = lean.forward(ids, torch.arange(8)[None]).float()
        want = model(ids).logits.float()
    # bf16 has 8 bits of mantissa: logits of size ~10 round at ~0.06
    assert (got - want).abs().max() < 0.25
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bfloat16_weights_through_the_kernels_compute_in_float32(kind: str,
                                                                  monkeypatch) -> None:
    """A bfloat16 model through the fused kernels: the packed weights are its bfloat16
    weights, everything else float32, so scoring, prefill and decode give the logits of the
    same weights widened to float32 up to float32 rounding (head_dim 16: the attention scaling
    1/4 folds into the q weights exactly; the norm weights are ones)."""
    monkeypatch.setenv("GRIDRL_CPU_KERNELS", "1")  # whether or not they win the race here
    model = _tiny(kind).to(torch.bfloat16)
    lean = LeanLlama(model)
    widened = copy.deepcopy(model).float()  # buffers too (rotary's inv_freq, now rounded)
    assert lean.products == "fused C kernel (bfloat16 weights, float32 arithmetic)"
    assert lean.compute_dtype == torch.float32 and lean._attn_scale == 1.0
    assert {layer.down.weight.dtype for layer in lean.layers} == {torch.bfloat16}
    _score_prefill_and_decode_like(lean, widened)


@pytest.mark.parametrize("products", ["kernel", "onednn"])
def test_lora_factors_equal_peft(tmp_path: Path, products: str, monkeypatch) -> None:
    """Per-module ranks and alphas, rsLoRA, partial q/k/v coverage and lm_head: the factors
    give the peft model's logits (with the fused kernels, the LoRA term inside the product
    and the norm weight folded into A; with oneDNN, two small products after it)."""
    from peft import LoraConfig, get_peft_model

    from gridrl.engine.backends.torch import llama as torch_llama

    if products == "onednn":
        monkeypatch.setattr(torch_llama, "_decode_kernels", lambda dtype, device: None)
    else:  # whether or not they are the faster path on this CPU
        monkeypatch.setenv("GRIDRL_CPU_KERNELS", "1")
    model = _tiny()
    lean = LeanLlama(model)
    assert lean.head.kind == products
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, use_rslora=True,
                        target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj",
                                        "lm_head"],
                        rank_pattern={"v_proj": 2, "layers.1.mlp.up_proj": 6},
                        alpha_pattern={"o_proj": 3.0})
    torch.manual_seed(1)
    peft_model = get_peft_model(model, config).eval()
    peft_model.save_pretrained(str(tmp_path), save_embedding_layers=False)
    factors = lean.lora_factors(read_lora(tmp_path))
    assert {name for _, name in factors.factors} == {"qkv", "o", "gate_up", "down", "lm_head"}
    ids = torch.tensor([[7, 8, 9, 10, 11, 12]])
    with torch.inference_mode():
        want = peft_model(ids).logits
        lean.activate(factors)
        got = lean.forward(ids, torch.arange(6)[None])
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
        with peft_model.disable_adapter():
            base = peft_model(ids).logits
        lean.activate(None)
        assert torch.allclose(lean.forward(ids, torch.arange(6)[None]), base, atol=1e-5,
                              rtol=1e-5)
        assert (want - base).abs().max() > 1e-2  # the adapter does change the model
        lean.release(factors)
        assert not factors.factors


def test_lora_factors_name_what_does_not_fit() -> None:
    lean = LeanLlama(_tiny())
    a, b = torch.zeros(4, 64), torch.zeros(128, 4)
    with pytest.raises(ValueError, match=r"model\.embed_tokens"):
        lean.lora_factors({"model.embed_tokens": (a, b, 1.0)})
    with pytest.raises(ValueError, match=r"layer 0 qkv\[0\].*do not fit"):
        lean.lora_factors({"model.layers.0.self_attn.q_proj": (a, b, 1.0)})


def test_unsupported_architectures_use_transformers(tmp_path: Path) -> None:
    assert unsupported_reason(_tiny()) is None
    assert "hidden_act" in unsupported_reason(_tiny(hidden_act="gelu"))
    assert "MLP biases" in unsupported_reason(_tiny(mlp_bias=True))
    gpt2 = _tiny("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=300)
    assert "model_type 'gpt2'" in unsupported_reason(gpt2)
    with pytest.raises(ValueError, match="lean llama forward: hidden_act"):
        LeanLlama(_tiny(hidden_act="gelu"))


def test_in_process_peft_model_runs_lean_with_its_live_lora(tiny_llama_dir: Path) -> None:
    """The trainer's use (TorchBackend.from_model over its peft model, base frozen, LoRA
    training): the lean forward reads the LoRA weights at every call, so an optimizer step
    between calls is served, and it agrees with the transformers/peft forward."""
    from engine_helpers import PROMPT
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gridrl.engine.backends.torch.backend import TorchBackend
    from gridrl.engine.contract import SamplingConfig, SequenceRequest

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                      init_lora_weights=False))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    model.train()
    lean = TorchBackend.from_model(model, tokenizer)
    plain = TorchBackend.from_model(model, tokenizer, lean=False)
    assert (lean.forward_kind, plain.forward_kind) == ("lean", "transformers")
    batch = [SequenceRequest(PROMPT, SamplingConfig(max_tokens=8, temperature=1.0), seed=s)
             for s in range(4)]

    def agree() -> list:
        got, want = lean.generate(batch, None), plain.generate(batch, None)
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        return got

    before = agree()
    with torch.no_grad():  # an optimizer step on the LoRA weights only
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.5)
    after = agree()
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert model.training  # left as found


def test_in_process_model_with_trainable_base_is_not_lean(tiny_llama_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gridrl.engine.backends.torch.backend import TorchBackend

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    assert TorchBackend.from_model(model, None).forward_kind == "transformers"
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    peft_model.base_model.model.lm_head.weight.requires_grad_(True)
    assert TorchBackend.from_model(peft_model, None).forward_kind == "transformers"
