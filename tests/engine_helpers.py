"""Model helpers shared by the engine and rollout tests (imported as ``engine_helpers``; the
tests directory is on sys.path through its conftest): a prompt for the tiny llama, random peft
adapters "trained elsewhere", mlx-lm adapters, and peft/transformers references to compare a backend with."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

PROMPT = [5, 7, 9, 2, 6]  # "<|user|> the cat </s> <|assistant|>" in the tiny tokenizer


def make_peft_adapter(base_dir: Path, out: Path, seed: int = 1, targets: Any = "all-linear",
                      rank: int = 4, alpha: float = 8.0, std: float | None = None,
                      dora: bool = False) -> Path:
    """Save a random, non-zero peft LoRA for the model in ``base_dir`` (an adapter "trained
    elsewhere"). ``std`` rescales A and B to that standard deviation (None: peft's init);
    ``dora``: a DoRA adapter (magnitudes from the base weights' norms, as peft starts them)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir))
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha,
                                                  target_modules=targets,
                                                  init_lora_weights=False, use_dora=dora))
    if std is not None:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, std)
    peft_model.save_pretrained(str(out))
    return out


def peft_reference(base_dir: Path, adapter_dir: Path | None) -> Any:
    """The base model with ``adapter_dir`` loaded by peft (or the plain model), eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir)).eval()
    return PeftModel.from_pretrained(model, str(adapter_dir)).eval() if adapter_dir else model


def reference_greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens by full forwards (no cache) and their log_softmax logprobs."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], reference_logprobs(model, prompt, ids[len(prompt):])


def reference_logprobs(model: Any, prompt: list[int], completion: list[int]) -> list[float]:
    """Teacher-forced log_softmax logprobs of ``completion`` (temperature 1, no truncation)."""
    import torch

    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].tolist()


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user message in the tokenizer's chat template."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


#: config fields per family for :func:`make_tiny_model` beyond the shared tiny sizes: small
#: head dims where the family's default is large, and sliding windows (48 tokens) where the
#: family has one, so the context cap is reached by short prompts.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},  # q/k/v biases
    "qwen3": {"head_dim": 16},  # q/k RMSNorm per head
    "mistral": {"sliding_window": 48},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 48},
    "phi3": {},  # fused qkv_proj and gate_up_proj
}


def make_tiny_model(out: Path, family: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a random 2-layer model of ``family`` (a transformers ``model_type`` in
    :data:`FAMILIES`; hidden size 64, fp32, the family's own defaults otherwise, e.g. tied
    embeddings for gemma2) with the tokenizer of ``tokenizer_dir`` to ``out``. Returns ``out``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = AutoConfig.for_model(
        family, vocab_size=len(tok), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **FAMILIES[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger logits than the default init, so sampling is not uniform
        model.get_output_embeddings().weight.mul_(8.0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def layer_shapes(model_dir: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(num_layers, {'self_attn.q_proj': (in, out), ...}) from the checkpoint itself."""
    import mlx.core as mx

    weights = mx.load(str(model_dir / "model.safetensors"))
    n = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    shapes = {}
    for name, w in weights.items():
        if name.startswith("model.layers.0.") and name.endswith("_proj.weight"):
            out_dims, in_dims = w.shape
            shapes[name[len("model.layers.0."):-len(".weight")]] = (in_dims, out_dims)
    return n, shapes


def write_mlx_adapter(out: Path, model_dir: Path, *, rank: int, scale: float, keys: list[str],
                      num_layers: int, seed: int, config_edit=None, weights_edit=None) -> Path:
    """An adapter as ``mlx_lm.lora`` saves one: adapter_config.json + adapters.safetensors
    (``model.layers.<i>.<key>.lora_a`` (in, r), ``.lora_b`` (r, out), last num_layers blocks),
    with random non-zero A and B."""
    import mlx.core as mx
    import numpy as np

    n, shapes = layer_shapes(model_dir)
    rng = np.random.default_rng(seed)
    weights = {}
    for i in list(range(n))[-max(num_layers, 0):]:  # mlx-lm: 0 and -1 mean every block
        for key in keys:
            in_dims, out_dims = shapes[key]
            a = rng.uniform(-1, 1, (in_dims, rank)) / math.sqrt(in_dims)
            weights[f"model.layers.{i}.{key}.lora_a"] = mx.array(a.astype(np.float32))
            b = rng.normal(0, 0.2, (rank, out_dims))
            weights[f"model.layers.{i}.{key}.lora_b"] = mx.array(b.astype(np.float32))
    config = {"fine_tune_type": "lora", "num_layers": num_layers,
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys}}
    if config_edit:
        config_edit(config)
    if weights_edit:
        weights_edit(weights)
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=4))
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    return out
