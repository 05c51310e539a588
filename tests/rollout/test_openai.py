"""The rollout node's OpenAI-compatible endpoint over real HTTP, with the official ``openai``
client (and curl): models, completions and chat, streamed and whole, equal to a gRPC Generate
with the same seed; streams leave before the batch ends; the queue bound is 429; bearer
tokens; HTTPS and mutual TLS; an abandoned stream stops its batch; the policy version; the
CLI flag; an MLX node."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from engine_helpers import PROMPT
from rollout_helpers import GatedBackend, push_dir
from waiting import wait_for

from gridrl.common.security.policy import Security
from gridrl.common.security.tls import TlsFiles
from gridrl.engine.contract import Backend, DecodeObserver, SequenceRequest, SequenceResult
from gridrl.rollout.openai_server import OpenAIServer
from gridrl.v1 import common_pb2, rollout_pb2


def _client(base_url: str, key: str = "unused", **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60, **kw)


@pytest.fixture
def oa(live_node):
    """(node, client, base model id): a torch node on the tiny llama with the endpoint on."""
    node = live_node(openai_listen="127.0.0.1:0")
    return node, _client(node.node.openai.base_url), node.node.backend.identity.model_id


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _same_logprobs(http: list[float], grpc: Any) -> bool:
    return bool(np.array_equal(np.float32(http), np.float32(list(grpc))))


def _grpc_chat(node, text: str, **sampling: Any) -> rollout_pb2.GenerateResponse:
    return node.stub.Generate(rollout_pb2.GenerateRequest(
        prompt_text=text, apply_chat_template=True,
        sampling=common_pb2.SamplingParams(**sampling)), timeout=60)


SAMPLING = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "n": 3, "max_tokens": 6}
EXTRA = {"top_k": 50, "return_tokens_as_token_ids": True}


def test_completion_equals_grpc_generate_with_the_same_seed(oa) -> None:
    node, client, model = oa
    want = node.generate(PROMPT, top_k=50, **SAMPLING)
    got = client.completions.create(model=model, prompt=PROMPT, logprobs=0, extra_body=EXTRA,
                                    **SAMPLING)
    assert got.object == "text_completion" and got.model == model
    assert got.system_fingerprint == "gridrl:base:v0"
    assert [c.index for c in got.choices] == [0, 1, 2]
    for choice, sample in zip(got.choices, want.samples, strict=True):
        assert _ids(choice.logprobs.tokens) == list(sample.token_ids)
        assert _same_logprobs(choice.logprobs.token_logprobs, sample.logprobs)
        assert choice.text == sample.text
        assert choice.finish_reason == {1: "stop", 2: "length"}[sample.finish_reason]
    assert got.usage.prompt_tokens == len(PROMPT)
    assert got.usage.completion_tokens == sum(len(s.token_ids) for s in want.samples)
    assert len({c.text for c in got.choices}) > 1  # n samples, each with its own seed


def test_streamed_completion_is_one_token_per_event_and_adds_up(oa) -> None:
    node, client, model = oa
    want = node.generate(PROMPT, top_k=50, **SAMPLING)
    text: dict[int, str] = {i: "" for i in range(3)}
    tokens: dict[int, list[str]] = {i: [] for i in range(3)}
    logprobs: dict[int, list[float]] = {i: [] for i in range(3)}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(model=model, prompt=PROMPT, logprobs=0,
                                           extra_body=EXTRA, stream=True, **SAMPLING):
        (choice,) = chunk.choices
        assert len(choice.logprobs.tokens) == 1  # one decode step per event
        text[choice.index] += choice.text
        tokens[choice.index] += choice.logprobs.tokens
        logprobs[choice.index] += choice.logprobs.token_logprobs
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    for i, sample in enumerate(want.samples):
        assert _ids(tokens[i]) == list(sample.token_ids)
        assert _same_logprobs(logprobs[i], sample.logprobs)
        assert text[i] == sample.text
        assert finish[i] == {1: "stop", 2: "length"}[sample.finish_reason]


def test_chat_equals_grpc_generate_with_the_chat_template(oa) -> None:
    node, client, model = oa
    want = _grpc_chat(node, "the cat", top_k=50, **SAMPLING)
    got = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "the cat"}], logprobs=True,
        extra_body=EXTRA, **SAMPLING)
    assert got.object == "chat.completion"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    for choice, sample in zip(got.choices, want.samples, strict=True):
        assert choice.message.role == "assistant" and choice.message.content == sample.text
        assert _ids([t.token for t in choice.logprobs.content]) == list(sample.token_ids)
        assert _same_logprobs([t.logprob for t in choice.logprobs.content], sample.logprobs)
    streamed: dict[int, str] = {i: "" for i in range(3)}
    roles = []
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "the cat"}], stream=True,
            stream_options={"include_usage": True}, extra_body={"top_k": 50}, **SAMPLING):
        if chunk.usage is not None:
            assert not chunk.choices
            assert chunk.usage.completion_tokens == sum(len(s.token_ids) for s in want.samples)
            continue
        (choice,) = chunk.choices
        roles += [choice.delta.role] if choice.delta.role else []
        streamed[choice.index] += choice.delta.content or ""
    assert roles == ["assistant"] * 3
    assert streamed == {i: s.text for i, s in enumerate(want.samples)}


def test_stop_strings_and_stop_ids(oa) -> None:
    node, client, model = oa
    greedy = node.generate(PROMPT, max_tokens=8, temperature=0.0).samples[0]
    words = greedy.text.split(" ")
    assert len(words) >= 4
    stop = " " + words[2]  # the third token's text: ends the text after the second word
    expected_text = " ".join(words[:2])
    for stream in (False, True):
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                        temperature=0, stop=[stop, "zzz"], stream=stream,
                                        logprobs=0, extra_body=EXTRA)
        chunks = list(got) if stream else [got]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        assert text == expected_text
        assert chunks[-1].choices[0].finish_reason == "stop"
        # the token that completed the stop string is the last one returned
        assert _ids(tokens) == list(greedy.token_ids[:3])
    third = greedy.token_ids[2]
    by_id = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                      logprobs=0, extra_body={**EXTRA, "stop_token_ids": [third]})
    want = node.generate(PROMPT, max_tokens=8, temperature=0.0, stop_token_ids=[third])
    assert _ids(by_id.choices[0].logprobs.tokens) == list(want.samples[0].token_ids)
    assert by_id.choices[0].finish_reason == "stop" and by_id.choices[0].text == want.samples[0].text


def _raw(url: str, body: bytes | None = None, headers: dict[str, str] | None = None,
         method: str | None = None) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(url, data=body, method=method, headers={
        "content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_bad_requests_are_openai_errors_naming_the_field(oa) -> None:
    node, client, model = oa
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=100_000)
    assert e.value.status_code == 400 and e.value.param == "max_tokens"
    assert e.value.body["message"].startswith("max_tokens: must be in [1, 2048] on this node")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                       top_p=0)
    assert e.value.param == "top_p" and e.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="hi")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    url = node.node.openai.base_url
    status, _, body = _raw(f"{url}/completions", b"{not json")
    assert status == 400 and "not JSON" in body["error"]["message"]
    status, _, body = _raw(f"{url}/completions",
                           json.dumps({"model": model, "prompt": "hi", "n": "2"}).encode())
    assert (status, body["error"]["param"]) == (400, "n")
    status, _, body = _raw(f"{url}/nowhere")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}


def test_queue_full_is_429(live_node, tiny_llama_dir) -> None:
    from gridrl.engine.backends.torch.backend import TorchBackend

    backend = GatedBackend(TorchBackend.from_pretrained(tiny_llama_dir))
    node = live_node(backend, openai_listen="127.0.0.1:0", max_queue=1)
    client = _client(node.node.openai.base_url)
    model = backend.identity.model_id
    running = node.stub.Generate.future(rollout_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=60)
    wait_for(lambda: backend.entered == 1)
    waiting: list[Any] = []
    thread = threading.Thread(target=lambda: waiting.append(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4)))
    thread.start()
    wait_for(lambda: node.engine.queue_depth == 1)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4)
    assert e.value.status_code == 429 and "queue full" in e.value.body["message"]
    backend.gate.set()
    thread.join(60)
    assert len(running.result().samples) == 1 and waiting[0].choices[0].finish_reason


def test_credentials_and_scopes_are_the_grpc_side_s(live_node, creds) -> None:
    """The node's authorized tokens decide every route as for the gRPC method it stands for:
    models as GetNodeInfo (read scope), completions as Generate (trainer scope)."""
    node = live_node(openai_listen="127.0.0.1:0", security=creds.security(None, authorized=True))
    url = node.node.openai.base_url
    model = node.node.backend.identity.model_id
    with pytest.raises(openai.AuthenticationError) as e:
        _client(url, creds.tokens["wrong"]).models.list()
    assert e.value.status_code == 401 and "not recognised" in e.value.body["message"]
    status, _, body = _raw(f"{url}/models")
    assert status == 401 and "no credential" in body["error"]["message"]
    with pytest.raises(openai.PermissionDeniedError) as e:  # a node's credential reads nothing
        _client(url, creds.tokens["node"]).models.list()
    assert e.value.status_code == 403 and "needs scope read" in e.value.body["message"]
    reader = _client(url, creds.tokens["read"])
    assert [m.id for m in reader.models.list().data] == [model]
    with pytest.raises(openai.PermissionDeniedError) as e:  # reading is not generating
        reader.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert "needs scope trainer" in e.value.body["message"]
    trainer = _client(url, creds.tokens["trainer"])
    assert trainer.completions.create(model=model, prompt=PROMPT, max_tokens=2).choices
    assert _raw(url.removesuffix("/v1") + "/health")[0] == 200  # open, like gRPC health


def test_a_certificate_bound_credential_is_refused_over_http(live_node, pki, tmp_path) -> None:
    """The HTTP endpoint does not see the TLS client certificate, so a credential bound to one
    (``gridrl-auth mint --cert``) is refused there (401, saying why), even by a client
    presenting that certificate: taking its token alone would undo the binding."""
    from gridrl.common.security.minting import mint
    from gridrl.common.security.policy import Security
    from gridrl.common.security.tokens import AuthorizedTokens, certificate_file_fingerprint

    authorized = tmp_path / "authorized_tokens"
    mint(authorized, tmp_path / "bound.token", "trainer", "bound",
         cert=certificate_file_fingerprint(pki.crt("client")))
    mint(authorized, tmp_path / "free.token", "trainer", "free")
    node = live_node(openai_listen="127.0.0.1:0",
                     security=Security(authorized=AuthorizedTokens(authorized)))
    url = node.node.openai.base_url
    model = node.node.backend.identity.model_id
    with pytest.raises(openai.AuthenticationError) as e:
        _client(url, (tmp_path / "bound.token").read_text().strip()).completions.create(
            model=model, prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401
    assert e.value.body["message"] == (
        "RolloutService/Generate: credential 'bound' is bound to a client certificate, which "
        "the HTTP endpoint does not check; use a credential minted without --cert")
    free = _client(url, (tmp_path / "free.token").read_text().strip())
    assert free.completions.create(model=model, prompt=PROMPT, max_tokens=2).choices


def test_adapter_answers_with_its_policy_version_and_the_base_model_stays_reachable(
        oa, tiny_adapters) -> None:
    node, client, model = oa
    base = node.generate(PROMPT, max_tokens=6, temperature=0.0).samples[0]
    push_dir(node.stub, tiny_adapters["a"], "run-a", 3)
    tuned = node.generate(PROMPT, max_tokens=6, temperature=0.0).samples[0]
    assert list(tuned.token_ids) != list(base.token_ids)
    models = client.models.list().data
    assert [(m.id, m.policy_version) for m in models] == [("run-a", 3), (model, 0)]
    raw = client.completions.with_raw_response.create(model="run-a", prompt=PROMPT,
                                                      max_tokens=6, temperature=0)
    got = raw.parse()
    assert raw.headers["x-gridrl-policy-version"] == "3"
    assert raw.headers["x-gridrl-adapter"] == "run-a"
    assert (got.model, got.system_fingerprint) == ("run-a", "gridrl:run-a:v3")
    assert got.choices[0].text == tuned.text
    # naming the base model decodes without the adapter, while the adapter keeps serving
    as_base = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert as_base.system_fingerprint == "gridrl:base:v0" and as_base.choices[0].text == base.text
    assert node.info().adapter.version == 3


class StepGate(GatedBackend):
    """A real backend that stops inside its decode hook after ``hold_at`` steps until
    ``release`` is set: a test can look at a stream while its batch is still decoding."""

    def __init__(self, inner: Backend, hold_at: int) -> None:
        super().__init__(inner)
        self.gate.set()  # only the step is held
        self.hold_at = hold_at
        self.held, self.release = threading.Event(), threading.Event()
        self.steps = 0
        self.observer: DecodeObserver | None = None

    def generate(self, batch: list[SequenceRequest], adapter: Any | None,
                 observer: DecodeObserver | None = None) -> list[SequenceResult]:
        self.observer = observer
        gate = self

        class Held:
            def on_tokens(self, rows, token_ids, logprobs) -> None:
                gate.steps += 1
                hold = gate.steps == gate.hold_at
                if hold:
                    gate.held.set()  # before the tokens leave: a reader that has them sees it
                if observer is not None:
                    observer.on_tokens(rows, token_ids, logprobs)
                if hold:
                    assert gate.release.wait(60), "test never released the step"

            def interrupted(self) -> bool:
                return observer is not None and observer.interrupted()

        return super().generate(batch, adapter, Held())


@pytest.fixture
def gated_node(live_node, tiny_llama_dir):
    """``gated_node(hold_at)`` -> (node, StepGate backend, client)."""
    from gridrl.engine.backends.torch.backend import TorchBackend

    backends: list[StepGate] = []

    def start(hold_at: int):
        backend = StepGate(TorchBackend.from_pretrained(tiny_llama_dir), hold_at=hold_at)
        backends.append(backend)
        node = live_node(backend, openai_listen="127.0.0.1:0")
        return node, backend, _client(node.node.openai.base_url)

    yield start
    for backend in backends:
        backend.release.set()


def test_stream_events_leave_before_the_batch_ends(gated_node) -> None:
    node, backend, client = gated_node(hold_at=3)
    stream = client.completions.create(model=backend.identity.model_id, prompt=PROMPT,
                                       max_tokens=8, temperature=0, logprobs=0, stream=True)
    received = []
    for chunk in stream:
        received += chunk.choices[0].logprobs.tokens
        if len(received) == 3:
            # the batch is still decoding: the backend sits inside its third decode step
            assert backend.held.is_set() and not backend.release.is_set()
            assert node.engine.active_sequences == 1
            backend.release.set()
    assert len(received) == 8 and backend.steps == 8


def test_an_abandoned_stream_stops_its_batch(gated_node) -> None:
    node, backend, client = gated_node(hold_at=1)  # holds inside the first decode step
    with client.completions.create(model=backend.identity.model_id, prompt=PROMPT,
                                   max_tokens=200, temperature=0, stream=True) as stream:
        next(iter(stream))
    assert backend.held.is_set()
    # the client went away: the engine's observer now asks the backend to stop
    wait_for(lambda: backend.observer is not None and backend.observer.interrupted())
    backend.release.set()
    wait_for(lambda: node.engine.active_sequences == 0)
    assert backend.steps == 1  # stopped before the next step, not after 200 tokens
    assert node.engine.recent_batches() == []  # the batch never completed
    after = client.completions.create(model=backend.identity.model_id, prompt=PROMPT,
                                      max_tokens=4, temperature=0)
    assert after.choices[0].finish_reason  # the node goes on serving


def test_a_client_leaving_a_whole_request_stops_it_too(gated_node) -> None:
    import socket

    node, backend, _ = gated_node(hold_at=1)
    body = json.dumps({"model": backend.identity.model_id, "prompt": PROMPT, "max_tokens": 200,
                       "temperature": 0}).encode()
    port = node.node.openai.port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        assert backend.held.wait(30)
    wait_for(lambda: backend.observer is not None and backend.observer.interrupted())
    backend.release.set()
    wait_for(lambda: node.engine.active_sequences == 0)
    assert backend.steps == 1 and node.engine.recent_batches() == []


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(tmp: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca",
             cwd=tmp)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"),
                      ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
                 cwd=tmp)
        (tmp / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile",
                 f"{name}.ext", cwd=tmp)
    return {n: tmp / n for n in ("ca.pem", "server.pem", "server.key", "client.pem",
                                 "client.key")}


def test_https_and_mutual_tls(live_node, tmp_path: Path) -> None:
    import ssl

    node = live_node()
    files = _certificates(tmp_path)
    model = node.node.backend.identity.model_id
    server = OpenAIServer(node.engine, node.node.codec, node.node.limits, "127.0.0.1:0",
                          security=Security(tls=TlsFiles(str(files["server.pem"]),
                                                         str(files["server.key"]))),
                          grace_s=1).start()
    try:
        assert server.base_url.startswith("https://127.0.0.1:")
        client = _client(server.base_url, http_client=openai.DefaultHttpxClient(
            verify=ssl.create_default_context(cafile=str(files["ca.pem"]))))
        got = client.chat.completions.create(model=model, max_tokens=3, temperature=0,
                                             messages=[{"role": "user", "content": "the cat"}])
        assert got.choices[0].message.content == _grpc_chat(
            node, "the cat", max_tokens=3, temperature=0.0).samples[0].text
        with pytest.raises(openai.APIConnectionError):  # the CA is not the system's
            _client(server.base_url).models.list()
    finally:
        server.stop()
    mutual = OpenAIServer(node.engine, node.node.codec, node.node.limits, "127.0.0.1:0",
                          security=Security(tls=TlsFiles(str(files["server.pem"]),
                                                         str(files["server.key"]),
                                                         str(files["ca.pem"]))),
                          grace_s=1).start()
    try:
        context = ssl.create_default_context(cafile=str(files["ca.pem"]))
        no_cert = _client(mutual.base_url, http_client=openai.DefaultHttpxClient(verify=context))
        with pytest.raises(openai.APIConnectionError):
            no_cert.models.list()
        context.load_cert_chain(str(files["client.pem"]), str(files["client.key"]))
        with_cert = _client(mutual.base_url,
                            http_client=openai.DefaultHttpxClient(verify=context))
        assert [m.id for m in with_cert.models.list().data] == [model]
    finally:
        mutual.stop()


def test_cli_flag_serves_it_and_curl_streams(service_factory, tiny_llama_dir: Path,
                                             tmp_path: Path, creds) -> None:
    curl = shutil.which("curl")
    assert curl, "curl is needed for this test"
    node = service_factory(["gridrl-rollout", "serve", "--model", str(tiny_llama_dir),
                            "--listen", "127.0.0.1:0", "--metrics-port", "-1",
                            "--openai-listen", "127.0.0.1:0",
                            "--authorized-tokens", str(creds.authorized),
                            "--adapter-root", str(tmp_path / "adapters")], "rollout")
    token = creds.tokens["trainer"]
    url = node.info["openai_base_url"]
    body = {"model": str(tiny_llama_dir), "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
            "logprobs": 0}
    whole = _client(url, token).completions.create(**body, extra_body=EXTRA)
    out = subprocess.run([curl, "-sSN", "--fail-with-body", f"{url}/completions",
                          "-H", f"authorization: Bearer {token}",
                          "-H", "content-type: application/json",
                          "-d", json.dumps({**body, **EXTRA, "stream": True})],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    events = [line.removeprefix("data: ") for line in out.split("\n\n") if line]
    assert events[-1] == "[DONE]" and all(line.startswith("data: ") for line in
                                          out.strip().split("\n\n"))
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 5  # one event per token
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.choices[0].text
    assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == \
        whole.choices[0].logprobs.tokens
    assert node.stop() == 0


@pytest.mark.mlx
def test_mlx_node(live_node, tiny_llama_dir: Path) -> None:
    pytest.importorskip("mlx.core")
    from gridrl.engine.backends.mlx.backend import MlxBackend

    node = live_node(MlxBackend.from_pretrained(tiny_llama_dir, device="cpu"),
                     openai_listen="127.0.0.1:0")
    client = _client(node.node.openai.base_url)
    model = node.node.backend.identity.model_id
    sampling = {"temperature": 0.8, "seed": 5, "n": 2, "max_tokens": 3}
    want = node.generate(PROMPT, **sampling)
    got = client.completions.create(model=model, prompt=PROMPT, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True}, **sampling)
    for choice, sample in zip(got.choices, want.samples, strict=True):
        assert _ids(choice.logprobs.tokens) == list(sample.token_ids)
        assert _same_logprobs(choice.logprobs.token_logprobs, sample.logprobs)
    chat_want = _grpc_chat(node, "the cat", **sampling)
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "the cat"}], stream=True,
            **sampling):
        streamed[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert streamed == {i: s.text for i, s in enumerate(chat_want.samples)}


# -------------------------------------------------- alternatives, echo, an RL orchestrator

def _on_engine(node, fn):
    """Run a backend call on the node's scheduler thread (where every backend call runs)."""
    return node.node.engine.call_between_batches(fn, timeout=60)


def test_alternatives_are_the_top_of_the_processed_distribution(oa) -> None:
    """``logprobs=N`` (completions) and ``top_logprobs=N`` (chat): beside each token, the N
    most likely tokens of the distribution it was drawn from (temperature 0.8, top-k 50,
    top-p 0.9 here), as teacher-forced scoring gives them; streamed the same."""
    from gridrl.engine.contract import SamplingConfig

    node, client, model = oa
    backend = node.node.backend
    config = SamplingConfig(max_tokens=6, temperature=0.8, top_p=0.9, top_k=50)
    got = client.completions.create(model=model, prompt=PROMPT, logprobs=5, extra_body=EXTRA,
                                    **SAMPLING)
    for choice in got.choices:
        tokens = _ids(choice.logprobs.tokens)
        _, top = _on_engine(node, lambda t=tokens: backend.score_top(PROMPT, t, config, None, 5))
        for pos, (entry, lp, want) in enumerate(zip(
                choice.logprobs.top_logprobs, choice.logprobs.token_logprobs, top,
                strict=True)):
            assert entry[f"token_id:{tokens[pos]}"] == lp  # the sampled one, its logprob
            named = {f"token_id:{t}": max(v, -9999.0) for t, v in want}
            # the N alternatives and the sampled token (one of them, or one more)
            assert set(entry) == set(named) | {f"token_id:{tokens[pos]}"}
            for key, value in named.items():
                assert entry[key] == pytest.approx(value, abs=1e-4), (pos, key)
    streamed: dict[int, list[dict]] = {i: [] for i in range(3)}
    for chunk in client.completions.create(model=model, prompt=PROMPT, logprobs=5,
                                           extra_body=EXTRA, stream=True, **SAMPLING):
        streamed[chunk.choices[0].index] += chunk.choices[0].logprobs.top_logprobs
    assert streamed == {c.index: c.logprobs.top_logprobs for c in got.choices}

    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "the cat"}], logprobs=True,
        top_logprobs=3, extra_body=EXTRA, **SAMPLING)
    prompt = node.node.codec.encode("the cat", True)
    for choice in chat.choices:
        content = choice.logprobs.content
        tokens = _ids([t.token for t in content])
        _, top = _on_engine(node, lambda t=tokens: backend.score_top(prompt, t, config, None, 3))
        for entry, want in zip(content, top, strict=True):
            assert [t.token for t in entry.top_logprobs] == [f"token_id:{t}" for t, _ in want]
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
                [max(v, -9999.0) for _, v in want], abs=1e-4)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, logprobs=21)
    assert e.value.param == "logprobs" and "must be in [0, 20]" in e.value.body["message"]


def test_echo_returns_the_prompt_scored_by_the_model(oa) -> None:
    """``echo`` with ``max_tokens`` 0 (what lm-evaluation-harness sends for loglikelihoods,
    with 1): the prompt's text and tokens, each token's logprob under the model (the first
    null), its alternatives; with new tokens, the prompt then the completion."""
    from gridrl.engine.contract import SamplingConfig

    node, client, model = oa
    backend, codec = node.node.backend, node.node.codec
    text = "the red cat jump"
    ids = codec.encode(text, False)
    greedy = SamplingConfig(max_tokens=1, temperature=0.0)
    want, want_top = _on_engine(node, lambda: backend.score_top(ids[:1], ids[1:], greedy,
                                                                None, 2))
    got = client.completions.create(model=model, prompt=text, echo=True, max_tokens=0,
                                    logprobs=2, temperature=0)
    (choice,) = got.choices
    assert choice.text == text and choice.finish_reason == "length"
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == codec.token_texts(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == want  # the same computation: equal
    for entry, token, pairs in zip(lp.top_logprobs[1:], lp.tokens[1:], want_top, strict=True):
        assert token in entry and set(codec.token_texts([t for t, _ in pairs])) <= set(entry)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    sample = node.generate(ids, max_tokens=2, temperature=0.0).samples[0]
    two = client.completions.create(model=model, prompt=ids, echo=True, max_tokens=2,
                                    logprobs=1, temperature=0, extra_body=EXTRA)
    (choice,) = two.choices
    assert choice.text == codec.decode(ids) + sample.text
    assert _ids(choice.logprobs.tokens) == ids + list(sample.token_ids)
    assert choice.logprobs.token_logprobs[1:len(ids)] == want
    assert _same_logprobs(choice.logprobs.token_logprobs[len(ids):], sample.logprobs)
    plain = client.completions.create(model=model, prompt=text, echo=True, max_tokens=2,
                                      temperature=0)
    assert plain.choices[0].text == text + sample.text and plain.choices[0].logprobs is None


def test_an_rl_orchestrator_reads_what_it_reads_from_vllm(oa, tiny_adapters) -> None:
    """What a framework that drives vLLM for RL asks (``return_token_ids``,
    ``return_tokens_as_token_ids``, ``logprobs``): the sampled ids as ``"token_id:<id>"`` and
    as ``token_ids``, their behaviour logprobs (the node's policy, teacher-forced: the
    importance ratio starts at 1), the prompt's ids, and the policy version that sampled them,
    whole and streamed, chat and completions."""
    from gridrl.engine.contract import SamplingConfig

    node, client, _ = oa
    push_dir(node.stub, tiny_adapters["a"], "run", 3)
    wait_for(lambda: node.node.engine.serving.version == 3)
    backend, handle = node.node.backend, node.node.engine.serving.handle
    asks = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    messages = [{"role": "user", "content": "the cat"}]
    prompt = node.node.codec.encode("the cat", True)
    got = client.chat.completions.create(model="run", messages=messages, logprobs=True,
                                         max_tokens=6, temperature=1.0, seed=5, n=2,
                                         extra_body=asks)
    assert got.model_extra["policy_version"] == 3 and got.system_fingerprint == "gridrl:run:v3"
    assert got.model_extra["prompt_token_ids"] == prompt
    config = SamplingConfig(max_tokens=6, temperature=1.0)
    for choice in got.choices:
        ids = choice.model_extra["token_ids"]
        assert _ids([t.token for t in choice.logprobs.content]) == ids
        scored = _on_engine(node, lambda i=ids: backend.score(prompt, i, config, handle))
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(scored, abs=1e-4)
    completion = client.completions.create(model="run", prompt=prompt, logprobs=0,
                                           max_tokens=6, temperature=1.0, seed=5, n=2,
                                           extra_body=asks)
    assert completion.model_extra["policy_version"] == 3
    for choice, chat_choice in zip(completion.choices, got.choices, strict=True):
        assert choice.model_extra["prompt_token_ids"] == prompt
        assert choice.model_extra["token_ids"] == chat_choice.model_extra["token_ids"]  # seed
    chunks = list(client.chat.completions.create(model="run", messages=messages, logprobs=True,
                                                 max_tokens=6, temperature=1.0, seed=5, n=2,
                                                 stream=True, extra_body=asks))
    assert {c.model_extra["policy_version"] for c in chunks} == {3}
    assert [c.model_extra.get("prompt_token_ids") for c in chunks if
            c.model_extra.get("prompt_token_ids")] == [prompt, prompt]  # each choice's first
    for choice in got.choices:
        streamed = [i for c in chunks for ch in c.choices if ch.index == choice.index
                    for i in (ch.model_extra.get("token_ids") or [])]
        assert streamed == choice.model_extra["token_ids"]
