"""What the lean forward reads from a transformers llama-family model: whether it can run it
(:func:`unsupported_reason`), its decoder's text config, and, for a node's own model
(``LeanLlama(take_weights=True)``), taking its projection weights so that the process holds one
resident copy of each (:func:`own_the_rest`, :func:`release`; :mod:`.memory`).
"""

from __future__ import annotations

from typing import Any

import torch

from gridrl.engine.backends.torch.memory import drop_mapped_pages
from gridrl.engine.families import unsupported_layers

_TYPES = ("llama", "mistral", "qwen2")


def text_config(config: Any) -> Any:
    """The decoder's text config of a transformers ``config`` (itself for a text-only model)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def unsupported_reason(model: Any) -> str | None:
    """None when :class:`~gridrl.engine.backends.torch.llama.LeanLlama` can run ``model`` (a transformers causal LM), else why not."""
    cfg = text_config(model.config)
    kind = getattr(cfg, "model_type", "")
    if kind not in _TYPES:
        return f"model_type {kind!r} is not one of {', '.join(_TYPES)}"
    refused = unsupported_layers(model.config.to_dict())
    if refused is not None:
        return refused
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return f"{type(model).__name__} has no .model.layers / .model.rotary_emb"
    with torch.no_grad():  # rotary as pairs (dim j with j + D/2) needs equal cos/sin halves
        probe = torch.zeros(1, 1, dtype=torch.float32, device=inner.embed_tokens.weight.device)
        cos, sin = inner.rotary_emb(probe, torch.tensor([[1, 7, 100]], device=probe.device))
        half = cos.shape[-1] // 2
        if not (torch.equal(cos[..., :half], cos[..., half:])
                and torch.equal(sin[..., :half], sin[..., half:])):
            return "a rotary embedding whose two halves differ"
    return None


def projections_of(layer: Any) -> list[torch.nn.Module]:
    """The linear modules of a decoder layer that the lean forward packs."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
            mlp.down_proj]


def own_the_rest(model: torch.nn.Module, taken: list[torch.nn.Module],
                  keep_mapped: torch.Tensor) -> None:
    """Copy every parameter and buffer of ``model`` but the ``taken`` modules' weights and
    ``keep_mapped`` into memory of its own (out of a memory-mapped checkpoint, where
    transformers maps safetensors files); parameters keep their identity, so tied weights stay
    tied."""
    skip = {id(m.weight) for m in taken} | {id(keep_mapped)}
    with torch.no_grad():
        for p in model.parameters():  # each shared (tied) parameter once
            if id(p) not in skip and p.device.type != "meta":
                p.data = p.data.clone()
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.device.type != "meta":
                    module._buffers[name] = buf.clone()


def release(modules: list[torch.nn.Module]) -> None:
    """Replace each module's parameters by ``meta`` tensors of the same shape and dtype (the
    pages of a memory-mapped checkpoint they viewed handed back at once)."""
    drop_mapped_pages(p for module in modules for p in module.parameters(recurse=False))
    for module in modules:
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False))
