"""One error type for domain code that must become a gRPC status.

Domain modules (sampling, registry, GRPO...) know nothing about gRPC contexts; they raise
:class:`StatusError` and the server interceptor in :mod:`gridrl.common.server` turns it into
the status code and message the client sees.
"""

from __future__ import annotations

import grpc


class StatusError(Exception):
    """An error with a gRPC status code.

    Args:
        code: the ``grpc.StatusCode`` the client receives.
        message: human-readable reason; for bad input it names the field, e.g.
            ``"sampling.top_p: must be in (0, 1], got 1.5"``.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def invalid_argument(field: str, problem: str) -> StatusError:
    """INVALID_ARGUMENT naming ``field``: ``"<field>: <problem>"``."""
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


def failed_precondition(message: str) -> StatusError:
    """FAILED_PRECONDITION with ``message``."""
    return StatusError(grpc.StatusCode.FAILED_PRECONDITION, message)


def not_found(message: str) -> StatusError:
    """NOT_FOUND with ``message``."""
    return StatusError(grpc.StatusCode.NOT_FOUND, message)


def resource_exhausted(message: str) -> StatusError:
    """RESOURCE_EXHAUSTED with ``message``."""
    return StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
