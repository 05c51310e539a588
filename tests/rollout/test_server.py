"""RolloutService over real loopback channels: Generate (token-id and text prompts, stop ids,
seeds across batch compositions, concurrency, queue bound), every INVALID_ARGUMENT field,
GetNodeInfo and the node's Prometheus metrics."""

from __future__ import annotations

import concurrent.futures
import urllib.request

import grpc
import pytest
from engine_helpers import PROMPT
from rollout_helpers import GatedBackend, push_dir, rpc_error
from waiting import wait_for

from gridrl.rollout.text import TextCodec
from gridrl.v1 import common_pb2, rollout_pb2

STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


def test_generate_returns_ids_logprobs_text(live_node, tiny_backend) -> None:
    node = live_node()
    response = node.generate(n=3, max_tokens=5, temperature=1.0, seed=11)
    assert list(response.prompt_token_ids) == PROMPT
    assert len(response.samples) == 3 and response.duration_s > 0
    codec = TextCodec(tiny_backend.tokenizer)
    for s in response.samples:
        assert len(s.token_ids) == len(s.logprobs) == 5 and s.finish_reason == LENGTH
        assert s.text == codec.decode(s.token_ids)
        assert s.adapter_version == 0 and s.adapter_name == ""
        scored = tiny_backend.score(PROMPT, list(s.token_ids), _config(5, 1.0), None)
        assert list(s.logprobs) == pytest.approx(scored, abs=1e-4)
    again = node.generate(n=3, max_tokens=5, temperature=1.0, seed=11)
    assert [list(s.token_ids) for s in again.samples] == \
        [list(s.token_ids) for s in response.samples]


def _config(max_tokens: int, temperature: float, **kw):
    from gridrl.engine.contract import SamplingConfig

    return SamplingConfig(max_tokens=max_tokens, temperature=temperature, **kw)


def test_seed_determinism_across_batch_compositions(live_node, tiny_backend) -> None:
    """The same seeded request gives the same samples alone and batched with others."""
    gated = GatedBackend(tiny_backend)
    node = live_node(gated)
    gated.gate.set()
    alone = node.generate(n=4, max_tokens=8, temperature=0.9, top_p=0.9, seed=5)
    gated.gate.clear()
    pool = concurrent.futures.ThreadPoolExecutor(4)
    blocker = pool.submit(node.generate, [30, 31], max_tokens=2, seed=1)
    wait_for(lambda: gated.entered == 2)
    others = [pool.submit(node.generate, [40 + i, 41, 42, 43][:2 + i], n=3, max_tokens=6,
                          temperature=0.7, top_k=9, seed=i) for i in range(2)]
    target = pool.submit(node.generate, n=4, max_tokens=8, temperature=0.9, top_p=0.9, seed=5)
    wait_for(lambda: node.engine.queue_depth == 3)
    gated.gate.set()
    together = target.result(30)
    for f in (blocker, *others):
        f.result(30)
    batch = node.engine.recent_batches()[-1]
    assert batch.sequences == 10 and len(batch.requests) == 3  # all three in one batch
    assert [list(s.token_ids) for s in together.samples] == \
        [list(s.token_ids) for s in alone.samples]
    for a, b in zip(together.samples, alone.samples, strict=True):
        assert list(a.logprobs) == pytest.approx(list(b.logprobs), abs=1e-5)


def test_concurrent_callers_are_batched_together(live_node) -> None:
    """Callers arriving together are decoded in one batch (the batch-size metric and the engine
    history both show it), not one at a time."""
    node = live_node(batch_window_s=1.0)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    futures = [pool.submit(node.generate, n=2, max_tokens=4, seed=i) for i in range(2)]
    for f in futures:
        assert len(f.result(30).samples) == 2
    assert [(b.sequences, len(b.requests)) for b in node.engine.recent_batches()] == [(4, 2)]


def test_queue_full_is_resource_exhausted(live_node, tiny_backend) -> None:
    gated = GatedBackend(tiny_backend)
    node = live_node(gated, max_queue=2, batch_window_s=0.0)
    pool = concurrent.futures.ThreadPoolExecutor(4)
    running = pool.submit(node.generate, max_tokens=2)
    wait_for(lambda: gated.entered == 1)
    queued = [pool.submit(node.generate, max_tokens=2, seed=i) for i in range(2)]
    wait_for(lambda: node.engine.queue_depth == 2)
    e = rpc_error(lambda: node.generate(max_tokens=2))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in e.details()
    gated.gate.set()
    for f in [running, *queued]:
        assert len(f.result(30).samples) == 1


def test_text_prompts_and_chat_template(live_node, tiny_backend) -> None:
    node = live_node()
    tok = tiny_backend.tokenizer
    chat = node.stub.Generate(rollout_pb2.GenerateRequest(
        prompt_text="reverse the words", apply_chat_template=True,
        sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0)), timeout=30)
    rendered = tok.apply_chat_template([{"role": "user", "content": "reverse the words"}],
                                       add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|user|> reverse the words </s>")
    assert list(chat.prompt_token_ids) == tok(rendered, add_special_tokens=False)["input_ids"]
    plain = node.stub.Generate(rollout_pb2.GenerateRequest(
        prompt_text="reverse the words", sampling=common_pb2.SamplingParams(
            max_tokens=3, temperature=0)), timeout=30)
    assert list(plain.prompt_token_ids) == tok("reverse the words")["input_ids"]
    # a text prompt decodes exactly like its ids
    by_ids = node.generate(list(chat.prompt_token_ids), max_tokens=3, temperature=0)
    assert list(by_ids.samples[0].token_ids) == list(chat.samples[0].token_ids)


def test_chat_without_a_template_is_refused(tiny_llama_dir) -> None:
    from transformers import AutoTokenizer

    from gridrl.common.errors import StatusError

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tok.chat_template = None
    with pytest.raises(StatusError) as e:
        TextCodec(tok).encode("hi", chat=True)
    assert e.value.message.startswith("apply_chat_template: ")


def test_stop_token_ids(live_node) -> None:
    node = live_node()
    free = node.generate(max_tokens=8, temperature=0).samples[0]
    stop = free.token_ids[2]
    first = list(free.token_ids).index(stop)
    stopped = node.generate(max_tokens=8, temperature=0, stop_token_ids=[stop]).samples[0]
    assert stopped.finish_reason == STOP
    assert list(stopped.token_ids) == list(free.token_ids)[:first + 1]
    assert free.finish_reason == LENGTH


VOCAB, CONTEXT = 512, 512
BAD_REQUESTS = [
    ({"prompt_token_ids": []}, "prompt_token_ids", "empty prompt"),
    ({"prompt_token_ids": [1, 512]}, "prompt_token_ids[1]", "outside the vocabulary"),
    ({"prompt_token_ids": [-1]}, "prompt_token_ids[0]", "outside the vocabulary"),
    ({"prompt_token_ids": [1], "prompt_text": "hi"}, "prompt_text", "not both"),
    ({"prompt_token_ids": [1], "apply_chat_template": True}, "apply_chat_template", "prompt_text"),
    ({"sampling": {"n": 65}}, "sampling.n", "[1, 64]"),
    ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens", "[1, 300]"),
    ({"sampling": {"max_tokens": 301}}, "sampling.max_tokens", "[1, 300]"),
    ({"prompt_token_ids": [1] * 250, "sampling": {"max_tokens": 300}}, "sampling.max_tokens",
     "exceeds the model's context of 512"),
    ({"sampling": {"temperature": -0.5}}, "sampling.temperature", ">= 0"),
    ({"sampling": {"temperature": float("nan")}}, "sampling.temperature", "finite"),
    ({"sampling": {"temperature": 1e-30}}, "sampling.temperature", "overflow"),
    ({"sampling": {"top_p": 1.5}}, "sampling.top_p", "must be in (0, 1], got 1.5"),
    ({"sampling": {"top_p": 0.0}}, "sampling.top_p", "(0, 1]"),
    ({"sampling": {"top_k": -1}}, "sampling.top_k", ">= 0"),
    ({"sampling": {"stop_token_ids": [3, 9999]}}, "sampling.stop_token_ids[1]", "vocabulary"),
]


@pytest.fixture(scope="module")
def validating_node(tiny_llama_dir, tmp_path_factory):
    from rollout_helpers import LiveNode

    from gridrl.engine.backends.torch.backend import TorchBackend

    node = LiveNode(TorchBackend.from_pretrained(tiny_llama_dir),
                    tmp_path_factory.mktemp("validating"), max_tokens=300)
    yield node
    node.close()


@pytest.mark.parametrize(("fields", "field", "problem"), BAD_REQUESTS,
                         ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD_REQUESTS)])
def test_invalid_argument_names_the_field(validating_node, fields, field, problem) -> None:
    fields = {"prompt_token_ids": PROMPT, **fields}
    fields["sampling"] = common_pb2.SamplingParams(**{"max_tokens": 4,
                                                      **fields.get("sampling", {})})
    request = rollout_pb2.GenerateRequest(**fields)
    e = rpc_error(lambda: validating_node.stub.Generate(request, timeout=30))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details().startswith(f"{field}: "), e.details()
    assert problem in e.details()


def test_node_info(live_node) -> None:
    node = live_node(capacity=12, max_n=5, max_tokens=77)
    node.generate(max_tokens=2)
    info = node.info()
    assert info.address == node.node.address and info.role == common_pb2.NODE_ROLE_ROLLOUT
    assert info.backend == common_pb2.BACKEND_TORCH
    assert info.adapter_format == common_pb2.ADAPTER_FORMAT_PEFT
    assert (info.base_model.architecture, info.base_model.hidden_size,
            info.base_model.num_layers, info.base_model.vocab_size) == ("llama", 64, 2, VOCAB)
    assert info.adapter.version == 0 and info.adapter.name == ""
    assert (info.capacity, info.max_n, info.max_tokens, info.max_context) == (12, 5, 77, CONTEXT)
    assert info.queue_depth == 0 and info.uptime_s > 0
    assert (info.device, info.dtype) == ("cpu", "float32")
    assert info.software_version and not info.stored_adapters


def test_metrics(live_node) -> None:
    node = live_node(metrics_port=0)
    node.generate(n=3, max_tokens=4, temperature=0)
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{node.node.metrics_port}/metrics", timeout=10).read().decode()
    for name in ("gridrl_rollout_completion_tokens_total", "gridrl_rollout_batch_size_bucket",
                 "gridrl_rollout_request_duration_seconds_bucket",
                 "gridrl_rollout_time_to_first_token_seconds_bucket",
                 "gridrl_rollout_queue_depth", "gridrl_rollout_adapter_version",
                 "gridrl_rollout_push_bytes_total", "gridrl_rollout_push_duration_seconds"):
        assert name in body, name
    assert ('gridrl_rpc_requests_total{code="OK",method="Generate",'
            'service="gridrl.v1.RolloutService"}') in body
    assert 'gridrl_rollout_samples_total{finish_reason="length"}' in body


def test_credentials_are_required(live_node, creds) -> None:
    from gridrl.common.rpc.channel import dial
    from gridrl.v1 import rollout_pb2_grpc

    node = live_node(security=creds.security(None, authorized=True))
    request = rollout_pb2.GenerateRequest(prompt_token_ids=PROMPT,
                                          sampling=common_pb2.SamplingParams(max_tokens=2))
    e = rpc_error(lambda: node.stub.Generate(request, timeout=30))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    stub = rollout_pb2_grpc.RolloutServiceStub(dial(node.node.address, creds.tokens["read"]))
    e = rpc_error(lambda: stub.Generate(request, timeout=30))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED
    assert stub.GetNodeInfo(rollout_pb2.GetNodeInfoRequest(), timeout=30).info.capacity > 0
    stub = rollout_pb2_grpc.RolloutServiceStub(dial(node.node.address, creds.tokens["trainer"]))
    assert len(stub.Generate(request, timeout=30).samples) == 1


def test_requests_over_16_mib_are_refused_before_the_credential_check(live_node, creds) -> None:
    """A node's requests are one prompt or one 1 MiB adapter chunk: one over 16 MiB is refused
    by gRPC while it is read (RESOURCE_EXHAUSTED), before the credential check, so a caller
    without a credential cannot make the node buffer the channels' 64 MiB; a trainer's
    ordinary Generate still goes through."""
    from gridrl.common.rpc.channel import NODE_REQUEST_BYTES, dial
    from gridrl.v1 import rollout_pb2_grpc

    node = live_node(security=creds.security(None, authorized=True))
    big = rollout_pb2.GenerateRequest(prompt_text="x" * (NODE_REQUEST_BYTES + 1),
                                      sampling=common_pb2.SamplingParams(max_tokens=2))
    e = rpc_error(lambda: node.stub.Generate(big, timeout=30))  # no credential
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trainer = rollout_pb2_grpc.RolloutServiceStub(dial(node.node.address,
                                                       creds.tokens["trainer"]))
    e = rpc_error(lambda: trainer.Generate(big, timeout=30))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    request = rollout_pb2.GenerateRequest(prompt_token_ids=PROMPT,
                                          sampling=common_pb2.SamplingParams(max_tokens=2))
    assert len(trainer.Generate(request, timeout=30).samples) == 1


def test_keep_cache_lets_the_next_turn_reuse_the_node_s_keys_and_values(live_node,
                                                                     tiny_llama_dir) -> None:
    """Generate(keep_cache) leaves each sample's keys/values on the node; a request whose prompt
    continues a sample prefills only its new tokens, and samples what a cold node samples."""
    from gridrl.engine.backends.torch.backend import TorchBackend
    from gridrl.v1 import common_pb2, rollout_pb2

    backend = TorchBackend.from_pretrained(tiny_llama_dir, prefix_cache_bytes=16 << 20)
    node = live_node(backend)
    first = node.stub.Generate(rollout_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, keep_cache=True, sampling=common_pb2.SamplingParams(
            n=2, max_tokens=5, temperature=1.0, seed=3)), timeout=60)
    assert backend.prefix_cache.stats.stored == 2
    cont = PROMPT + list(first.samples[0].token_ids) + [4, 5, 6]
    warm = node.generate(cont, n=1, max_tokens=5, temperature=1.0, seed=4)
    assert backend.prefix_cache.stats.hits == 1
    assert backend.prefix_cache.stats.reused_tokens == len(PROMPT) + 4
    cold = live_node().generate(cont, n=1, max_tokens=5, temperature=1.0, seed=4)
    assert list(warm.samples[0].token_ids) == list(cold.samples[0].token_ids)
    assert list(warm.samples[0].logprobs) == pytest.approx(list(cold.samples[0].logprobs),
                                                           abs=1e-5)


def test_a_push_invalidates_the_prefix_cache_even_of_the_same_weights(live_node, tiny_llama_dir,
                                                                     tiny_adapters) -> None:
    """The prefix cache is keyed by the served adapter's name AND policy version (the node's
    backend key ``<name>-v<version>-<n>``): keys and values kept under v1 are never reused
    under v2, even when v2 carries the very same weights, and they are freed with v1."""
    from gridrl.engine.backends.torch.backend import TorchBackend
    from gridrl.v1 import common_pb2, rollout_pb2

    backend = TorchBackend.from_pretrained(tiny_llama_dir, prefix_cache_bytes=16 << 20)
    node = live_node(backend)
    cache = backend.prefix_cache

    def turn(prompt, seed):
        return node.stub.Generate(rollout_pb2.GenerateRequest(
            prompt_token_ids=prompt, keep_cache=True, sampling=common_pb2.SamplingParams(
                n=1, max_tokens=5, temperature=1.0, seed=seed)), timeout=60).samples[0]

    push_dir(node.stub, tiny_adapters["a"], "run", 1)
    first = turn(PROMPT, 3)
    assert first.adapter_version == 1 and cache.stats.stored == 1
    cont = PROMPT + list(first.token_ids) + [4, 5, 6]
    assert turn(cont, 4).adapter_version == 1 and cache.stats.hits == 1  # same version: reused
    push_dir(node.stub, tiny_adapters["a"], "run", 2)  # the same files, the next version
    assert cache.stats.bytes == 0 and len(cache) == 0  # v1's entries went with v1
    hits = cache.stats.hits
    again = turn(cont, 4)
    assert again.adapter_version == 2 and cache.stats.hits == hits  # prefilled afresh
