"""The base model an adapter names in its config, read from a local model directory
(the manifest's ``base_model``, a :class:`gridrl.models.ModelIdentity`)."""

from __future__ import annotations

import json
from pathlib import Path

from gridrl.models import ModelIdentity


def identity_from_config(cfg: dict, model_id: str = "") -> ModelIdentity:
    """Identity from a Hugging Face config.json object (``text_config`` for multimodal
    models, like :func:`gridrl.models.model_identity`), without the weights' fingerprint."""
    text = cfg.get("text_config") or cfg
    return ModelIdentity(
        model_id=model_id,
        architecture=str(cfg.get("model_type", "")),
        hidden_size=int(text.get("hidden_size", 0) or 0),
        num_layers=int(text.get("num_hidden_layers", 0) or 0),
        vocab_size=int(text.get("vocab_size", 0) or 0),
    )


def local_identity(model_path: str) -> ModelIdentity | None:
    """Identity of a local base model directory named by an adapter config; None when
    ``model_path`` is empty, not a local directory with a readable config.json (a hub id,
    say)."""
    if not model_path:
        return None
    config = Path(model_path).expanduser() / "config.json"
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    return identity_from_config(cfg, model_path)
