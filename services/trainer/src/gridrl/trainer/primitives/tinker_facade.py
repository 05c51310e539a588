"""The Tinker-compatible API's semantics, without HTTP: :class:`TinkerFacade` over a
:class:`PrimitivesService` (sessions, heartbeats, models by ``"<session>:train:<n>"``,
samplers, the futures, the credentials) and :class:`HttpError`, the status and message a request
gets. :mod:`gridrl.trainer.primitives.tinker_http` serves it (the endpoints, the SDK's semantics
of futures and of the endpoints gridrl does not serve)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from gridrl.common.errors import Kind, StatusError, invalid_argument, not_found
from gridrl.common.security.access import authorize, check_bound_certificate
from gridrl.common.security.tokens import AUTH_HEADER, AuthorizedTokens
from gridrl.trainer.primitives import paths, tinker_wire
from gridrl.trainer.primitives.checkpoints import CheckpointStore
from gridrl.trainer.primitives.futures import Done, Failed, FutureStore, Pending
from gridrl.trainer.primitives.ordering import SequenceGate
from gridrl.trainer.primitives.service import PrimitivesService, SampleTarget
from gridrl.trainer.primitives.types import LoraRequest, ModelInfo

log = logging.getLogger(__name__)


KEY_PREFIX = "tml-"
LONG_POLL_S = 25.0  # below the SDK's 45 s read timeout of retrieve_future
AUTH_METHOD = "/gridrl.v1.TrainingService/ForwardBackward"  # the scope the facade needs
PROTO_KINDS = ("ForwardBackward", "Forward", "Sample")
# Tinker features gridrl does not serve, by endpoint (the message names them).
UNSUPPORTED = {
    "create_custom_loss": "server-side custom losses (forward_backward_custom runs them on the "
                          "client, on cross_entropy)",
    "copy_weights": "copying weights between projects",
    "join_sampling_session": "joining sampling sessions",
    "retrieve_futures": "the session futures poller",
    "auth/token": "JWT exchange and whoami (send a gridrl token as TINKER_API_KEY=tml-<token>)",
}
_HTTP_STATUS = {Kind.NOT_FOUND: 404, Kind.UNAUTHENTICATED: 401, Kind.PERMISSION_DENIED: 403,
                Kind.UNAVAILABLE: 503, Kind.INTERNAL: 500, Kind.UNKNOWN: 500}


class HttpError(Exception):
    """An answer other than 200: ``status`` and a JSON ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    @classmethod
    def of(cls, e: StatusError) -> HttpError:
        """INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED... -> 400 (never a status
        the SDK would retry), NOT_FOUND -> 404, UNAUTHENTICATED -> 401, PERMISSION_DENIED ->
        403."""
        return cls(_HTTP_STATUS.get(e.kind, 400), e.message)


@dataclass
class _Session:
    heartbeat: float
    models: set[str] = field(default_factory=set)
    samplers: list[str] = field(default_factory=list)


class TinkerFacade:
    """Tinker's sessions, models, samplers and futures over a :class:`PrimitivesService`.

    Args:
        service: the primitives.
        base_model: the model the server names in ``get_server_capabilities`` (its
            ``--model``).
        authorized: the credentials it accepts (None: none checked).
        session_timeout_s: a session whose heartbeats stopped this long ago is closed (its
            models released) when the next session or model is created.
        long_poll_s: how long ``retrieve_future`` waits for a pending result.
    """

    def __init__(self, service: PrimitivesService, *, base_model: str,
                 authorized: AuthorizedTokens | None = None,
                 session_timeout_s: float = 600.0, long_poll_s: float = LONG_POLL_S) -> None:
        self.service = service
        self.long_poll_s = long_poll_s
        self.base_model = base_model
        self.authorized = authorized
        self.session_timeout_s = session_timeout_s
        self.futures = FutureStore()
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._gates: dict[str, SequenceGate] = {}
        self._samplers: dict[str, tuple[SampleTarget, str | None]] = {}  # id -> target, uri
        self._sample_requests: dict[tuple[str, int], str] = {}
        self._counter = itertools.count(1)
        self.checkpoints = CheckpointStore(service.root)

    # ------------------------------------------------------------------ sessions

    def session_ids(self) -> list[str]:
        """The live sessions, oldest first."""
        with self._lock:
            return list(self._sessions)

    def session_contents(self, session_id: str) -> tuple[list[str], list[str]]:
        """The training models and samplers of a session (NOT_FOUND naming it)."""
        session = self._session(session_id)
        with self._lock:
            return sorted(session.models), list(session.samplers)

    def create_session(self, body: dict) -> dict:
        tinker_wire.parse(tinker_wire.tt.CreateSessionRequest, body, "request")
        self._expire_sessions()
        sid = f"gs-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._sessions[sid] = _Session(time.monotonic())
        return {"type": "create_session", "session_id": sid}

    def heartbeat(self, body: dict) -> dict:
        request = tinker_wire.parse(tinker_wire.tt.SessionHeartbeatRequest, body, "request")
        with self._lock:
            session = self._sessions.get(request.session_id)
            if session is None:
                raise HttpError(410, f"session {request.session_id} has finished")
            session.heartbeat = time.monotonic()
        return {"type": "session_heartbeat"}

    def finish_session(self, session_id: str) -> dict:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        for model_id in session.models if session else ():
            self._close_model(model_id)
        return {}

    def _expire_sessions(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [sid for sid, s in self._sessions.items()
                    if now - s.heartbeat > self.session_timeout_s]
        for sid in gone:
            log.info("session %s: no heartbeat for %.0fs, closing it", sid,
                     self.session_timeout_s)
            self.finish_session(sid)

    def _close_model(self, model_id: str) -> None:
        with self._lock:
            self._gates.pop(model_id, None)
        self.service.close_model(model_id)

    def _session(self, session_id: str) -> _Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise not_found(f"session {session_id!r} is unknown (finished, timed out, or the "
                            "trainer restarted): create a new ServiceClient")
        return session

    # ------------------------------------------------------------------ models

    def create_model(self, body: dict) -> dict:
        request = tinker_wire.parse(tinker_wire.tt.CreateModelRequest, body, "request")
        if request.optimizer_config.type != "adamw":
            raise invalid_argument("optimizer_config", f"{request.optimizer_config.type} is not "
                                   "supported (gridrl steps AdamW)")
        self._expire_sessions()
        session = self._session(request.session_id)
        lora = request.lora_config or tinker_wire.tt.LoraConfig(rank=32)
        model_id = f"{request.session_id}:train:{request.model_seq_id}"
        with self._lock:
            if model_id in self._gates:  # the SDK retried the call
                raise invalid_argument("model_seq_id", f"{model_id} exists")
            self._gates[model_id] = SequenceGate()
            session.models.add(model_id)
        started = self.service.create_model(
            request.base_model, LoraRequest(rank=lora.rank, seed=lora.seed,
                                            train_attn=lora.train_attn,
                                            train_mlp=lora.train_mlp,
                                            train_unembed=lora.train_unembed),
            model_id=model_id)
        run = {"base_model": request.base_model, "lora_rank": lora.rank,
               "train_attn": lora.train_attn, "train_mlp": lora.train_mlp,
               "train_unembed": lora.train_unembed, "user_metadata": request.user_metadata}

        def created(info: ModelInfo) -> dict:
            self.checkpoints.record_run(info.model_id, run)
            return {"model_id": info.model_id, "type": "create_model"}

        rid = self._track("CreateModel", started, created,
                          on_error=lambda: self._forget_model(model_id))
        return {"request_id": rid, "model_id": model_id}

    def _forget_model(self, model_id: str) -> None:
        with self._lock:
            self._gates.pop(model_id, None)

    def get_info(self, body: dict) -> dict:
        request = tinker_wire.parse(tinker_wire.tt.GetInfoRequest, body, "request")
        return _info_json(self.service.info(request.model_id))

    def load_weights(self, body: dict) -> dict:
        request = tinker_wire.parse(tinker_wire.tt.LoadWeightsRequest, body, "request")
        where = paths.parse(request.path, "path", kind=paths.STATE)
        saved = self.checkpoints.get(where)  # 404 at once, naming the path
        if request.session_id is not None:  # a new model from the state
            session = self._session(request.session_id)
            model_id = f"{request.session_id}:train:{request.model_seq_id}"
            with self._lock:
                if model_id in self._gates:
                    raise invalid_argument("model_seq_id", f"{model_id} exists")
                self._gates[model_id] = SequenceGate()
                session.models.add(model_id)
            started = self.service.create_model(request.base_model, LoraRequest(),
                                                model_id=model_id, state=where,
                                                with_optimizer=request.optimizer)
            run = {"base_model": request.base_model or saved.meta["base_model"],
                   "lora_rank": saved.meta["lora_rank"], "loaded_from": where.uri,
                   "user_metadata": request.user_metadata}

            def loaded(info: ModelInfo) -> dict:
                self.checkpoints.record_run(info.model_id, run)
                return {"path": where.uri, "model_id": info.model_id, "type": "load_weights"}

            rid = self._track("LoadWeights", started, loaded,
                              on_error=lambda: self._forget_model(model_id))
            return {"request_id": rid, "model_id": model_id}
        if request.model_id is None:
            raise invalid_argument("model_id", "give model_id and seq_id, or session_id and "
                                   "model_seq_id")
        model_id = request.model_id
        return self._ordered(model_id, request.seq_id, "LoadWeights", lambda: self.service.load_state(
            model_id, where, with_optimizer=request.optimizer), lambda _: {
            "path": where.uri, "model_id": model_id, "type": "load_weights"})

    # ------------------------------------------------------------------ training

    def forward_backward(self, body: bytes, content_encoding: str | None) -> dict:
        msg = tinker_wire.forward_backward_message(body, content_encoding)
        kind = "Forward" if msg.forward_only else "ForwardBackward"
        try:
            call = tinker_wire.forward_backward_call(msg)
        except StatusError as e:
            self.release_refused(msg.model_id, msg.seq_id, kind, e.message)
            raise
        return self._ordered(call.model_id, call.seq_id, kind, lambda: self.service.forward(
            call.model_id, call.data, call.loss, backward=not call.forward_only),
            tinker_wire.forward_output)

    def optim_step(self, body: dict) -> dict:
        request = tinker_wire.parse(tinker_wire.tt.OptimStepRequest, body, "request")
        adam = tinker_wire.adam_settings(request)
        return self._ordered(request.model_id, request.seq_id, "OptimStep",
                             lambda: self.service.optim_step(request.model_id, adam),
                             lambda r: {"metrics": {"grad_norm:mean": r.grad_norm,
                                                    "optimizer_step:unique": float(r.steps)}})

    def save_weights(self, body: dict) -> dict:
        request = tinker_wire.parse(tinker_wire.tt.SaveWeightsRequest, body, "request")
        name = paths.check_name(request.path or f"state-{next(self._counter)}", "path")
        ttl = _ttl(request.ttl_seconds)
        return self._ordered(request.model_id, request.seq_id, "SaveWeights",
                             lambda: self.service.save_state(request.model_id, name),
                             lambda uri: {"path": self._with_ttl(uri, ttl),
                                          "type": "save_weights"})

    def save_weights_external(self, body: dict) -> dict:
        """An export of the adapter (peft and mlx-lm layouts) as ``external_weights/<name>``
        (see :meth:`PrimitivesService.save_external`); its files are listed with
        ``get_external_weights_urls``."""
        request = tinker_wire.parse(tinker_wire.tt.SaveWeightsExternalRequest, body, "request")
        if request.age_encryption_recipients:
            raise invalid_argument("age_encryption_recipients", "encrypting exports is not "
                                   "supported by gridrl (the files stay on the trainer's disk)")
        name = paths.check_name(request.path, "path")
        ttl = _ttl(request.ttl_seconds)
        return self._ordered(request.model_id, request.seq_id, "SaveWeightsExternal",
                             lambda: self.service.save_external(request.model_id, name),
                             lambda uri: {"path": self._with_ttl(uri, ttl),
                                          "type": "save_weights_external"})

    def _with_ttl(self, uri: str, ttl: float | None) -> str:
        if ttl is not None:
            self.checkpoints.set_ttl(paths.parse(uri), ttl)
        return uri

    def forget_checkpoint(self, where: paths.WeightsPath) -> None:
        """A checkpoint was deleted: samplers of it answer NOT_FOUND from now on."""
        with self._lock:
            gone = [sid for sid, (_, uri) in self._samplers.items() if uri == where.uri]
            for sid in gone:
                del self._samplers[sid]

    def save_weights_for_sampler(self, body: dict) -> dict:
        request = tinker_wire.parse(tinker_wire.tt.SaveWeightsForSamplerRequest, body, "request")
        name = paths.check_name(request.path, "path") if request.path else None
        model_id = request.model_id

        ttl = _ttl(request.ttl_seconds)

        def done(snap: Any) -> dict:
            answer = {"path": self._with_ttl(snap.uri, ttl), "type": "save_weights_for_sampler"}
            if name is None:  # save_weights_and_get_sampling_client: a sampler for it
                target = self.service.base_target(model_id, snap.version)
                answer["sampling_session_id"] = self._new_sampler(
                    target, snap.uri, model_id.split(":train:")[0])
            return answer

        return self._ordered(model_id, request.seq_id, "SaveWeightsForSampler",
                             lambda: self.service.save_for_sampler(model_id, name), done)

    # ------------------------------------------------------------------ sampling

    def create_sampling_session(self, body: dict) -> dict:
        request = tinker_wire.parse(tinker_wire.tt.CreateSamplingSessionRequest, body, "request")
        self._session(request.session_id)
        if request.model_path:
            self.checkpoints.get(paths.parse(request.model_path, "model_path",
                                             kind=paths.SAMPLER))
            target, uri = self.service.sampler_target(request.model_path), request.model_path
        elif request.base_model:
            target, uri = SampleTarget(request.base_model), None
        else:
            raise invalid_argument("base_model", "give model_path or base_model")
        return {"type": "create_sampling_session",
                "sampling_session_id": self._new_sampler(target, uri, request.session_id)}

    def get_sampler(self, sampler_id: str) -> dict:
        with self._lock:
            known = self._samplers.get(sampler_id)
        if known is None:
            raise not_found(f"no sampler {sampler_id!r}")
        target, uri = known
        return {"sampler_id": sampler_id, "base_model": target.base_model, "model_path": uri}

    def _new_sampler(self, target: SampleTarget, uri: str | None, session_id: str) -> str:
        sid = f"sampler-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._samplers[sid] = (target, uri)
            session = self._sessions.get(session_id)
            if session is not None:
                session.samplers.append(sid)
        return sid

    def asample(self, body: dict) -> dict:
        request = tinker_wire.parse(tinker_wire.tt.SampleRequest, body, "request")
        prompt, spec = tinker_wire.sampling_spec(request)
        key = None
        if request.sampling_session_id is not None:
            with self._lock:
                known = self._samplers.get(request.sampling_session_id)
                key = (request.sampling_session_id, request.seq_id or 0)
                repeat = self._sample_requests.get(key) if request.seq_id is not None else None
            if known is None:
                raise not_found(f"no sampler {request.sampling_session_id!r}")
            target = known[0]
            if repeat is not None:
                return {"request_id": repeat, "sample_sequence_ids": _sequence_ids(repeat,
                                                                                   spec.n)}
        elif request.model_path:
            self.checkpoints.get(paths.parse(request.model_path, "model_path",
                                             kind=paths.SAMPLER))
            target = self.service.sampler_target(request.model_path)
        elif request.base_model:
            target = SampleTarget(request.base_model)
        else:
            raise invalid_argument("sampling_session_id", "give a sampler, a model_path or a "
                                   "base_model")
        last_n = request.prompt_logprobs_last_n
        if last_n is not None and not 1 <= last_n < len(prompt):
            raise invalid_argument("prompt_logprobs_last_n", f"must be in [1, {len(prompt) - 1}]")
        started = self.service.sample(target, prompt, spec,
                                      prompt_logprobs=bool(request.prompt_logprobs),
                                      topk_prompt=int(request.topk_prompt_logprobs or 0))
        rid = self._track("Sample", started,
                          lambda r: tinker_wire.sample_output(r, len(prompt), last_n))
        if key is not None and request.seq_id is not None:
            with self._lock:
                self._sample_requests[key] = rid
        return {"request_id": rid, "sample_sequence_ids": _sequence_ids(rid, spec.n)}

    # ------------------------------------------------------------------ futures

    def _ordered(self, model_id: str, seq_id: int | None, kind: str,
                 start: Callable[[], futures.Future], encode: Callable[[Any], Any]) -> dict:
        """Take request ``seq_id`` of ``model_id``; start it (and the ones it unblocks) in
        order. Answers its request id (a repeat: the first one's)."""
        with self._lock:
            gate = self._gates.get(model_id)
            if gate is None:
                raise not_found(f"no training model {model_id!r} (closed, or never created "
                                "here)")
            repeat = gate.repeat_of(seq_id) if seq_id is not None else None
            if repeat is not None:
                return {"request_id": repeat, "model_id": model_id}
            rid = self.futures.create(kind)
            # started under the lock: submitting only queues the work, in this order
            for ready_rid, ready_start, ready_encode in gate.offer(seq_id, (rid, start, encode),
                                                                    rid):
                self._start(ready_rid, ready_start, ready_encode)
        return {"request_id": rid, "model_id": model_id}

    def release_refused(self, model_id: Any, seq_id: Any, kind: str, message: str) -> None:
        """Give up the place of a refused request (answered 4xx before it could start):
        request ``seq_id`` of ``model_id`` is taken as a failed one, so the requests numbered
        after it start in their turn instead of waiting for it forever. A place already taken
        (a repeat), an unknown model or a request without a number releases nothing.

        The SDK numbers a training client's requests before it sends them and moves on to the
        next number whatever the answer, so a refusal must consume its number here too.
        """
        if not isinstance(model_id, str) or isinstance(seq_id, bool) or not isinstance(seq_id,
                                                                                     int):
            return
        with self._lock:
            gate = self._gates.get(model_id)
            if gate is None or gate.repeat_of(seq_id) is not None or seq_id < gate.next_seq:
                return
            rid = self.futures.create(kind)
            self.futures.fail(rid, message, user=True)
            for ready_rid, ready_start, ready_encode in gate.offer(seq_id, (rid, None, None),
                                                                    rid):
                self._start(ready_rid, ready_start, ready_encode)

    def _track(self, kind: str, started: futures.Future, encode: Callable[[Any], Any],
               on_error: Callable[[], None] | None = None) -> str:
        rid = self.futures.create(kind)
        self._settle(rid, started, encode, on_error)
        return rid

    def _start(self, rid: str, start: Callable[[], futures.Future] | None,
               encode: Callable[[Any], Any] | None) -> None:
        if start is None or encode is None:  # a refused request's place: already failed
            return
        try:
            started = start()
        except StatusError as e:
            self.futures.fail(rid, e.message, user=True)
            return
        except Exception as e:  # a bug of ours: the request fails, the order goes on
            log.error("request %s failed to start", rid, exc_info=e)
            self.futures.fail(rid, f"{type(e).__name__}: {e}", user=False)
            return
        self._settle(rid, started, encode)

    def _settle(self, rid: str, started: futures.Future, encode: Callable[[Any], Any],
                on_error: Callable[[], None] | None = None) -> None:
        def done(f: futures.Future) -> None:
            error = f.exception()
            if error is None:
                try:
                    self.futures.resolve(rid, encode(f.result()))
                    return
                except Exception as e:  # an encoding bug is the server's
                    error = e
            if on_error is not None:
                on_error()
            if isinstance(error, StatusError):
                user = error.kind not in (Kind.INTERNAL, Kind.UNKNOWN)
                self.futures.fail(rid, error.message, user=user)
            else:
                log.error("request %s failed", rid, exc_info=error)
                self.futures.fail(rid, f"{type(error).__name__}: {error}", user=False)

        started.add_done_callback(done)

    async def retrieve(self, body: dict) -> tuple[Any, str]:
        """The outcome of a request: ``(payload, kind)`` with kind ``"proto"``, ``"json"`` or
        ``"pending"`` (still running after ``long_poll_s``: answered 408)."""
        request = tinker_wire.parse(tinker_wire.tt.FutureRetrieveRequest, body, "request")
        rid = request.request_id
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future = loop.create_future()

        def wake() -> None:
            loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(None))

        try:
            self.futures.on_done(rid, wake)
            await asyncio.wait_for(waiter, self.long_poll_s)
        except KeyError:
            raise not_found(f"request {rid!r} is unknown (or its result expired)") from None
        except asyncio.TimeoutError:
            pass
        outcome = self.futures.peek(rid)
        if isinstance(outcome, Pending):
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}, "pending"
        if isinstance(outcome, Failed):
            return {"error": outcome.message,
                    "category": "user" if outcome.user else "server"}, "json"
        assert isinstance(outcome, Done)
        return outcome.result, "proto" if outcome.kind in PROTO_KINDS else "json"

    # ------------------------------------------------------------------ server info

    def client_config(self, body: dict) -> dict:
        tinker_wire.parse(tinker_wire.tt.ClientConfigRequest, body, "request")
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False,
                "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    def capabilities(self) -> dict:
        names = dict.fromkeys([self.base_model, *(self.service.info(m).base_model
                                                  for m in self.service.models())])
        return {"supported_models": [{"model_name": n, "trainable": True, "sampleable": True}
                                     for n in names]}

    def check_key(self, key: str | None) -> None:
        """Raises :class:`HttpError` 401 / 403 unless ``key`` (``X-API-Key``) is a gridrl
        credential of scope ``trainer`` (``tml-`` prefix optional)."""
        if self.authorized is None:
            return
        token = key.removeprefix(KEY_PREFIX) if key else None
        metadata = [(AUTH_HEADER, f"Bearer {token}")] if token else []
        # the facade sees no client certificate: a certificate-bound credential is refused
        decision = check_bound_certificate(authorize(self.authorized, AUTH_METHOD, metadata),
                                           AUTH_METHOD, None)
        if decision.code is not None:
            message = decision.message.replace(
                "send 'authorization: Bearer <token>' (clients: --auth-token-file)",
                "set TINKER_API_KEY=tml-<a gridrl token of scope trainer>")
            raise HttpError.of(StatusError(decision.code, message))


def _ttl(seconds: int | None) -> float | None:
    """A checkpoint's ``ttl_seconds`` (None: it never expires); INVALID_ARGUMENT unless > 0."""
    if seconds is not None and seconds <= 0:
        raise invalid_argument("ttl_seconds", f"must be > 0, got {seconds}")
    return seconds


def _sequence_ids(rid: str, n: int) -> list[str]:
    return [f"{rid}:{j}" for j in range(n)]


def _info_json(info: ModelInfo) -> dict:
    return {"type": "get_info", "model_id": info.model_id, "is_lora": True,
            "lora_rank": info.lora_rank, "model_name": info.base_model,
            "model_data": {"arch": info.architecture, "model_name": info.base_model,
                           "tokenizer_id": info.tokenizer_dir}}
