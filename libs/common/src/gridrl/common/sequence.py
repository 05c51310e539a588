"""The order of a node's reports: ``NodeInfo.sequence``, ``HeartbeatRequest.sequence``,
``PushAdapterResponse.sequence``.

    reports = ReportSequence()
    info.sequence = reports.next()     # strictly increasing within the process

A report relayed by the master (a heartbeat's copy) can reach the trainer after the node's own
later answer (a push's): ordering them by arrival made the trainer think the node had lost the
adapter it had just taken. Ordering by the sequence the node stamped on each makes the relayed
copy the older one. The counter starts from the wall clock in nanoseconds when the process
starts and then only counts (no later clock reading), so a restarted node's reports order
after its predecessor's, and a clock step while the process runs changes nothing.
"""

from __future__ import annotations

import itertools
import threading
import time


class ReportSequence:
    """A process's strictly increasing report numbers (uint64). Thread-safe.

    Args:
        start: the first number (default: ``time.time_ns()`` now).
    """

    def __init__(self, start: int | None = None) -> None:
        self._counter = itertools.count(time.time_ns() if start is None else start)
        self._lock = threading.Lock()

    def next(self) -> int:
        """The next number: larger than every one returned before by this object.

        A report must take its number *before* it reads the state it reports (and an answer
        to a change *after* the change): then a larger number always shows the newer state.
        """
        with self._lock:
            return next(self._counter)


def newer(sequence: int, than: int) -> bool | None:
    """Whether a report numbered ``sequence`` is newer than one numbered ``than``; None when
    either is 0 (not reported: an older node), and the caller falls back on arrival order."""
    if not sequence or not than:
        return None
    return sequence > than
