"""The engine of a rollout node: a bounded queue, one scheduler thread, dynamic batching across
concurrent requests, and adapter swaps between batches or between two decode steps.

    engine = Engine(backend, capacity=64, max_queue=128).start()
    outcome = engine.generate(GenerateJob(prompt_ids, sampling, n=8, seed=1))
    engine.call_between_batches(lambda: engine.set_serving(new_adapter))
    engine.call_between_batches(lambda: engine.set_serving(newer), preempt=True, timeout=5)

Batching: the scheduler takes waiting requests in arrival order and decodes up to ``capacity``
sequences together in one backend call (the ``n`` samples of each request, across requests),
and no more than its KV-cache budget holds (:class:`~gridrl.rollout.kv_budget.KvBudget`: rows x
(longest prompt + largest max_tokens + overhead) tokens); a request one of whose samples alone
does not fit is refused at :meth:`Engine.submit` (RESOURCE_EXHAUSTED).
A request whose samples do not all fit is split; its remaining samples go first into the next
batch. When the scheduler was idle, it waits up to ``batch_window_s`` after the first arrival
so that concurrent callers land in the same batch.

Seeds: sample ``i`` of a request seeded ``s`` decodes with ``rng.sequence_seed(s, i)``, so its
tokens do not depend on the batch it lands in (up to float rounding changing an argmax).

Adapters: every backend call happens on the scheduler thread. Commands queued with
:meth:`Engine.call_between_batches` run there too, between two batches and never while a
request has samples both decoded and still waiting, so every sample of a request is produced by
the same adapter: requests that started decoding finish on the adapter they started with, and
requests started after a swap get the new one. A request submitted with ``base_model=True``
decodes without any adapter whatever is serving; a batch holds requests of one adapter only.

Preemption (adapter pushes): a command queued with ``preempt=True`` does not wait for the batch
in progress. The scheduler's :class:`~gridrl.engine.contract.DecodeObserver` answers
``interrupted()`` with True at the backend's next decode step (or prefill), the backend raises
``DecodeInterrupted``, and every request that had started (in that batch, or split and waiting
for its next one) is reset and put back at the head of the queue, in arrival order; the command
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
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
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
from gridrl.rollout.config import default_of
from gridrl.rollout.jobs import (
    BASE_MODEL,
    BatchRecord,
    GenerateJob,
    GenerateOutcome,
    ServingAdapter,
    TokenSink,
)
from gridrl.rollout.kv_budget import KvBudget

log = logging.getLogger(__name__)
T = TypeVar("T")


#: How a prompt is scored: the model's own distribution (greedy's transform: none).
_MODEL_DISTRIBUTION = SamplingConfig(max_tokens=1, temperature=0.0)


def _same_adapter(a: ServingAdapter, b: ServingAdapter) -> bool:
    return a.handle is b.handle and a.name == b.name and a.version == b.version


@dataclass
class _Request:
    id: int
    job: GenerateJob
    future: Future
    arrival: float
    next_sample: int = 0  # samples [0, next_sample) are scheduled
    done_samples: int = 0
    results: list[SequenceResult | None] = field(default_factory=list)
    adapter: ServingAdapter | None = None
    sink: TokenSink | None = None
    base_model: bool = False
    started: float = 0.0
    first_token: float | None = None
    batches: list[int] = field(default_factory=list)


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: Future
    preempt: bool = False


class Engine:
    """Batches Generate jobs over one backend and swaps adapters between batches.

    Args:
        backend: the model (any :class:`~gridrl.engine.contract.Backend`).
        capacity: most sequences decoded together in one batch (>= 1).
        max_queue: most requests waiting to start; past it, :meth:`submit` raises
            RESOURCE_EXHAUSTED (>= 1).
        batch_window_s: how long an idle scheduler waits after a first arrival for more.
        The defaults are the node's settings (:class:`gridrl.rollout.config.NodeConfig`).
        history: how many :class:`BatchRecord` to keep for :meth:`recent_batches`.
        kv_budget: KV-cache tokens a batch may take (default: not limited).
    """

    def __init__(self, backend: Backend, capacity: int = default_of("capacity"),
                 max_queue: int = default_of("max_queue"),
                 batch_window_s: float = default_of("batch_window_s"), history: int = 256,
                 kv_budget: KvBudget | None = None) -> None:
        if capacity < 1 or max_queue < 1:
            raise ValueError(f"capacity ({capacity}) and max_queue ({max_queue}) must be >= 1")
        self.backend = backend
        self.capacity = capacity
        self.max_queue = max_queue
        self.batch_window_s = batch_window_s
        self.kv_budget = kv_budget or KvBudget()
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._partial: collections.deque[_Request] = collections.deque()
        self._commands: collections.deque[_Command] = collections.deque()
        self._serving = BASE_MODEL
        self._ids = itertools.count(1)
        self._batch_index = 0
        self._active_sequences = 0
        self._history: collections.deque[BatchRecord] = collections.deque(maxlen=history)
        self._closing = False
        self._scheduler_done = False
        self._interrupting = False  # close(interrupt=True): stop the batch in progress
        self._observer = _SchedulerObserver(self)
        self._thread: threading.Thread | None = None
        self.started_at = time.time()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Engine:
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
                raise RuntimeError("the engine's scheduler thread is already running")
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

    # -- requests ----------------------------------------------------------------------------

    def submit(self, job: GenerateJob, sink: TokenSink | None = None,
               base_model: bool = False) -> Future:
        """Queue ``job``; the future resolves to a :class:`GenerateOutcome`.

        Cancelling the future before the job starts decoding drops it from the queue.

        Args:
            job: the validated request.
            sink: told the adapter and every decode step's tokens (module docstring, "Streams").
            base_model: decode without an adapter, whatever is serving.

        Raises:
            StatusError: RESOURCE_EXHAUSTED when ``max_queue`` requests are already waiting,
                or when one of its sequences alone exceeds the KV-cache budget; UNAVAILABLE
                when the engine is closing.
        """
        self.kv_budget.check(len(job.prompt_ids), job.sampling.max_tokens)
        future: Future = Future()
        with self._cond:
            if self._closing:
                raise StatusError(Kind.UNAVAILABLE, "rollout node is shutting down")
            if len(self._waiting) >= self.max_queue:
                metrics.REJECTED.inc()
                raise resource_exhausted(
                    f"queue full: {len(self._waiting)} requests waiting (--max-queue "
                    f"{self.max_queue}); retry later or on another node")
            req = _Request(id=next(self._ids), job=job, future=future,
                           arrival=time.perf_counter(), results=[None] * job.n, sink=sink,
                           base_model=base_model)
            self._waiting.append(req)
            metrics.QUEUE_DEPTH.set(len(self._waiting))
            self._cond.notify_all()
        return future

    def generate(self, job: GenerateJob, timeout: float | None = None) -> GenerateOutcome:
        """:meth:`submit` and wait for the outcome (re-raises the job's error)."""
        return self.submit(job).result(timeout)

    def call_between_batches(self, fn: Callable[[], T], timeout: float | None = None,
                             preempt: bool = False) -> T:
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
            self._commands.append(_Command(fn, future, preempt))
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

    def set_serving(self, adapter: ServingAdapter) -> ServingAdapter:
        """Make ``adapter`` the one new batches use; returns the previous one. Only from a
        function run by :meth:`call_between_batches` (or before :meth:`start`).

        Raises:
            RuntimeError: called from another thread while the scheduler runs.
        """
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("set_serving must run inside call_between_batches")
        previous, self._serving = self._serving, adapter
        metrics.ADAPTER_VERSION.set(adapter.version)
        return previous

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
                    self._restart_started([])  # split requests restart after the command
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

    def _take_batch(self) -> list[tuple[_Request, int]]:
        """With the lock held: pick up to ``capacity`` (request, sample index) pairs, unfinished
        started requests first, then waiting ones in arrival order, all of one adapter (the
        first waiting request of another adapter ends the batch) and within the KV-cache
        budget (the first request that does not fit ends it; a batch holds at least one
        sequence, which :meth:`submit` made sure fits). Abandoned requests are dropped with
        CANCELLED."""
        room = self.capacity
        items: list[tuple[_Request, int]] = []
        adapter: ServingAdapter | None = None
        longest = largest = 0  # the batch's longest prompt and largest max_tokens so far
        now = time.perf_counter()
        for source in (self._partial, self._waiting):
            while source and room > 0:
                req = source[0]
                # rows of the batch with this request in it that the KV-cache budget holds
                shape = (max(longest, len(req.job.prompt_ids)),
                         max(largest, req.job.sampling.max_tokens))
                fit = self.kv_budget.rows_that_fit(*shape) - len(items)
                if fit < 1 and items:
                    break  # the next batch starts with it
                if source is self._waiting:
                    wanted = BASE_MODEL if req.base_model else self._serving
                    if adapter is not None and not _same_adapter(adapter, wanted):
                        break  # the next batch starts with it
                    if not req.future.running() and \
                            not req.future.set_running_or_notify_cancel():
                        source.popleft()  # cancelled while queued
                        continue
                    req.adapter = wanted
                    req.started = req.started or now
                if _abandoned(req):
                    source.popleft()
                    req.future.set_exception(_cancelled())
                    continue
                adapter = req.adapter
                longest, largest = shape
                take = min(room, max(1, fit), req.job.n - req.next_sample)
                items.extend((req, i) for i in range(req.next_sample, req.next_sample + take))
                req.next_sample += take
                room -= take
                source.popleft()
                if req.next_sample < req.job.n:
                    self._partial.append(req)
        metrics.QUEUE_DEPTH.set(len(self._waiting))
        return items

    def _run_batch(self, items: list[tuple[_Request, int]]) -> None:
        adapter = items[0][0].adapter or self._serving
        # samples of max_tokens 0 (a prompt scored, nothing decoded) are not decoded
        decoding = [(req, i) for req, i in items if req.job.sampling.max_tokens > 0]
        batch = [SequenceRequest(prompt_ids=list(req.job.prompt_ids), sampling=req.job.sampling,
                                 seed=rng.sequence_seed(req.job.seed, i),
                                 keep_cache=req.job.keep_cache) for req, i in decoding]
        index = self._batch_index
        self._batch_index += 1
        self._active_sequences = len(batch)
        metrics.ACTIVE_SEQUENCES.set(len(batch))
        metrics.BATCH_SIZE.observe(len(batch))
        observer = (_BatchObserver(items, decoding, self) if any(req.sink for req, _ in items)
                    else self._observer)
        start = time.perf_counter()
        try:
            if isinstance(observer, _BatchObserver):
                observer.start()
            decoded = iter(self.backend.generate(batch, adapter.handle, observer)
                           if batch else [])
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
            elif all(_abandoned(req) for req, _ in items):
                log.debug("batch %d of %d sequences stopped after %d steps: every request in "
                          "it was abandoned", index, len(batch), e.steps)
                self._fail_batch(items, _cancelled())
            else:  # a preempting command (an adapter push) waits
                self._requeue_started(items, index, adapter, time.perf_counter() - start,
                                      e.steps)
            return
        except Exception as e:
            log.exception("batch %d of %d sequences failed", index, len(batch))
            self._fail_batch(items, e)
            return
        finally:
            self._active_sequences = 0
            metrics.ACTIVE_SEQUENCES.set(0)
        end = time.perf_counter()
        first = self.backend.last_first_token_s
        first_token = start + first if isinstance(first, float) else end
        requests: list[int] = []
        finished: list[_Request] = []
        for (req, i), result in zip(items, results, strict=True):
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
            self._history.append(BatchRecord(index, len(batch), tuple(requests),
                                             adapter.version, end - start))
        metrics.BATCHES.inc()
        metrics.BATCH_DURATION.observe(end - start)
        for req in finished:
            self._finish(req, end)

    def _requeue_started(self, items: list[tuple[_Request, int]], index: int,
                         adapter: ServingAdapter, seconds: float, steps: int) -> None:
        """After an interrupted batch: restart its requests and the split ones waiting for
        their next batch (:meth:`_restart_started`)."""
        with self._cond:
            restarted = self._restart_started([req for req, _ in items])
            self._history.append(BatchRecord(index, len(items), tuple(r.id for r in restarted),
                                             adapter.version, seconds, interrupted=True))
        metrics.BATCHES_INTERRUPTED.inc()
        log.info("batch %d (%d sequences, %s) interrupted after %d steps for a preempting "
                 "command; %d requests requeued", index, len(items),
                 f"{adapter.name} v{adapter.version}" if adapter.handle is not None
                 else "the base model", steps, len(restarted))

    def _restart_started(self, reqs: list[_Request]) -> list[_Request]:
        """With the lock held: reset ``reqs`` and every split request waiting for its next
        batch, and put them back at the head of the queue in arrival order, so that they
        decode again, whole, on what serves after the preempting command. Returns them."""
        started = {req.id: req for req in (*reqs, *self._partial) if not req.future.done()}
        self._partial.clear()
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

    def _finish(self, req: _Request, end: float) -> None:
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

    def _score_prompt(self, req: _Request) -> tuple[list[float], list[TopLogprobs]]:
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

    def _fail_batch(self, items: list[tuple[_Request, int]], error: Exception) -> None:
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


class _SchedulerObserver:
    """The :class:`~gridrl.engine.contract.DecodeObserver` of every batch: stops it between
    decode steps once :meth:`Engine.close` was asked to interrupt (any thread), or once a
    preempting command waits (module docstring, "Preemption")."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def on_tokens(self, rows: list[int], token_ids: list[int], logprobs: list[float],
                  top: Sequence[TopLogprobs] | None = None) -> None:
        pass

    def interrupted(self) -> bool:
        return self._engine._interrupting or self._engine.preempt_pending()


def _cancelled() -> StatusError:
    return StatusError(Kind.CANCELLED, "request abandoned by its caller")


def _abandoned(req: _Request) -> bool:
    if req.sink is None:
        return False
    try:
        return bool(req.sink.abandoned())
    except Exception:
        log.exception("token sink of request %d failed; dropping the request", req.id)
        return True


class _BatchObserver(_SchedulerObserver):
    """The observer of a batch with token sinks (OpenAI streaming): routes its decode steps to
    the sinks of its requests, and also stops the batch once every request in it is abandoned.
    A sink that raises is logged and dropped; the batch goes on."""

    def __init__(self, items: list[tuple[_Request, int]], rows: list[tuple[_Request, int]],
                 engine: Engine) -> None:
        super().__init__(engine)
        self._rows = rows  # the backend's rows: the items it decodes
        self._requests = list({req.id: req for req, _ in items}.values())
        self._broken: set[int] = set()

    def start(self) -> None:
        """Tell each request decoding for the first time which adapter it got."""
        for req in self._requests:
            if req.sink is not None and not req.batches:
                self._call(req, "started", req.adapter or BASE_MODEL)

    def on_tokens(self, rows: Sequence[int], token_ids: Sequence[int],
                  logprobs: Sequence[float], top: Sequence[TopLogprobs] | None = None) -> None:
        steps: dict[int, tuple[_Request, list[int], list[int], list[float],
                               list[TopLogprobs]]] = {}
        for j, (row, token, logprob) in enumerate(zip(rows, token_ids, logprobs, strict=True)):
            req, i = self._rows[row]
            if req.sink is None or req.id in self._broken:
                continue
            step = steps.setdefault(req.id, (req, [], [], [], []))
            step[1].append(i)
            step[2].append(int(token))
            step[3].append(float(logprob))
            step[4].append(top[j] if top is not None else [])
        for req, samples, tokens, lps, alternatives in steps.values():
            extra = {"top": alternatives} if req.job.sampling.top_logprobs else {}
            self._call(req, "on_tokens", samples, tokens, lps, **extra)

    def interrupted(self) -> bool:
        return super().interrupted() or all(_abandoned(req) for req in self._requests)

    def _call(self, req: _Request, method: str, *args: Any, **kwargs: Any) -> None:
        try:
            getattr(req.sink, method)(*args, **kwargs)
        except Exception:
            log.exception("token sink of request %d failed; it gets no more tokens", req.id)
            self._broken.add(req.id)
