"""The Tinker-compatible API's semantics, without HTTP: :class:`TinkerFacade` over a
:class:`PrimitivesService` (sessions, heartbeats, models by ``"<session>:train:<n>"``,
samplers, the credentials) and :class:`HttpError`, the status and message a request gets.
Each endpoint method takes the SDK's own request model (``tinker.types``, parsed by
:mod:`gridrl.trainer.primitives.tinker_wire`); a request's id, future and place in its model's
order are :mod:`gridrl.trainer.primitives.tinker_requests`'. :mod:`gridrl.trainer.primitives.
tinker_http` serves it (the endpoints, the SDK's semantics of futures and of the endpoints
gridrl does not serve)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from gridrl.common.errors import Kind, StatusError, invalid_argument, not_found
from gridrl.common.security.access import authorize, check_bound_certificate
from gridrl.common.security.tokens import AUTH_HEADER, AuthorizedTokens
from gridrl.trainer.primitives import paths, tinker_wire
from gridrl.trainer.primitives.checkpoints import CheckpointStore
from gridrl.trainer.primitives.futures import FutureKind
from gridrl.trainer.primitives.service import PrimitivesService, SampleTarget
from gridrl.trainer.primitives.snapshots import Snapshot
from gridrl.trainer.primitives.tinker_requests import Accepted, RequestTracker, Retrieved
from gridrl.trainer.primitives.types import LoraRequest, ModelInfo

log = logging.getLogger(__name__)


KEY_PREFIX = "tml-"
LONG_POLL_S = 25.0  # below the SDK's 45 s read timeout of retrieve_future
AUTH_METHOD = "/gridrl.v1.TrainingService/ForwardBackward"  # the scope the facade needs
tt = tinker_wire.tt  # the SDK's request and response models
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
        self.base_model = base_model
        self.authorized = authorized
        self.session_timeout_s = session_timeout_s
        self.requests = RequestTracker(long_poll_s=long_poll_s)
        self.futures = self.requests.futures
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
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

    def create_session(self, request: tt.CreateSessionRequest) -> dict:
        self._expire_sessions()
        sid = f"gs-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._sessions[sid] = _Session(time.monotonic())
        return {"type": "create_session", "session_id": sid}

    def heartbeat(self, request: tt.SessionHeartbeatRequest) -> dict:
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
        self.requests.close(model_id)
        self.service.close_model(model_id)

    def _session(self, session_id: str) -> _Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise not_found(f"session {session_id!r} is unknown (finished, timed out, or the "
                            "trainer restarted): create a new ServiceClient")
        return session

    # ------------------------------------------------------------------ models

    def create_model(self, request: tt.CreateModelRequest) -> Accepted:
        if request.optimizer_config.type != "adamw":
            raise invalid_argument("optimizer_config", f"{request.optimizer_config.type} is not "
                                   "supported (gridrl steps AdamW)")
        self._expire_sessions()
        session = self._session(request.session_id)
        lora = request.lora_config or tt.LoraConfig(rank=32)
        model_id = f"{request.session_id}:train:{request.model_seq_id}"
        self.requests.open(model_id)  # INVALID_ARGUMENT when the SDK retried the call
        with self._lock:
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

        rid = self.requests.track(FutureKind.CREATE_MODEL, started, created,
                                  on_error=lambda: self.requests.close(model_id))
        return Accepted(rid, model_id)

    def get_info(self, request: tt.GetInfoRequest) -> dict:
        return _info_json(self.service.info(request.model_id))

    def load_weights(self, request: tt.LoadWeightsRequest) -> Accepted:
        where = paths.parse(request.path, "path", kind=paths.STATE)
        saved = self.checkpoints.get(where)  # 404 at once, naming the path
        if request.session_id is not None:  # a new model from the state
            session = self._session(request.session_id)
            model_id = f"{request.session_id}:train:{request.model_seq_id}"
            self.requests.open(model_id)
            with self._lock:
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

            rid = self.requests.track(FutureKind.LOAD_WEIGHTS, started, loaded,
                                      on_error=lambda: self.requests.close(model_id))
            return Accepted(rid, model_id)
        if request.model_id is None:
            raise invalid_argument("model_id", "give model_id and seq_id, or session_id and "
                                   "model_seq_id")
        model_id = request.model_id
        return self.requests.ordered(
            model_id, request.seq_id, FutureKind.LOAD_WEIGHTS, lambda: self.service.load_state(
                model_id, where, with_optimizer=request.optimizer), lambda _: {
                "path": where.uri, "model_id": model_id, "type": "load_weights"})

    # ------------------------------------------------------------------ training

    def forward_backward(self, body: bytes, content_encoding: str | None) -> Accepted:
        """``forward`` and ``forward_backward`` (a protobuf body, the SDK's)."""
        msg = tinker_wire.forward_backward_message(body, content_encoding)
        kind = FutureKind.FORWARD if msg.forward_only else FutureKind.FORWARD_BACKWARD
        try:
            call = tinker_wire.forward_backward_call(msg)
        except StatusError as e:
            self.requests.release_refused(msg.model_id, msg.seq_id, kind, e.message)
            raise
        return self.requests.ordered(call.model_id, call.seq_id, kind, lambda: self.service.forward(
            call.model_id, call.data, call.loss, backward=not call.forward_only),
            tinker_wire.forward_output)

    def optim_step(self, request: tt.OptimStepRequest) -> Accepted:
        adam = tinker_wire.adam_settings(request)
        return self.requests.ordered(
            request.model_id, request.seq_id, FutureKind.OPTIM_STEP,
            lambda: self.service.optim_step(request.model_id, adam),
            lambda r: {"metrics": {"grad_norm:mean": r.grad_norm,
                                   "optimizer_step:unique": float(r.steps)}})

    def save_weights(self, request: tt.SaveWeightsRequest) -> Accepted:
        name = paths.check_name(request.path or f"state-{next(self._counter)}", "path")
        ttl = _ttl(request.ttl_seconds)
        return self.requests.ordered(
            request.model_id, request.seq_id, FutureKind.SAVE_WEIGHTS,
            lambda: self.service.save_state(request.model_id, name),
            lambda uri: {"path": self._with_ttl(uri, ttl), "type": "save_weights"})

    def save_weights_external(self, request: tt.SaveWeightsExternalRequest) -> Accepted:
        """An export of the adapter (peft and mlx-lm layouts) as ``external_weights/<name>``
        (see :meth:`PrimitivesService.save_external`); its files are listed with
        ``get_external_weights_urls``."""
        if request.age_encryption_recipients:
            raise invalid_argument("age_encryption_recipients", "encrypting exports is not "
                                   "supported by gridrl (the files stay on the trainer's disk)")
        name = paths.check_name(request.path, "path")
        ttl = _ttl(request.ttl_seconds)
        return self.requests.ordered(
            request.model_id, request.seq_id, FutureKind.SAVE_WEIGHTS_EXTERNAL,
            lambda: self.service.save_external(request.model_id, name),
            lambda uri: {"path": self._with_ttl(uri, ttl), "type": "save_weights_external"})

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

    def save_weights_for_sampler(self, request: tt.SaveWeightsForSamplerRequest) -> Accepted:
        name = paths.check_name(request.path, "path") if request.path else None
        model_id = request.model_id

        ttl = _ttl(request.ttl_seconds)

        def done(snap: Snapshot) -> dict:
            answer = {"path": self._with_ttl(snap.uri, ttl), "type": "save_weights_for_sampler"}
            if name is None:  # save_weights_and_get_sampling_client: a sampler for it
                target = self.service.base_target(model_id, snap.version)
                answer["sampling_session_id"] = self._new_sampler(
                    target, snap.uri, model_id.split(":train:")[0])
            return answer

        return self.requests.ordered(model_id, request.seq_id,
                                     FutureKind.SAVE_WEIGHTS_FOR_SAMPLER,
                                     lambda: self.service.save_for_sampler(model_id, name), done)

    # ------------------------------------------------------------------ sampling

    def create_sampling_session(self, request: tt.CreateSamplingSessionRequest) -> dict:
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

    def asample(self, request: tt.SampleRequest) -> Accepted:
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
                return Accepted(repeat, sample_sequence_ids=_sequence_ids(repeat, spec.n))
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
        rid = self.requests.track(FutureKind.SAMPLE, started,
                                  lambda r: tinker_wire.sample_output(r, len(prompt), last_n))
        if key is not None and request.seq_id is not None:
            with self._lock:
                self._sample_requests[key] = rid
        return Accepted(rid, sample_sequence_ids=_sequence_ids(rid, spec.n))

    # ------------------------------------------------------------------ futures

    def release_refused(self, model_id: Any, seq_id: Any, endpoint: str, message: str) -> None:
        """A request to ``endpoint`` was refused before it started: it gives up its place in
        its model's order (:meth:`RequestTracker.release_refused`)."""
        self.requests.release_refused(model_id, seq_id, FutureKind.of_endpoint(endpoint),
                                      message)

    async def retrieve(self, request: tt.FutureRetrieveRequest) -> Retrieved:
        """The outcome of a request, waiting up to ``long_poll_s`` (pending after that:
        answered 408, the SDK asks again)."""
        return await self.requests.retrieve(request.request_id)

    # ------------------------------------------------------------------ server info

    def client_config(self, request: tt.ClientConfigRequest) -> dict:
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
