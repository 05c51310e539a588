"""Builders shared by the adapter tests: real peft and mlx-lm adapters with non-zero weights,
and next-token logprobs from both engines."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_dir: Path, out: Path, seed: int = 0, b_std: float = 0.05,
                      dtype: str = "float32", **lora_kwargs) -> Path:
    """Save a peft LoRA adapter on ``base_dir`` whose A and B (and DoRA magnitudes) are random
    and non-zero. ``lora_kwargs`` go to ``LoraConfig`` (default r=4, alpha=8, q/v)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    kwargs = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **lora_kwargs}
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
            elif "lora_magnitude_vector" in name:
                p.mul_(0.5 + torch.rand(p.shape, generator=gen))
    if dtype != "float32":
        peft_model = peft_model.to(getattr(torch, dtype))
    peft_model.save_pretrained(out)
    return out


def make_mlx_adapter(base_dir: Path, out: Path, num_layers: int, keys: list[str],
                     rank: int = 4, scale: float = 3.0, dora: bool = False, seed: int = 0) -> Path:
    """Save an adapter the way ``mlx_lm.lora`` does (``linear_to_lora_layers``, trainable
    parameters through ``mx.save_safetensors``, the full training config through
    ``save_config``), with random non-zero lora_a / lora_b (and magnitudes)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.lora import CONFIG_DEFAULTS
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load, save_config

    mx.random.seed(seed)
    model, _ = load(str(base_dir))
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys}
    linear_to_lora_layers(model, num_layers, params, use_dora=dora)
    weights = dict(tree_flatten(model.trainable_parameters()))
    for name, w in weights.items():
        if name.endswith(".lora_b"):
            weights[name] = mx.random.normal(w.shape) * 0.05
        elif name.endswith(".m"):
            weights[name] = w * (0.5 + mx.random.uniform(shape=w.shape))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {**CONFIG_DEFAULTS, "model": str(base_dir), "num_layers": num_layers,
              "fine_tune_type": "dora" if dora else "lora", "lora_parameters": params,
              "adapter_path": str(out), "train": True}
    save_config(config, out / "adapter_config.json")
    return out


def torch_logprobs(base_dir: Path, adapter_dir: Path | None, ids: list[int]) -> np.ndarray:
    """(len(ids), vocab) next-token log-probabilities from transformers (+ peft): the fp32
    model's logits, normalized in float64 (as :func:`mlx_logprobs`, so only the engines differ)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    assert logits.dtype == torch.float32
    return _log_softmax64(logits.numpy())


def mlx_logprobs(base_dir: Path, adapter_dir: Path | None, ids: list[int]) -> np.ndarray:
    """(len(ids), vocab) next-token log-probabilities from ``mlx_lm.load``: the fp32 model's
    logits, normalized in float64 (mlx's fp32 ``logsumexp`` over a 49k vocabulary alone is off
    by up to 5e-5, which would be the test's error, not the engine's).

    transformers 5 nests ``rope_theta`` in ``rope_parameters``, where mlx-lm's llama does not
    look (it would silently use 10000; SmolLM2 uses 100000), so it is passed explicitly.
    """
    import json

    import mlx.core as mx
    from mlx_lm import load

    cfg = json.loads((Path(base_dir) / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    overrides = {"rope_theta": rope["rope_theta"]} if "rope_theta" in rope else {}
    model, _ = load(str(base_dir), model_config=overrides,
                    adapter_path=str(adapter_dir) if adapter_dir else None)
    logits = model(mx.array([ids]))[0]
    assert logits.dtype == mx.float32
    return _log_softmax64(np.array(logits))


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
