"""The fleet's one backoff rule: exponential, capped.

    probes = Backoff(first_s=5.0, max_s=60.0)
    probes.delay(1), probes.delay(2), probes.delay(5)     # 5.0, 10.0, 60.0

Used for the probes of a node benched again and again (:mod:`~gridrl.trainer.fleet.membership`),
the reviews of a flagged node that keeps failing its check (:mod:`~gridrl.trainer.fleet.probation`)
and the reconnections to the master (:mod:`~gridrl.trainer.fleet.watch`). Pure: the callers
count the failures and own their clocks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Delays that start at ``first_s`` seconds and double after each failure, never above
    ``max_s``."""

    first_s: float
    max_s: float

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failures in a row (>= 1):
        ``min(max_s, first_s * 2 ** (failures - 1))``."""
        if failures < 1:
            raise ValueError(f"failures: must be >= 1, got {failures}")
        return min(self.max_s, self.first_s * 2.0 ** min(failures - 1, 64))
