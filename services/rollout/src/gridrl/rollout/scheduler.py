"""The scheduler of a rollout node: a bounded queue with a fair share per run, one scheduler
thread, dynamic batching across concurrent requests and runs, rows of several adapters in one
batch, and adapter swaps between batches or between two decode steps.

    scheduler = BatchScheduler(backend, capacity=64, max_queue=128).start()
    outcome = scheduler.generate(GenerateJob(prompt_ids, sampling, n=8, seed=1))
    scheduler.call_between_batches(lambda: scheduler.set_serving(new_adapter))
    scheduler.call_between_batches(lambda: scheduler.set_serving(newer), preempt=True,
                                   timeout=5, scope=newer.name)

Batching: the scheduler takes waiting requests in fair-share order (below) and decodes up to ``capacity``
sequences together in one backend call (the ``n`` samples of each request, across requests),
and no more than its KV-cache budget holds (:class:`~gridrl.rollout.kv_budget.KvBudget`: rows x
(longest prompt + largest max_tokens + overhead) tokens); a request one of whose samples alone
does not fit is refused at :meth:`BatchScheduler.submit` (RESOURCE_EXHAUSTED).
A request whose samples do not all fit is split; its remaining samples go first into the next
batch. When the scheduler was idle, it waits up to ``batch_window_s`` after the first arrival
so that concurrent callers land in the same batch.

Seeds: sample ``i`` of a request seeded ``s`` decodes with ``rng.sequence_seed(s, i)``, so its
tokens do not depend on the batch it lands in (up to float rounding changing an argmax).

Runs and fair share: a request belongs to a run -- the adapter it names
(``GenerateJob.adapter``), the base model's run ("" with ``base_model``), or, naming none, the
serving adapter's. Waiting requests start in the order :class:`~gridrl.rollout.fair_share.FairShare`
gives (start-time fair queueing over runs, weighted by ``GenerateJob.share_weight``; in arrival
order within a run), so a run that queues many requests cannot starve another; past
``max_queue`` a request is refused only when its run already holds its share of the queue
(:func:`~gridrl.rollout.fair_share.within_share`). :meth:`BatchScheduler.shares` reports each
run's share of the work started.

Adapters: several stay resident (``max_resident`` names, ``max_adapter_bytes`` bytes in all,
least recently used evicted first); a batch holds rows of any of them and of the base model,
decoded together by ``Backend.generate_mixed`` (the torch lean forward: one base product, one
small product per adapter group, S-LoRA / Punica). Every backend call happens on the scheduler
thread. Commands queued with :meth:`BatchScheduler.call_between_batches` run there too,
between two batches (or between two decode steps, below) and never while a request has samples
both decoded and still waiting on the adapter they replace, so every sample of a request is
produced by the same adapter version: requests that started decoding finish on the adapter
they started with, and requests started after a swap get the new one. A request submitted with
``base_model=True`` decodes without any adapter whatever is serving.

Preemption (adapter pushes): a command queued with ``preempt=True`` does not wait for the batch
in progress. With a ``scope`` (the name of the adapter a push replaces) it concerns only the
rows of that adapter and the rows following the serving adapter: the batch's other rows go on
untouched, and where the backend stops single rows (the torch lean forward) the command runs
between two decode steps and only the rows in scope restart
(:mod:`gridrl.rollout.batch_observer`). Without a scope, or when every row is in scope, the
batch's :class:`~gridrl.engine.contract.DecodeObserver` answers ``interrupted()`` with True at
the backend's next decode step (or prefill), the backend raises ``DecodeInterrupted``, and
every request in scope that had started (in that batch, or split and waiting for its next
one) is reset and put back at the head of the queue, in arrival order; the command
runs, then those requests decode again from their first token on what serves then. Their seeds
fix every draw, so nothing of the interrupted work is visible but the time it cost; every sample
of a request still comes from one adapter, now the new one. So a push takes effect within one
decode step of a batch of any length, instead of after it (the design of vLLM's ``abort``
pause mode). A preempting command cancelled before it runs (its caller's deadline passed)
interrupts nothing more and never runs. A streamed request (below) that preemption
interrupts fails with ABORTED instead: its caller has tokens of the old adapter already.

Prompt logprobs (OpenAI's ``echo``): a job with ``prompt_logprobs`` N gets each prompt token's
logprob and its N most likely alternatives under the model's own distribution (no temperature
or truncation, as vLLM's ``prompt_logprobs``), scored by the backend (``Backend.score_top``) on
the scheduler thread right after the request's last batch, with the adapter that decoded its
samples. Such a job may ask ``max_tokens`` 0: it is scored and decodes nothing.

Streams: a request submitted with a :class:`TokenSink` is told its adapter when it starts and
its tokens after every decode step of the batches it is in (the backend's decode hooks, routed
per request), so a caller can stream them before the batch ends. A sink that says it is
``abandoned`` gets nothing more: its samples still waiting are dropped, and a batch whose every
request is abandoned stops at the next decode step (its requests fail with CANCELLED).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from gridrl.common.errors import Kind, StatusError, resource_exhausted
from gridrl.engine import rng
from gridrl.engine.contract import (
    Backend,
    DecodeInterrupted,
    SamplingConfig,
    SequenceRequest,
    SequenceResult,
    TopLogprobs,
)
from gridrl.engine.threads import release_thread_state
from gridrl.rollout import metrics
from gridrl.rollout.batch_observer import BatchObserver, abandoned, cancelled
from gridrl.rollout.config import default_of
from gridrl.rollout.fair_share import FairShare, check_weight, within_share
from gridrl.rollout.jobs import (
    BASE_MODEL,
    BASE_RUN,
    BatchRecord,
    GenerateJob,
    GenerateOutcome,
    QueuedRequest,
    ServingAdapter,
    TokenSink,
)
from gridrl.rollout.kv_budget import KvBudget
from gridrl.rollout.residency import ResidentAdapters

log = logging.getLogger(__name__)
T = TypeVar("T")


#: How a prompt is scored: the model's own distribution (greedy's transform: none).
_MODEL_DISTRIBUTION = SamplingConfig(max_tokens=1, temperature=0.0)


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: Future
    preempt: bool = False
    scope: str | None = None  # preempt: rows of this adapter name (None: every row)


class BatchScheduler:
    """Batches Generate jobs of several runs over one backend, rows of several adapters
    together, and swaps adapter versions between batches or decode steps.

    Args:
        backend: the model (any :class:`~gridrl.engine.contract.Backend`).
        capacity: most sequences decoded together in one batch (>= 1).
        max_queue: most requests waiting to start; past it, :meth:`submit` raises
            RESOURCE_EXHAUSTED (>= 1).
        batch_window_s: how long an idle scheduler waits after a first arrival for more.
        The defaults are the node's settings (:class:`gridrl.rollout.config.NodeConfig`).
        history: how many :class:`BatchRecord` to keep for :meth:`recent_batches`.
        kv_budget: KV-cache tokens a batch may take (default: not limited).
        max_resident: adapter names held loaded at once (>= 1); past it the least recently
            used is unloaded.
        max_adapter_bytes: bytes the resident adapters may take in all (0: not limited);
            past it the least recently used are unloaded.
    """

    def __init__(self, backend: Backend, capacity: int = default_of("capacity"),
                 max_queue: int = default_of("max_queue"),
                 batch_window_s: float = default_of("batch_window_s"), history: int = 256,
                 kv_budget: KvBudget | None = None,
                 max_resident: int = default_of("max_resident_adapters"),
                 max_adapter_bytes: int = 0) -> None:
        if capacity < 1 or max_queue < 1:
            raise ValueError(f"capacity ({capacity}) and max_queue ({max_queue}) must be >= 1")
        self.backend = backend
        self.capacity = capacity
        self.max_queue = max_queue
        self.batch_window_s = batch_window_s
        self.kv_budget = kv_budget or KvBudget()
        self._cond = threading.Condition()
        self._waiting: collections.deque[QueuedRequest] = collections.deque()
        self._partial: collections.deque[QueuedRequest] = collections.deque()
        self._commands: collections.deque[_Command] = collections.deque()
        self._serving = BASE_MODEL
        self._resident = ResidentAdapters(max_resident, max_adapter_bytes)
        self._retired: list[Any] = []  # handles to unload once no batch uses them
        self._in_batch = False
        self._fair = FairShare()
        self._weights: dict[str, float] = {}
        self._stops_rows = bool(getattr(backend, "stops_rows", False))
        self._ids = itertools.count(1)
        self._batch_index = 0
        self._active_sequences = 0
        self._history: collections.deque[BatchRecord] = collections.deque(maxlen=history)
        self._closing = False
        self._scheduler_done = False
        self._interrupting = False  # close(interrupt=True): stop the batch in progress
        self._thread: threading.Thread | None = None
        self.started_at = time.time()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> BatchScheduler:
        """Start the scheduler thread. Returns self."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rollout-scheduler",
                                                daemon=True)
                self._thread.start()
        return self

    def claim_thread(self) -> None:
        """Make the calling thread the scheduler thread; :meth:`run` must follow on it, and
        :meth:`start` then starts nothing.

        Raises:
            RuntimeError: the engine already has a scheduler thread.
        """
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("the scheduler thread is already running")
            self._thread = threading.current_thread()

    def run(self) -> None:
        """Run the scheduler loop on the calling thread until :meth:`close` (instead of
        :meth:`start`): for a process that loaded its model on this thread, so that all of
        torch's parallel work starts from one thread (see ``server.run_on_engine_thread``)."""
        if self._thread is not threading.current_thread():
            self.claim_thread()
        self._run()

    def close(self, timeout: float | None = 30.0, interrupt: bool = False) -> None:
        """Refuse new work, fail waiting requests and commands with UNAVAILABLE, and join the
        scheduler. Idempotent.

        Args:
            timeout: seconds to wait for the scheduler thread (None: no limit).
            interrupt: stop the batch in progress at its next decode step (its requests get
                UNAVAILABLE) instead of letting it finish: for a node whose callers are gone
                (its gRPC server has stopped), so the thread, and the framework's work on it,
                ends before the process does.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            if interrupt:
                self._interrupting = True  # the batch in progress stops at its next step
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the scheduler thread is still running after %s s", timeout)

    # -- state -------------------------------------------------------------------------------

    @property
    def scheduler_alive(self) -> bool:
        """Whether the scheduler thread still runs (after :meth:`close`: it did not stop
        within the timeout, e.g. a decode step slower than that)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def serving(self) -> ServingAdapter:
        """The adapter new batches decode with."""
        return self._serving

    @property
    def queue_depth(self) -> int:
        """Requests waiting to start decoding."""
        return len(self._waiting)

    @property
    def active_sequences(self) -> int:
        """Sequences in the batch being decoded now (0 when idle)."""
        return self._active_sequences

    def load(self) -> float:
        """Busy fraction in [0, 1]: (sequences decoding + waiting) / capacity, capped."""
        with self._cond:
            waiting = sum(r.job.n - r.next_sample for r in (*self._waiting, *self._partial))
        return min(1.0, (self._active_sequences + waiting) / self.capacity)

    def recent_batches(self) -> list[BatchRecord]:
        """The last batches decoded, oldest first."""
        with self._cond:
            return list(self._history)

    def shares(self) -> dict[str, float]:
        """Each run's fraction of the work this node started so far (sequences x token
        budget; :mod:`gridrl.rollout.fair_share`), by run name ("" the base model)."""
        with self._cond:
            return self._fair.shares()

    def resident(self) -> list[ServingAdapter]:
        """The adapters loaded, least recently used first."""
        with self._cond:
            return self._resident.listing()

    # -- requests ----------------------------------------------------------------------------

    def submit(self, job: GenerateJob, sink: TokenSink | None = None,
               base_model: bool = False) -> Future:
        """Queue ``job``; the future resolves to a :class:`GenerateOutcome`.

        Cancelling the future before the job starts decoding drops it from the queue.

        Args:
            job: the validated request (``job.adapter``: a resident adapter's name, or "").
            sink: told the adapter and every decode step's tokens (module docstring, "Streams").
            base_model: decode without an adapter, whatever is serving.

        Raises:
            StatusError: RESOURCE_EXHAUSTED when ``max_queue`` requests are already waiting
                and the request's run holds its share of them, or when one of its sequences
                alone exceeds the KV-cache budget; NOT_FOUND when ``job.adapter`` is not
                resident; INVALID_ARGUMENT for a share weight that is not > 0; UNAVAILABLE
                when the scheduler is closing.
        """
        self.kv_budget.check(len(job.prompt_ids), job.sampling.max_tokens)
        try:
            weight = check_weight(job.share_weight)
        except ValueError as e:
            raise StatusError(Kind.INVALID_ARGUMENT, f"share_weight: {e}") from e
        future: Future = Future()
        with self._cond:
            if self._closing:
                raise StatusError(Kind.UNAVAILABLE, "rollout node is shutting down")
            if base_model:
                run = BASE_RUN
            elif job.adapter:
                if job.adapter not in self._resident:
                    raise self._resident.not_resident(job.adapter)
                run = job.adapter
            else:
                run = self._serving.name
            waiting = collections.Counter(r.run for r in self._waiting)
            if len(self._waiting) >= self.max_queue and (
                    len(self._waiting) >= 2 * self.max_queue
                    or not within_share(run, waiting, {**self._weights, run: weight},
                                        self.max_queue)):
                metrics.REJECTED.inc()
                raise resource_exhausted(
                    f"queue full: {len(self._waiting)} requests waiting (--max-queue "
                    f"{self.max_queue}), {waiting.get(run, 0)} of them of run {run!r}, its "
                    "share or more; retry later or on another node")
            self._weights[run] = weight
            if not waiting.get(run) and not any(r.run == run for r in self._partial):
                self._fair.wake(run, waiting)
            req = QueuedRequest(id=next(self._ids), job=job, future=future,
                           arrival=time.perf_counter(), results=[None] * job.n, sink=sink,
                           base_model=base_model, run=run)
            self._waiting.append(req)
            metrics.QUEUE_DEPTH.set(len(self._waiting))
            self._cond.notify_all()
        return future

    def generate(self, job: GenerateJob, timeout: float | None = None) -> GenerateOutcome:
        """:meth:`submit` and wait for the outcome (re-raises the job's error)."""
        return self.submit(job).result(timeout)

    def call_between_batches(self, fn: Callable[[], T], timeout: float | None = None,
                             preempt: bool = False, scope: str | None = None) -> T:
        """Run ``fn`` on the scheduler thread between two batches (no backend call overlaps
        it, and no request is half-decoded), and return its result or raise its exception.
        Commands run before any request that has not started yet.

        Args:
            timeout: seconds to wait for ``fn`` to start; past it the command is withdrawn
                (it never runs) and TimeoutError is raised. Once ``fn`` has started, this
                waits for it to end whatever the timeout.
            preempt: interrupt the batch in progress at its next decode step and restart the
                requests it had started after ``fn`` (module docstring, "Preemption"),
                instead of waiting for them to finish.
            scope: with ``preempt``: only the requests of this adapter name (and those
                following the serving adapter) restart; ``fn`` may then run between two
                decode steps of a batch whose other rows go on.
        Raises:
            StatusError: UNAVAILABLE when the engine is closing.
            TimeoutError: ``fn`` had not started within ``timeout`` seconds; it never will.
        """
        if threading.current_thread() is self._thread:
            return fn()
        future: Future = Future()
        with self._cond:
            if self._closing:
                raise StatusError(Kind.UNAVAILABLE, "rollout node is shutting down")
            self._commands.append(_Command(fn, future, preempt, scope))
            self._cond.notify_all()
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.cancel():  # not started: withdrawn, it never runs
                with self._cond:
                    self._commands = collections.deque(
                        c for c in self._commands if c.future is not future)
                raise TimeoutError(f"the command did not start within {timeout} s") from None
            return future.result()  # started meanwhile: its outcome is the truth

    def preempt_pending(self) -> bool:
        """Whether a preempting command waits to run (the batch in progress should stop)."""
        with self._cond:
            return self._preempt_waiting()

    def _preempt_waiting(self) -> bool:
        return any(c.preempt and not c.future.cancelled() for c in self._commands)

    def _next_preempting(self) -> _Command | None:
        """The first preempting command waiting (not cancelled), or None."""
        with self._cond:
            return self._next_preempting_locked()

    def _next_preempting_locked(self) -> _Command | None:
        return next((c for c in self._commands if c.preempt and not c.future.cancelled()),
                    None)

    def _take_command(self, command: _Command) -> bool:
        """Remove ``command`` from the queue to run it now (between two decode steps);
        False if it was withdrawn meanwhile."""
        with self._cond:
            if command not in self._commands:
                return False
            self._commands.remove(command)
            return True

    def _restart_split(self, scope: str | None, decoding: set[int]) -> None:
        """Between two decode steps, before a scoped command runs: restart the split requests
        in its scope that wait for their next batch and are not in the batch decoding
        (``decoding``: its request ids; those are stopped by the batch's observer)."""
        with self._cond:
            self._restart([r for r in self._partial
                           if r.id not in decoding and self._in_scope(r, scope)])

    def _in_scope(self, req: QueuedRequest, scope: str | None) -> bool:
        """Whether a preempting command of ``scope`` restarts ``req``: every request without
        a scope; else those of that adapter name and those following the serving adapter
        (they named none)."""
        if scope is None:
            return True
        if req.base_model:
            return False
        return not req.job.adapter or (req.adapter is not None and req.adapter.name == scope)

    def set_serving(self, adapter: ServingAdapter, serve: bool = True) -> ServingAdapter:
        """Make ``adapter`` resident under its name (replacing that name's older version) and,
        with ``serve``, the one requests naming no adapter use; returns the previous serving
        adapter. The replaced version, and the least recently used names past
        ``max_resident`` / ``max_adapter_bytes``, are unloaded once no batch uses them. Only
        from a function run by :meth:`call_between_batches` (or before :meth:`start`).

        Raises:
            RuntimeError: called from another thread while the scheduler runs.
        """
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("set_serving must run inside call_between_batches")
        previous = self._serving
        with self._cond:
            if serve or (adapter.handle is not None and previous.handle is not None
                         and previous.name == adapter.name):
                self._serving = adapter  # a newer version of the serving name serves too
            if adapter.handle is not None:
                for handle in self._resident.put(adapter, protect=self._serving.name):
                    self._retire(handle)
        if serve:
            metrics.ADAPTER_VERSION.set(adapter.version)
        self._unload_retired()
        return previous

    def check_fits(self, name: str, nbytes: int) -> None:
        """:meth:`ResidentAdapters.check_fits` (RESOURCE_EXHAUSTED naming the limit)."""
        self._resident.check_fits(name, nbytes)

    def _retire(self, handle: Any) -> None:
        """With the lock held: unload ``handle`` once no batch uses it."""
        if handle is not None and handle is not self._serving.handle:
            self._retired.append(handle)

    def _unload_retired(self) -> None:
        """On the scheduler thread, between batches: unload retired handles."""
        if self._in_batch:
            return
        with self._cond:
            retired, self._retired = self._retired, []
        for handle in retired:
            try:
                self.backend.unload_adapter(handle)
            except Exception:
                log.exception("unloading a replaced adapter failed")

    # -- scheduler ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._schedule()
        finally:
            release_thread_state()  # this thread ran the backend: free its streams (MLX)

    def _schedule(self) -> None:
        while True:
            with self._cond:
                while not (self._closing or self._partial or self._commands or self._waiting):
                    self._cond.wait()
                if self._closing:
                    break
                if self._partial and self._preempt_waiting():
                    # split requests in the command's scope restart after it
                    command = self._next_preempting_locked()
                    self._restart_started([], None if command is None else command.scope)
                command = self._commands.popleft() if (self._commands and not self._partial) \
                    else None
                if command is None and not self._partial:
                    self._wait_for_company()
                    if self._commands or self._closing:
                        continue  # a swap arrived while waiting: it goes first
                items = [] if command is not None else self._take_batch()
            if command is not None:
                self._run_command(command)
            elif items:
                self._run_batch(items)
            self._unload_retired()
        with self._cond:
            self._scheduler_done = True
        self._shutdown()

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

    def _run_batch(self, items: list[tuple[QueuedRequest, int]]) -> None:
        adapter = items[0][0].adapter or self._serving
        # samples of max_tokens 0 (a prompt scored, nothing decoded) are not decoded
        decoding = [(req, i) for req, i in items if req.job.sampling.max_tokens > 0]
        batch = [SequenceRequest(prompt_ids=list(req.job.prompt_ids), sampling=req.job.sampling,
                                 seed=rng.sequence_seed(req.job.seed, i),
                                 keep_cache=req.job.keep_cache) for req, i in decoding]
        handles = [(req.adapter or BASE_MODEL).handle for req, _ in decoding]
        runs: dict[str, int] = {}
        for req, _ in items:
            runs[req.run] = runs.get(req.run, 0) + 1
        index = self._batch_index
        self._batch_index += 1
        self._active_sequences = len(batch)
        metrics.ACTIVE_SEQUENCES.set(len(batch))
        metrics.BATCH_SIZE.observe(len(batch))
        observer = BatchObserver(items, decoding, self)
        start = time.perf_counter()
        self._in_batch = True
        try:
            observer.start()
            if not batch:
                decoded = iter([])
            elif all(h is handles[0] for h in handles):
                decoded = iter(self.backend.generate(batch, handles[0], observer))
            else:  # rows of several adapters in one batch (module docstring, "Adapters")
                decoded = iter(self.backend.generate_mixed(batch, handles, observer))
            results = [next(decoded, None) if req.job.sampling.max_tokens > 0
                       else SequenceResult() for req, _ in items]
            if any(r is None for r in results) or next(decoded, None) is not None:
                raise RuntimeError(f"the backend did not return {len(batch)} results for "
                                   f"{len(batch)} sequences")
        except DecodeInterrupted as e:
            if self._interrupting:
                log.info("batch %d of %d sequences interrupted: %s", index, len(batch), e)
                self._fail_batch(items, StatusError(
                    Kind.UNAVAILABLE, f"the rollout node is shutting down ({e})"))
            elif all(abandoned(req) for req, _ in items):
                log.debug("batch %d of %d sequences stopped after %d steps: every request in "
                          "it was abandoned", index, len(batch), e.steps)
                self._fail_batch(items, cancelled())
            else:  # a preempting command (an adapter push) waits
                command = self._next_preempting()
                self._requeue_started(items, index, adapter, time.perf_counter() - start,
                                      e.steps, None if command is None else command.scope,
                                      tuple(runs.items()))
            return
        except Exception as e:
            log.exception("batch %d of %d sequences failed", index, len(batch))
            self._fail_batch(items, e)
            return
        finally:
            self._in_batch = False
            self._active_sequences = 0
            metrics.ACTIVE_SEQUENCES.set(0)
        end = time.perf_counter()
        first = self.backend.last_first_token_s
        first_token = start + first if isinstance(first, float) else end
        cut = observer.cut  # their adapter was replaced between two steps: they restart
        if cut:
            with self._cond:
                self._restart(list(cut.values()))
            log.info("batch %d: %d requests stopped between two decode steps for their "
                     "adapter's new version and requeued; %d other sequences went on", index,
                     len(cut), sum(1 for req, _ in items if req.id not in cut))
        requests: list[int] = []
        finished: list[QueuedRequest] = []
        for (req, i), result in zip(items, results, strict=True):
            if req.id in cut:
                continue
            if not requests or requests[-1] != req.id:
                requests.append(req.id)
                req.batches.append(index)
            if req.first_token is None:
                req.first_token = first_token
            req.results[i] = result
            req.done_samples += 1
            if req.done_samples == req.job.n:
                finished.append(req)
        with self._cond:
            self._history.append(BatchRecord(
                index, len(batch), tuple(requests), adapter.version, end - start,
                runs=tuple(runs.items()), cut=sum(1 for req, _ in items if req.id in cut)))
        metrics.BATCHES.inc()
        metrics.BATCH_DURATION.observe(end - start)
        for req in finished:
            self._finish(req, end)

    def _requeue_started(self, items: list[tuple[QueuedRequest, int]], index: int,
                         adapter: ServingAdapter, seconds: float, steps: int,
                         scope: str | None, runs: tuple[tuple[str, int], ...]) -> None:
        """After an interrupted batch: restart its requests and the split ones waiting for
        their next batch that are in the command's ``scope`` (:meth:`_restart_started`); the
        batch's other requests go back to wait for their next batch as they were."""
        with self._cond:
            restarted = self._restart_started([req for req, _ in items], scope)
            others = {req.id: req for req, _ in items if not req.future.done()
                      and req not in restarted}
            for req in sorted(others.values(), key=lambda r: r.id, reverse=True):
                for _, i in [(q, i) for q, i in items if q is req]:
                    req.next_sample = min(req.next_sample, i)  # its samples of this batch
                if req not in self._partial:
                    self._partial.appendleft(req)
            self._history.append(BatchRecord(index, len(items), tuple(r.id for r in restarted),
                                             adapter.version, seconds, interrupted=True,
                                             runs=runs))
        metrics.BATCHES_INTERRUPTED.inc()
        log.info("batch %d (%d sequences, %s) interrupted after %d steps for a preempting "
                 "command; %d requests requeued", index, len(items),
                 f"{adapter.name} v{adapter.version}" if adapter.handle is not None
                 else "the base model", steps, len(restarted))

    def _restart_started(self, reqs: list[QueuedRequest], scope: str | None = None
                         ) -> list[QueuedRequest]:
        """With the lock held: reset those of ``reqs`` and of the split requests waiting for
        their next batch that a command of ``scope`` concerns (:meth:`_in_scope`), and put
        them back at the head of the queue in arrival order, so that they decode again,
        whole, on what serves after the preempting command. Returns them."""
        started = {req.id: req for req in (*reqs, *self._partial)
                   if not req.future.done() and self._in_scope(req, scope)}
        self._partial = collections.deque(r for r in self._partial if r.id not in started)
        return self._restart(list(started.values()))

    def _restart(self, reqs: list[QueuedRequest]) -> list[QueuedRequest]:
        """With the lock held: reset ``reqs`` (started, not done) and put them back at the
        head of the queue in arrival order; a streamed one fails with ABORTED instead (its
        caller holds tokens of the old adapter). Returns those requeued."""
        started = {req.id: req for req in reqs if not req.future.done()}
        self._partial = collections.deque(r for r in self._partial if r.id not in started)
        for req in [r for r in started.values() if r.sink is not None]:
            del started[req.id]  # its caller holds tokens of the old adapter: it cannot restart
            req.future.set_exception(StatusError(
                Kind.ABORTED, "the node switched adapters (a push or reload) while "
                "this streamed request was decoding; nothing more will come: send it again"))
        for req in sorted(started.values(), key=lambda r: r.id, reverse=True):
            req.next_sample = req.done_samples = 0
            req.results = [None] * req.job.n
            req.adapter = req.first_token = None
            req.batches = []
            self._waiting.appendleft(req)
        metrics.QUEUE_DEPTH.set(len(self._waiting))
        return sorted(started.values(), key=lambda r: r.id)

    def _finish(self, req: QueuedRequest, end: float) -> None:
        prompt_logprobs = prompt_top = None
        if req.job.prompt_logprobs is not None:  # the adapter that decoded it still serves
            try:
                prompt_logprobs, prompt_top = self._score_prompt(req)
            except Exception as e:
                log.exception("scoring the prompt of request %d failed", req.id)
                req.future.set_exception(
                    e if isinstance(e, StatusError) else
                    StatusError(Kind.INTERNAL, f"scoring the prompt failed: {e}"))
                return
        samples = [r for r in req.results if r is not None]
        tokens = sum(len(r.token_ids) for r in samples)
        metrics.COMPLETION_TOKENS.inc(tokens)
        metrics.PROMPT_TOKENS.inc(len(req.job.prompt_ids))
        for r in samples:
            metrics.SAMPLES.labels(r.finish_reason).inc()
        first_token = (req.first_token or end) - req.arrival
        metrics.TIME_TO_FIRST_TOKEN.observe(first_token)
        metrics.QUEUE_WAIT.observe(req.started - req.arrival)
        metrics.REQUEST_DURATION.observe(end - req.arrival)
        req.future.set_result(GenerateOutcome(
            samples=samples, adapter=req.adapter or BASE_MODEL, queued_s=req.started - req.arrival,
            first_token_s=first_token, duration_s=end - req.arrival, batches=list(req.batches),
            prompt_logprobs=prompt_logprobs, prompt_top_logprobs=prompt_top))

    def _score_prompt(self, req: QueuedRequest) -> tuple[list[float], list[TopLogprobs]]:
        """The prompt's logprobs and alternatives (module docstring, "Prompt logprobs").

        Raises:
            StatusError: FAILED_PRECONDITION when the backend cannot score alternatives.
        """
        prompt = list(req.job.prompt_ids)
        handle = (req.adapter or BASE_MODEL).handle
        try:
            return self.backend.score_top(prompt[:1], prompt[1:], _MODEL_DISTRIBUTION, handle,
                                          req.job.prompt_logprobs or 0)
        except NotImplementedError as e:
            raise StatusError(Kind.FAILED_PRECONDITION, f"prompt logprobs: {e}") from e

    def _fail_batch(self, items: list[tuple[QueuedRequest, int]], error: Exception) -> None:
        failed = {req.id: req for req, _ in items}
        with self._cond:
            self._partial = collections.deque(r for r in self._partial if r.id not in failed)
        if isinstance(error, StatusError):
            status = error
        elif isinstance(error, ConnectionError):  # a backend's server (vLLM) is unreachable
            status = StatusError(Kind.UNAVAILABLE, f"decoding failed: {error}")
        else:
            status = StatusError(Kind.INTERNAL,
                                 f"decoding failed: {type(error).__name__}: {error}")
        for req in failed.values():
            if not req.future.done():
                req.future.set_exception(status)

    def _run_command(self, command: _Command) -> None:
        if not command.future.set_running_or_notify_cancel():
            return
        try:
            result = command.fn()
        except BaseException as e:
            command.future.set_exception(e)
        else:
            command.future.set_result(result)

    def _shutdown(self) -> None:
        unavailable = StatusError(Kind.UNAVAILABLE, "rollout node is shutting down")
        with self._cond:
            pending = [*self._waiting, *self._partial]
            commands = list(self._commands)
            self._waiting.clear()
            self._partial.clear()
            self._commands.clear()
        for req in pending:
            if req.future.running() or req.future.set_running_or_notify_cancel():
                req.future.set_exception(unavailable)
        for command in commands:
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(unavailable)
        metrics.QUEUE_DEPTH.set(0)


