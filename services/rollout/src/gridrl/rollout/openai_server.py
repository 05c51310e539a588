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
stream is fed by the engine's decode hooks (:class:`gridrl.rollout.jobs.TokenSink`): each
server-sent event leaves as soon as its decode step is drawn, before the batch ends. An answer
reports the adapter and policy version that produced it: ``system_fingerprint``
``gridrl:<adapter>:v<version>`` and the headers ``x-gridrl-policy-version`` and (when an
adapter answered) ``x-gridrl-adapter``. A client that goes away stops getting tokens; a batch
whose every request went away stops at the next decode step.

Credentials and TLS are the gRPC side's: ``Authorization: Bearer <token>`` checked by
:func:`check_caller` (as the gRPC method the route stands for: completions as ``Generate``,
models as ``GetNodeInfo``), HTTPS when a certificate and key are given (and client
certificates required when a CA is given too).

What one request does inside the engine (its sink, its choices) is
:class:`~gridrl.rollout.openai_run.RequestRun`; this module is the HTTP side.

Stack: the services' one HTTP stack (:class:`gridrl.common.http.HttpServer`: Starlette on
uvicorn, in a thread of its own with its own asyncio loop); the engine's scheduler thread hands tokens to that loop with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

from gridrl.common.address import join_address, parse_listen
from gridrl.common.errors import Kind, StatusError
from gridrl.common.http import HttpServer, HttpTls
from gridrl.common.security.access import Decision, authorize
from gridrl.common.security.policy import Security, check_exposure
from gridrl.common.security.tokens import AUTH_HEADER, AuthorizedTokens
from gridrl.rollout.jobs import ServingAdapter
from gridrl.rollout.openai_protocol import OpenAIError, Prepared, parse_body, prepare
from gridrl.rollout.openai_responses import (
    Choice,
    chunk_body,
    models_body,
    new_id,
    now,
    response_body,
    usage_chunk_body,
)
from gridrl.rollout.openai_run import RequestRun, drain
from gridrl.rollout.scheduler import BatchScheduler
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

    def __init__(self, engine: BatchScheduler, codec: TextCodec, limits: Limits, listen: str,
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
        self._server: HttpServer | None = None

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
        tls = HttpTls(*self.tls) if self.tls else None
        server = HttpServer(self._app(), self._host, self._requested_port, tls=tls,
                            name="openai-http", grace_s=self.grace_s)
        self._server = server.start()
        self.port = server.port
        log.info("OpenAI-compatible endpoint on %s (%s, %s)", self.base_url,
                 "mutual TLS" if self.tls and self.tls[2] else self.scheme,
                 "bearer token required" if self.authorized else "no credentials")
        return self

    def stop(self) -> None:
        """Stop accepting, give requests in flight ``grace_s`` to finish, then close. Idempotent."""
        if self._server is None:
            return
        if not self._server.stop():
            log.warning("the OpenAI endpoint did not stop within %.0fs", self.grace_s + 5)
        self._server = None

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
        run = RequestRun(asyncio.get_running_loop(), prepared, self.codec, self.eos_ids)
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
            outcome = await _unless_disconnected(request, drain(run, prepared.echo))
        finally:
            run.abandon()
        choices = [Choice(index=i, text=s.text, token_ids=s.token_ids, logprobs=s.logprobs,
                          text_offsets=s.text_offsets, token_texts=run.token_texts(s.token_ids),
                          finish_reason=s.finish_reason, top=run.top[i])
                   for i, s in enumerate(run.samples)]
        echo = run.echo(outcome) if outcome is not None else None
        return JSONResponse(response_body(prepared, response_id, created, adapter, choices,
                                          prompt_tokens, model, echo), headers=headers)

    async def _events(self, run: RequestRun, p: Prepared, response_id: str, created: int,
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
