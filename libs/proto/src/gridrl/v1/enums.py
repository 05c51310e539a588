"""``gridrl.v1`` enum values <-> the words gridrl uses for them, by the enums' own names
(``EnumTypeWrapper.Name()`` / ``.Value()``), never a hand-written map. Hand-written: the one
module of this package that ``scripts/gen_protos.sh`` does not generate.

Every ``gridrl.v1`` enum starts with ``<PREFIX>_UNSPECIFIED = 0`` (buf STANDARD), so a value's
word is its name without that prefix, in lower case: ``BACKEND_TORCH`` <-> ``"torch"``,
``ADAPTER_FORMAT_PEFT`` <-> ``"peft"``, ``RUN_STATE_RUNNING`` <-> ``"running"``; ``""`` is the
unspecified value.

    enum_word(common_pb2.Backend, common_pb2.BACKEND_TORCH)      # "torch"
    enum_word(common_pb2.Backend, 0)                             # ""
    enum_word(common_pb2.Backend, 0, default=None)               # "unspecified"
    enum_value(common_pb2.Backend, "torch")                      # BACKEND_TORCH
"""

from __future__ import annotations

from typing import Any, Protocol


class EnumTypeWrapper(Protocol):
    """What this module reads of a generated enum (``common_pb2.Backend``: at run time a
    ``google.protobuf``'s ``EnumTypeWrapper``, to a type checker mypy-protobuf's
    ``_BackendEnumTypeWrapper``, whose methods take the enum's own ``ValueType``)."""

    @property
    def DESCRIPTOR(self) -> Any: ...

    def Name(self, number: Any) -> str: ...

    def Value(self, name: Any) -> Any: ...

    def values(self) -> Any: ...


def _prefix(enum: EnumTypeWrapper) -> str:
    """``"BACKEND_"``: the name of the enum's zero value up to ``UNSPECIFIED``."""
    return enum.Name(0).removesuffix("UNSPECIFIED")


def enum_word(enum: EnumTypeWrapper, value: int, default: str | None = "") -> str:
    """``value`` of ``enum`` as a word: its name without the enum's prefix, lower case.

    Args:
        enum: a generated enum (``common_pb2.Backend``).
        value: the wire value.
        default: the word for the unspecified value and for a value this build does not know
            (a newer peer's); None spells those too: ``"unspecified"``, or the number
            (``"7"``) for an unknown value (for displays and metric labels).
    """
    try:
        name = enum.Name(value)
    except ValueError:
        return str(value) if default is None else default
    if value == 0 and default is not None:
        return default
    return name.removeprefix(_prefix(enum)).lower()


def enum_value(enum: EnumTypeWrapper, word: str, default: int | None = None) -> int:
    """The wire value of ``word`` (as :func:`enum_word` spells it) in ``enum``; 0
    (unspecified) for ``""``.

    Args:
        default: the value for a word ``enum`` lacks (``"unspecified"`` included); None: raise.

    Raises:
        ValueError: naming the enum, for a word it lacks (without ``default``).
    """
    if not word:
        return 0
    try:
        value = enum.Value(_prefix(enum) + word.upper())
    except ValueError:
        value = 0
    if value == 0:
        if default is None:
            raise ValueError(f"{word!r} is not a {enum.DESCRIPTOR.name} (one of "
                             f"{', '.join(enum_word(enum, v) for v in enum.values() if v)})")
        return default
    return value
