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
decoded together by ``Backend.generate_mixed`` (the torch lean forward and MLX: one base
product, one small product per adapter group, S-LoRA / Punica). Every backend call happens on the scheduler
thread. Commands queued with :meth:`BatchScheduler.call_between_batches` run there too,
between two batches (or between two decode steps, below) and never while a request has samples
both decoded and still waiting on the adapter they replace, so every sample of a request is
produced by the same adapter version: requests that started decoding finish on the adapter
they started with, and requests started after a swap get the new one. A request submitted with
``base_model=True`` decodes without any adapter whatever is serving.

Preemption (adapter pushes): a command queued with ``preempt=True`` does not wait for the batch
in progress. With a ``scope`` (the name of the adapter a push replaces) it concerns only the
rows of that adapter and the rows following the serving adapter: the batch's other rows go on
untouched, and where the backend stops single rows (the torch lean forward, MLX) the command runs
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

Modules, by job: admission and the public API here (:class:`BatchScheduler`); which requests
the next batch takes, :mod:`gridrl.rollout.batch_assembly`; the backend call of one batch and
its results, :mod:`gridrl.rollout.batch_run`; commands, preemption and restarts,
:mod:`gridrl.rollout.preemption`, and what stops between two decode steps,
:mod:`gridrl.rollout.batch_observer`.

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
from typing import Any, TypeVar

from gridrl.common.errors import Kind, StatusError, resource_exhausted
from gridrl.engine.contract import Backend
from gridrl.engine.threads import release_thread_state
from gridrl.rollout import metrics
from gridrl.rollout.batch_assembly import BatchAssembly
from gridrl.rollout.batch_run import BatchRun
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
from gridrl.rollout.preemption import Command, Preemption
from gridrl.rollout.residency import ResidentAdapters

log = logging.getLogger(__name__)
T = TypeVar("T")


class BatchScheduler(BatchAssembly, Preemption, BatchRun):
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
        self._commands: collections.deque[Command] = collections.deque()
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
            self._commands.append(Command(fn, future, preempt, scope))
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


