"""Which decoder models the engine serves, and at what context, read from a model's config.

Every backend serves decoders whose layers are all attention layers -- full attention, or a
sliding window over the last ``sliding_window`` tokens (Mistral-7B-v0.1, Gemma 2 and 3,
Phi-3). Linear-attention, recurrent or chunked layers are refused (:func:`unsupported_layers`).

A sliding window is served by capping the context (prompt + completion tokens) at the window
(:func:`context_limit`): no token then has anything beyond the window to attend to, so
windowed attention equals full attention, every forward (the lean one, transformers' own,
mlx-lm's, the trainer's) computes the same function, and a batch's left padding never
matters. Requests longer than the cap are refused (the node's INVALID_ARGUMENT on
``sampling.max_tokens``, ``ValueError`` in :func:`gridrl.engine.contract.check_batch`); a
caller that needs more context than a window holds is refused when the backend is built.

Which forward runs each family on the torch backend: the lean forward
(:mod:`gridrl.engine.backends.torch.llama`) for ``llama``, ``mistral`` and ``qwen2``; every
other family (``qwen3``, ``gemma2``, ``gemma3_text``, ``phi3``, ...) runs the model's own
transformers forward with transformers' public cache (``DynamicCache``). The MLX backend runs
whatever mlx-lm implements.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: layer kinds (transformers' ``layer_types``) the backends serve
SERVED_LAYERS = ("full_attention", "sliding_attention")
DEFAULT_CONTEXT = 2048  # when a config names no max_position_embeddings


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder's part of a config dict (``text_config`` of a multimodal config)."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def unsupported_layers(config: Mapping[str, Any]) -> str | None:
    """Why the backends cannot serve this model's layers (None: they can).

    Args:
        config: the model's ``config.json`` as a dict (a transformers config's ``to_dict()``).
    """
    kinds = set(text_config(config).get("layer_types") or ())
    others = sorted(kinds - set(SERVED_LAYERS))
    if others:
        return (f"layer_types {', '.join(others)}: only attention layers (full or sliding "
                "window) are served")
    return None


def sliding_window(config: Mapping[str, Any]) -> int | None:
    """The sliding window in tokens of any layer of the model (None: full attention only).

    With ``layer_types``, the window applies when a layer is ``sliding_attention``; without,
    when ``sliding_window`` is set and ``use_sliding_window`` is not false (as transformers
    reads Mistral, Phi-3 and Qwen2 configs).
    """
    text = text_config(config)
    window = text.get("sliding_window")
    if not window:
        return None
    layer_types = text.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    return int(window) if text.get("use_sliding_window", True) else None


def context_limit(config: Mapping[str, Any], needed: int | None = None) -> tuple[int, str | None]:
    """The most tokens (prompt + completion) a sequence may hold on this model.

    Args:
        config: the model's config as a dict.
        needed: a context the caller must be able to serve, or None.
    Returns:
        ``(limit, note)``: ``max_position_embeddings``, capped at the sliding window when the
        model has one (``note`` then says so, for the log; else None).
    Raises:
        ValueError: ``needed`` exceeds the limit (the message names the window or the
            positions that bound it).
    """
    text = text_config(config)
    positions = int(text.get("max_position_embeddings") or DEFAULT_CONTEXT)
    window = sliding_window(config)
    limit, note = positions, None
    if window is not None and window < positions:
        limit = window
        note = (f"context capped at the sliding window, {window} tokens (the model has "
                f"{positions} positions): windowed attention then equals full attention")
    if needed is not None and needed > limit:
        bound = (f"its sliding window of {window} tokens" if limit == window
                 else f"its {positions} positions")
        raise ValueError(f"a context of {needed} tokens does not fit this model: "
                         f"{bound} (a longer context needs a forward that slides the window)")
    return limit, note
