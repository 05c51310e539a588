"""The Tinker-compatible REST facade on HTTP: the Starlette routes under ``/api/v1`` that the
official SDK (``tinker`` 0.38, read in its ``tinker/resources/*.py``) calls, each mapped onto
:class:`~gridrl.trainer.primitives.tinker_facade.TinkerFacade` (what the endpoints mean), and
:class:`HttpServer`, on the services' HTTP stack (:mod:`gridrl.common.http`).

Point the SDK at it with ``TINKER_BASE_URL=http://127.0.0.1:8100`` (https with TLS) and
``TINKER_API_KEY=tml-<a gridrl token of scope trainer>`` (the SDK insists on the ``tml-``
prefix; the facade strips it and checks the token as the gRPC servers do; without
``--authorized-tokens`` any ``tml-`` key passes).

Futures (the SDK's semantics): ``create_model``, ``forward_backward``, ``optim_step``,
``save_weights``, ``load_weights``, ``save_weights_for_sampler`` and ``asample`` answer a
request id at once; ``retrieve_future`` answers the result when there is one, else waits up to
:data:`LONG_POLL_S` and answers ``try_again`` as HTTP 408 (the SDK polls again at once, without
logging a warning for each wait). A training model's requests run in the order of
their ``seq_id`` (:class:`~gridrl.trainer.primitives.ordering.SequenceGate`); a request the SDK
retries with the same ``seq_id`` gets the first one's id. Failures are results
(``{"error", "category"}``: ``user`` for bad input, else ``server``), so the SDK raises
``RequestFailedError`` at once instead of retrying.

Endpoints gridrl does not serve answer 400 (a known Tinker feature: the message names it) or
404 (anything else under ``/api/v1``), never a hang and never a status the SDK retries (408,
409, 429, 5xx).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from gridrl.common import http
from gridrl.common.errors import StatusError
from gridrl.trainer.primitives import tinker_wire
from gridrl.trainer.primitives.tinker_facade import (
    LONG_POLL_S,
    UNSUPPORTED,
    HttpError,
    TinkerFacade,
)
from gridrl.trainer.primitives.tinker_requests import Accepted, RetrieveTag
from gridrl.trainer.primitives.tinker_rest import TinkerRest, refused_feature

log = logging.getLogger(__name__)
tt = tinker_wire.tt

API = "/api/v1"
KEY_HEADER = "x-api-key"


def app(facade: TinkerFacade) -> Any:
    """The Starlette application of ``facade``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def json_body(request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError as e:
            raise HttpError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        return body

    def endpoint(fn: Callable[..., Any], parsed: type | None = None, *, raw: bool = False,
                 auth: bool = True) -> Callable:
        """``fn`` on a route: a POST body parsed as the SDK's ``parsed`` request model (the
        raw JSON object when None), then the path's parameters; its answer as JSON (an
        :class:`Accepted` through its ``to_json``)."""
        async def handle(request: Request) -> Response:
            body = None
            try:
                if auth:
                    facade.check_key(request.headers.get(KEY_HEADER))
                if raw:
                    return await fn(request)
                args: list[Any] = []
                if request.method == "POST":
                    body = await json_body(request)
                    args.append(body if parsed is None else
                                tinker_wire.parse(parsed, body, "request"))
                args += list(request.path_params.values())
                answer = fn(*args)
                return JSONResponse(answer.to_json() if isinstance(answer, Accepted) else answer)
            except HttpError as e:
                error = e
            except StatusError as e:
                error = HttpError.of(e)
            if body is not None:  # a numbered request refused: the ones after it go on
                facade.release_refused(body.get("model_id"), body.get("seq_id"),
                                       request.url.path.rsplit("/", 1)[-1], error.message)
            return JSONResponse({"error": error.message}, status_code=error.status)
        return handle

    async def forward_backward(request: Request) -> Response:
        body = await request.body()
        return JSONResponse(facade.forward_backward(
            body, request.headers.get("content-encoding")).to_json())

    async def retrieve(request: Request) -> Response:
        asked = tinker_wire.parse(tt.FutureRetrieveRequest, await json_body(request), "request")
        answer = await facade.retrieve(asked)
        if answer.tag is RetrieveTag.PROTO:
            return Response(answer.payload, media_type=tinker_wire.PROTOBUF)
        return JSONResponse(answer.payload, status_code=answer.status)

    rest_api = TinkerRest(facade)

    async def rest_or_refused(request: Request) -> Response:
        """The RestClient's paths (:mod:`~gridrl.trainer.primitives.tinker_rest`), else a
        refusal: 400 naming a Tinker feature gridrl does not serve, 404 for anything else."""
        path = request.url.path.removeprefix(API + "/")
        body = None
        if request.method in ("POST", "PUT", "PATCH"):
            try:
                body = await request.json()
            except ValueError:
                body = None
        try:
            facade.check_key(request.headers.get(KEY_HEADER))
            try:
                answer = rest_api.route(request.method, path, dict(request.query_params), body)
                return JSONResponse(answer)
            except KeyError:
                pass
            feature = refused_feature(path) or next(
                (f for key, f in UNSUPPORTED.items() if path.startswith(key)), None)
            if feature is None:
                error = HttpError(404, f"gridrl's Tinker facade has no {request.method} "
                                       f"{request.url.path}")
            else:
                error = HttpError(400, f"{request.method} {request.url.path}: {feature} is not "
                                       "supported by gridrl")
        except HttpError as e:
            return JSONResponse({"error": e.message}, status_code=e.status)
        except StatusError as e:
            error = HttpError.of(e)
        if isinstance(body, dict):  # e.g. copy_weights may take a place in the order
            facade.release_refused(body.get("model_id"), body.get("seq_id"), path,
                                   error.message)
        return JSONResponse({"error": error.message}, status_code=error.status)

    routes = [
        Route(f"{API}/healthz", endpoint(lambda: {"status": "ok"}, auth=False), methods=["GET"]),
        Route(f"{API}/client/config", endpoint(facade.client_config, tt.ClientConfigRequest),
              methods=["POST"]),
        Route(f"{API}/client/dynamic_config", endpoint(lambda body: {}), methods=["POST"]),
        Route(f"{API}/get_server_capabilities", endpoint(facade.capabilities), methods=["GET"]),
        Route(f"{API}/create_session", endpoint(facade.create_session,
                                                tt.CreateSessionRequest), methods=["POST"]),
        Route(f"{API}/session_heartbeat", endpoint(facade.heartbeat,
                                                   tt.SessionHeartbeatRequest),
              methods=["POST"]),
        Route(f"{API}/sessions/{{session_id}}/finish",
              endpoint(lambda body, sid: facade.finish_session(sid)), methods=["POST"]),
        Route(f"{API}/telemetry", endpoint(lambda body: {"status": "accepted"}),
              methods=["POST"]),
        Route(f"{API}/create_model", endpoint(facade.create_model, tt.CreateModelRequest),
              methods=["POST"]),
        Route(f"{API}/get_info", endpoint(facade.get_info, tt.GetInfoRequest),
              methods=["POST"]),
        Route(f"{API}/forward_backward", endpoint(forward_backward, raw=True), methods=["POST"]),
        Route(f"{API}/optim_step", endpoint(facade.optim_step, tt.OptimStepRequest),
              methods=["POST"]),
        Route(f"{API}/save_weights", endpoint(facade.save_weights, tt.SaveWeightsRequest),
              methods=["POST"]),
        Route(f"{API}/load_weights", endpoint(facade.load_weights, tt.LoadWeightsRequest),
              methods=["POST"]),
        Route(f"{API}/save_weights_external", endpoint(facade.save_weights_external,
                                                       tt.SaveWeightsExternalRequest),
              methods=["POST"]),
        Route(f"{API}/save_weights_for_sampler", endpoint(facade.save_weights_for_sampler,
                                                          tt.SaveWeightsForSamplerRequest),
              methods=["POST"]),
        Route(f"{API}/create_sampling_session", endpoint(facade.create_sampling_session,
                                                         tt.CreateSamplingSessionRequest),
              methods=["POST"]),
        Route(f"{API}/samplers/{{sampler_id}}", endpoint(facade.get_sampler), methods=["GET"]),
        Route(f"{API}/asample", endpoint(facade.asample, tt.SampleRequest), methods=["POST"]),
        Route(f"{API}/retrieve_future", endpoint(retrieve, raw=True), methods=["POST"]),
        Route(f"{API}/cancel_future", endpoint(lambda body: {}), methods=["POST"]),
        Route(f"{API}/{{rest:path}}", rest_or_refused,
              methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ]
    return Starlette(routes=routes)


class HttpServer:
    """The facade on the services' HTTP stack (:class:`gridrl.common.http.HttpServer`:
    uvicorn on a thread of its own).

    Args:
        facade: what it serves.
        host, port: where to listen (port 0: any free port; ``port`` is the bound one after
            :meth:`start`).
        tls: ``(cert, key)`` PEM files to serve https, or None. Client certificates are not
            asked for: the credential is the API key (the SDK cannot present a certificate).
        grace_s: seconds requests in flight get on stop.
    """

    def __init__(self, facade: TinkerFacade, host: str, port: int,
                 tls: tuple[str, str] | None = None, grace_s: float = 2.0) -> None:
        self.facade = facade
        self.host = host
        self.port = port
        self.tls = tls
        self.grace_s = grace_s
        self._server: http.HttpServer | None = None

    @property
    def base_url(self) -> str:
        """What ``TINKER_BASE_URL`` takes."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def start(self) -> HttpServer:
        """Bind and serve; returns once it accepts connections.

        Raises:
            OSError: the address cannot be bound. RuntimeError: it did not start.
        """
        tls = http.HttpTls(*self.tls) if self.tls else None
        server = http.HttpServer(app(self.facade), self.host, self.port, tls=tls,
                                 name="tinker-http", grace_s=self.grace_s)
        self._server = server.start()
        self.port = server.port
        return self

    def stop(self) -> None:
        """Stop serving (long polls answer at once). Idempotent."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.begin_stop()
        self.facade.futures.wake()
        server.stop(extra_s=LONG_POLL_S)
