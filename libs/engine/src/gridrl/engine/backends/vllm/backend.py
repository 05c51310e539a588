"""The vLLM backend: a rollout node that fronts a vLLM OpenAI-compatible server on its machine.

vLLM does the decoding (its own continuous batching, on its own GPU); this backend maps the
sampling contract of :mod:`gridrl.engine.contract` onto vLLM's HTTP API, checks at start that
the server honours it, and refuses, naming the vLLM flag to add, when it does not.

The HTTP contract it follows (vLLM 0.33.0's, read from its wheel) and the mapping of requests
and answers are :mod:`.wire`'s; the HTTP client and vLLM's LoRA routes :mod:`.client`'s; the
start-up probe (:meth:`VllmBackend.probe`, refused with :class:`VllmRefused`: API key, tokenizer,
token-id prompts, processed logprobs, runtime LoRA) :mod:`.probe`'s. This module samples
batches, scores and moves adapters. The probe runs again after vLLM was unreachable, before the
next batch.

Threading: every method is called from the node engine's scheduler thread (the contract), so an
adapter load never overlaps a batch on this node (vLLM issue 13698: loading while requests
generate has crashed servers). HTTP runs on a private asyncio loop thread (httpx).
Per-token callbacks of a decode observer are not delivered (requests are not streamed); its
``interrupted()`` is polled and cancels the batch's requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re
import secrets
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gridrl.adapters import AdapterError, read_dir, write_dir
from gridrl.engine.backends.vllm.client import VllmClient
from gridrl.engine.backends.vllm.probe import ProbedModel, probe_prompt, probe_server
from gridrl.engine.backends.vllm.wire import (
    MASKED,
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    ModelMissing,
    VllmError,
    VllmRefused,
    completion_request,
    parse_completion,
)
from gridrl.engine.contract import (
    AdapterLoadError,
    Backend,
    SamplingConfig,
    SequenceRequest,
    SequenceResult,
    TopLogprobs,
    check_batch,
)
from gridrl.engine.tokens import eos_token_ids, model_dir_configs
from gridrl.models import ModelIdentity, model_identity

log = logging.getLogger(__name__)


@dataclasses.dataclass
class VllmAdapter:
    """Handle of an adapter loaded into vLLM.

    Attributes:
        key: the engine's key for it.
        served_name: the LoRA name vLLM serves it under (``model`` of the completions);
            never reused; replaced when vLLM lost it (restarted) and it was loaded again.
        path: where its peft files are landed, under the node's adapter root (vLLM reads
            them from there, also later when its LoRA cache reloads an evicted adapter).
    """

    key: str
    served_name: str
    path: Path


class VllmBackend(Backend):
    """A vLLM server on this machine, seen through its OpenAI-compatible HTTP API.

    Build it with :meth:`connect` (which probes the server). ``--model`` must be the model
    vLLM serves: its tokenizer (text prompts, sample text), config (identity, adapter checks)
    and eos ids come from that directory; the probe checks that the tokenizers agree.

    Args:
        url: vLLM's base URL, e.g. ``http://127.0.0.1:8000``.
        model_dir: the resolved model directory vLLM serves.
        landing_dir: where adapters are written for vLLM to read (``<adapter root>/.vllm``);
            everything in it is this backend's and is cleared at :meth:`connect`.
        api_key: one of vLLM's ``--api-key`` values (None: none sent).
        model_id: the id reported to the master (default: ``model_dir``).
        max_concurrency: most HTTP requests in flight (the node's batch capacity).
        request_timeout_s: seconds one completion may take.
    """

    name = "vllm"
    adapter_format = "peft"
    interrupt_is_synchronous = False  # vLLM aborts cancelled completions in its own time

    def __init__(self, url: str, model_dir: Path | str, landing_dir: Path | str, *,
                 api_key: str | None = None, model_id: str | None = None,
                 max_concurrency: int = 256, request_timeout_s: float = 600.0) -> None:
        from transformers import AutoTokenizer

        self.url = url.rstrip("/")
        self.model_dir = Path(model_dir)
        self.landing_dir = Path(landing_dir).expanduser().resolve()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.identity: ModelIdentity = model_identity(model_dir, model_id)
        self.vocab_size = self.identity.vocab_size
        self.eos_token_ids = eos_token_ids(self.tokenizer, *model_dir_configs(self.model_dir))
        self.device = "vllm"
        self.dtype = "auto"
        self.temperature_range = (MIN_TEMPERATURE, MAX_TEMPERATURE)
        self.served_model = ""  # vLLM's name for the base model (from /v1/models)
        self.server_version = ""
        self._session = secrets.token_hex(4)  # names loaded by this process end with it
        self._loads = 0
        self._needs_probe = True

        def unreachable() -> None:
            self._needs_probe = True

        self._http = VllmClient(self.url, api_key=api_key, max_concurrency=max_concurrency,
                                request_timeout_s=request_timeout_s,
                                on_unreachable=unreachable)

    @classmethod
    def connect(cls, url: str, model_dir: Path | str, landing_dir: Path | str,
                **kwargs: Any) -> VllmBackend:
        """Build the backend, clear its landing directory (and unload from vLLM the adapters
        an earlier node process left there), and run :meth:`probe`.

        Raises:
            VllmRefused: the server does not honour the contract (the message says which vLLM
                flag or environment variable to add); VllmUnavailable: it cannot be reached.
        """
        backend = cls(url, model_dir, landing_dir, **kwargs)
        try:
            backend.probe()
            backend._clear_landing()
        except BaseException:
            backend.close()
            raise
        return backend

    def close(self) -> None:
        """Close the HTTP client and its loop."""
        self._http.close()

    # -- probe -----------------------------------------------------------------------------

    def probe(self) -> None:
        """Check that the server honours the sampling contract
        (:func:`~gridrl.engine.backends.vllm.probe.probe_server`); sets :attr:`served_model`,
        :attr:`server_version` and the context length.

        Raises:
            VllmRefused: naming the flag to add; VllmUnavailable: unreachable.
        """
        model = ProbedModel(self.model_dir, self.tokenizer, self.eos_token_ids, self.vocab_size)
        facts = probe_server(self._http, model,
                             self.landing_dir / f"gridrl-probe-{self._session}-{self._loads}")
        self.served_model = facts.served_model
        if facts.max_model_len:
            context = min(self.identity.max_context, facts.max_model_len)
            self.identity = dataclasses.replace(self.identity, max_context=context)
        if facts.version is not None:
            self.server_version = facts.version
            self.device = f"vllm-{self.server_version}"
        self._needs_probe = False
        log.info("vLLM %s at %s serves %s (context %d): token-id prompts, processed logprobs "
                 "and runtime LoRA checked", self.server_version or "?", self.url,
                 self.served_model, self.identity.max_context)

    def probe_prompt(self) -> list[int]:
        """A prompt that a text round trip would change (it holds special tokens)."""
        return probe_prompt(ProbedModel(self.model_dir, self.tokenizer, self.eos_token_ids,
                                        self.vocab_size))

    def _clear_landing(self) -> None:
        """Unload LoRAs vLLM still serves from the landing directory (left by an earlier node
        process: their names are never asked for again) and delete the directory's contents."""
        models = self._http.call("GET", "/v1/models")
        for card in (models.body or {}).get("data", []) if models.status == 200 else []:
            root = str(card.get("root") or "")
            if card.get("parent") and Path(root).parent == self.landing_dir:
                self._http.unload_lora(str(card["id"]))
        if self.landing_dir.is_dir():
            for child in self.landing_dir.iterdir():
                shutil.rmtree(child, ignore_errors=True)
        self.landing_dir.mkdir(parents=True, exist_ok=True)

    def _ensure_probed(self) -> None:
        if self._needs_probe:
            try:
                self.probe()
            except VllmRefused as e:
                raise VllmError(f"vLLM came back but is refused: {e}") from e

    # -- generate --------------------------------------------------------------------------

    def _stops(self, sampling: SamplingConfig) -> frozenset[int]:
        return self.eos_token_ids | frozenset(sampling.stop_token_ids)

    def generate(self, batch: list[SequenceRequest], adapter: Any | None,
                 observer: Any = None) -> list[SequenceResult]:
        """Sample every sequence of ``batch`` as its own concurrent ``/v1/completions`` request
        (vLLM batches them), with ``adapter``'s LoRA name or the base model.

        Args:
            batch: sequences; each is sent with its own seed (mod 2**63). The same seed gives
                the same sample on the same server (vLLM's sampler, not gridrl's rng: a vllm
                node's samples differ from a torch node's for the same seed).
            adapter: a :class:`VllmAdapter` from :meth:`load_adapter_files`, or None.
            observer: optional; its ``interrupted()`` is polled every 20 ms and cancels the
                batch (per-token callbacks are not delivered by this backend).
        Returns:
            one result per request, in order; logprobs are vLLM's processed logprobs (checked
            by the probe) as float.
        Raises:
            ValueError: an empty prompt, ``max_tokens < 1``, a temperature outside
                {0} | [0.01, 2].
            VllmError: a response that breaks the contract (:func:`parse_completion`) or an
                error answer; VllmUnavailable: vLLM unreachable (probed again before the next
                batch); DecodeInterrupted: the observer interrupted the batch.
        """
        return self.generate_mixed(batch, [adapter] * len(batch), observer)

    #: vLLM batches requests of different LoRAs itself (its punica kernels).
    mixes_adapters = True

    def generate_mixed(self, batch: list[SequenceRequest], adapters: Sequence[Any | None],
                       observer: Any = None) -> list[SequenceResult]:
        """:meth:`generate` where row ``i`` names its own adapter, ``adapters[i]`` (a
        :class:`VllmAdapter`, or None: the base model): each request goes with its own
        ``model`` (the LoRA's served name), and vLLM batches requests of different LoRAs in
        its own scheduler (its S-LoRA/Punica kernels, ``--max-loras`` at once).

        Raises:
            as :meth:`generate`; ValueError when ``adapters`` and ``batch`` differ in length.
        """
        if len(adapters) != len(batch):
            raise ValueError(f"{len(adapters)} adapters for {len(batch)} sequences")
        if not batch:
            return []
        check_batch(batch)
        for i, req in enumerate(batch):
            t = req.sampling.temperature
            if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
                raise ValueError(f"batch[{i}].sampling.temperature {t}: vLLM samples at 0 or "
                                 f"in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]")
        self._ensure_probed()
        try:
            return self._http.run(self._complete_all(batch, adapters), observer)
        except ModelMissing as e:  # vLLM restarted: probe it again, load the adapters again
            loaded = list({id(a): a for a in adapters if a is not None}.values())
            log.warning("%s; probing vLLM again%s", e,
                        " and loading the adapters again" if loaded else "")
            self._needs_probe = True
            self._ensure_probed()
            for adapter in loaded:
                self._reload(adapter)
            return self._http.run(self._complete_all(batch, adapters), observer)

    async def _complete_all(self, batch: list[SequenceRequest],
                            adapters: Sequence[VllmAdapter | None]) -> list[SequenceResult]:
        models = [a.served_name if a is not None else self.served_model for a in adapters]
        tasks = [asyncio.ensure_future(self._complete(i, req, model))
                 for i, (req, model) in enumerate(zip(batch, models, strict=True))]
        try:
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if pending:  # one failed: the batch fails, its other requests are cancelled
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        return [t.result() for t in tasks]

    async def _complete(self, index: int, req: SequenceRequest, model: str) -> SequenceResult:
        stops = self._stops(req.sampling)
        answer = await self._http.request("POST", "/v1/completions",
                                     completion_request(req, model, stops, self.vocab_size,
                                                        req.sampling.top_logprobs))
        if answer.status == 404 and isinstance(answer.body, dict) and \
                (answer.body.get("error") or {}).get("param") == "model":
            raise ModelMissing(f"vLLM does not serve {model!r}: {answer.message}")
        if answer.status != 200:
            raise VllmError(f"batch[{index}]: vLLM answered {answer.status}: {answer.message}")
        try:
            return parse_completion(answer.body, req, stops)
        except VllmError as e:
            raise VllmError(f"batch[{index}] ({model}): {e}") from e

    # -- adapters --------------------------------------------------------------------------

    def load_adapter_files(self, files: Mapping[str, bytes], key: str) -> VllmAdapter:
        """Land a peft adapter (relative path -> bytes) under the landing directory and load it
        into vLLM under a new name (``<key>-<session>-<n>``, never reused).

        Raises:
            AdapterLoadError: unsafe file paths, or vLLM refused the load (the message has
                vLLM's and the flag to add when known); nothing is left loaded or on disk.
            VllmUnavailable: vLLM unreachable.
        """
        self._loads += 1
        name = f"{_safe(key)}-{self._session}-{self._loads}"
        path = self.landing_dir / name
        try:
            write_dir(files, path)
        except AdapterError as e:
            raise AdapterLoadError(str(e)) from e
        try:
            self._load_lora(name, path)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        log.info("vLLM loaded %s from %s", name, path)
        return VllmAdapter(key=key, served_name=name, path=path)

    def load_adapter(self, directory: Path, key: str) -> VllmAdapter:
        """:meth:`load_adapter_files` of the files of ``directory`` (copied into the landing
        directory, which this backend alone owns)."""
        try:
            files = read_dir(directory)
        except AdapterError as e:
            raise AdapterLoadError(str(e)) from e
        return self.load_adapter_files(files, key)

    def unload_adapter(self, adapter: Any) -> None:
        """Unload ``adapter``'s name from vLLM and delete its landed files. Whatever vLLM
        answers (a name it already forgot, 404; or no answer) is logged, not raised: the name
        is never asked for again.

        Raises:
            ValueError: ``adapter`` is not a :class:`VllmAdapter`.
        """
        if not isinstance(adapter, VllmAdapter):
            raise ValueError(f"not a vLLM adapter handle: {adapter!r}")
        try:
            self._http.unload_lora(adapter.served_name)
        except VllmError as e:
            log.warning("unloading %s: %s", adapter.served_name, e)
        shutil.rmtree(adapter.path, ignore_errors=True)

    def _load_lora(self, name: str, path: Path) -> None:
        """:meth:`VllmClient.load_lora`."""
        self._http.load_lora(name, path)

    def _reload(self, adapter: VllmAdapter) -> None:
        """Load ``adapter``'s landed files again under a new name (vLLM lost the old one)."""
        self._loads += 1
        name = f"{_safe(adapter.key)}-{self._session}-{self._loads}"
        try:
            self._load_lora(name, adapter.path)
        except AdapterLoadError as e:
            raise VllmError(f"vLLM lost {adapter.served_name} and refused it again: {e}") from e
        log.info("vLLM serves %s again as %s", adapter.served_name, name)
        adapter.served_name = name

    # -- score -----------------------------------------------------------------------------

    def score(self, prompt_ids: list[int], completion_ids: list[int], sampling: SamplingConfig,
              adapter: Any | None) -> list[float]:
        """:meth:`score_top` without alternatives."""
        return self.score_top(prompt_ids, completion_ids, sampling, adapter, 0)[0]

    def score_top(self, prompt_ids: list[int], completion_ids: list[int],
                  sampling: SamplingConfig, adapter: Any | None, top_n: int
                  ) -> tuple[list[float], list[TopLogprobs]]:
        """Teacher-forced logprobs of ``completion_ids`` under the sampling transform, from
        vLLM's ``prompt_logprobs`` of ``prompt + completion`` (one request, one token
        generated and discarded); with ``top_n``, each position's ``top_n`` most likely
        tokens (greedy, or temperature 1 without truncation, only: the raw distribution).

        ``prompt_logprobs`` are raw (the log-softmax of the logits, in every logprobs mode:
        ``config/model.py`` 296-298), so the transform is applied here, which is exact when the
        kept set is visible: greedy or (temperature 1, no top-k, no top-p): the raw value; top-k
        ``k`` (up to vLLM's default ``--max-logprobs`` 20), top-p 1: with ``z = raw / T``,
        ``z[token] - logsumexp(z[top k])`` for a token in the top k (ties at the k-th value
        included), ``-inf`` otherwise.

        Raises:
            NotImplementedError: temperature != 1 without top-k, or top-p < 1 (the whole
                distribution would be needed), or alternatives of a transformed
                distribution; ValueError: empty prompt; VllmError.
        """
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if not completion_ids:
            return [], []
        t, k = sampling.temperature, sampling.top_k if 0 < sampling.top_k < self.vocab_size \
            else 0
        exact_raw = t == 0 or (t == 1 and k == 0 and sampling.top_p >= 1)
        if not exact_raw and (k == 0 or k > MAX_LOGPROBS or sampling.top_p < 1 or top_n):
            raise NotImplementedError("vllm backend: score needs temperature 0, or temperature "
                                      f"1 without truncation, or top-k <= {MAX_LOGPROBS} without "
                                      "top-p and without alternatives")
        self._ensure_probed()
        model = adapter.served_name if isinstance(adapter, VllmAdapter) else self.served_model
        body = {"model": model, "prompt": [*prompt_ids, *completion_ids], "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": top_n if exact_raw else min(k + 1, MAX_LOGPROBS),
                "return_token_ids": True}
        answer = self._http.call("POST", "/v1/completions", body)
        if answer.status != 200:
            raise VllmError(f"score: vLLM answered {answer.status}: {answer.message}")
        rows = answer.body["choices"][0].get("prompt_logprobs")
        if not isinstance(rows, list) or len(rows) != len(prompt_ids) + len(completion_ids):
            raise VllmError("score: prompt_logprobs missing or of the wrong length")
        out, top = [], []
        for pos, token in enumerate(completion_ids, start=len(prompt_ids)):
            row = {int(tid): float(v["logprob"]) for tid, v in rows[pos].items()}
            if token not in row:
                raise VllmError(f"score: prompt_logprobs[{pos}] lacks token {token}")
            if exact_raw:
                out.append(row[token])
                ranked = sorted(row.items(), key=lambda p: -p[1])[:top_n]
                top.append([(i, -math.inf if v <= MASKED else v) for i, v in ranked])
                continue
            ranked = sorted(row.values(), reverse=True)
            kth = ranked[k - 1]
            kept = [v / t for v in row.values() if v >= kth]
            norm = max(kept) + math.log(sum(math.exp(z - max(kept)) for z in kept))
            out.append(row[token] / t - norm if row[token] >= kth else -math.inf)
            top.append([])
        return out, top


def _safe(key: str) -> str:
    """``key`` with characters other than letters, digits, '-' and '_' replaced by '_'."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", key) or "adapter"


