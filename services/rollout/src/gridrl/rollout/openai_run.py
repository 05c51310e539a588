"""One OpenAI request inside the node's engine: RequestRun is the TokenSink the scheduler thread
feeds and the asyncio side that turns its events into choices (text, tokens, logprobs, stop
strings); drain runs it to its end. gridrl.rollout.openai_server turns runs into HTTP answers."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from typing import Any

from gridrl.common.errors import Kind, StatusError
from gridrl.engine.contract import TopLogprobs
from gridrl.rollout.jobs import GenerateOutcome, ServingAdapter
from gridrl.rollout.openai_decode import SampleText
from gridrl.rollout.openai_protocol import OpenAIError, Prepared
from gridrl.rollout.openai_responses import (
    Choice,
    Echo,
    Named,
)
from gridrl.rollout.text import TextCodec


class RequestRun:
    """One HTTP request in the engine: the :class:`~gridrl.rollout.jobs.TokenSink` the
    scheduler thread feeds, and the asyncio side that turns its events into choices.

    The scheduler thread only posts events to the loop (``call_soon_threadsafe``) and reads
    ``abandoned``; everything else runs on the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, prepared: Prepared, codec: TextCodec,
                 eos_ids: frozenset[int]) -> None:
        self._loop = loop
        self._events: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._abandoned = False
        self._codec = codec
        self._prepared = prepared
        job = prepared.job
        self.samples = [SampleText(codec, eos_ids, prepared.stop, job.sampling.stop_token_ids,
                                   job.sampling.max_tokens) for _ in range(job.n)]
        self.top: list[list[Named]] = [[] for _ in range(job.n)]  # each sample's, named
        self.adapter: ServingAdapter | None = None
        self.future: Future | None = None

    # -- scheduler thread (TokenSink) ------------------------------------------------------

    def started(self, adapter: ServingAdapter) -> None:
        self._post(("started", adapter))

    def on_tokens(self, samples: Sequence[int], token_ids: Sequence[int],
                  logprobs: Sequence[float], top: Sequence[TopLogprobs] | None = None) -> None:
        self._post(("tokens", list(samples), list(token_ids), list(logprobs),
                    list(top) if top is not None else None))

    def abandoned(self) -> bool:
        return self._abandoned

    def _post(self, event: tuple[Any, ...]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody listens any more
            self._abandoned = True

    # -- loop --------------------------------------------------------------------------------

    def attach(self, future: Future) -> None:
        """Watch the engine's future (it resolves when the request's last batch ends)."""
        self.future = future
        future.add_done_callback(lambda f: self._post(("done", f)))

    def abandon(self) -> None:
        """Want no more tokens: drop the request from the queue, or let the engine stop
        feeding it (and stop its batch when nobody else is in it)."""
        self._abandoned = True
        if self.future is not None:
            self.future.cancel()

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    async def wait_started(self) -> ServingAdapter:
        """The adapter, once the request's first batch starts.

        Raises:
            OpenAIError: the request failed before it started (e.g. the node is closing).
        """
        while self.adapter is None:
            event = await self._events.get()
            if event[0] == "started":
                self.adapter = event[1]
            else:  # the engine says "started" before any token or success: a failure
                if event[0] == "done":
                    self._raise_failure(event[1])
                raise RuntimeError(f"the engine sent {event[0]!r} before 'started'")
        return self.adapter

    async def steps(self) -> AsyncIterator[list[Choice]]:
        """The choices each decode step adds (new text, tokens, finish reason), until every
        sample has finished.

        Raises:
            OpenAIError: the engine failed the request before every sample finished.
        """
        while not self.finished:
            event = await self._events.get()
            if event[0] == "tokens":
                _, samples, token_ids, logprobs, top = event
                by_sample: dict[int, tuple[list[int], list[float], list[TopLogprobs]]] = {}
                for j, (i, token, logprob) in enumerate(zip(samples, token_ids, logprobs,
                                                            strict=True)):
                    entry = by_sample.setdefault(i, ([], [], []))
                    entry[0].append(token)
                    entry[1].append(logprob)
                    entry[2].append(top[j] if top is not None else [])
                yield [self._choice(i, *entry) for i, entry in sorted(by_sample.items())]
            elif event[0] == "done":
                self._raise_failure(event[1])
                yield self._rest(event[1].result())
        self.abandon()  # every sample ended: the engine may stop decoding it

    def _choice(self, i: int, token_ids: list[int], logprobs: list[float],
                top: list[TopLogprobs]) -> Choice:
        delta = self.samples[i].feed(token_ids, logprobs)
        named = self.name_top(top[:len(delta.token_ids)])  # the tokens the sample accepted
        self.top[i] += named
        return Choice(index=i, text=delta.text, token_ids=delta.token_ids,
                      logprobs=delta.logprobs, text_offsets=delta.text_offsets,
                      token_texts=self.token_texts(delta.token_ids),
                      finish_reason=delta.finish_reason, top=named)

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token as logprobs name it (nothing when logprobs were not asked for)."""
        if not self._prepared.logprobs:
            return []
        if self._prepared.tokens_as_ids:
            return [f"token_id:{t}" for t in token_ids]
        return self._codec.token_texts(token_ids)

    def name_top(self, top: Sequence[TopLogprobs]) -> list[Named]:
        """Alternatives with each token named as :meth:`token_texts` names it (nothing when
        none were asked for)."""
        if not (self._prepared.logprobs and self._prepared.top_logprobs):
            return []
        return [list(zip(self.token_texts([t for t, _ in pairs]), (v for _, v in pairs),
                         strict=True)) for pairs in top]

    def echo(self, outcome: GenerateOutcome) -> Echo:
        """The prompt to return before the completion (``echo``), with its logprobs and
        alternatives when logprobs were asked (the outcome's prompt scores)."""
        p = self._prepared
        ids = list(p.job.prompt_ids)
        texts = self.token_texts(ids)
        offsets = list(itertools.accumulate((len(t) for t in texts[:-1]), initial=0)) \
            if texts else []
        logprobs: list[float | None] = []
        top: list[Named | None] = []
        if p.logprobs and outcome.prompt_logprobs is not None:
            logprobs = [None, *outcome.prompt_logprobs]
            top = [None, *(self.name_top(outcome.prompt_top_logprobs or [])
                           if p.top_logprobs else [[] for _ in ids[1:]])]
        text = p.prompt_text if p.prompt_text is not None else self._codec.decode(ids)
        return Echo(text=text, token_ids=ids, token_texts=texts, logprobs=logprobs, top=top,
                    text_offsets=offsets)

    def _rest(self, outcome: GenerateOutcome) -> list[Choice]:
        """The tokens of the outcome the hooks did not deliver (none with the torch and MLX
        backends; a backend without hooks delivers everything here)."""
        out = []
        for i, (sample, result) in enumerate(zip(self.samples, outcome.samples, strict=True)):
            if sample.finished:
                continue
            start = len(sample.token_ids)
            top = result.top_logprobs[start:] or [[] for _ in result.token_ids[start:]]
            out.append(self._choice(i, result.token_ids[start:], result.logprobs[start:], top))
            if not sample.finished:  # tokens ran out: the engine's own finish reason
                sample.finish_reason = result.finish_reason
                out[-1].finish_reason = result.finish_reason
        return out

    @staticmethod
    def _raise_failure(future: Future) -> None:
        if future.cancelled():
            raise OpenAIError.from_status(StatusError(Kind.CANCELLED,
                                                      "request cancelled"))
        error = future.exception()
        if error is None:
            return
        if isinstance(error, StatusError):
            raise OpenAIError.from_status(error)
        raise OpenAIError(500, f"decoding failed: {type(error).__name__}: {error}",
                          type="server_error")


async def drain(run: RequestRun, outcome: bool = False) -> GenerateOutcome | None:
    """Feed every step to ``run``'s samples; with ``outcome``, then wait for the engine's
    outcome (the end of the request's last batch: the prompt's scores come with it)."""
    async for _ in run.steps():
        pass
    if outcome and run.future is not None:
        try:
            return await asyncio.wrap_future(run.future)
        except StatusError as e:
            raise OpenAIError.from_status(e) from e
    return None
