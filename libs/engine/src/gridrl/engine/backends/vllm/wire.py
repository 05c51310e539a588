"""vLLM's HTTP contract as pure functions: the completion request a :class:`SequenceRequest`
becomes, its answer parsed back into a :class:`SequenceResult` (or refused), the check that
logprobs are processed, and the errors. :mod:`.client` sends and receives; nothing here does I/O.

The HTTP contract followed is vLLM 0.33.0's (:data:`VLLM_CONTRACT_VERSION`), read from its wheel
(``vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl``; paths below are inside ``vllm/``):

- ``POST /v1/completions`` (``entrypoints/openai/completion/api_router.py`` 37-77): the request
  is ``CompletionRequest`` (``entrypoints/openai/completion/protocol.py`` 49-297): ``prompt``
  may be a list of token ids (53-59, no tokenization then), ``logprobs`` (63), ``seed`` in
  [-2**63, 2**63) (67), ``top_k`` (78, 0 disables), ``stop_token_ids`` (83),
  ``return_tokens_as_token_ids`` (164-171: tokens come back as ``"token_id:N"``),
  ``return_token_ids`` (172-181: the choice also carries ``token_ids`` and
  ``prompt_token_ids``). Sampling fields left out take the server's defaults, which come from
  the model's ``generation_config.json`` (``to_sampling_params`` 359-436, defaults 313-321), so
  every one is sent explicitly.
- The response (``protocol.py`` 668-702; built in ``completion/serving.py`` 560-712): one
  choice per sequence with ``finish_reason``, ``token_ids``, ``prompt_token_ids`` and
  ``logprobs = {tokens, token_logprobs, top_logprobs, text_offset}``, one entry per token
  (``_create_completion_logprobs`` 714-804); values below -9999 (``-inf``: a token the sampler
  masked) are written as -9999.0 (765, 783). ``top_logprobs`` holds the sampled token then the
  top ``logprobs`` tokens (``generate/base/serving.py`` 368-379). Finish reasons are ``stop``
  (eos or a stop token id, the token included: ``v1/core/sched/utils.py`` 98-119),
  ``length``, and ``abort`` / ``error`` / ``repetition`` (``v1/request.py`` 404-412), which
  this backend refuses.
- Logprobs: the default ``--logprobs-mode`` is ``raw_logprobs`` (``config/model.py`` 291-299),
  the log-softmax of the logits *before* temperature and top-k/top-p (``v1/sample/sampler.py``
  129-170). Only ``processed_logprobs`` returns the log-softmax of what the token was drawn from
  (``v1/sample/ops/topk_topp_sampler.py`` 292-313): temperature, then top-k (tokens below the
  k-th value masked, ties kept) then top-p over what is left (``apply_top_k_top_p_pytorch``
  524-565), i.e. gridrl's sampling transform. Greedy requests (temperature < 1e-5) get the
  log-softmax of the raw logits (``sampler.py`` 320-335), as gridrl's greedy does.
- Sampling bounds: temperature in [0, 2] (``sampling_params.py`` 656-679), and a positive
  temperature below 0.01 is silently raised to 0.01 (560-568); greedy requests must have
  ``n == 1`` (769-773); with ``n > 1`` choice ``i`` samples with ``seed + i``
  (``v1/engine/parallel_sampling.py`` 81). Each sequence here is its own request (``n = 1``)
  with its own seed, so the ``n`` samples of a group run concurrently and vLLM shares their
  prompt through its prefix cache.
- Runtime LoRA (``entrypoints/serve/lora/api_router.py`` 23-99; bodies in
  ``serve/lora/protocol.py`` 7-16): ``POST /v1/load_lora_adapter {lora_name, lora_path,
  load_inplace}`` and ``POST /v1/unload_lora_adapter {lora_name}`` exist only when vLLM's
  environment has ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (else FastAPI answers 404 ``{"detail":
  "Not Found"}``); they answer 200 with a plain-text body. Loading reads ``lora_path`` from
  vLLM's own disk; a name already loaded is refused (400) unless ``load_inplace``, and
  reloading a name keeps prefix-cache blocks computed with its old weights
  (``entrypoints/openai/models/serving.py`` 167-301, warning at 215-224): this backend never
  reuses a name. Without ``--enable-lora`` a load answers 500 "LoRA is not enabled"
  (``v1/worker/lora_model_runner_mixin.py`` 89-91); a rank above ``--max-lora-rank`` 500
  (``lora/peft_helper.py`` 194-197); a path it cannot read 404 "No adapter found for ..."
  (``exceptions.py`` 71-95). Unloading an unknown name answers 404.
- Errors are ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status
  (``entrypoints/serve/exception_handling/error_response.py`` 14-105,
  ``serve/engine/protocol.py`` 79-87). ``--api-key`` guards only paths under ``/v1``, ``/v2``,
  ``/inference`` and ``/cohere`` and answers 401 ``{"error": "Unauthorized"}``
  (``serve/middleware/authenticate.py`` 11, 47-62): run vLLM on loopback.
- A client that disconnects cancels its request (``serve/utils/api_utils.py`` 68-110,
  ``with_cancellation``), which is how an interrupted batch stops vLLM's work.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from gridrl.engine.contract import (
    FinishReason,
    SequenceRequest,
    SequenceResult,
    TopLogprobs,
)

VLLM_CONTRACT_VERSION = "0.33.0"
MASKED = -9999.0  # how vLLM writes the logprob of a masked (-inf) token
MIN_TEMPERATURE = 0.01  # vLLM raises positive temperatures below this to it
MAX_TEMPERATURE = 2.0  # vLLM refuses temperatures above this
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs: most logprobs a request may ask for
_TOKEN = re.compile(r"token_id:(\d+)")
_SEED_MOD = 1 << 63  # vLLM seeds are int64 and -1 means "none": send seed mod 2**63


class VllmError(RuntimeError):
    """vLLM answered something that breaks the sampling contract, or an error; the message
    says which request and what. Nothing of the batch is returned."""


class VllmUnavailable(VllmError, ConnectionError):
    """vLLM could not be reached (refused, reset, timed out)."""


class VllmRefused(VllmError):
    """The server does not honour the contract; the message names the vLLM flag to add."""


@dataclasses.dataclass(frozen=True)
class HttpAnswer:
    """One HTTP response: ``status``, parsed JSON ``body`` (None when not JSON), raw ``text``."""

    status: int
    body: Any
    text: str

    @property
    def message(self) -> str:
        """vLLM's error message (``error.message``, or the whole body)."""
        if isinstance(self.body, dict):
            err = self.body.get("error")
            if isinstance(err, dict) and "message" in err:
                return str(err["message"])
            if isinstance(err, str):
                return err
            if "detail" in self.body:
                return str(self.body["detail"])
        return self.text[:500]

    @property
    def route_missing(self) -> bool:
        """FastAPI's 404 for a path no route serves (not a vLLM error object)."""
        return self.status == 404 and isinstance(self.body, dict) and "error" not in self.body


class ModelMissing(VllmError):
    """vLLM does not know the LoRA name a request asked for (404 on ``model``)."""


def completion_request(req: SequenceRequest, model: str, stop_ids: frozenset[int],
                       vocab_size: int, logprobs: int = 0) -> dict[str, Any]:
    """The ``/v1/completions`` body that samples ``req`` under gridrl's contract.

    Every sampling field is explicit (the server's generation-config defaults never apply):
    ``top_k`` 0 when disabled or ``>= vocab_size``; ``min_p`` 0 and no penalties; the stop set
    is ``stop_ids`` (eos ids and the request's stop ids); ``seed`` is the sequence seed mod
    2**63; ``n`` 1; no streaming.
    """
    s = req.sampling
    return {
        "model": model, "prompt": list(req.prompt_ids), "max_tokens": s.max_tokens, "n": 1,
        "temperature": s.temperature, "top_p": s.top_p,
        "top_k": s.top_k if 0 < s.top_k < vocab_size else 0, "min_p": 0.0,
        "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "seed": req.seed % _SEED_MOD, "stop_token_ids": sorted(stop_ids), "ignore_eos": False,
        "min_tokens": 0, "logprobs": logprobs, "return_tokens_as_token_ids": True,
        "return_token_ids": True, "add_special_tokens": False, "echo": False, "stream": False,
    }


def parse_completion(body: Any, req: SequenceRequest, stop_ids: frozenset[int]
                     ) -> SequenceResult:
    """Read one sequence from a ``/v1/completions`` response, failing closed.

    Returns:
        the token ids (from ``"token_id:N"`` strings, equal to ``token_ids``), one float
        logprob each, the finish reason, and with ``req.sampling.top_logprobs`` N > 0 each
        position's N most likely tokens (from ``top_logprobs``, which also holds the sampled
        token; -9999 read back as ``-inf``).
    Raises:
        VllmError: not exactly one choice; a prompt that is not the ids sent; a token that is
            not ``"token_id:N"`` (plain text is never re-tokenized here); ``tokens``,
            ``token_logprobs`` and ``token_ids`` of different lengths or ids; missing,
            non-finite, positive or masked (-9999) logprobs; a finish reason other than
            ``stop``/``length``; ``length`` before ``max_tokens``; ``stop`` on a token outside
            ``stop_ids``, or a stop id before the end.
    """
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise VllmError(f"expected one choice, got {_short(choices)}")
    choice = choices[0]
    prompt = choice.get("prompt_token_ids")
    if prompt != list(req.prompt_ids):
        raise VllmError("prompt_token_ids differ from the prompt sent as token ids "
                        f"({_short(prompt)} != {_short(req.prompt_ids)}): the server does not "
                        "take token-id prompts as they are")
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        raise VllmError("the choice has no logprobs (requested with logprobs=0)")
    tokens, values, ids = lp.get("tokens"), lp.get("token_logprobs"), choice.get("token_ids")
    if not (isinstance(tokens, list) and isinstance(values, list) and isinstance(ids, list)):
        raise VllmError("logprobs.tokens, logprobs.token_logprobs and token_ids must be lists")
    if not len(tokens) == len(values) == len(ids):
        raise VllmError(f"misaligned lists: {len(tokens)} tokens, {len(values)} "
                        f"token_logprobs, {len(ids)} token_ids")
    parsed = []
    for i, (tok, tid) in enumerate(zip(tokens, ids, strict=True)):
        m = _TOKEN.fullmatch(tok) if isinstance(tok, str) else None
        if m is None:
            raise VllmError(f"token {i} is {tok!r}, not 'token_id:N': the server ignored "
                            "return_tokens_as_token_ids (text is never re-tokenized here)")
        if int(m.group(1)) != tid:
            raise VllmError(f"token {i}: {tok!r} but token_ids[{i}] = {tid}")
        parsed.append(tid)
    logprobs = []
    for i, v in enumerate(values):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise VllmError(f"token_logprobs[{i}] is {v!r}, not a finite number")
        if v <= MASKED or v > 1e-4:
            raise VllmError(f"token_logprobs[{i}] = {v}: a sampled token cannot have "
                            "probability 0 or above 1")
        logprobs.append(float(v))
    reason = choice.get("finish_reason")
    n, limit = len(parsed), req.sampling.max_tokens
    stops_inside = [t for t in parsed[:-1] if t in stop_ids]
    if stops_inside:
        raise VllmError(f"stop token {stops_inside[0]} inside the completion")
    if reason == "length":
        if n != limit:
            raise VllmError(f"finish_reason 'length' after {n} of max_tokens {limit} tokens "
                            "(vLLM capped max_tokens: --max-model-len, or --generation-config "
                            "with max_new_tokens; start it with --generation-config vllm)")
        # the contract: a stop token ends with "stop"
        finish: FinishReason = "stop" if parsed[-1] in stop_ids else "length"
    elif reason == "stop":
        if not parsed or parsed[-1] not in stop_ids:
            raise VllmError(f"finish_reason 'stop' on token {parsed[-1] if parsed else None}, "
                            "which is no eos or stop id of this model (another eos in vLLM's "
                            "generation config, or a stop string)")
        finish = "stop"
    else:
        raise VllmError(f"unknown finish_reason {reason!r} (only 'stop' and 'length' are "
                        "behaviour samples)")
    if n < 1 or n > limit:
        raise VllmError(f"{n} tokens for max_tokens {limit}")
    top = _top_logprobs(lp.get("top_logprobs"), n, req.sampling.top_logprobs)
    return SequenceResult(token_ids=parsed, logprobs=logprobs, finish_reason=finish,
                          top_logprobs=top)


def _top_logprobs(entries: Any, positions: int, top_n: int) -> list[TopLogprobs]:
    """The ``top_n`` most likely ``(id, logprob)`` of each position from vLLM's
    ``top_logprobs`` (``{"token_id:N": logprob}`` per position); [] when ``top_n`` is 0.

    Raises:
        VllmError: not one entry per position, a key not ``"token_id:N"``, fewer than
            ``top_n`` tokens at a position.
    """
    if not top_n:
        return []
    if not isinstance(entries, list) or len(entries) != positions:
        raise VllmError(f"top_logprobs: expected {positions} positions, got {_short(entries)}")
    out = []
    for pos, entry in enumerate(entries):
        pairs = []
        for key, value in (entry or {}).items():
            m = _TOKEN.fullmatch(key) if isinstance(key, str) else None
            if m is None or not isinstance(value, (int, float)):
                raise VllmError(f"top_logprobs[{pos}]: {key!r}: {value!r} is not "
                                "'token_id:N': logprob")
            pairs.append((int(m.group(1)), -math.inf if value <= MASKED else float(value)))
        if len(pairs) < top_n:
            raise VllmError(f"top_logprobs[{pos}]: {len(pairs)} tokens, asked for {top_n}")
        out.append(sorted(pairs, key=lambda p: -p[1])[:top_n])
    return out


def processed_logprobs_problem(choice: Mapping[str, Any], top_k: int) -> str | None:
    """What the logprobs of a sampled choice (requested with ``top_k``, temperature != 1 and
    ``logprobs >= top_k + 2``) show that processed logprobs cannot: None when they are
    processed. At every position at least ``top_k`` tokens (more only on ties at the k-th
    value) must be > -9999 and renormalise to 1 (``|logsumexp| < 1e-3``), the tokens after them
    must be masked (-9999; raw logprobs mask nothing), and the sampled token must be kept."""
    top = (choice.get("logprobs") or {}).get("top_logprobs")
    ids = choice.get("token_ids") or []
    if not isinstance(top, list) or not top or len(top) != len(ids):
        return "no top_logprobs came back"
    for pos, entries in enumerate(top):
        if not isinstance(entries, dict) or len(entries) < top_k + 2:
            return f"position {pos}: {len(entries or {})} top logprobs, asked for {top_k + 2}"
        values = sorted((float(v) for v in entries.values()), reverse=True)
        kept = [v for v in values if v > MASKED]
        if len(kept) < top_k or len(kept) == len(values):
            return (f"position {pos}: {len(kept)} of the {len(values)} top tokens have a "
                    f"logprob above {MASKED} under top_k {top_k} (nothing masked)")
        mass = math.log(sum(math.exp(v) for v in kept))
        if abs(mass) > 1e-3:
            return (f"position {pos}: the {top_k} kept tokens have total probability "
                    f"{math.exp(mass):.4f}, not 1 (logprobs before temperature/top-k)")
        sampled = entries.get(f"token_id:{ids[pos]}")
        if sampled is None or float(sampled) <= MASKED:
            return f"position {pos}: the sampled token is not among the kept ones"
    return None


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
