"""The base model, one type for every layer: what an adapter must match and what a node
serves (:class:`ModelIdentity`).

A node reads it from its model directory (:func:`gridrl.models.model_identity`), an adapter's
manifest carries it (what the adapter was trained on), and the wire carries it as
``gridrl.v1.BaseModel`` (converted in one place, :mod:`gridrl.adapters.wire`). Zero or empty
fields mean unknown: an adapter whose config names no local model knows only its hidden size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelIdentity:
    """A base model's identity; zero / empty means unknown.

    Attributes:
        model_id: hub id, alias or path (informational).
        architecture: config.json ``model_type``, e.g. "llama".
        hidden_size: d_model.
        num_layers: number of transformer blocks.
        vocab_size: vocabulary size.
        max_context: tokens (prompt + completion) the model serves (0: unknown; not carried by
            ``gridrl.v1.BaseModel``: ``NodeInfo.max_context`` says it).
        weights_fingerprint: fingerprint of the weights (:func:`gridrl.models.weights_fingerprint`),
            which tells fine-tunes of one architecture apart.
    """

    model_id: str = ""
    architecture: str = ""
    hidden_size: int = 0
    num_layers: int = 0
    vocab_size: int = 0
    max_context: int = 0
    weights_fingerprint: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The identity as a manifest stores it (the fields of ``gridrl.v1.BaseModel``;
        ``max_context``, a bound of what serves, is left out)."""
        d = dataclasses.asdict(self)
        del d["max_context"]
        return d

    @classmethod
    def from_any(cls, obj: Any) -> ModelIdentity:
        """From a dict (snake_case or protobuf-JSON camelCase keys, numbers or numeric strings:
        a manifest's JSON, stored or older), an object with these attributes, or None (all
        unknown). Unknown keys are ignored."""
        if obj is None:
            return cls()
        if isinstance(obj, cls):
            return obj
        if not isinstance(obj, dict):
            obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)
                   if hasattr(obj, f.name)}
        values = {}
        for f in dataclasses.fields(cls):
            camel = f.name.split("_")[0] + "".join(w.title() for w in f.name.split("_")[1:])
            value = obj.get(f.name, obj.get(camel))
            if value is not None:
                values[f.name] = str(value) if f.type == "str" else int(value)
        return cls(**values)

    def known(self, **given: Any) -> ModelIdentity:
        """This identity with the fields of ``given`` that are known (non-zero, non-empty)."""
        return dataclasses.replace(self, **{k: v for k, v in given.items() if v})
