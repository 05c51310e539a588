"""The vllm backend against a stand-in vLLM server (real HTTP on loopback, vLLM 0.33.0's shapes,
honest sampling from the tiny llama): the start-up probe accepts a server that honours the
sampling contract and refuses, naming the flag, one that does not; generate maps every sampling
field and fails closed on responses that break the contract; adapters load under new names and
unload; a lost adapter is loaded again; an interrupted batch cancels its requests."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from rollout_helpers import PROMPT
from vllm_standin import StandInVllm
from waiting import wait_for

from gridrl.adapters import read_dir
from gridrl.engine.backends.vllm.backend import VllmBackend
from gridrl.engine.backends.vllm.probe import PROBE_TOP_K, zero_adapter
from gridrl.engine.backends.vllm.wire import VllmError, VllmRefused, VllmUnavailable
from gridrl.engine.contract import (
    AdapterLoadError,
    DecodeInterrupted,
    SamplingConfig,
    SequenceRequest,
)

TOL = 1e-4  # float32 logprobs of the same weights through two forwards

CONFIGS = [
    SamplingConfig(max_tokens=6, temperature=0.0),
    SamplingConfig(max_tokens=8, temperature=0.7, top_k=20),
    SamplingConfig(max_tokens=8, temperature=1.3, top_p=0.9),
    SamplingConfig(max_tokens=8, temperature=1.0),
    SamplingConfig(max_tokens=8, temperature=0.9, top_k=50, top_p=0.8, stop_token_ids=(9, 30)),
]


@pytest.fixture
def standin(tiny_llama_dir: Path):
    """``standin(**modes)``: started stand-in servers, stopped at teardown."""
    servers: list[StandInVllm] = []

    def start(model_dir: Path | None = None, **modes) -> StandInVllm:
        servers.append(StandInVllm(model_dir or tiny_llama_dir, **modes).start())
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def connect(tiny_llama_dir: Path, tmp_path: Path):
    """``connect(server, **kw)``: a VllmBackend on it (landing under tmp), closed at teardown."""
    backends: list[VllmBackend] = []

    def make(server: StandInVllm, **kw) -> VllmBackend:
        kw.setdefault("landing_dir", tmp_path / "adapters" / ".vllm")
        backends.append(VllmBackend.connect(server.url, tiny_llama_dir, **kw))
        return backends[-1]

    yield make
    for b in backends:
        b.close()


@pytest.fixture
def reference(tiny_llama_dir: Path):
    """A torch backend on the same weights: the contract's score, to check behaviour logprobs."""
    from gridrl.engine.backends.torch.backend import TorchBackend

    return TorchBackend.from_pretrained(tiny_llama_dir)


def _batch(seed0: int = 0) -> list[SequenceRequest]:
    return [SequenceRequest(prompt_ids=list(PROMPT), sampling=c, seed=seed0 + i)
            for i, c in enumerate(CONFIGS)] + \
        [SequenceRequest(prompt_ids=[5, 12, 13, 2, 6], sampling=CONFIGS[1], seed=99)]


def _assert_behaviour_logprobs(reference, batch, results, handle=None) -> None:
    """Each token's logprob is the contract's score under the same sampling (the stand-in ran
    vLLM's sampler; the reference runs gridrl's transform)."""
    assert len(results) == len(batch)
    for req, res in zip(batch, results, strict=True):
        assert 1 <= len(res.token_ids) <= req.sampling.max_tokens
        assert len(res.logprobs) == len(res.token_ids)
        scored = reference.score(req.prompt_ids, res.token_ids, req.sampling, handle)
        assert max(abs(a - b) for a, b in zip(scored, res.logprobs, strict=True)) < TOL
        stops = reference.eos_token_ids | set(req.sampling.stop_token_ids)
        if res.finish_reason == "stop":
            assert res.token_ids[-1] in stops
        else:
            assert len(res.token_ids) == req.sampling.max_tokens
        assert not stops & set(res.token_ids[:-1])


def test_samples_under_the_contract_with_every_field_sent(standin, connect, reference) -> None:
    server = standin()
    backend = connect(server)
    assert backend.name == "vllm" and backend.adapter_format == "peft"
    assert backend.device == "vllm-0.33.0" and backend.served_model == server.served_name
    assert backend.temperature_range == (0.01, 2.0)
    before = len(server.completions)
    batch = _batch()
    results = backend.generate(batch, None)
    _assert_behaviour_logprobs(reference, batch, results)
    assert {r.finish_reason for r in results} >= {"length"}
    sent = server.completions[before:]
    assert len(sent) == len(batch)  # one request per sequence, sent concurrently
    by_seed = {b["seed"]: b for b in sent}
    for req in batch:
        body = by_seed[req.seed]
        s = req.sampling
        assert body["prompt"] == req.prompt_ids and body["n"] == 1
        assert body["model"] == server.served_name
        assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == \
            (s.temperature, s.top_p, s.top_k, s.max_tokens)
        assert (body["min_p"], body["repetition_penalty"], body["presence_penalty"],
                body["frequency_penalty"]) == (0.0, 1.0, 0.0, 0.0)
        assert set(body["stop_token_ids"]) == backend.eos_token_ids | set(s.stop_token_ids)
        assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
        assert body["stream"] is False and body["ignore_eos"] is False
    # the same seeds give the same samples; other seeds other samples
    assert backend.generate(batch, None) == results
    other = backend.generate(_batch(seed0=1000), None)
    assert [r.token_ids for r in other[1:4]] != [r.token_ids for r in results[1:4]]


def test_seeds_above_int64_are_sent_in_range(standin, connect) -> None:
    server = standin()
    backend = connect(server)
    req = SequenceRequest(prompt_ids=list(PROMPT), sampling=CONFIGS[1], seed=(1 << 64) - 1)
    backend.generate([req], None)
    assert server.completions[-1]["seed"] == (1 << 63) - 1


def test_probe_refuses_raw_logprobs(standin, connect) -> None:
    with pytest.raises(VllmRefused, match="--logprobs-mode processed_logprobs"):
        connect(standin(logprobs_mode="raw_logprobs"))


def test_probe_refuses_a_server_that_retokenizes_token_ids(standin, connect) -> None:
    with pytest.raises(VllmRefused, match="token ids"):
        connect(standin(honour_token_ids=False))


def test_probe_refuses_without_lora(standin, connect) -> None:
    with pytest.raises(VllmRefused, match="--enable-lora"):
        connect(standin(enable_lora=False))
    with pytest.raises(VllmRefused, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
        connect(standin(runtime_lora=False))


def test_probe_refuses_a_vllm_that_cannot_read_the_adapter_root(standin, connect,
                                                               tmp_path) -> None:
    elsewhere = tmp_path / "another-machine"
    elsewhere.mkdir()
    with pytest.raises(VllmRefused, match="must run on this machine"):
        connect(standin(disk=elsewhere))


def test_probe_refuses_another_tokenizer(standin, connect, tiny_llama_dir, tmp_path) -> None:
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_llama_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["cat"], vocab["the"] = vocab["the"], vocab["cat"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(VllmRefused, match="another tokenizer"):
        connect(standin(model_dir=other))


def test_api_key(standin, connect) -> None:
    server = standin(api_key="s3cret")
    with pytest.raises(VllmRefused, match="--vllm-api-key-file"):
        connect(server)
    with pytest.raises(VllmRefused, match="401"):
        connect(server, api_key="wrong")
    backend = connect(server, api_key="s3cret")
    assert len(backend.generate(_batch()[:2], None)) == 2
    # vLLM's --api-key guards /v1 only: the rest answers anyone (hence: run it on loopback)
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/version").status_code == 200


def _mutation(fn):
    def mutate(body: dict) -> dict:
        fn(body["choices"][0])
        return body
    return mutate


def _set(choice: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        choice = choice[key]
    choice[path[-1]] = value


def _drop_last_token(choice: dict) -> None:
    for values in (choice["token_ids"], choice["logprobs"]["tokens"],
                   choice["logprobs"]["token_logprobs"]):
        values.pop()


FAULTS = {
    "plain-text tokens": (lambda c: _set(c, ("logprobs", "tokens"),
                                         [f"w{i}" for i in c["token_ids"]]), "not 'token_id:N'"),
    "misaligned lists": (lambda c: c["logprobs"]["token_logprobs"].pop(), "misaligned"),
    "missing logprobs": (lambda c: _set(c, ("logprobs",), None), "no logprobs"),
    "null logprob": (lambda c: _set(c, ("logprobs", "token_logprobs", 0), None), "finite"),
    "masked logprob": (lambda c: _set(c, ("logprobs", "token_logprobs", 0), -9999.0),
                       "probability 0"),
    "unknown finish reason": (lambda c: _set(c, ("finish_reason",), "abort"),
                              "unknown finish_reason 'abort'"),
    "ids disagree": (lambda c: _set(c, ("token_ids", 0), c["token_ids"][0] + 1),
                     "token_ids\\[0\\]"),
    "prompt changed": (lambda c: _set(c, ("prompt_token_ids",), c["prompt_token_ids"][1:]),
                       "prompt_token_ids differ"),
    "length too early": (lambda c: _drop_last_token(c), "'length' after"),
    "two choices": (lambda c: None, "expected one choice"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fails_closed_on_responses_that_break_the_contract(standin, connect, fault) -> None:
    server = standin()
    backend = connect(server)
    fn, message = FAULTS[fault]
    if fault == "two choices":
        server.mutate = lambda body: {**body, "choices": body["choices"] * 2}
    else:
        server.mutate = _mutation(fn)
    req = SequenceRequest(prompt_ids=list(PROMPT),
                          sampling=SamplingConfig(max_tokens=6, temperature=1.0), seed=3)
    with pytest.raises(VllmError, match=message):
        backend.generate([req], None)
    server.mutate = None
    assert len(backend.generate([req], None)[0].token_ids) == 6


def test_stop_on_a_token_outside_the_stop_set_fails_closed(standin, connect) -> None:
    server = standin()
    backend = connect(server)

    def stop_early(choice: dict) -> None:
        choice["finish_reason"] = "stop"
    server.mutate = _mutation(stop_early)
    req = SequenceRequest(prompt_ids=list(PROMPT),
                          sampling=SamplingConfig(max_tokens=4, temperature=1.0), seed=3)
    with pytest.raises(VllmError, match="no eos or stop id"):
        backend.generate([req], None)


def test_temperatures_vllm_does_not_sample_at_are_refused(standin, connect) -> None:
    backend = connect(standin())
    for t in (0.005, 2.5):
        req = SequenceRequest(prompt_ids=list(PROMPT),
                              sampling=SamplingConfig(max_tokens=2, temperature=t), seed=0)
        with pytest.raises(ValueError, match="temperature"):
            backend.generate([req], None)


def test_adapters_load_under_new_names_serve_and_unload(standin, connect, reference,
                                                        tiny_adapters) -> None:
    server = standin()
    backend = connect(server)
    files = read_dir(tiny_adapters["a"])
    first = backend.load_adapter_files(files, "run-v1-1")
    second = backend.load_adapter_files(files, "run-v1-1")  # same key, still a new name
    assert first.served_name != second.served_name
    assert set(server.loras) == {first.served_name, second.served_name}
    assert Path(server.loras[first.served_name]) == first.path
    assert first.path.parent == backend.landing_dir and read_dir(first.path) == files

    ref = reference.load_adapter(tiny_adapters["a"], "a")
    batch = _batch()
    results = backend.generate(batch, first)
    assert {b["model"] for b in server.completions[-len(batch):]} == {first.served_name}
    _assert_behaviour_logprobs(reference, batch, results, ref)
    assert backend.generate(batch, None) != results  # the adapter changes the samples

    backend.unload_adapter(first)
    assert first.served_name not in server.loras and not first.path.exists()
    backend.unload_adapter(first)  # vLLM answers 404 (unknown adapter): logged, not raised
    directory_loaded = backend.load_adapter(tiny_adapters["b"], "other-v2-3")
    assert directory_loaded.path != tiny_adapters["b"] and directory_loaded.path.is_dir()
    names = server.loads
    assert len(names) == len(set(names))  # no name is ever loaded twice


def test_refused_loads_leave_nothing_behind(standin, connect, tiny_adapters) -> None:
    server = standin(max_lora_rank=4)
    backend = connect(server)
    with pytest.raises(AdapterLoadError, match="--max-lora-rank"):
        backend.load_adapter(tiny_adapters["b"], "b-v1-1")  # rank 8
    assert not server.loras and not list(backend.landing_dir.iterdir())
    with pytest.raises(AdapterLoadError, match="adapter file path"):
        backend.load_adapter_files({"../evil": b"x"}, "evil-v1-2")
    # a name already loaded: vLLM's 400 becomes a refused load
    handle = backend.load_adapter(tiny_adapters["a"], "a-v1-3")
    with pytest.raises(AdapterLoadError, match="has already been loaded"):
        backend._load_lora(handle.served_name, handle.path)


def test_an_adapter_vllm_lost_is_loaded_again(standin, connect, reference,
                                              tiny_adapters) -> None:
    server = standin()
    backend = connect(server)
    handle = backend.load_adapter(tiny_adapters["a"], "a-v1-1")
    batch = _batch()[:3]
    before = backend.generate(batch, handle)
    lost = handle.served_name
    server.restart()  # vLLM forgot every LoRA: the next request gets 404 on `model`
    after = backend.generate(batch, handle)
    assert after == before
    assert handle.served_name != lost and handle.served_name in server.loras


def test_unreachable_vllm_is_unavailable_and_probed_again(standin, connect,
                                                          tiny_llama_dir) -> None:
    server = standin()
    backend = connect(server)
    batch = _batch()[:2]
    expected = backend.generate(batch, None)
    server.stop()
    with pytest.raises(VllmUnavailable) as e:
        backend.generate(batch, None)
    assert isinstance(e.value, ConnectionError)
    back = standin(port=int(server.url.rsplit(":", 1)[1]))  # vLLM restarted, same address
    assert backend.generate(batch, None) == expected
    # probed again first: the sampled probe (top logprobs) came before the batch
    assert back.completions[0]["logprobs"] == PROBE_TOP_K + 2
    assert [b["logprobs"] for b in back.completions[-len(batch):]] == [0] * len(batch)


def test_an_interrupted_batch_cancels_its_requests(standin, connect) -> None:
    server = standin()
    backend = connect(server)
    server.step_delay = 0.05
    batch = [SequenceRequest(prompt_ids=list(PROMPT),
                             sampling=SamplingConfig(max_tokens=400, temperature=1.0), seed=i)
             for i in range(3)]
    started = len(server.completions)

    class Observer:
        def __init__(self, when) -> None:
            self.when = when

        def interrupted(self) -> bool:
            return self.when()

    with pytest.raises(DecodeInterrupted):  # once vLLM has all of them
        backend.generate(batch, None, observer=Observer(
            lambda: len(server.completions) - started >= len(batch)))
    wait_for(lambda: server.aborted == len(batch), timeout_s=30)
    server.step_delay = 0.0
    short = [SequenceRequest(prompt_ids=list(PROMPT), sampling=CONFIGS[0], seed=0)]
    assert len(backend.generate(short, None, observer=Observer(lambda: False))[0]
               .token_ids) == 6


def test_score_is_the_contract_where_it_can_be_computed(standin, connect, reference,
                                                        tiny_adapters) -> None:
    backend = connect(standin())
    handle = backend.load_adapter(tiny_adapters["a"], "a-v1-1")
    ref = reference.load_adapter(tiny_adapters["a"], "a")
    completion = [30, 40, 50, 2]
    for sampling in (SamplingConfig(4, 0.0), SamplingConfig(4, 1.0),
                     SamplingConfig(4, 0.6, top_k=5), SamplingConfig(4, 1.4, top_k=20)):
        for h, r in ((None, None), (handle, ref)):
            mine = backend.score(list(PROMPT), completion, sampling, h)
            theirs = reference.score(list(PROMPT), completion, sampling, r)
            for a, b in zip(mine, theirs, strict=True):
                assert (math.isinf(a) and math.isinf(b)) or abs(a - b) < TOL
    for refused in (SamplingConfig(4, 1.0, top_p=0.9), SamplingConfig(4, 0.7),
                    SamplingConfig(4, 0.7, top_k=21)):
        with pytest.raises(NotImplementedError, match="without top-p"):
            backend.score(list(PROMPT), completion, refused, None)


def test_connect_clears_what_an_earlier_node_left(standin, connect, tmp_path,
                                                  tiny_llama_dir) -> None:
    server = standin()
    landing = tmp_path / "adapters" / ".vllm"
    stale = landing / "run-v3-7-deadbeef-1"
    stale.mkdir(parents=True)
    for rel, data in zero_adapter(tiny_llama_dir).items():
        (stale / rel).write_bytes(data)
    r = httpx.post(f"{server.url}/v1/load_lora_adapter",
                   json={"lora_name": stale.name, "lora_path": str(stale.resolve())})
    assert r.status_code == 200
    connect(server, landing_dir=landing)
    assert stale.name not in server.loras and not stale.exists()
    assert list(landing.iterdir()) == []


def test_an_interrupted_batch_says_how_it_stopped() -> None:
    """vLLM sees no decode steps: the interruption reports 0 steps and why, as an int and a
    message (the scheduler logs ``e.steps`` with %d)."""
    import asyncio

    from gridrl.engine.backends.vllm.client import LoopThread as _LoopThread
    from gridrl.engine.contract import DecodeInterrupted

    loop = _LoopThread()
    try:
        with pytest.raises(DecodeInterrupted) as e:
            loop.run(asyncio.sleep(30), SimpleNamespace(interrupted=lambda: True))
    finally:
        loop.close()
    assert e.value.steps == 0
    assert str(e.value) == "decoding interrupted after 0 step(s): its vLLM requests were cancelled"


def test_alternatives_and_prompt_scores_come_from_vllm(standin, connect, reference) -> None:
    """``top_logprobs`` N asks vLLM for ``logprobs`` N: each position's N most likely tokens of
    the processed distribution (the sampled one, which vLLM adds, left out unless among them),
    as the reference's teacher-forced ``score_top``; a prompt's scores come from vLLM's
    ``prompt_logprobs`` (raw, the model's distribution) with their alternatives."""
    backend = connect(standin())
    batch = [SequenceRequest(list(PROMPT), SamplingConfig(6, 0.7, top_k=20, top_logprobs=4),
                             seed=3),
             SequenceRequest(list(PROMPT), SamplingConfig(4, 0.0, top_logprobs=2), seed=4),
             SequenceRequest(list(PROMPT), SamplingConfig(4, 1.0), seed=5)]
    results = backend.generate(batch, None)
    _assert_behaviour_logprobs(reference, batch, results)
    for req, res in zip(batch, results, strict=True):
        n = req.sampling.top_logprobs
        if not n:
            assert res.top_logprobs == []
            continue
        _, want = reference.score_top(req.prompt_ids, res.token_ids, req.sampling, None, n)
        for got, exp in zip(res.top_logprobs, want, strict=True):
            assert [t for t, _ in got] == [t for t, _ in exp]
            assert max(abs(a - b) for (_, a), (_, b) in zip(got, exp, strict=True)) < TOL
    greedy = SamplingConfig(1, 0.0)
    prompt = [5, 12, 13, 2, 6]
    mine = backend.score_top(prompt[:1], prompt[1:], greedy, None, 3)
    theirs = reference.score_top(prompt[:1], prompt[1:], greedy, None, 3)
    assert max(abs(a - b) for a, b in zip(mine[0], theirs[0], strict=True)) < TOL
    assert [[t for t, _ in pairs] for pairs in mine[1]] == \
        [[t for t, _ in pairs] for pairs in theirs[1]]
    with pytest.raises(NotImplementedError, match="without alternatives"):
        backend.score_top(list(PROMPT), [30], SamplingConfig(1, 0.6, top_k=5), None, 2)


def test_a_mixed_batch_sends_each_request_with_its_own_adapter(standin, connect, reference,
                                                               tiny_adapters) -> None:
    """Multi-adapter batches (issue 46 item 1): vLLM batches LoRAs itself, so each request of a
    mixed batch goes with its own ``model`` (the LoRA's served name, or the base model's), and
    each row's logprobs are the contract's score under its own adapter."""
    server = standin()
    backend = connect(server)
    assert backend.mixes_adapters
    a = backend.load_adapter_files(read_dir(tiny_adapters["a"]), "run-a-v1-1")
    b = backend.load_adapter_files(read_dir(tiny_adapters["b"]), "run-b-v1-2")
    refs = {id(a): reference.load_adapter(tiny_adapters["a"], "a"),
            id(b): reference.load_adapter(tiny_adapters["b"], "b")}
    batch = _batch()
    adapters = [a, None, b, a, b, None][:len(batch)]
    results = backend.generate_mixed(batch, adapters)
    sent = server.completions[-len(batch):]
    assert sorted(body["model"] for body in sent) == sorted(
        backend.served_model if h is None else h.served_name for h in adapters)
    for req, res, h in zip(batch, results, adapters, strict=True):
        _assert_behaviour_logprobs(reference, [req], [res],
                                   None if h is None else refs[id(h)])
    with pytest.raises(ValueError, match="adapters for"):
        backend.generate_mixed(batch, adapters[:-1])
