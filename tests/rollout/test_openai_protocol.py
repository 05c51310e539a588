"""The OpenAI endpoint's pure parts: incremental text with stop strings and finish reasons
(openai_decode), and request validation into engine jobs with OpenAI-shaped errors naming the
field (openai_protocol)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gridrl.common.errors import Kind, StatusError, invalid_argument
from gridrl.engine import rng
from gridrl.rollout.jobs import BASE_MODEL, ServingAdapter
from gridrl.rollout.openai_decode import SampleText
from gridrl.rollout.openai_protocol import OpenAIError, parse_body, prepare
from gridrl.rollout.openai_responses import models_body
from gridrl.rollout.text import TextCodec
from gridrl.rollout.validation import Limits


class ByteCodec:
    """Token ids are UTF-8 bytes (ids >= 256 are special and decode to nothing): a character
    may span several tokens, as with byte-level BPE."""

    def decode(self, token_ids) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


def _ids(text: str) -> list[int]:
    return list(text.encode())


def _feed_one_by_one(sample: SampleText, ids: list[int]) -> list[str]:
    return [sample.feed([t], [-0.5]).text for t in ids]


def test_text_comes_out_whole_characters_and_adds_up() -> None:
    text = "héllo wörld €"
    sample = SampleText(ByteCodec(), eos_ids={300}, stop=[], stop_token_ids=(), max_tokens=100)
    deltas = _feed_one_by_one(sample, _ids(text))
    assert "".join(deltas) == text == sample.text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[_ids(text).index(0xC3)] == ""  # the first byte of "é" waits for the second
    assert not sample.finished and sample.text_offsets[:3] == [0, 1, 1]


def test_eos_and_stop_ids_end_with_stop_and_max_tokens_with_length() -> None:
    eos = SampleText(ByteCodec(), eos_ids={300}, stop=[], stop_token_ids=(), max_tokens=10)
    delta = eos.feed([104, 105, 300], [-1.0, -2.0, -3.0])
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("hi", [104, 105, 300], "stop")
    assert eos.feed([106], [-1.0]).token_ids == []  # nothing after the end
    stop_id = SampleText(ByteCodec(), eos_ids={300}, stop=[], stop_token_ids=(105,),
                         max_tokens=10)
    assert stop_id.feed([104, 105, 106], [-1.0] * 3).token_ids == [104, 105]
    assert stop_id.finish_reason == "stop"
    length = SampleText(ByteCodec(), eos_ids={300}, stop=[], stop_token_ids=(), max_tokens=2)
    assert length.feed([104, 105, 106], [-1.0] * 3).finish_reason == "length"
    assert length.token_ids == [104, 105] and length.text == "hi"


def test_stop_string_across_tokens_is_cut_and_never_sent() -> None:
    sample = SampleText(ByteCodec(), eos_ids={300}, stop=["END", "\n\n"], stop_token_ids=(),
                        max_tokens=100)
    ids = _ids("abc EN") + _ids("D more")
    deltas = _feed_one_by_one(sample, ids)
    assert sample.finish_reason == "stop"
    assert sample.text == "abc " == "".join(deltas)
    assert sample.token_ids == _ids("abc END")  # the token that completed it is the last one
    assert len(sample.logprobs) == len(sample.token_ids)
    # the last 2 characters are held back: they might begin "END" (or "\n\n")
    assert deltas == ["", "", "a", "b", "c", " ", ""] + [""] * len(" more")


def test_held_back_text_is_released_when_no_stop_string_follows() -> None:
    sample = SampleText(ByteCodec(), eos_ids={300}, stop=["END"], stop_token_ids=(),
                        max_tokens=7)
    deltas = _feed_one_by_one(sample, _ids("an ENdz"))
    assert sample.finish_reason == "length"
    assert "".join(deltas) == "an ENdz" == sample.text
    assert deltas == ["", "", "a", "n", " ", "E", "Ndz"]


# ---------------------------------------------------------------------------- requests


@pytest.fixture(scope="module")
def codec(tiny_llama_dir: Path) -> TextCodec:
    from transformers import AutoTokenizer

    return TextCodec(AutoTokenizer.from_pretrained(str(tiny_llama_dir)))


LIMITS = Limits(max_n=4, max_tokens=32, vocab_size=512, max_context=64)
ADAPTER = ServingAdapter(name="run-a", version=3)


def _prepare(codec: TextCodec, kind: str = "completion", serving=ADAPTER, **body):
    body.setdefault("model", "base")
    if kind == "completion":
        body.setdefault("prompt", "the cat")
    else:
        body.setdefault("messages", [{"role": "user", "content": "the cat"}])
    return prepare(parse_body(kind, body), codec, LIMITS, "base", serving)


def _error(codec: TextCodec, kind: str = "completion", **body) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        _prepare(codec, kind, **body)
    return e.value


def test_fields_become_the_job_generate_would_queue(codec: TextCodec) -> None:
    p = _prepare(codec, model="run-a", prompt=[5, 7, 9], max_tokens=5, temperature=0.5,
                 top_p=0.75, top_k=7, n=3, seed=9, stop=["x"], stop_token_ids=[2],
                 logprobs=0, stream=True, stream_options={"include_usage": True})
    assert not p.base_model and p.model == "run-a"
    assert p.job.prompt_ids == [5, 7, 9] and (p.job.n, p.job.seed) == (3, 9)
    s = p.job.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop_token_ids) == (
        5, 0.5, 0.75, 7, (2,))
    assert p.stop == ("x",) and p.logprobs and p.stream and p.include_usage
    chat = _prepare(codec, "chat", messages=[{"role": "user", "content": [
        {"type": "text", "text": "the "}, {"type": "text", "text": "cat"}]}])
    assert chat.base_model and chat.job.prompt_ids == codec.encode("the cat", True)
    assert chat.job.sampling.max_tokens == LIMITS.max_tokens  # chat default: what fits
    assert _prepare(codec).job.sampling.max_tokens == 16  # completions default: OpenAI's
    assert _prepare(codec, top_k=-1).job.sampling.top_k == 0  # vLLM's "disabled"
    assert _prepare(codec, "chat", logprobs=True, top_logprobs=0).logprobs
    # alternatives and the prompt's logprobs (echo) become the job's
    top = _prepare(codec, logprobs=5, echo=True, max_tokens=0)
    assert top.top_logprobs == top.job.sampling.top_logprobs == 5 and top.echo
    assert top.job.prompt_logprobs == 5 and top.job.sampling.max_tokens == 0
    assert top.prompt_text == "the cat"
    assert _prepare(codec, echo=True).job.prompt_logprobs is None  # text only: nothing scored
    chat_top = _prepare(codec, "chat", logprobs=True, top_logprobs=20)
    assert chat_top.job.sampling.top_logprobs == 20 and chat_top.job.prompt_logprobs is None
    assert _prepare(codec, return_token_ids=True).token_ids


def test_seed_gives_generate_sequence_seeds(codec: TextCodec) -> None:
    job = _prepare(codec, seed=123, n=2).job
    assert job.seed == 123
    assert rng.sequence_seed(job.seed, 1) == rng.sequence_seed(123, 1)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"temperature": -1}, "temperature", "finite number >= 0"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", ">= 0"),
    ({"n": 0}, "n", "[1,"),
    ({"n": 5}, "n", "[1, 4] on this node"),
    ({"max_tokens": 0}, "max_tokens", "0 only with echo: true"),
    ({"max_tokens": -1, "echo": True}, "max_tokens", "[0,"),
    ({"max_tokens": 33}, "max_tokens", "[1, 32] on this node"),
    ({"max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"prompt": [5, 600]}, "prompt", "outside the vocabulary"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"stop": ["a", ""]}, "stop[1]", "must not be empty"),
    ({"stop_token_ids": [512]}, "stop_token_ids", "outside the vocabulary"),
    ({"seed": -1}, "seed", "[0,"),
    ({"logprobs": 21}, "logprobs", "must be in [0, 20] (alternatives per token), got 21"),
    ({"logprobs": -1}, "logprobs", "must be in [0, 20]"),
    ({"echo": True, "stream": True}, "echo", "not supported with stream"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "not supported"),
    ({"best_of": 3}, "best_of", "must equal n"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ({"model": "nope"}, "model", "not served here"),
])
def test_bad_completion_fields_are_400_naming_the_field(codec: TextCodec, body, param,
                                                        words) -> None:
    e = _error(codec, **body)
    assert (e.status, e.param, e.type) == (404 if param == "model" else 400, param,
                                           "invalid_request_error")
    assert e.message.startswith(f"{param}") and words in e.message, e.message
    assert e.body() == {"error": {"message": e.message, "type": "invalid_request_error",
                                  "param": param, "code": e.code}}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "valid"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs",
     "must be in [0, 20] (alternatives per token), got 21"),
    ({"top_logprobs": 0}, "top_logprobs", "needs logprobs"),
    ({"tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "text"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", "give one"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "[1,"),
])
def test_bad_chat_fields_are_400_naming_the_field(codec: TextCodec, body, param,
                                                  words) -> None:
    e = _error(codec, "chat", **body)
    assert (e.status, e.param) == (400, param)
    assert e.message.startswith(param) and words in e.message, e.message


def test_chat_prompt_beyond_the_context_names_messages(codec: TextCodec) -> None:
    e = _error(codec, "chat", messages=[{"role": "user", "content": "the cat " * 40}])
    assert e.param == "messages" and "context" in e.message


def test_status_errors_map_to_openai_statuses() -> None:
    assert OpenAIError.from_status(StatusError(Kind.RESOURCE_EXHAUSTED,
                                               "queue full")).status == 429
    assert OpenAIError.from_status(StatusError(Kind.UNAVAILABLE, "x")).status == 503
    assert OpenAIError.from_status(StatusError(Kind.INTERNAL, "x")).status == 500
    bad = OpenAIError.from_status(invalid_argument("sampling.stop_token_ids[2]", "out"))
    assert (bad.status, bad.param, bad.message) == (400, "stop_token_ids",
                                                    "stop_token_ids[2]: out")


def test_models_list_the_serving_adapter_first_with_its_version() -> None:
    assert [m["id"] for m in models_body("base", BASE_MODEL, 1)["data"]] == ["base"]
    data = models_body("base", ADAPTER, 1)["data"]
    assert [(m["id"], m["policy_version"], m["parent"]) for m in data] == [
        ("run-a", 3, "base"), ("base", 0, None)]
