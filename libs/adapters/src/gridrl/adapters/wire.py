"""The one place where the adapter world's domain types meet ``gridrl.v1`` protobuf: the
adapter format, the base model (:class:`gridrl.models.ModelIdentity` <-> ``BaseModel``) and the
manifest (:class:`gridrl.adapters.AdapterManifest` <-> ``AdapterManifest``, through its
:meth:`~gridrl.adapters.AdapterManifest.to_proto` / ``from_proto``, which use these).

Enums go by their names (:mod:`gridrl.v1.enums`): ``"peft"`` is ``ADAPTER_FORMAT_PEFT``;
``""`` is the ``_UNSPECIFIED`` value. Messages only: this module imports no gRPC.
"""

from __future__ import annotations

from typing import Literal, cast

from gridrl.adapters.adapter import FORMATS, Format
from gridrl.models import ModelIdentity
from gridrl.v1 import common_pb2
from gridrl.v1.enums import enum_value, enum_word


def adapter_format_to_proto(name: str) -> int:
    """``"peft"`` -> ``ADAPTER_FORMAT_PEFT``; unknown names -> unspecified."""
    return enum_value(common_pb2.AdapterFormat, name, default=0)


def adapter_format_from_proto(value: int) -> Format | Literal[""]:
    """``ADAPTER_FORMAT_PEFT`` -> ``"peft"``; ``""`` for unspecified (and for a format this
    build does not know)."""
    word = enum_word(common_pb2.AdapterFormat, value)
    return cast(Format, word) if word in FORMATS else ""


def adapter_format_from_json(value: object) -> Format | Literal[""]:
    """A ``format`` as JSON writes it: the word (``"peft"``), the enum's name
    (``"ADAPTER_FORMAT_PEFT"``, ``MessageToDict``'s) or number (``1``); ``""`` and the
    unspecified value give ``""``.

    Raises:
        ValueError: anything else.
    """
    if value == "" or value == 0:
        return ""
    if isinstance(value, str) and value in FORMATS:
        return cast(Format, value)
    if isinstance(value, str) and value.startswith("ADAPTER_FORMAT_"):
        number: int = common_pb2.AdapterFormat.Value(value)  # ValueError: not a name
    elif isinstance(value, int):
        number = value
    else:
        raise ValueError(f"{value!r} is not peft or mlx")
    word = adapter_format_from_proto(number)
    if not word and number:
        raise ValueError(f"{value!r} is not peft or mlx")
    return word


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
