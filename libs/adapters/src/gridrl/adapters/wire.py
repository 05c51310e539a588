"""The one place where the adapter world's domain types meet ``gridrl.v1`` protobuf: the
adapter format, the base model (:class:`gridrl.models.ModelIdentity` <-> ``BaseModel``) and the
manifest (:class:`gridrl.adapters.AdapterManifest` <-> ``AdapterManifest``, through its
:meth:`~gridrl.adapters.AdapterManifest.to_proto` / ``from_proto``, which use these).

Enums go by their names (:mod:`gridrl.v1.enums`): ``"peft"`` is ``ADAPTER_FORMAT_PEFT``;
``""`` is the ``_UNSPECIFIED`` value. Messages only: this module imports no gRPC.
"""

from __future__ import annotations

from gridrl.models import ModelIdentity
from gridrl.v1 import common_pb2
from gridrl.v1.enums import enum_value, enum_word


def adapter_format_to_proto(name: str) -> int:
    """``"peft"`` -> ``ADAPTER_FORMAT_PEFT``; unknown names -> unspecified."""
    return enum_value(common_pb2.AdapterFormat, name, default=0)


def adapter_format_from_proto(value: int) -> str:
    """``ADAPTER_FORMAT_PEFT`` -> ``"peft"``; ``""`` for unspecified."""
    return enum_word(common_pb2.AdapterFormat, value)


def base_model_to_proto(identity: ModelIdentity) -> common_pb2.BaseModel:
    """The wire form of a base model (``max_context`` travels in ``NodeInfo``, not here)."""
    return common_pb2.BaseModel(
        model_id=identity.model_id, architecture=identity.architecture,
        hidden_size=identity.hidden_size, num_layers=identity.num_layers,
        vocab_size=identity.vocab_size, weights_fingerprint=identity.weights_fingerprint)


def base_model_from_proto(message: common_pb2.BaseModel) -> ModelIdentity:
    """Inverse of :func:`base_model_to_proto` (``max_context`` 0: unknown)."""
    return ModelIdentity(
        model_id=message.model_id, architecture=message.architecture,
        hidden_size=message.hidden_size, num_layers=message.num_layers,
        vocab_size=message.vocab_size, weights_fingerprint=message.weights_fingerprint)
