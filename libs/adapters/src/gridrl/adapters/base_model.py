"""Base-model identity as the manifest carries it (proto ``gridrl.v1.BaseModel``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any


@dataclass
class BaseModelInfo:
    """The base model an adapter belongs to; zero / empty means unknown.

    Attributes:
        model_id: hub id, alias or path (informational).
        architecture: config.json ``model_type``, e.g. "llama".
        hidden_size: d_model.
        num_layers: number of transformer blocks.
        vocab_size: vocabulary size.
        weights_fingerprint: fingerprint of the weights (``gridrl.models.weights_fingerprint``),
            which tells fine-tunes of one architecture apart.
    """

    model_id: str = ""
    architecture: str = ""
    hidden_size: int = 0
    num_layers: int = 0
    vocab_size: int = 0
    weights_fingerprint: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_any(cls, obj: Any) -> BaseModelInfo:
        """From a dict (snake_case or protobuf-JSON camelCase keys, numbers or numeric
        strings), a dataclass such as ``gridrl.models.ModelIdentity``, or None (all unknown).
        Unknown keys are ignored."""
        if obj is None:
            return cls()
        if isinstance(obj, cls):
            return obj
        if is_dataclass(obj) and not isinstance(obj, type):
            obj = asdict(obj)
        elif not isinstance(obj, dict):
            obj = {f.name: getattr(obj, f.name) for f in fields(cls) if hasattr(obj, f.name)}
        out = cls()
        for f in fields(cls):
            camel = f.name.split("_")[0] + "".join(w.title() for w in f.name.split("_")[1:])
            value = obj.get(f.name, obj.get(camel))
            if value is not None:
                setattr(out, f.name, str(value) if f.type == "str" else int(value))
        return out


def identity_from_config(cfg: dict, model_id: str = "") -> BaseModelInfo:
    """Identity from a Hugging Face config.json object (``text_config`` for multimodal
    models, like :func:`gridrl.models.model_identity`)."""
    text = cfg.get("text_config") or cfg
    return BaseModelInfo(
        model_id=model_id,
        architecture=str(cfg.get("model_type", "")),
        hidden_size=int(text.get("hidden_size", 0) or 0),
        num_layers=int(text.get("num_hidden_layers", 0) or 0),
        vocab_size=int(text.get("vocab_size", 0) or 0),
    )


def local_identity(model_path: str) -> dict[str, Any] | None:
    """Identity of a local base model directory named by an adapter config, as a dict; None
    when ``model_path`` is empty, not a local directory with a readable config.json (a hub
    id, say)."""
    if not model_path:
        return None
    config = Path(model_path).expanduser() / "config.json"
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    return identity_from_config(cfg, model_path).to_dict()
