"""Generate requests -> validated :class:`~gridrl.rollout.jobs.GenerateJob`: every
INVALID_ARGUMENT a Generate call can get, each naming its field.

Proto zero values are read as documented in ``common.proto``: ``n`` 0 is 1, unset ``top_p`` is
1 (disabled), ``top_k`` 0 is disabled, unset ``seed`` is random.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gridrl.common.errors import invalid_argument
from gridrl.engine import rng
from gridrl.engine.contract import MIN_TEMPERATURE, SamplingConfig
from gridrl.rollout.jobs import GenerateJob
from gridrl.v1 import rollout_pb2

# Smallest non-zero temperature: logits / T must stay far from float32 overflow.
# (text, apply_chat_template[, system_prompt]) -> token ids; raises StatusError for text it
# cannot encode. The system prompt is passed only when the request sets one.
Tokenize = Callable[..., list[int]]


@dataclass(frozen=True)
class Limits:
    """The node's bounds on a Generate request.

    Attributes:
        max_n: largest ``sampling.n``.
        max_tokens: largest ``sampling.max_tokens``.
        vocab_size: token ids must be in [0, vocab_size).
        max_context: prompt tokens + max_tokens must not exceed this.
        min_temperature: smallest positive temperature (0 is greedy).
        max_temperature: largest temperature (vLLM samples up to 2).
    """

    max_n: int
    max_tokens: int
    vocab_size: int
    max_context: int
    min_temperature: float = MIN_TEMPERATURE
    max_temperature: float = math.inf


def validate_generate(request: rollout_pb2.GenerateRequest, limits: Limits,
                      tokenize: Tokenize) -> GenerateJob:
    """Check a GenerateRequest and turn it into a job.

    Raises:
        StatusError: INVALID_ARGUMENT naming the field: ``prompt_token_ids`` (empty prompt,
            an id outside the vocabulary), ``prompt_text`` (both prompts set, tokenizes to
            nothing), ``apply_chat_template`` (with token ids), ``sampling.n``,
            ``sampling.max_tokens`` (out of bounds, or prompt + max_tokens beyond the
            context), ``sampling.temperature`` (< 0, not finite, positive but below
            ``limits.min_temperature``, above ``limits.max_temperature``), ``sampling.top_p``
            (outside (0, 1]), ``sampling.top_k`` (< 0), ``sampling.stop_token_ids[i]``
            (outside the vocabulary).
    """
    prompt = _prompt(request, limits, tokenize)
    s = request.sampling
    n = s.n or 1
    if not 1 <= n <= limits.max_n:
        raise invalid_argument("sampling.n", f"must be in [1, {limits.max_n}] on this node, "
                                             f"got {s.n}")
    if not 1 <= s.max_tokens <= limits.max_tokens:
        raise invalid_argument("sampling.max_tokens", f"must be in [1, {limits.max_tokens}] on "
                                                      f"this node, got {s.max_tokens}")
    if len(prompt) + s.max_tokens > limits.max_context:
        raise invalid_argument(
            "sampling.max_tokens",
            f"prompt ({len(prompt)} tokens) + max_tokens ({s.max_tokens}) = "
            f"{len(prompt) + s.max_tokens} exceeds the model's context of "
            f"{limits.max_context} tokens")
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise invalid_argument("sampling.temperature",
                               f"must be a finite number >= 0 (0 = greedy), got {s.temperature}")
    if 0 < s.temperature < limits.min_temperature:
        why = "logits / T would overflow" if limits.min_temperature <= MIN_TEMPERATURE else \
            "its backend samples no lower"
        raise invalid_argument("sampling.temperature",
                               f"must be 0 (greedy) or >= {limits.min_temperature} on this node "
                               f"({why}), got {s.temperature}")
    if s.temperature > limits.max_temperature:
        raise invalid_argument("sampling.temperature", f"must be <= {limits.max_temperature} on "
                                                       f"this node, got {s.temperature}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise invalid_argument("sampling.top_p", f"must be in (0, 1], got {top_p}")
    if s.top_k < 0:
        raise invalid_argument("sampling.top_k", f"must be >= 0 (0 disables), got {s.top_k}")
    _check_ids(s.stop_token_ids, "sampling.stop_token_ids", limits.vocab_size)
    sampling = SamplingConfig(max_tokens=s.max_tokens, temperature=float(s.temperature),
                              top_p=float(top_p), top_k=int(s.top_k),
                              stop_token_ids=tuple(dict.fromkeys(s.stop_token_ids)))
    seed = s.seed if s.HasField("seed") else rng.random_seed()
    if request.base_model and request.adapter_name:
        raise invalid_argument("base_model", "set either base_model or adapter_name, not both")
    weight = request.share_weight
    if not math.isfinite(weight) or weight < 0:
        raise invalid_argument("share_weight", f"{weight} must be a finite number >= 0 (0: 1)")
    return GenerateJob(prompt_ids=prompt, sampling=sampling, n=n, seed=seed,
                       request_id=request.request_id, keep_cache=request.keep_cache,
                       adapter=request.adapter_name, share_weight=weight or 1.0)


def _prompt(request: rollout_pb2.GenerateRequest, limits: Limits,
            tokenize: Tokenize) -> list[int]:
    ids, text = list(request.prompt_token_ids), request.prompt_text
    if ids and text:
        raise invalid_argument("prompt_text", "set either prompt_token_ids or prompt_text, "
                                              "not both")
    if not ids and not text:
        raise invalid_argument("prompt_token_ids", "empty prompt: set prompt_token_ids or "
                                                   "prompt_text")
    if ids:
        if request.apply_chat_template:
            raise invalid_argument("apply_chat_template", "applies to prompt_text only, not to "
                                                          "prompt_token_ids")
        _check_ids(ids, "prompt_token_ids", limits.vocab_size)
        return ids
    if request.system_prompt and not (text and request.apply_chat_template):
        raise invalid_argument("system_prompt", "needs prompt_text with apply_chat_template "
                                                "(it is a turn of the chat template)")
    ids = (tokenize(text, True, request.system_prompt) if request.system_prompt
           else tokenize(text, request.apply_chat_template))
    if not ids:
        raise invalid_argument("prompt_text", "tokenizes to no tokens")
    return ids


def _check_ids(ids: Sequence[int], field: str, vocab_size: int) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise invalid_argument(f"{field}[{i}]", f"token id {token} is outside the "
                                                    f"vocabulary [0, {vocab_size})")
