"""By when a push, fetch or reload must be applied on a node, and whether its caller still waits
(:class:`ApplyDeadline`): a late adapter is refused with DEADLINE_EXCEEDED and never applied
later (:mod:`.adapter_manager`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gridrl.common.errors import Kind, StatusError
from gridrl.rollout import metrics


@dataclass(frozen=True)
class ApplyDeadline:
    """By when a push or reload must be applied, and whether its caller still waits.

    Attributes:
        at: ``time.monotonic()`` seconds by which the swap must happen (None: no deadline).
        caller_active: False once the caller has gone (a cancelled RPC): nothing is applied.
    """

    at: float | None = None
    caller_active: Callable[[], bool] = field(default=lambda: True)

    @classmethod
    def of_rpc(cls, context, reply_margin_s: float = 0.5) -> ApplyDeadline:
        """From a gRPC servicer context: its deadline less a margin for the reply to reach the
        caller (``min(reply_margin_s, 10%`` of the time left)), and ``context.is_active``."""
        left = context.time_remaining()
        at = None if left is None else time.monotonic() + left - min(reply_margin_s, 0.1 * left)
        return cls(at, context.is_active)

    def left(self) -> float | None:
        """Seconds left (>= 0), None without a deadline."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def check(self, what: str) -> None:
        """Raise unless ``what`` may still be applied.

        Raises:
            StatusError: DEADLINE_EXCEEDED past the deadline; CANCELLED when the caller left.
        """
        if not self.caller_active():
            raise StatusError(Kind.CANCELLED,
                              f"{what}: the caller cancelled before it was applied; nothing "
                              "changed")
        if self.at is not None and time.monotonic() >= self.at:
            raise self.expired(what)

    def expired(self, what: str) -> StatusError:
        """The DEADLINE_EXCEEDED error of ``what`` (counted in the metrics)."""
        metrics.PUSHES_EXPIRED.inc()
        return StatusError(Kind.DEADLINE_EXCEEDED,
                           f"{what}: could not be applied before the caller's deadline; "
                           "nothing changed and it will not be applied later")


NO_DEADLINE = ApplyDeadline()
