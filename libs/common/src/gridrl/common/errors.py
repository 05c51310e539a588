"""The one error type of gridrl's domain code: what went wrong, where, and of what kind.

Domain modules (validation, the registry, the node's scheduler, settings) know nothing of gRPC
or HTTP: they raise :class:`StatusError` with a :class:`Kind` and, for bad input, the field at
fault. Only the edges turn it into what a caller sees: the gRPC server interceptor into a
status (:func:`gridrl.common.rpc.interceptor.grpc_status`), the node's OpenAI endpoint into an
HTTP status, a command line into a click error naming the flag (``error.field``). This module
imports no gRPC, so any library can raise it.

    raise invalid_argument("sampling.top_p", "must be in (0, 1], got 1.5")
    # clients see INVALID_ARGUMENT "sampling.top_p: must be in (0, 1], got 1.5"
"""

from __future__ import annotations

import enum


class Kind(enum.Enum):
    """What kind of failure: the canonical status codes (``google.rpc.Code``; gRPC's
    ``StatusCode`` of the same name), values included."""

    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class StatusError(Exception):
    """A failure of a :class:`Kind`, with the field at fault when there is one.

    Args:
        kind: what kind of failure (the gRPC status the client receives).
        problem: human-readable reason, without the field.
        field: the request field, flag or setting at fault (``"sampling.top_p"``,
            ``"--max-queue"``), or None.

    Attributes:
        message: what clients see: ``"<field>: <problem>"``, or ``problem`` without a field.
    """

    def __init__(self, kind: Kind, problem: str, field: str | None = None) -> None:
        self.kind = kind
        self.problem = problem
        self.field = field
        self.message = f"{field}: {problem}" if field else problem
        super().__init__(self.message)

    def __str__(self) -> str:
        return f"{self.kind.name}: {self.message}"


def invalid_argument(field: str, problem: str) -> StatusError:
    """INVALID_ARGUMENT naming ``field``: ``"<field>: <problem>"``."""
    return StatusError(Kind.INVALID_ARGUMENT, problem, field)


def failed_precondition(problem: str, field: str | None = None) -> StatusError:
    """FAILED_PRECONDITION: ``problem``, naming ``field`` when given."""
    return StatusError(Kind.FAILED_PRECONDITION, problem, field)


def not_found(problem: str, field: str | None = None) -> StatusError:
    """NOT_FOUND: ``problem``, naming ``field`` when given."""
    return StatusError(Kind.NOT_FOUND, problem, field)


def resource_exhausted(problem: str, field: str | None = None) -> StatusError:
    """RESOURCE_EXHAUSTED: ``problem``, naming ``field`` when given."""
    return StatusError(Kind.RESOURCE_EXHAUSTED, problem, field)


def unavailable(problem: str) -> StatusError:
    """UNAVAILABLE: ``problem`` (a server shutting down or unreachable)."""
    return StatusError(Kind.UNAVAILABLE, problem)
