"""One batch of the node's scheduler (:mod:`gridrl.rollout.scheduler`): the backend call that
decodes it (rows of one adapter through ``Backend.generate``, of several through
``Backend.generate_mixed``), with its :class:`~gridrl.rollout.batch_observer.BatchObserver`;
then its results handed to their requests (a request's prompt scored, "Prompt logprobs", once
its last sample is in), its interruption turned into requeued requests, or its failure into
each request's error.

A mixin of :class:`~gridrl.rollout.scheduler.BatchScheduler` (state declared below); it runs on
the scheduler thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from gridrl.common.errors import Kind, StatusError
from gridrl.engine import rng
from gridrl.engine.contract import (
    Backend,
    DecodeInterrupted,
    SamplingConfig,
    SequenceRequest,
    SequenceResult,
    TopLogprobs,
)
from gridrl.rollout import metrics
from gridrl.rollout.batch_observer import BatchObserver, abandoned, cancelled
from gridrl.rollout.jobs import (
    BASE_MODEL,
    BatchRecord,
    GenerateOutcome,
    QueuedRequest,
    ServingAdapter,
)

log = logging.getLogger("gridrl.rollout.scheduler")

#: How a prompt is scored: the model's own distribution (greedy's transform: none).
_MODEL_DISTRIBUTION = SamplingConfig(max_tokens=1, temperature=0.0)


class BatchRun:
    """Decodes one batch and settles its requests (state: :class:`BatchScheduler`'s; the
    restart methods are :class:`~gridrl.rollout.preemption.Preemption`'s)."""

    backend: Backend
    _cond: threading.Condition
    _partial: collections.deque[QueuedRequest]
    _history: collections.deque[BatchRecord]
    _serving: ServingAdapter
    _batch_index: int
    _active_sequences: int
    _in_batch: bool
    _interrupting: bool

    if TYPE_CHECKING:  # provided by Preemption
        def _next_preempting(self) -> Any: ...
        def _requeue_started(self, items: list[tuple[QueuedRequest, int]], index: int,
                             adapter: ServingAdapter, seconds: float, steps: int,
                             scope: str | None, runs: tuple[tuple[str, int], ...]) -> None: ...
        def _restart(self, reqs: list[QueuedRequest]) -> list[QueuedRequest]: ...

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
