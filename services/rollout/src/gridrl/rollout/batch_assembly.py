"""Batch assembly of the node's scheduler (:mod:`gridrl.rollout.scheduler`, "Batching" and
"Runs and fair share"): how long an idle scheduler waits for company, and which (request,
sample) pairs the next batch decodes -- split requests first, then waiting ones in fair-share
order, within ``capacity`` and the KV-cache budget -- and with which adapter each starts.

A mixin of :class:`~gridrl.rollout.scheduler.BatchScheduler`: its methods run on the scheduler
thread with the scheduler's lock held and read the scheduler's state, declared below.
"""

from __future__ import annotations

import collections
import threading
import time

from gridrl.rollout import metrics
from gridrl.rollout.batch_observer import abandoned, cancelled
from gridrl.rollout.fair_share import FairShare
from gridrl.rollout.jobs import BASE_MODEL, QueuedRequest, ServingAdapter
from gridrl.rollout.kv_budget import KvBudget
from gridrl.rollout.residency import ResidentAdapters


class BatchAssembly:
    """Picks the requests of the next batch (state: :class:`BatchScheduler`'s)."""

    capacity: int
    batch_window_s: float
    kv_budget: KvBudget
    _cond: threading.Condition
    _closing: bool
    _commands: collections.deque
    _waiting: collections.deque[QueuedRequest]
    _partial: collections.deque[QueuedRequest]
    _fair: FairShare
    _weights: dict[str, float]
    _resident: ResidentAdapters
    _serving: ServingAdapter

    def _wait_for_company(self) -> None:
        """With the lock held and the queue just non-empty: wait until ``batch_window_s``
        after the oldest arrival, or until the waiting samples fill a batch."""
        while not self._closing and not self._commands:
            if sum(r.job.n for r in self._waiting) >= self.capacity or not self._waiting:
                return
            left = self._waiting[0].arrival + self.batch_window_s - time.perf_counter()
            if left <= 0:
                return
            self._cond.wait(left)

    def _take_batch(self) -> list[tuple[QueuedRequest, int]]:
        """With the lock held: pick up to ``capacity`` (request, sample index) pairs, unfinished
        started requests first, then waiting ones in fair-share order (module docstring,
        "Runs"), of any adapters, within the KV-cache budget (the first request that does not
        fit ends it; a batch holds at least one sequence, which :meth:`submit` made sure
        fits). Abandoned requests are dropped with CANCELLED, requests whose adapter was
        unloaded meanwhile fail with NOT_FOUND."""
        room = self.capacity
        items: list[tuple[QueuedRequest, int]] = []
        longest = largest = 0  # the batch's longest prompt and largest max_tokens so far
        now = time.perf_counter()
        for source in (self._partial, self._waiting):
            while source and room > 0:
                req = source[0] if source is self._partial else self._next_waiting()
                # rows of the batch with this request in it that the KV-cache budget holds
                shape = (max(longest, len(req.job.prompt_ids)),
                         max(largest, req.job.sampling.max_tokens))
                fit = self.kv_budget.rows_that_fit(*shape) - len(items)
                if fit < 1 and items:
                    break  # the next batch starts with it
                if source is self._waiting:
                    if not req.future.running() and \
                            not req.future.set_running_or_notify_cancel():
                        source.remove(req)  # cancelled while queued
                        continue
                    wanted = self._adapter_for(req)
                    if wanted is None:
                        source.remove(req)
                        req.future.set_exception(self._resident.not_resident(req.job.adapter))
                        continue
                    req.adapter = wanted
                    req.started = req.started or now
                if abandoned(req):
                    source.remove(req)
                    req.future.set_exception(cancelled())
                    continue
                longest, largest = shape
                take = min(room, max(1, fit), req.job.n - req.next_sample)
                items.extend((req, i) for i in range(req.next_sample, req.next_sample + take))
                req.next_sample += take
                room -= take
                self._fair.charge(req.run, take * (req.job.sampling.max_tokens + 1),
                                  self._weights.get(req.run, 1.0))
                source.remove(req)
                if req.next_sample < req.job.n:
                    self._partial.append(req)
        metrics.QUEUE_DEPTH.set(len(self._waiting))
        return items

    def _next_waiting(self) -> QueuedRequest:
        """With the lock held and requests waiting: the oldest request of the run whose turn
        it is (:meth:`FairShare.next_run`, runs in order of their oldest request)."""
        runs = list(dict.fromkeys(r.run for r in self._waiting))
        run = self._fair.next_run(runs)
        return next(r for r in self._waiting if r.run == run)

    def _adapter_for(self, req: QueuedRequest) -> ServingAdapter | None:
        """With the lock held: what a request starting now decodes with (None: the adapter it
        names is no longer resident); marks that adapter used (LRU)."""
        if req.base_model:
            return BASE_MODEL
        if not req.job.adapter:
            self._resident.use(self._serving.name)
            return self._serving
        return self._resident.use(req.job.adapter)
