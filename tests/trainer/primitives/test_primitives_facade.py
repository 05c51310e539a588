"""The Tinker facade's own logic over a scripted service (no model): a model's requests start
in ``seq_id`` order whatever order they arrive in, a retried request is the same request,
futures long-poll and answer 408 while pending, failures are results, refusals are 4xx."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import pytest

pytest.importorskip("tinker", reason="the Tinker SDK's wire definitions (gridrl-trainer[tinker])")

from starlette.testclient import TestClient

from gridrl.common.errors import invalid_argument
from gridrl.trainer.primitives.tinker_facade import TinkerFacade
from gridrl.trainer.primitives.tinker_http import app
from gridrl.trainer.primitives.types import ModelInfo, OptimResult

ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
        "grad_clip_norm": 0.0}


class ScriptedService:
    """Records the order work is submitted in; each call's future is completed by the test."""

    def __init__(self) -> None:
        self.started: list[tuple[str, Any]] = []
        self.pending: list[futures.Future] = []

    def _future(self, what: str, arg: Any) -> futures.Future:
        self.started.append((what, arg))
        f: futures.Future = futures.Future()
        self.pending.append(f)
        return f

    def create_model(self, base_model: str, lora: Any, **kw: Any) -> futures.Future:
        f = self._future("create_model", kw["model_id"])
        f.set_result(ModelInfo(kw["model_id"], base_model, "/m", "llama", lora.rank, 32.0))
        return f

    def optim_step(self, model_id: str, adam: Any) -> futures.Future:
        return self._future("optim_step", adam.lr)

    def models(self) -> list[str]:
        return []


@pytest.fixture
def client(tmp_path) -> tuple[TestClient, ScriptedService, TinkerFacade]:
    service = ScriptedService()
    service.root = tmp_path
    facade = TinkerFacade(service, base_model="/m", long_poll_s=0.05)  # type: ignore[arg-type]
    with TestClient(app(facade)) as c:
        yield c, service, facade


def test_requests_start_in_seq_order_and_a_retry_is_the_same_request(client) -> None:
    c, service, _ = client
    sid = c.post("/api/v1/create_session", json={"tags": [], "user_metadata": None,
                                                  "sdk_version": "0.38.0"}).json()["session_id"]
    created = c.post("/api/v1/create_model", json={
        "session_id": sid, "model_seq_id": 0, "base_model": "/m",
        "lora_config": {"rank": 4}}).json()
    model_id = created["model_id"]
    assert model_id == f"{sid}:train:0"

    def step(seq: int, lr: float) -> str:
        answer = c.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": seq,
                                                     "adam_params": {**ADAM, "learning_rate": lr}})
        assert answer.status_code == 200, answer.text
        return answer.json()["request_id"]

    third = step(3, 3e-3)
    second = step(2, 2e-3)
    assert [w for w, _ in service.started] == ["create_model"]  # 1 has not arrived yet
    assert step(3, 3e-3) == third  # the SDK retried a request whose answer it lost
    first = step(1, 1e-3)
    assert service.started[1:] == [("optim_step", 1e-3), ("optim_step", 2e-3),
                                   ("optim_step", 3e-3)]
    assert len({first, second, third}) == 3

    def retrieve(rid: str):
        return c.post("/api/v1/retrieve_future", json={"request_id": rid})

    pending = retrieve(first)
    assert pending.status_code == 408 and pending.json()["type"] == "try_again"
    service.pending[1].set_result(OptimResult(grad_norm=0.5, steps=1, datums=2))
    service.pending[2].set_exception(invalid_argument("adam_params.beta2", "out of range: 1.0"))
    service.pending[3].set_exception(RuntimeError("disk full"))
    done = retrieve(first)
    assert done.status_code == 200 and done.json()["metrics"]["grad_norm:mean"] == 0.5
    assert retrieve(second).json() == {"error": "adam_params.beta2: out of range: 1.0",
                                       "category": "user"}
    assert retrieve(third).json() == {"error": "RuntimeError: disk full", "category": "server"}
    assert retrieve("unknown").status_code == 404


def test_refusals_are_client_errors_that_name_the_problem(client) -> None:
    c, _, _ = client
    answer = c.post("/api/v1/optim_step", json={"model_id": "nope", "seq_id": 1,
                                                 "adam_params": ADAM})
    assert answer.status_code == 404 and "no training model 'nope'" in answer.json()["error"]
    answer = c.post("/api/v1/create_model", json={"session_id": "gone", "model_seq_id": 0,
                                                   "base_model": "/m"})
    assert answer.status_code == 404 and "session 'gone' is unknown" in answer.json()["error"]
    answer = c.post("/api/v1/create_model", json={"session_id": "s", "base_model": "/m"})
    assert answer.status_code == 400 and answer.json()["error"].startswith(
        "request.model_seq_id:")
    answer = c.post("/api/v1/session_heartbeat", json={"session_id": "gone"})
    assert answer.status_code == 410  # the SDK stops heartbeating a finished session
    answer = c.post("/api/v1/copy_weights", json={})
    assert answer.status_code == 400 and "copying weights" in answer.json()["error"]


def test_serve_api_keeps_its_http_port_off_the_network_without_tls_and_credentials() -> None:
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([str(Path(sys.executable).parent / "gridrl-trainer"), "serve-api",
                           "--http-listen", "0.0.0.0:0"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--http-listen: 0.0.0.0 is reachable from other machines" in done.stderr
    assert "TLS" in done.stderr and "--authorized-tokens" in done.stderr


def test_a_refused_request_gives_up_its_place_and_the_later_ones_start(client) -> None:
    """Every kind of refusal of a numbered request (bad body, bad settings, bad name, a
    feature gridrl does not serve, a bad loss) consumes its ``seq_id``: the requests numbered
    after it start in their turn, whichever arrived first (the defect: they waited forever)."""
    from tinker.proto import tinker_public_pb2 as pb

    c, service, _ = client
    sid = c.post("/api/v1/create_session", json={"tags": [], "user_metadata": None,
                                                  "sdk_version": "0.38.0"}).json()["session_id"]
    model_id = c.post("/api/v1/create_model", json={
        "session_id": sid, "model_seq_id": 0, "base_model": "/m",
        "lora_config": {"rank": 4}}).json()["model_id"]

    def step(seq: int, lr: float, **extra: Any) -> Any:
        return c.post("/api/v1/optim_step", json={
            "model_id": model_id, "seq_id": seq, "adam_params": {**ADAM, "learning_rate": lr,
                                                                 **extra}})

    def fwdbwd(seq: int, loss: str) -> Any:
        msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn=loss)
        return c.post("/api/v1/forward_backward", content=msg.SerializeToString(),
                      headers={"content-type": "application/x-protobuf"})

    # arriving after their turn: each refusal releases the good request held behind it
    refusals = [
        (lambda seq: step(seq, 1.0, beta1="not a number"), 400, "beta1"),
        (lambda seq: step(seq, -1.0), 400, "learning_rate"),
        (lambda seq: fwdbwd(seq, "no-such-loss"), 400, "loss_fn"),
        (lambda seq: c.post("/api/v1/save_weights", json={
            "model_id": model_id, "seq_id": seq, "path": "../escape"}), 400, "path"),
        (lambda seq: c.post("/api/v1/save_weights_external", json={
            "model_id": model_id, "seq_id": seq, "path": "x",
            "age_encryption_recipients": ["age1q"]}), 400, "age_encryption_recipients"),
        (lambda seq: c.post("/api/v1/copy_weights", json={
            "model_id": model_id, "seq_id": seq}), 400, "copying weights"),
    ]
    seq = 1
    for n, (refuse, status, named) in enumerate(refusals):
        lr = 1e-3 * (n + 1)
        assert step(seq + 1, lr).status_code == 200  # arrives first, waits for seq
        assert service.started[-1][0] == "create_model" or service.started[-1][1] != lr
        answer = refuse(seq)
        assert answer.status_code == status and named in answer.json()["error"], answer.text
        assert service.started[-1] == ("optim_step", lr)  # started once its turn was given up
        seq += 2
    # a refusal arriving before its turn holds its place, then gives it up in order
    assert step(seq + 2, 0.5).status_code == 200
    answer = step(seq + 1, 1.0, beta2=2.0)
    assert answer.status_code == 400
    assert service.started[-1] == ("optim_step", 1e-3 * len(refusals))
    assert step(seq, 0.25).status_code == 200
    assert service.started[-2:] == [("optim_step", 0.25), ("optim_step", 0.5)]
    # an unknown model releases nothing and names the model
    answer = c.post("/api/v1/optim_step", json={
        "model_id": "nope:train:0", "seq_id": 1, "adam_params": ADAM})
    assert answer.status_code == 404 and "nope:train:0" in answer.json()["error"]
