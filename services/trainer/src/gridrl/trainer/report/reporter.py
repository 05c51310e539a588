"""One subscriber list for everything a run reports.

    reporter = Reporter()
    reporter.subscribe(ConsoleLines(console, ...), order=CONSOLE)   # anything with the methods
    reporter.subscribe(LogFile(run_dir), essential=True, order=LOG)  # below; LOG goes first
    reporter.step(record)                                   # the loop, once per step
    reporter.event(NodeFlagged(node, step, reason, True))   # the run, its threads
    reporter.close()

A subscriber (:class:`RunSubscriber`) gets each finished step's typed
:class:`~gridrl.trainer.report.records.StepRecord` (``on_step``) and each typed
:data:`~gridrl.trainer.report.events.RunEvent` (``on_event``: the run starting, resuming,
waiting for nodes, a node flagged, a sync that skipped nodes, the baseline eval, a checkpoint,
the end). Subscribers are called by ``order`` (lower first, then in subscription order), so a
subscriber added late still runs where it belongs. The subscribers of a run, in order:
``log.jsonl``
(:class:`gridrl.trainer.run.rundir.LogFile`), the experiment trackers
(:class:`~gridrl.trainer.report.trackers.TrackerSubscriber`), ``GetRunStatus`` / ``WatchRun``
(:class:`~gridrl.trainer.report.status.StatusSubscriber`), Prometheus
(:class:`~gridrl.trainer.report.metrics.PrometheusSubscriber`), the run's history for the plot
and ``summary.json`` (:class:`~gridrl.trainer.report.summary.RunHistory`) and the console
(:class:`~gridrl.trainer.report.console.ConsoleLines`): every other output shows a step only
once it is on disk. Adding an output is one more subscriber (default order :data:`OTHER`,
before the console); the loop does not change.

Calls never overlap: the reporter holds a lock around each fan-out, so a subscriber needs no
locking of its own although events come from several threads (the loop; the node pool's batch
thread for :class:`~gridrl.trainer.report.events.NodeWaitChanged`; probation's thread for
:class:`~gridrl.trainer.report.events.NodeReviewed`). A subscriber must therefore return
quickly. A subscriber that raises is logged and dropped (a report must never stop training),
unless it was subscribed as ``essential`` (``log.jsonl``: a run that cannot write its log
stops), whose exception goes to the caller.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from gridrl.trainer.report.events import RunEvent
from gridrl.trainer.report.records import StepRecord

log = logging.getLogger(__name__)

# Places in the subscriber list (lower first).
LOG, TRACKERS, STATUS, METRICS, HISTORY, OTHER, CONSOLE = 0, 10, 20, 30, 40, 50, 90


class RunSubscriber(Protocol):
    """What a run reports to (see the module docstring). A class that names this protocol as
    a base gets no-op defaults and implements only what it shows."""

    def on_step(self, record: StepRecord) -> None:
        """A step finished (the loop's thread; in step order)."""

    def on_event(self, event: RunEvent) -> None:
        """Something happened to the run (any thread, never two calls at once)."""

    def close(self) -> None:
        """The run's process is done with the subscriber (called once)."""


class Reporter:
    """Fans each record and event out to the subscribers, in subscription order."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a subscriber may emit an event itself
        self._subscribers: list[tuple[RunSubscriber, bool]] = []
        self._orders: list[int] = []

    def subscribe(self, subscriber: RunSubscriber, *, essential: bool = False,
                  order: int = OTHER) -> None:
        """Add ``subscriber`` after those of a lower or equal ``order``; ``essential``: its
        exceptions propagate (else it is logged and dropped)."""
        with self._lock:
            at = sum(o <= order for o in self._orders)
            self._orders.insert(at, order)
            self._subscribers.insert(at, (subscriber, essential))

    def step(self, record: StepRecord) -> None:
        """Hand a finished step's record to every subscriber."""
        with self._lock:
            for subscriber, essential in list(self._subscribers):
                self._call(subscriber, essential, lambda s=subscriber: s.on_step(record))

    def event(self, event: RunEvent) -> None:
        """Hand an event to every subscriber (from any thread)."""
        with self._lock:
            for subscriber, essential in list(self._subscribers):
                self._call(subscriber, essential, lambda s=subscriber: s.on_event(event))

    def close(self) -> None:
        """Close every subscriber once (the last first); failures are logged."""
        with self._lock:
            subscribers, self._subscribers, self._orders = self._subscribers, [], []
        for subscriber, _ in reversed(subscribers):
            try:
                subscriber.close()
            except Exception:
                log.exception("closing %r failed", subscriber)

    def _call(self, subscriber: RunSubscriber, essential: bool, call) -> None:
        if essential:
            call()
            return
        try:
            call()
        except Exception:
            log.exception("report subscriber %r failed; it gets nothing more", subscriber)
            at = next(i for i, (s, _) in enumerate(self._subscribers) if s is subscriber)
            del self._subscribers[at], self._orders[at]
