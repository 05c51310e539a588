"""The OpenAI-compatible API's answers as plain data: response bodies, stream chunks, usage and the
model list, from the samples of a Prepared request (gridrl.rollout.openai_protocol parses and
checks the requests; gridrl.rollout.openai_server serves both)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from gridrl.engine.contract import FinishReason
from gridrl.rollout.jobs import ServingAdapter

if TYPE_CHECKING:
    from gridrl.rollout.openai_protocol import Prepared


def new_id(kind: Literal["completion", "chat"]) -> str:
    """``cmpl-<hex>`` or ``chatcmpl-<hex>``."""
    return f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"


def fingerprint(adapter: ServingAdapter) -> str:
    """``system_fingerprint`` of an answer: ``gridrl:<adapter name>:v<policy version>``
    (``gridrl:base:v0`` for the base model)."""
    return f"gridrl:{adapter.name or 'base'}:v{adapter.version}"


#: How -inf (a token outside the kept support) is written, as vLLM writes it: JSON has no -inf.
MASKED_LOGPROB = -9999.0
#: Named alternatives of one token: (token as logprobs name it, logprob), most likely first.
Named = list[tuple[str, float]]


@dataclass
class Choice:
    """One sample's contribution to a response or a chunk.

    Attributes:
        index: the sample index (the ``n`` samples are choices 0..n-1).
        text: its text (a chunk: the new text).
        token_ids / logprobs / text_offsets: its tokens (a chunk: the new ones).
        token_texts: each token as text (for logprobs).
        finish_reason: None until the sample ended.
        top: each token's alternatives, named (with ``top_logprobs`` > 0; else empty).
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    text_offsets: list[int]
    token_texts: list[str]
    finish_reason: FinishReason | None
    top: list[Named] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class Echo:
    """The prompt a completion returns before its own text (``echo``).

    Attributes:
        text: the prompt as given (token ids: decoded).
        token_ids: its ids.
        token_texts: each as logprobs name it.
        logprobs: each token's logprob under the model (None for the first, which nothing
            predicts); empty when logprobs were not asked.
        top: each token's named alternatives (None for the first); empty when not asked.
        text_offsets: where each token starts in ``text``.
    """

    text: str
    token_ids: list[int]
    token_texts: list[str]
    logprobs: list[float | None]
    top: list[Named | None]
    text_offsets: list[int]


def _finite(value: float | None) -> float | None:
    return None if value is None else max(value, MASKED_LOGPROB)


def _top_entry(sampled: str, logprob: float, top: Named) -> dict[str, float]:
    """OpenAI's and vLLM's ``top_logprobs`` entry of one token: the sampled token and its
    alternatives, ``{token: logprob}``."""
    return {sampled: _finite(logprob), **{t: _finite(v) for t, v in top}}  # type: ignore[dict-item]


def _completion_logprobs(p: Prepared, choice: Choice, echo: Echo | None = None
                         ) -> dict[str, Any]:
    tops = ([_top_entry(t, lp, top) for t, lp, top in
             zip(choice.token_texts, choice.logprobs, choice.top, strict=True)]
            if p.top_logprobs else None)
    out = {"tokens": choice.token_texts, "token_logprobs": [_finite(v) for v in choice.logprobs],
           "top_logprobs": tops, "text_offset": choice.text_offsets}
    if echo is None:
        return out
    echo_tops = [None if top is None else _top_entry(t, lp, top)  # type: ignore[arg-type]
                 for t, lp, top in zip(echo.token_texts, echo.logprobs, echo.top, strict=True)]
    return {"tokens": [*echo.token_texts, *out["tokens"]],
            "token_logprobs": [*map(_finite, echo.logprobs), *out["token_logprobs"]],
            "top_logprobs": [*echo_tops, *tops] if tops is not None else None,
            "text_offset": [*echo.text_offsets,
                            *(o + len(echo.text) for o in choice.text_offsets)]}


def _chat_logprobs(choice: Choice) -> dict[str, Any]:
    tops = choice.top or [[] for _ in choice.token_ids]
    return {"content": [{"token": text, "logprob": _finite(logprob), "bytes": list(text.encode()),
                         "top_logprobs": [{"token": t, "logprob": _finite(v),
                                           "bytes": list(t.encode())} for t, v in top]}
                        for text, logprob, top in zip(choice.token_texts, choice.logprobs, tops,
                                                      strict=True)],
            "refusal": None}


def _head(p: Prepared, response_id: str, created: int, adapter: ServingAdapter, model: str,
          kind: str) -> dict[str, Any]:
    """The fields every response and chunk starts with, ``policy_version`` included."""
    return {"id": response_id, "object": kind, "created": created, "model": model,
            "system_fingerprint": fingerprint(adapter), "policy_version": adapter.version}


def response_body(p: Prepared, response_id: str, created: int, adapter: ServingAdapter,
                  choices: list[Choice], prompt_tokens: int, model: str,
                  echo: Echo | None = None) -> dict[str, Any]:
    """The JSON of a whole (non-streamed) completion or chat completion; ``model`` is the id
    of the policy that answered; ``echo``: the prompt a completion returns first."""
    prompt_ids = list(p.job.prompt_ids)
    if p.kind == "completion":
        out = [{"index": c.index, "text": (echo.text if echo else "") + c.text,
                "finish_reason": c.finish_reason,
                "logprobs": _completion_logprobs(p, c, echo) if p.logprobs else None,
                **({"token_ids": c.token_ids, "prompt_token_ids": prompt_ids}
                   if p.token_ids else {})}
               for c in choices]
    else:
        out = [{"index": c.index, "finish_reason": c.finish_reason,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _chat_logprobs(c) if p.logprobs else None,
                **({"token_ids": c.token_ids} if p.token_ids else {})}
               for c in choices]
    completion_tokens = sum(len(c.token_ids) for c in choices)
    body = {**_head(p, response_id, created, adapter, model,
                    "text_completion" if p.kind == "completion" else "chat.completion"),
            "choices": out, "usage": usage(prompt_tokens, completion_tokens)}
    if p.kind == "chat" and p.token_ids:
        body["prompt_token_ids"] = prompt_ids
    return body


def chunk_body(p: Prepared, response_id: str, created: int, adapter: ServingAdapter,
               choice: Choice, model: str, first: bool = False) -> dict[str, Any]:
    """One server-sent event of a stream: ``choice``'s new text and tokens (``first``: the
    stream's first chunk of that choice: a chat one carries ``role``, and with
    ``return_token_ids`` it carries the prompt's ids)."""
    ids = {"token_ids": choice.token_ids} if p.token_ids else {}
    prompt_ids = list(p.job.prompt_ids) if p.token_ids and first else None
    if p.kind == "completion":
        item = {"index": choice.index, "text": choice.text,
                "finish_reason": choice.finish_reason,
                "logprobs": _completion_logprobs(p, choice) if p.logprobs else None, **ids}
        if prompt_ids is not None:
            item["prompt_token_ids"] = prompt_ids
        kind = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if choice.text or first:
            delta["content"] = choice.text
        item = {"index": choice.index, "delta": delta, "finish_reason": choice.finish_reason,
                "logprobs": _chat_logprobs(choice) if p.logprobs and choice.token_ids else None,
                **ids}
        kind = "chat.completion.chunk"
    body = {**_head(p, response_id, created, adapter, model, kind), "choices": [item]}
    if p.kind == "chat" and prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    return body


def usage_chunk_body(p: Prepared, response_id: str, created: int, adapter: ServingAdapter,
                     prompt_tokens: int, completion_tokens: int, model: str) -> dict[str, Any]:
    """The last chunk of a stream asked with ``include_usage``: no choices, the counts."""
    kind = "text_completion" if p.kind == "completion" else "chat.completion.chunk"
    return {**_head(p, response_id, created, adapter, model, kind), "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def models_body(base_model_id: str, serving: ServingAdapter, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the adapter serving now (first, with its ``policy_version``), then
    the base model (``policy_version`` 0)."""
    data = []
    if serving.name:
        data.append({"id": serving.name, "object": "model", "created": created,
                     "owned_by": "gridrl", "root": base_model_id, "parent": base_model_id,
                     "policy_version": serving.version})
    data.append({"id": base_model_id, "object": "model", "created": created,
                 "owned_by": "gridrl", "root": base_model_id, "parent": None,
                 "policy_version": 0})
    return {"object": "list", "data": data}


def now() -> int:
    """``created``: Unix seconds."""
    return int(time.time())
