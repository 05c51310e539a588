"""The OpenAI-compatible API of a rollout node as plain data: request bodies -> a validated
:class:`Prepared` request (the same :class:`~gridrl.rollout.jobs.GenerateJob` a gRPC
``Generate`` gives), and the JSON of errors; the JSON of responses and stream chunks is
:mod:`gridrl.rollout.openai_responses`'s. No HTTP here (:mod:`gridrl.rollout.openai_server`
serves it).

Fields (as in OpenAI's and vLLM's ``/v1/completions`` and ``/v1/chat/completions``):

* ``model``: an id from ``GET /v1/models``: the adapter now serving (decodes with it) or the
  base model (decodes without any adapter). Anything else is 404 ``model_not_found``.
* ``prompt`` (completions): a string, or token ids; one prompt per request.
  ``messages`` (chat): rendered by the model's chat template, assistant turn opened.
* ``max_tokens`` (chat also ``max_completion_tokens``): completions default to 16 (OpenAI's
  default); chat defaults to what the node and the context allow.
* ``temperature`` (default 1; 0 is greedy), ``top_p`` (default 1), ``top_k`` (vLLM's extension;
  0 or -1 disable), ``seed`` (sample ``i`` draws from ``rng.sequence_seed(seed, i)``, as in
  ``Generate``: the same seed gives the same tokens as a ``Generate`` call), ``n``.
* ``stop``: a string or up to :data:`MAX_STOP_STRINGS` strings (see
  :mod:`gridrl.rollout.openai_decode`); ``stop_token_ids`` (vLLM's extension): ids that end a
  sample like eos.
* ``logprobs``: completions: an int N in [0, :data:`MAX_TOP_LOGPROBS`]: each token's logprob
  and, for N > 0, its ``top_logprobs`` (the N most likely tokens and the sampled one); chat: a
  bool, with ``top_logprobs`` N in [0, 20]. The logprob is the behaviour logprob of
  ``Generate``: under the distribution the token was drawn from (after temperature, top-k and
  top-p; vLLM's ``processed_logprobs``), and so are the alternatives (-inf written -9999.0,
  as vLLM does).
* ``echo`` (completions): the prompt is returned before the completion, its tokens with their
  logprobs when ``logprobs`` is set (the first ``null``; under the model's own distribution,
  as vLLM's prompt logprobs: what lm-evaluation-harness's loglikelihood reads);
  ``max_tokens`` 0 then scores the prompt only. Not with ``stream``.
* ``return_tokens_as_token_ids`` (vLLM's extension): tokens in logprobs as ``"token_id:<id>"``.
* ``return_token_ids`` (vLLM's extension): each choice carries ``token_ids`` (the sampled ids)
  and, for completions, ``prompt_token_ids``; a chat response carries ``prompt_token_ids``
  (a stream: in its first chunk). With the logprobs and ``policy_version`` (every response
  and chunk: the adapter version that produced it, 0 for the base model) that is what an RL
  orchestrator reads from vLLM.
* ``stream``, ``stream_options.include_usage``.

Limits are the node's (``--max-n``, ``--max-tokens``, the model's context), checked by the same
:func:`~gridrl.rollout.validation.validate_generate` as ``Generate``. Errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}``; ``param`` names the request field and the
message starts with it. Unknown fields are ignored; known ones the node cannot honour
(``best_of`` > n, penalties, ``logit_bias``, ``tools``, a JSON ``response_format``, several
prompts) are 400 naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gridrl.common.errors import Kind, StatusError
from gridrl.engine.contract import MAX_TOP_LOGPROBS
from gridrl.rollout.jobs import GenerateJob, ServingAdapter
from gridrl.rollout.text import TextCodec
from gridrl.rollout.validation import Limits, validate_generate
from gridrl.v1 import common_pb2, rollout_pb2

MAX_STOP_STRINGS = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# validate_generate's field -> the OpenAI request field
_FIELDS = {"sampling.n": "n", "sampling.max_tokens": "max_tokens",
           "sampling.temperature": "temperature", "sampling.top_p": "top_p",
           "sampling.top_k": "top_k", "sampling.stop_token_ids": "stop_token_ids",
           "prompt_token_ids": "prompt", "prompt_text": "prompt"}
# The one mapping of the domain error's kinds to HTTP: status, OpenAI error type and code
_STATUS = {
    Kind.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    Kind.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    Kind.PERMISSION_DENIED: (403, "permission_error", None),
    Kind.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    Kind.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    Kind.CANCELLED: (499, "invalid_request_error", "cancelled"),
    Kind.UNAVAILABLE: (503, "server_error", "unavailable"),
}


class OpenAIError(Exception):
    """An error answered in OpenAI's shape.

    Args:
        status: HTTP status.
        message: what went wrong; for a bad field it starts with the field.
        param: the request field at fault, or None.
        type: OpenAI's error type, e.g. ``"invalid_request_error"``.
        code: OpenAI's error code, e.g. ``"model_not_found"``, or None.
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (status, message, param,
                                                                         type, code)

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def from_status(cls, error: StatusError) -> OpenAIError:
        """The OpenAI error of a domain error (INVALID_ARGUMENT 400 naming the OpenAI field,
        RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, anything else 500)."""
        status, kind, code = _STATUS.get(error.kind, (500, "server_error", None))
        message, param = error.message, None
        if error.kind is Kind.INVALID_ARGUMENT and error.field:
            base, _, index = error.field.partition("[")
            if base in _FIELDS:
                param = _FIELDS[base]
                message = f"{param}{'[' + index if index else ''}: {error.problem}"
        return cls(status, message, param, kind, code)


def invalid(param: str, problem: str) -> OpenAIError:
    """400 ``invalid_request_error`` naming ``param``: ``"<param>: <problem>"``."""
    return OpenAIError(400, f"{param}: {problem}", param)


class _Strict(BaseModel):
    # JSON types as OpenAI's server checks them ("5" is not an int, 1 is not a bool); unknown
    # fields are ignored so newer clients keep working.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _SamplingFields(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_tokens_as_token_ids: bool | None = False
    return_token_ids: bool | None = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_SamplingFields):
    """A ``POST /v1/completions`` body (the fields the node reads)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One message; ``content`` is a string or text parts (joined)."""

    role: str = Field(min_length=1)
    content: str | list[_TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """A ``POST /v1/chat/completions`` body (the fields the node reads)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


_FIELD_NAMES = frozenset(name for model in (CompletionRequest, ChatCompletionRequest, ChatMessage,
                                           _TextPart, StreamOptions)
                         for name in model.model_fields)


@dataclass(frozen=True)
class Prepared:
    """A validated request, ready for the engine.

    Attributes:
        kind: ``"completion"`` or ``"chat"``.
        model: the ``model`` asked for (an id of ``GET /v1/models``).
        base_model: decode without an adapter (``model`` named the base model).
        job: what ``Generate`` would have queued for the same fields.
        stop: stop strings.
        logprobs: return each token's logprob.
        stream: answer with server-sent events.
        include_usage: a last stream chunk with the token counts.
        tokens_as_ids: name tokens ``"token_id:<id>"`` in logprobs (vLLM's
            ``return_tokens_as_token_ids``).
        top_logprobs: alternatives per token (``job.sampling.top_logprobs``).
        echo: return the prompt before the completion (its logprobs: ``job.prompt_logprobs``).
        prompt_text: the prompt as the request gave it (echo), or None for token ids.
        token_ids: return the sampled and prompt token ids (vLLM's ``return_token_ids``).
    """

    kind: Literal["completion", "chat"]
    model: str
    base_model: bool
    job: GenerateJob
    stop: tuple[str, ...]
    logprobs: bool
    stream: bool
    include_usage: bool
    tokens_as_ids: bool = False
    top_logprobs: int = 0
    echo: bool = False
    prompt_text: str | None = None
    token_ids: bool = False


def parse_body(kind: Literal["completion", "chat"], body: Any
               ) -> CompletionRequest | ChatCompletionRequest:
    """Check the JSON types of a request body.

    Raises:
        OpenAIError: 400 naming the first field whose type is wrong or that is missing.
    """
    model = CompletionRequest if kind == "completion" else ChatCompletionRequest
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param(first["loc"])
        raise invalid(param, first["msg"]) from e


def _param(loc: Sequence[Any]) -> str:
    """A pydantic location as a field path: ``messages[0].content``; the names pydantic adds
    for union members (``str``, ``list[int]``, ...) are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELD_NAMES:
            out += f".{part}" if out else part
        else:
            break
    return out or "body"


def prepare(request: CompletionRequest | ChatCompletionRequest, codec: TextCodec,
            limits: Limits, base_model_id: str, serving: ServingAdapter) -> Prepared:
    """Validate a parsed request against the node and turn it into an engine job.

    Args:
        request: from :func:`parse_body`.
        codec: the node's tokenizer.
        limits: the node's bounds (the same as ``Generate``'s).
        base_model_id: the base model's id.
        serving: the adapter serving now (its name is a valid ``model``).

    Raises:
        OpenAIError: 404 ``model_not_found`` for an unknown ``model``; 400 naming the field
            for values out of bounds or the node cannot honour.
    """
    chat = isinstance(request, ChatCompletionRequest)
    if serving.name and request.model == serving.name:
        base_model = False
    elif request.model == base_model_id:
        base_model = True
    else:
        known = [m for m in (serving.name, base_model_id) if m]
        raise OpenAIError(404, f"model: the model {request.model!r} is not served here; this "
                               f"node serves {', '.join(map(repr, known))} (GET /v1/models)",
                          "model", code="model_not_found")
    _refuse_unsupported(request)
    stop = _stop_strings(request.stop)
    prompt = _chat_prompt(request, codec) if chat else _completion_prompt(request, codec)
    n = 1 if request.n is None else _bounded("n", request.n, 1, _U32)
    echo = not chat and bool(request.echo)
    max_tokens = _bounded("max_tokens", _max_tokens(request, len(prompt), limits),
                          0 if echo else 1, _U32)
    stop_ids = [_bounded(f"stop_token_ids[{i}]", t, 0, _I32)
                for i, t in enumerate(request.stop_token_ids or [])]
    top_k = 0 if request.top_k in (None, -1) else _bounded("top_k", request.top_k, -_I32, _I32)
    sampling = common_pb2.SamplingParams(
        n=n, max_tokens=max(max_tokens, 1), top_k=top_k, stop_token_ids=stop_ids,
        temperature=1.0 if request.temperature is None else request.temperature)
    if request.top_p is not None:
        sampling.top_p = request.top_p
    if request.seed is not None:
        sampling.seed = _bounded("seed", request.seed, 0, 1 << 64)
    try:
        job = validate_generate(rollout_pb2.GenerateRequest(prompt_token_ids=prompt,
                                                            sampling=sampling),
                                limits, codec.encode)
    except StatusError as e:
        raise OpenAIError.from_status(e) from e
    want_logprobs = bool(request.logprobs) or (not chat and request.logprobs == 0)
    top = _top_logprobs(request)
    job = dataclasses.replace(
        job, sampling=dataclasses.replace(job.sampling, max_tokens=max_tokens, top_logprobs=top),
        prompt_logprobs=top if echo and want_logprobs else None)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return Prepared(kind="chat" if chat else "completion", model=request.model,
                    base_model=base_model, job=job, stop=stop, logprobs=want_logprobs,
                    stream=bool(request.stream), include_usage=include_usage,
                    tokens_as_ids=bool(request.return_tokens_as_token_ids), top_logprobs=top,
                    echo=echo, prompt_text=_echo_text(request) if echo else None,
                    token_ids=bool(request.return_token_ids))


def _top_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int:
    """Alternatives per token the request asks: completions' ``logprobs`` N, chat's
    ``top_logprobs`` (checked by :func:`_refuse_unsupported`)."""
    if isinstance(request, ChatCompletionRequest):
        return request.top_logprobs or 0
    return request.logprobs or 0


def _echo_text(request: CompletionRequest) -> str | None:
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


_U32, _I32 = 1 << 32, 1 << 31


def _bounded(param: str, value: int, low: int, high: int) -> int:
    """``value`` when ``low <= value < high``, else 400 naming ``param``."""
    if not low <= value < high:
        raise invalid(param, f"must be in [{low}, {high}), got {value}")
    return value


def _refuse_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            raise invalid(name, "penalties are not supported by this node (use 0)")
    if request.logit_bias:
        raise invalid("logit_bias", "not supported by this node")
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options", "only allowed with stream: true")
    if isinstance(request, CompletionRequest):
        _alternatives_bound("logprobs", request.logprobs)
        if request.echo and request.stream:
            raise invalid("echo", "not supported with stream: true on this node")
        if not request.echo and request.max_tokens == 0:
            raise invalid("max_tokens", "0 only with echo: true (the prompt scored, nothing "
                                        "generated)")
        if request.suffix:
            raise invalid("suffix", "not supported by this node")
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise invalid("best_of", "must equal n: the node returns every sample")
    else:
        _alternatives_bound("top_logprobs", request.top_logprobs)
        if request.top_logprobs is not None and not request.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        if request.tools:
            raise invalid("tools", "tool calls are not supported by this node")
        if request.response_format and request.response_format.get("type") != "text":
            raise invalid("response_format", "only {\"type\": \"text\"} is supported")


def _alternatives_bound(param: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise invalid(param, f"must be in [0, {MAX_TOP_LOGPROBS}] (alternatives per token), "
                             f"got {value}")


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    for i, s in enumerate(strings):
        if not s:
            raise invalid(f"stop[{i}]" if not isinstance(stop, str) else "stop",
                          "a stop string must not be empty")
    return tuple(strings)


def _completion_prompt(request: CompletionRequest, codec: TextCodec) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise invalid("prompt", f"one prompt per request on this node, got {len(prompt)} "
                                    "(send them as separate requests; they share batches)")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = codec.encode(prompt, False)
        if not ids:
            raise invalid("prompt", "tokenizes to no tokens")
        return ids
    if not prompt:
        raise invalid("prompt", "empty prompt")
    return [_bounded(f"prompt[{i}]", t, -_I32, _I32) for i, t in enumerate(prompt)]


def _chat_prompt(request: ChatCompletionRequest, codec: TextCodec) -> list[int]:
    messages = []
    for message in request.messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        entry = {"role": message.role, "content": content or ""}
        if message.name:
            entry["name"] = message.name
        messages.append(entry)
    try:
        ids = codec.encode_chat(messages, "messages")
    except StatusError as e:
        raise invalid("messages", e.problem) from e
    if not ids:
        raise invalid("messages", "the chat template renders them to no tokens")
    return ids


def _max_tokens(request: CompletionRequest | ChatCompletionRequest, prompt_tokens: int,
                limits: Limits) -> int:
    value, param = request.max_tokens, "max_tokens"
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        if value is not None and value != request.max_completion_tokens:
            raise invalid("max_completion_tokens", "differs from max_tokens; give one")
        value, param = request.max_completion_tokens, "max_completion_tokens"
    if value is not None:  # 0: a completion that echoes its prompt (checked before)
        return _bounded(param, value, 0 if isinstance(request, CompletionRequest) else 1, _U32)
    if isinstance(request, CompletionRequest):
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    room = min(limits.max_tokens, limits.max_context - prompt_tokens)
    if room < 1:
        raise invalid("messages", f"the prompt ({prompt_tokens} tokens) leaves no room in the "
                                  f"model's context of {limits.max_context} tokens")
    return room


