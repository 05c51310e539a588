"""The rollout node's OpenAI-compatible HTTP endpoint (``gridrl-rollout serve --openai-listen
HOST:PORT``; off by default), so ordinary OpenAI clients can talk to the policy being trained.

    server = OpenAIServer(node.engine, node.codec, node.limits, "127.0.0.1:8000",
                          security=node_security).start()
    server.port      # the bound port (listen port 0: any free port)
    server.stop()

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(request and response fields: :mod:`gridrl.rollout.openai_protocol`), ``GET /health`` (open).

Every request goes through the node's engine queue like a gRPC ``Generate``: the same bounds,
the same batches (HTTP and gRPC requests decode together), RESOURCE_EXHAUSTED as HTTP 429. A
stream is fed by the engine's decode hooks (:class:`gridrl.rollout.scheduler.TokenSink`): each
server-sent event leaves as soon as its decode step is drawn, before the batch ends. An answer
reports the adapter and policy version that produced it: ``system_fingerprint``
``gridrl:<adapter>:v<version>`` and the headers ``x-gridrl-policy-version`` and (when an
adapter answered) ``x-gridrl-adapter``. A client that goes away stops getting tokens; a batch
whose every request went away stops at the next decode step.

Credentials and TLS are the gRPC side's: ``Authorization: Bearer <token>`` checked by
:func:`check_caller` (as the gRPC method the route stands for: completions as ``Generate``,
models as ``GetNodeInfo``), HTTPS when a certificate and key are given (and client
certificates required when a CA is given too).

Stack: Starlette on uvicorn (h11), in a thread of its own with its own asyncio loop; the
engine's scheduler thread hands tokens to that loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from typing import Any, Literal

from gridrl.common.address import join_address, parse_listen
from gridrl.common.errors import Kind, StatusError
from gridrl.common.security.access import Decision, authorize
from gridrl.common.security.policy import Security, check_exposure
from gridrl.common.security.tokens import AUTH_HEADER, AuthorizedTokens
from gridrl.engine.contract import TopLogprobs
from gridrl.rollout.jobs import GenerateOutcome, ServingAdapter
from gridrl.rollout.openai_decode import SampleText
from gridrl.rollout.openai_protocol import OpenAIError, Prepared, parse_body, prepare
from gridrl.rollout.openai_responses import (
    Choice,
    Echo,
    Named,
    chunk_body,
    models_body,
    new_id,
    now,
    response_body,
    usage_chunk_body,
)
from gridrl.rollout.scheduler import Engine
from gridrl.rollout.text import TextCodec
from gridrl.rollout.validation import Limits

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
GENERATE_METHOD = "/gridrl.v1.RolloutService/Generate"
INFO_METHOD = "/gridrl.v1.RolloutService/GetNodeInfo"
POLICY_VERSION_HEADER = "x-gridrl-policy-version"
ADAPTER_HEADER = "x-gridrl-adapter"


def check_caller(authorized: AuthorizedTokens | None, method: str, authorization: str | None
                 ) -> OpenAIError | None:
    """The one credential check of the HTTP endpoint: the ``Authorization`` header is decided
    exactly as the gRPC server decides a call to ``method`` carrying it as metadata
    (:func:`gridrl.common.security.access.authorize`: the same authorized tokens and scopes).

    A credential bound to a client certificate (``cert=``) is refused here (401): this
    endpoint does not see the TLS client certificate, and accepting the token alone would undo
    the binding (a rollout node sees the trainer's token on every call).

    Returns:
        None when the call may proceed, else the error to answer: 401 for a missing, unknown
        or certificate-bound token, 403 for a credential whose scope does not cover ``method``.
    """
    metadata = [(AUTH_HEADER, authorization)] if authorization is not None else []
    decision = authorize(authorized, method, metadata)
    if decision.code is None and decision.credential and decision.credential.cert:
        decision = Decision(Kind.UNAUTHENTICATED,
                            f"{method.removeprefix('/gridrl.v1.')}: credential "
                            f"{decision.credential.id!r} is bound to a client certificate, "
                            "which the HTTP endpoint does not check; use a credential minted "
                            "without --cert")
    if decision.code is None:
        return None
    return OpenAIError.from_status(StatusError(decision.code, decision.message))


class _Run:
    """One HTTP request in the engine: the :class:`~gridrl.rollout.scheduler.TokenSink` the
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


class OpenAIServer:
    """The OpenAI-compatible HTTP server of a rollout node.

    Args:
        engine: the node's engine (requests join its queue).
        codec: the node's tokenizer.
        limits: the node's bounds on a request (those of ``Generate``).
        listen: ``host:port`` to bind (port 0: any free port).
        security: the node's gRPC security, applied as it is: its authorized tokens and scopes
            decide every route but ``/health`` (``Authorization: Bearer``), its TLS files make
            it HTTPS (a CA: mutual TLS). None: plain HTTP, no credentials (loopback only).
        grace_s: seconds requests in flight get to finish on :meth:`stop`.

    Raises:
        StatusError: INVALID_ARGUMENT ``--openai-listen: ...`` for a malformed address.
        ExposedError: a non-loopback address without TLS and credentials (and no
            ``--insecure``), as for the gRPC ``--listen``.
    """

    def __init__(self, engine: Engine, codec: TextCodec, limits: Limits, listen: str,
                 security: Security | None = None, grace_s: float = 10.0) -> None:
        self._host, self._requested_port = parse_listen(listen, "--openai-listen")
        security = security or Security()
        check_exposure(self._host.strip("[]"), security, "--openai-listen")
        self.engine, self.codec, self.limits = engine, codec, limits
        self.model_id = engine.backend.identity.model_id
        self.eos_ids = frozenset(engine.backend.eos_token_ids)
        self.authorized = security.authorized
        tls = security.tls
        self.tls = (tls.cert, tls.key, tls.ca) if tls.serves_tls else None
        self.grace_s = grace_s
        self.port = 0
        self.created = now()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def address(self) -> str:
        """``host:port`` of the bound socket (0.0.0.0 / :: shown as 127.0.0.1 / ::1)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self._host.strip("[]"), self._host)
        return join_address(host.strip("[]"), self.port)

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``: ``http(s)://host:port/v1``."""
        return f"{self.scheme}://{self.address}/v1"

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> OpenAIServer:
        """Bind and serve on a thread of its own. Returns self once it accepts connections.

        Raises:
            OSError: the address cannot be bound.
            RuntimeError: the server did not start (the log says why).
        """
        import uvicorn

        host = self._host.strip("[]") or "0.0.0.0"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, self._requested_port), family=family)
        self.port = sock.getsockname()[1]
        kwargs: dict[str, Any] = {}
        if self.tls:
            cert, key, ca = self.tls
            kwargs = {"ssl_certfile": cert, "ssl_keyfile": key}
            if ca:
                kwargs |= {"ssl_ca_certs": ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(self._app(), log_config=None, access_log=False,
                                lifespan="off", http="h11", loop="asyncio",
                                server_header=False, timeout_graceful_shutdown=self.grace_s,
                                **kwargs)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="openai-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise RuntimeError(f"the OpenAI endpoint on {self.address} did not start")
            time.sleep(0.01)
        log.info("OpenAI-compatible endpoint on %s (%s, %s)", self.base_url,
                 "mutual TLS" if self.tls and self.tls[2] else self.scheme,
                 "bearer token required" if self.authorized else "no credentials")
        return self

    def stop(self) -> None:
        """Stop accepting, give requests in flight ``grace_s`` to finish, then close. Idempotent."""
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(self.grace_s + 5)
        if self._thread.is_alive():
            log.warning("the OpenAI endpoint did not stop within %.0fs", self.grace_s + 5)

    # -- routes ------------------------------------------------------------------------------

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def openai_error(request: Request, error: Exception) -> JSONResponse:
            assert isinstance(error, OpenAIError)
            return JSONResponse(error.body(), status_code=error.status)

        async def http_error(request: Request, error: Exception) -> JSONResponse:
            assert isinstance(error, HTTPException)
            return JSONResponse(OpenAIError(error.status_code, str(error.detail)).body(),
                                status_code=error.status_code)

        async def server_error(request: Request, error: Exception) -> JSONResponse:
            log.error("OpenAI endpoint: %s %s failed", request.method, request.url.path,
                      exc_info=error)
            body = OpenAIError(500, f"internal error: {type(error).__name__}: {error}",
                               type="server_error").body()
            return JSONResponse(body, status_code=500)

        return Starlette(routes=[
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat_completions, methods=["POST"]),
            Route("/health", self._health, methods=["GET"]),
        ], exception_handlers={OpenAIError: openai_error, HTTPException: http_error,
                               Exception: server_error})

    async def _health(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok"})

    async def _models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        self._check(request, INFO_METHOD)
        return JSONResponse(models_body(self.model_id, self.engine.serving, self.created))

    async def _completions(self, request: Any) -> Any:
        return await self._generate(request, "completion")

    async def _chat_completions(self, request: Any) -> Any:
        return await self._generate(request, "chat")

    def _check(self, request: Any, method: str) -> None:
        error = check_caller(self.authorized, method, request.headers.get(AUTH_HEADER))
        if error is not None:
            raise error

    async def _generate(self, request: Any, kind: Literal["completion", "chat"]) -> Any:
        """A completion or chat completion through the engine queue, streamed or whole."""
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import JSONResponse, StreamingResponse

        self._check(request, GENERATE_METHOD)
        body = await _read_json(request)
        parsed = parse_body(kind, body)
        prepared: Prepared = await run_in_threadpool(  # tokenizing: off the event loop
            prepare, parsed, self.codec, self.limits, self.model_id, self.engine.serving)
        run = _Run(asyncio.get_running_loop(), prepared, self.codec, self.eos_ids)
        try:
            future = self.engine.submit(prepared.job, sink=run, base_model=prepared.base_model)
        except StatusError as e:
            raise OpenAIError.from_status(e) from e
        run.attach(future)
        response_id, created = new_id(kind), now()
        try:
            adapter = await _unless_disconnected(request, run.wait_started())
        except BaseException:
            run.abandon()
            raise
        model = adapter.name or self.model_id
        headers = {POLICY_VERSION_HEADER: str(adapter.version)}
        if adapter.name:
            headers[ADAPTER_HEADER] = adapter.name
        prompt_tokens = len(prepared.job.prompt_ids)
        if prepared.stream:
            events = self._events(run, prepared, response_id, created, adapter, model)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={**headers, "cache-control": "no-cache",
                                              "x-accel-buffering": "no"})
        try:
            outcome = await _unless_disconnected(request, _drain(run, prepared.echo))
        finally:
            run.abandon()
        choices = [Choice(index=i, text=s.text, token_ids=s.token_ids, logprobs=s.logprobs,
                          text_offsets=s.text_offsets, token_texts=run.token_texts(s.token_ids),
                          finish_reason=s.finish_reason, top=run.top[i])
                   for i, s in enumerate(run.samples)]
        echo = run.echo(outcome) if outcome is not None else None
        return JSONResponse(response_body(prepared, response_id, created, adapter, choices,
                                          prompt_tokens, model, echo), headers=headers)

    async def _events(self, run: _Run, p: Prepared, response_id: str, created: int,
                      adapter: ServingAdapter, model: str) -> AsyncIterator[str]:
        """The server-sent events of a stream: one per choice and decode step that adds text,
        tokens or a finish reason; the usage chunk if asked; ``[DONE]``. An error after the
        stream started is sent as an ``{"error": ...}`` event."""
        try:
            opened: set[int] = set()  # choices whose first chunk went
            if p.kind == "chat":  # OpenAI opens each choice with the role
                for i in range(p.job.n):
                    opened.add(i)
                    yield _sse(chunk_body(p, response_id, created, adapter, _empty(i), model,
                                          first=True))
            async for choices in run.steps():
                for c in choices:
                    if c.text or c.finish_reason or ((p.logprobs or p.token_ids)
                                                     and c.token_ids):
                        first = c.index not in opened
                        opened.add(c.index)
                        yield _sse(chunk_body(p, response_id, created, adapter, c, model,
                                              first=first))
            if p.include_usage:
                completion = sum(len(s.token_ids) for s in run.samples)
                yield _sse(usage_chunk_body(p, response_id, created, adapter,
                                            len(p.job.prompt_ids), completion, model))
        except OpenAIError as e:
            yield _sse(e.body())
        finally:
            run.abandon()
        yield "data: [DONE]\n\n"


async def _drain(run: _Run, outcome: bool = False) -> GenerateOutcome | None:
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


async def _unless_disconnected(request: Any, work: Any) -> Any:
    """Await ``work``; if the client disconnects first, cancel it.

    Raises:
        OpenAIError: 499 (nobody reads it) when the client went away.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task not in done:
        task.cancel()
        raise OpenAIError(499, "the client disconnected", code="cancelled")
    return task.result()


async def _disconnected(request: Any) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read_json(request: Any) -> Any:
    """The request body as JSON (at most :data:`MAX_BODY_BYTES`).

    Raises:
        OpenAIError: 413 past the limit, 400 for a body that is not JSON.
    """
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise OpenAIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"the request body is not JSON: {e}") from e


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _empty(index: int) -> Choice:
    return Choice(index=index, text="", token_ids=[], logprobs=[], text_offsets=[],
                  token_texts=[], finish_reason=None)
