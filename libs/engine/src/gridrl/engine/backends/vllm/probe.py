"""The start-up probe: does the vLLM server honour the sampling contract?

:func:`probe_server` checks, in order, that the API key is accepted and the server lists a
model; that vLLM's tokenizer encodes like ``--model``'s; that a prompt sent as token ids comes
back unchanged and a sampled request at temperature :data:`PROBE_TEMPERATURE` with top-k
:data:`PROBE_TOP_K` returns processed logprobs (the top k renormalise to 1, the next are masked
at -9999), not raw ones; and that a zero LoRA adapter (:func:`zero_adapter`) landed under the
node's adapter root loads, samples and unloads. Each failure is a :class:`VllmRefused` naming
the vLLM flag to add. :class:`~gridrl.engine.backends.vllm.backend.VllmBackend` runs it at
start and again after vLLM was unreachable.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from gridrl.adapters import tensors as st
from gridrl.adapters import write_dir
from gridrl.engine.backends.vllm.client import VllmClient
from gridrl.engine.backends.vllm.wire import (
    VLLM_CONTRACT_VERSION,
    VllmError,
    VllmRefused,
    completion_request,
    parse_completion,
    processed_logprobs_problem,
)
from gridrl.engine.contract import AdapterLoadError, SamplingConfig, SequenceRequest

log = logging.getLogger(__name__)

PROBE_TOP_K = 4
PROBE_TEMPERATURE = 0.7


@dataclasses.dataclass(frozen=True)
class ServerFacts:
    """What the probe learnt about the server.

    Attributes:
        served_model: vLLM's name for the base model (from ``/v1/models``).
        max_model_len: its context length in tokens (None: not said).
        version: vLLM's version (None when ``/version`` did not answer).
    """

    served_model: str
    max_model_len: int | None
    version: str | None


@dataclasses.dataclass(frozen=True)
class ProbedModel:
    """What the probe checks the server against: the node's ``--model`` directory.

    Attributes:
        model_dir: the resolved model directory vLLM must serve.
        tokenizer: its tokenizer (transformers).
        eos_token_ids: its end-of-sequence ids.
        vocab_size: its vocabulary size.
    """

    model_dir: Path
    tokenizer: Any
    eos_token_ids: frozenset[int]
    vocab_size: int


def probe_server(http: VllmClient, model: ProbedModel, lora_path: Path) -> ServerFacts:
    """Check that the server honours the sampling contract (module docstring).

    Args:
        http: the client of the server.
        model: what the server must serve.
        lora_path: where to land the probe's zero LoRA (its last part is the name it loads
            under; removed afterwards).
    Raises:
        VllmRefused: naming the flag to add; VllmUnavailable: unreachable.
    """
    models = http.call("GET", "/v1/models")
    if models.status == 401:
        raise http.unauthorized(models)
    data = models.body.get("data") if isinstance(models.body, dict) else None
    if models.status != 200 or not data:
        raise VllmRefused(f"GET {http.url}/v1/models answered {models.status}: "
                          f"{models.message}; is this a vLLM OpenAI server?")
    base = next((m for m in data if not m.get("parent")), data[0])
    served_model = str(base["id"])
    max_model_len = int(base["max_model_len"]) if base.get("max_model_len") else None
    server_version: str | None = None
    version = http.call("GET", "/version")
    if version.status == 200 and isinstance(version.body, dict):
        server_version = str(version.body.get("version", ""))
        if server_version.split(".")[:2] != VLLM_CONTRACT_VERSION.split(".")[:2]:
            log.warning("vLLM %s: this backend follows vLLM %s's HTTP contract; the probe "
                        "checks what it relies on", server_version, VLLM_CONTRACT_VERSION)
    _probe_tokenizer(http, model, served_model)
    _probe_sampling(http, model, served_model)
    _probe_lora(http, model, lora_path)
    return ServerFacts(served_model, max_model_len, server_version)


def _probe_tokenizer(http: VllmClient, model: ProbedModel, served_model: str) -> None:
    text = "Reverse the words: the cat sat on the mat."
    mine = list(model.tokenizer(text, add_special_tokens=False)["input_ids"])
    answer = http.call("POST", "/tokenize", {"model": served_model, "prompt": text,
                                             "add_special_tokens": False})
    if answer.status != 200 or not isinstance(answer.body, dict):
        log.warning("vLLM's /tokenize answered %d: tokenizer agreement not checked",
                    answer.status)
        return
    if answer.body.get("tokens") != mine:
        raise VllmRefused(f"vLLM serves {served_model!r} with another tokenizer than "
                          f"--model {model.model_dir}: {answer.body.get('tokens')} != "
                          f"{mine}; give the node the model vLLM serves")


def probe_prompt(model: ProbedModel) -> list[int]:
    """A prompt that a text round trip would change (it holds special tokens)."""
    eos = min(model.eos_token_ids) if model.eos_token_ids else 0
    words = list(model.tokenizer("the cat sat", add_special_tokens=False)["input_ids"])
    return [*words, eos, *words]


def _probe_sampling(http: VllmClient, model: ProbedModel, served_model: str) -> None:
    prompt = probe_prompt(model)
    sampling = SamplingConfig(max_tokens=3, temperature=PROBE_TEMPERATURE,
                              top_k=PROBE_TOP_K)
    req = SequenceRequest(prompt_ids=prompt, sampling=sampling, seed=12345)
    stops = model.eos_token_ids | frozenset(sampling.stop_token_ids)
    body = completion_request(req, served_model, stops, model.vocab_size,
                              logprobs=PROBE_TOP_K + 2)
    answer = http.call("POST", "/v1/completions", body)
    if answer.status == 401:
        raise http.unauthorized(answer)
    if answer.status != 200:
        raise VllmRefused(f"the probe completion answered {answer.status}: "
                          f"{answer.message}")
    try:
        parse_completion(answer.body, req, stops)
    except VllmError as e:
        if "prompt_token_ids" in str(e):
            raise VllmRefused(f"vLLM at {http.url} did not sample the prompt given as "
                              f"token ids: {e}") from e
        raise VllmRefused(f"the probe completion breaks the contract: {e}") from e
    problem = processed_logprobs_problem(answer.body["choices"][0], PROBE_TOP_K)
    if problem is not None:
        raise VllmRefused(f"vLLM at {http.url} returns logprobs that are not those of the "
                          f"distribution sampled from ({problem}): restart it with "
                          "--logprobs-mode processed_logprobs")


def _probe_lora(http: VllmClient, model: ProbedModel, path: Path) -> None:
    name = path.name
    write_dir(zero_adapter(model.model_dir), path)
    try:
        try:
            http.load_lora(name, path)
        except AdapterLoadError as e:
            raise VllmRefused(f"the probe's zero LoRA does not load: {e}") from e
        req = SequenceRequest(prompt_ids=probe_prompt(model),
                              sampling=SamplingConfig(max_tokens=1, temperature=0.0),
                              seed=0)
        answer = http.call("POST", "/v1/completions",
                           completion_request(req, name, model.eos_token_ids,
                                              model.vocab_size))
        if answer.status != 200:
            raise VllmRefused(f"a completion with the probe LoRA {name!r} answered "
                              f"{answer.status}: {answer.message}")
        try:
            http.unload_lora(name)
        except VllmRefused:
            raise
        except VllmError as e:
            raise VllmRefused(f"the probe's zero LoRA does not unload: {e}") from e
    finally:
        shutil.rmtree(path, ignore_errors=True)


def zero_adapter(model_dir: Path) -> dict[str, bytes]:
    """A peft LoRA (rank 1, ``q_proj`` of every block, B = 0: the base model's outputs) for
    the llama-family model in ``model_dir``, as files: what the probe loads into vLLM."""
    from gridrl.adapters.peft_format import PREFIX, encode_config

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    q_out = heads * int(text.get("head_dim") or hidden // heads)
    tensors = {}
    for layer in range(int(text["num_hidden_layers"])):
        path = f"{PREFIX}model.layers.{layer}.self_attn.q_proj"
        tensors[f"{path}.lora_A.weight"] = st.Tensor("F32", (1, hidden), bytes(4 * hidden))
        tensors[f"{path}.lora_B.weight"] = st.Tensor("F32", (q_out, 1), bytes(4 * q_out))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 1, "lora_alpha": 1,
              "target_modules": ["q_proj"], "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": None, "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "inference_mode": True}
    return {"adapter_config.json": encode_config(config),
            "adapter_model.safetensors": st.dump(tensors)}
