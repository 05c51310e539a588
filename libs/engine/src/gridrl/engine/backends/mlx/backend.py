"""The MLX backend: mlx-lm models (Apple Silicon, or Linux CPU through ``mlx[cpu]``).

Decoding (``generate``):

1. Every distinct prompt of the batch is prefilled alone (batch 1, its own mlx-lm KV cache),
   so a prompt's cache and first-token logits never depend on the rest of the batch; the
   ``n`` samples of a GRPO group share one prefill.
2. The per-sequence caches are merged into mlx-lm's batch caches (``KVCache.merge`` ->
   ``BatchKVCache``: left padding with a per-row offset, so RoPE positions and the attention
   mask are each sequence's own, exactly as ``mlx_lm.generate.BatchGenerator`` decodes).
3. One forward per step for all live sequences; finished rows are filtered out of the cache.
   Each step applies :func:`~gridrl.engine.backends.mlx.sampling.transform_logits` to float32
   logits and draws with the sequence's own key (``split(key(seed), max_tokens)[step]``).

``score`` runs one teacher-forced forward and reads the same transform, so the behaviour
logprobs of ``generate`` equal ``score`` up to float rounding of the logits.

Adapters are mlx-lm LoRA directories held next to the base weights
(:mod:`gridrl.engine.backends.mlx.lora`). ``generate_mixed`` decodes rows of several adapters
(and the base model) in one batch: one base product for the batch, one small product per
adapter group (S-LoRA / Punica; :meth:`~gridrl.engine.backends.mlx.lora.LoRAManager.activate_rows`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from gridrl.engine.backends.mlx.lora import LoRAManager, MlxAdapter
from gridrl.engine.backends.mlx.sampling import (
    alternatives,
    draw_tokens,
    sequence_keys,
    transform_logits,
)
from gridrl.engine.contract import (
    Backend,
    DecodeInterrupted,
    DecodeObserver,
    SamplingConfig,
    SequenceRequest,
    SequenceResult,
    TopLogprobs,
    check_batch,
)
from gridrl.engine.families import context_limit
from gridrl.engine.tokens import eos_token_ids, model_dir_configs
from gridrl.models import ModelIdentity, model_identity

log = logging.getLogger(__name__)

PREFILL_STEP = 2048  # prompt tokens per forward while prefilling (as mlx-lm's default)


def _device_for(device: str) -> mx.Device:
    """``"auto"`` (MLX's default device), ``"cpu"`` / ``"mlx-cpu"`` or ``"gpu"`` / ``"mlx-gpu"``.

    Raises:
        ValueError: an unknown name, or a GPU that this MLX build cannot use.
    """
    name = device.lower().removeprefix("mlx-")
    if name == "auto":
        return mx.default_device()
    if name == "cpu":
        return mx.Device(mx.cpu)
    if name == "gpu":
        if not mx.is_available(mx.gpu):
            raise ValueError("--device gpu: this MLX build has no GPU back-end "
                             "(mlx[cpu] on Linux is CPU only)")
        return mx.Device(mx.gpu)
    raise ValueError(f"--device: {device!r} is not one of auto, cpu, gpu (mlx-cpu, mlx-gpu)")


def _config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """Config keys mlx-lm needs but a transformers >= 5 ``config.json`` nests elsewhere.

    transformers 5 writes ``rope_parameters: {rope_theta, rope_type, ...}`` instead of the
    top-level ``rope_theta`` / ``rope_scaling`` that mlx-lm's llama-family models read; without
    this, mlx-lm silently uses its default base 10000 (SmolLM2 uses 100000).
    """
    text = config.get("text_config", config)
    rope = text.get("rope_parameters")
    out: dict[str, Any] = {}
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return out  # absent, or nested per layer type (models that read it themselves)
    if "rope_theta" not in text:
        out["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and text.get("rope_scaling") is None:
        out["rope_scaling"] = dict(rope)
    if out and text is not config:
        return {"text_config": {**text, **out}}
    return out


class MlxBackend(Backend):
    """An mlx-lm model that decodes batches with exact behaviour logprobs and holds adapters.

    Build it with :meth:`from_pretrained`. Every method runs on the device chosen there; all
    calls must come from one thread at a time (the engine's scheduler thread).
    """

    name = "mlx"
    adapter_format = "mlx"

    def __init__(self, model: nn.Module, tokenizer: Any, identity: ModelIdentity,
                 eos_token_ids: frozenset[int], device: mx.Device) -> None:
        self._model = model
        self._device = device
        self._lora = LoRAManager(model)
        self.tokenizer = tokenizer
        self.identity = identity
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = "mlx-gpu" if device.type == mx.gpu else "mlx-cpu"
        self.dtype = self._weight_dtype(model)
        # Whether merged (left-padded) batch caches decode as each sequence alone does.
        self.batches_exactly = self._batching_is_exact()
        #: generate_mixed decodes rows of several adapters in one batch (when batched at all).
        self.mixes_adapters = self.batches_exactly
        #: single rows stop between two decode steps (observer.rows_to_stop), and an adapter
        #: loaded between two steps leaves the batch's rows as they were (a new wrapper carries
        #: no update; a row keeps the arrays it started with).
        self.stops_rows = True

    @classmethod
    def from_pretrained(cls, model_dir: Path | str, device: str = "auto",
                        max_context: int | None = None) -> MlxBackend:
        """Load a local Hugging Face directory (safetensors) with mlx-lm.

        Weights keep their stored dtype (fp32 stays fp32). The tokenizer is
        ``transformers.AutoTokenizer`` of the same directory, so ids and chat templates equal
        the torch backend's.

        Args:
            model_dir: a resolved model directory (``gridrl.models.resolve_model``).
            device: ``"auto"``, ``"cpu"`` or ``"gpu"`` (``"mlx-"`` prefix accepted).
            max_context: a context (prompt + completion tokens) the caller needs (None: the
                model's, capped at a sliding window; :mod:`gridrl.engine.families`).
        Raises:
            ValueError: unknown device, an architecture mlx-lm does not know, or
                ``max_context`` beyond the model's limit.
            FileNotFoundError: no config.json / safetensors in ``model_dir``.
        """
        from mlx_lm.utils import load_config, load_model
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        dev = _device_for(device)
        config = load_config(model_dir)
        limit, context_note = context_limit(config, max_context)
        overrides = _config_overrides(config)
        with mx.stream(dev):
            model, _ = load_model(model_dir, model_config=overrides or None)
        model.eval()
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        identity = dataclasses.replace(model_identity(model_dir), max_context=limit)
        eos = eos_token_ids(tokenizer, *model_dir_configs(model_dir))
        backend = cls(model, tokenizer, identity, eos, dev)
        log.info("mlx backend: %s on %s (%s), %d layers; %s; %s", model_dir, backend.device,
                 backend.dtype, backend.identity.num_layers,
                 context_note or f"context {limit} tokens",
                 "batches decoded together" if backend.batches_exactly else
                 "one sequence at a time (mlx-lm's model does not decode padded batches as it "
                 "decodes each sequence alone)")
        return backend

    @property
    def model(self) -> nn.Module:
        """The mlx-lm model it decodes with. Its weights are read live at every call, so a
        trainer may wrap its linears in mlx-lm LoRA layers (``mlx_lm.tuner``) and train them:
        :meth:`generate` and :meth:`score` then sample the current policy (with
        ``adapter=None``; put the model in eval mode first so dropout is off)."""
        return self._model

    @staticmethod
    def _weight_dtype(model: nn.Module) -> str:
        from mlx.utils import tree_flatten

        for _, w in tree_flatten(model.parameters()):
            if mx.issubdtype(w.dtype, mx.floating):
                return str(w.dtype).rsplit(".", 1)[-1]
        return "float32"

    # -- adapters ----------------------------------------------------------------------------

    def load_adapter(self, directory: Path, key: str) -> MlxAdapter:
        """Load an mlx-lm LoRA directory next to the serving weights under ``key``.

        Returns:
            an :class:`~gridrl.engine.backends.mlx.lora.MlxAdapter` handle for
            :meth:`generate` / :meth:`score`.
        Raises:
            AdapterLoadError: it does not fit the base model (the message names the tensor,
                module, shape or config field); nothing is changed then.
        """
        with mx.stream(self._device):
            handle = self._lora.load(directory, key)
        log.info("mlx adapter %r loaded from %s: rank %d, scale %g, %d modules, %.1f MiB",
                 key, directory, handle.rank, handle.scale, len(handle.modules),
                 handle.nbytes / 2**20)
        return handle

    def unload_adapter(self, adapter: Any) -> None:
        """Free ``adapter``'s arrays; the handle cannot be used afterwards.

        Raises:
            ValueError: ``adapter`` is not a handle of this backend.
        """
        if not isinstance(adapter, MlxAdapter):
            raise ValueError(f"not an MLX adapter handle: {type(adapter).__name__}")
        self._lora.unload(adapter)
        mx.clear_cache()

    # -- decoding ----------------------------------------------------------------------------

    def generate(self, batch: list[SequenceRequest], adapter: Any | None,
                 observer: DecodeObserver | None = None) -> list[SequenceResult]:
        """Decode ``batch`` together (see the module docstring), following the contract's
        semantics (:mod:`gridrl.engine.contract`).

        Args:
            batch: sequences; prompts of any lengths >= 1, each with its sampling and seed.
            adapter: a handle from :meth:`load_adapter`, or None for the base model.
            observer: told each step's tokens and asked between steps whether to stop; one
                with ``rows_to_stop()`` is asked right after, and the batch indices it returns
                stop there (:attr:`stops_rows`).
        Returns:
            one :class:`SequenceResult` per request, in order: token ids (stop token included
            when ``finish_reason == "stop"``) and float natural-log behaviour logprobs.
        Raises:
            ValueError: an empty prompt, ``max_tokens < 1``, or an unloaded adapter handle.
            DecodeInterrupted: ``observer.interrupted()`` returned True (nothing is kept).
        """
        if not batch:
            return []
        check_batch(batch, self.identity.max_context)
        with mx.stream(self._device):
            self._lora.activate(adapter)
            try:
                return self._generate(batch, None, observer)
            finally:
                mx.clear_cache()

    def generate_mixed(self, batch: list[SequenceRequest], adapters: Sequence[Any | None],
                       observer: DecodeObserver | None = None) -> list[SequenceResult]:
        """Decode ``batch`` where row ``i`` uses ``adapters[i]`` (an :class:`MlxAdapter`, or
        None: the base model), all rows in one batch: each distinct (adapter, prompt) is
        prefilled alone with its adapter, then every decode step is one base product per
        linear for the whole batch plus one small product per adapter group over its rows
        (:meth:`LoRAManager.activate_rows`: S-LoRA / Punica batching). Each row's tokens and
        logprobs equal those it gets in :meth:`generate` with its adapter alone, up to float32
        rounding. Models whose caches cannot be merged decode one row after the other, each
        with its adapter.

        Raises:
            ValueError: as :meth:`generate`; ``adapters`` not as long as ``batch``.
            DecodeInterrupted: ``observer.interrupted()`` returned True (nothing is kept).
        """
        if len(adapters) != len(batch):
            raise ValueError(f"{len(adapters)} adapters for {len(batch)} sequences")
        if not batch:
            return []
        if all(a is adapters[0] for a in adapters):
            return self.generate(batch, adapters[0], observer)
        check_batch(batch, self.identity.max_context)
        for adapter in adapters:
            LoRAManager.check_handle(adapter)
        with mx.stream(self._device):
            try:
                return self._generate(batch, list(adapters), observer)
            finally:
                self._lora.activate(None)
                mx.clear_cache()

    def _generate(self, batch: list[SequenceRequest], adapters: list[Any | None] | None,
                  observer: DecodeObserver | None) -> list[SequenceResult]:
        """The decode of :meth:`generate` (``adapters`` None: the active adapter for every
        row) or :meth:`generate_mixed` (one handle per row)."""
        results = [SequenceResult() for _ in batch]
        stops = [self.eos_token_ids | set(r.sampling.stop_token_ids) for r in batch]
        keys = [sequence_keys(r.seed, r.sampling.max_tokens) for r in batch]
        mx.eval(keys)

        # 1. prefill each distinct (adapter, prompt) alone; the rows of one share its cache.
        prompt_index: dict[tuple[int, tuple[int, ...]], int] = {}
        handles: dict[int, Any] = {}
        row_prompt = []
        for i, r in enumerate(batch):
            handle = None if adapters is None else adapters[i]
            handles[id(handle)] = handle
            row_prompt.append(prompt_index.setdefault((id(handle), tuple(r.prompt_ids)),
                                                      len(prompt_index)))
        prefilled = []
        for handle_id, prompt in prompt_index:
            if observer is not None and observer.interrupted():
                raise DecodeInterrupted(0)
            if adapters is not None:
                self._lora.activate(handles[handle_id])
            prefilled.append(self._prefill(list(prompt)))
        caches = [cache for cache, _ in prefilled]
        first_logits = mx.concatenate([logits for _, logits in prefilled], axis=0)

        # 2. one batch cache for every sequence (left padding, per-row offsets), or, for cache
        # types mlx-lm cannot batch, one sequence at a time on a copy of its prompt's cache.
        batched = self.batches_exactly and self._can_merge(caches[0])
        if batched:
            groups = [list(range(len(batch)))]
        else:
            log.debug("cache types %s cannot be merged: decoding one sequence at a time",
                      sorted({type(c).__name__ for c in caches[0]}))
            groups = [[i] for i in range(len(batch))]
        for rows in groups:
            if batched:
                cache = [layer[0].merge(list(layer)) for layer in
                         zip(*(caches[row_prompt[i]] for i in rows), strict=True)]
            else:
                cache = copy.deepcopy(caches[row_prompt[rows[0]]])
            if adapters is not None:
                self._lora.activate_rows([adapters[i] for i in rows])
            logits = first_logits[mx.array([row_prompt[i] for i in rows])]
            self._decode(batch, rows, cache, logits, keys, stops, results, observer,
                         mixed=adapters is not None)
        return results

    def _batching_is_exact(self) -> bool:
        """Probe: one decode step of two prompts of different lengths, batched (merged,
        left-padded caches) and alone, give the same logprobs (within 1e-3). Not so for some
        mlx-lm models (gemma2 in mlx-lm 0.32 broadcasts a batch's padding mask over its
        key/value-head axis); those decode one sequence at a time."""
        vocab = self.identity.vocab_size
        prompts = [[1 % vocab, 2 % vocab, 3 % vocab, 4 % vocab], [5 % vocab]]
        with mx.stream(self._device):
            caches = [self._prefill(p)[0] for p in prompts]
            if not self._can_merge(caches[0]):
                return True  # never batched anyway
            step = mx.array([[1], [1]], mx.int32)
            alone = [self._model(step[i:i + 1], cache=copy.deepcopy(c))[0, -1, :]
                     for i, c in enumerate(caches)]
            merged = [layer[0].merge(list(layer)) for layer in zip(*caches, strict=True)]
            together = self._model(step, cache=merged)[:, -1, :]
            diff = max(float(mx.max(mx.abs(
                nn.log_softmax(together[i].astype(mx.float32))
                - nn.log_softmax(alone[i].astype(mx.float32))))) for i in range(2))
            mx.clear_cache()
        return diff < 1e-3

    @staticmethod
    def _can_merge(cache: list[Any]) -> bool:
        """Whether mlx-lm can merge these per-layer caches into batch caches (KVCache,
        RotatingKVCache, ArraysCache, ... can; e.g. ChunkedKVCache cannot)."""
        return all(hasattr(c, "merge") for c in cache)

    def _decode(self, batch: list[SequenceRequest], rows: list[int], cache: list[Any],
                logits: mx.array, keys: list[mx.array], stops: list[frozenset[int]],
                results: list[SequenceResult], observer: DecodeObserver | None,
                mixed: bool = False) -> None:
        """Sample ``batch[rows]`` to the end, appending to ``results[rows]`` (and telling
        ``observer`` each step's tokens); rows the observer's ``rows_to_stop()`` names end
        between two steps (their results cut short).

        Args:
            rows: batch indices, in the row order of ``cache`` and ``logits``.
            cache: mlx-lm cache per layer, batch dimension ``len(rows)``, after the prompts.
            logits: float32 (len(rows), V) for each row's first new token.
            keys: per batch index, its (max_tokens, 2) PRNG keys.
            mixed: rows carry their own adapters (:meth:`LoRAManager.activate_rows`), which
                follow the rows that stay.
        """
        active = list(rows)  # cache row -> batch index
        step = 0
        while True:
            configs = [batch[i].sampling for i in active]
            logprobs = transform_logits(logits, configs)
            tokens, token_logprobs = draw_tokens(logits, logprobs, configs,
                                                 [keys[i][step] for i in active])
            mx.eval(tokens, token_logprobs)
            token_list, logprob_list = tokens.tolist(), token_logprobs.tolist()
            top = alternatives(logprobs, [c.top_logprobs for c in configs])
            if observer is not None:
                observer.on_tokens(list(active), token_list, logprob_list,
                                   **({} if top is None else {"top": top}))
            keep: list[int] = []
            for row, (i, tok, lp) in enumerate(zip(active, token_list, logprob_list,
                                                   strict=True)):
                res = results[i]
                res.token_ids.append(tok)
                res.logprobs.append(lp)
                if top is not None and configs[row].top_logprobs:
                    res.top_logprobs.append(top[row])
                if tok in stops[i]:
                    res.finish_reason = "stop"
                elif len(res.token_ids) >= batch[i].sampling.max_tokens:
                    res.finish_reason = "length"
                else:
                    keep.append(row)
            if not keep:
                return
            if len(keep) < len(active):
                active, tokens = self._keep(cache, keep, active, tokens, mixed)
            step += 1
            if observer is not None and observer.interrupted():
                raise DecodeInterrupted(step)
            stop = _rows_to_stop(observer, active)
            if stop:  # rows the caller no longer wants (contract: Backend.stops_rows)
                keep = [row for row in range(len(active)) if row not in stop]
                if not keep:
                    return
                active, tokens = self._keep(cache, keep, active, tokens, mixed)
            logits = self._model(tokens[:, None], cache=cache)[:, -1, :].astype(mx.float32)

    def _keep(self, cache: list[Any], keep: list[int], active: list[int], tokens: mx.array,
              mixed: bool) -> tuple[list[int], mx.array]:
        """Only cache rows ``keep`` go on: filter the cache (and the rows' adapters); returns
        the kept rows' batch indices and last tokens."""
        for c in cache:
            c.filter(keep)
        if mixed:
            self._lora.keep_rows(keep)
        return [active[row] for row in keep], tokens[mx.array(keep)]

    def _prefill(self, prompt: list[int]) -> tuple[list[Any], mx.array]:
        """Run ``prompt`` through the model alone. Returns its mlx-lm cache (one entry per
        layer) and the float32 logits (1, V) of the token after it."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self._model)
        ids = mx.array(prompt, mx.int32)[None]
        done = 0
        while len(prompt) - done > 1:
            n = min(PREFILL_STEP, len(prompt) - 1 - done)
            self._model(ids[:, done:done + n], cache=cache)
            mx.eval([c.state for c in cache])
            done += n
        logits = self._model(ids[:, done:], cache=cache)[:, -1, :].astype(mx.float32)
        mx.eval(logits, [c.state for c in cache])
        return cache, logits

    def score(self, prompt_ids: list[int], completion_ids: list[int], sampling: SamplingConfig,
              adapter: Any | None) -> list[float]:
        """Teacher-forced logprobs of ``completion_ids`` after ``prompt_ids``
        (:meth:`score_top` without alternatives)."""
        return self.score_top(prompt_ids, completion_ids, sampling, adapter, 0)[0]

    def score_top(self, prompt_ids: list[int], completion_ids: list[int],
                  sampling: SamplingConfig, adapter: Any | None, top_n: int
                  ) -> tuple[list[float], list[TopLogprobs]]:
        """Teacher-forced logprobs of ``completion_ids`` after ``prompt_ids``.

        One forward over ``prompt_ids + completion_ids`` (no cache), float32 logits at the
        positions that predict each completion token, then the same transform as
        :meth:`generate` (contract.py steps 1-3).

        Returns:
            one float per completion token (natural log), ``-inf`` for tokens outside the
            top-k / top-p support, and each position's ``top_n`` most likely tokens
            (``contract.Backend.score_top``); ``([], [])`` for an empty completion.
        Raises:
            ValueError: empty ``prompt_ids``, or an unloaded adapter handle.
        """
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if not completion_ids:
            return [], []
        with mx.stream(self._device):
            self._lora.activate(adapter)
            ids = mx.array(list(prompt_ids) + list(completion_ids), mx.int32)[None]
            logits = self._model(ids)[0, len(prompt_ids) - 1:-1, :].astype(mx.float32)
            logprobs = transform_logits(logits, [sampling] * len(completion_ids))
            target = mx.array(list(completion_ids), mx.int32)[:, None]
            out = mx.take_along_axis(logprobs, target, axis=-1)[:, 0]
            top = alternatives(logprobs, [top_n] * len(completion_ids))
            return ([float(x) for x in out.tolist()],
                    top if top is not None else [[] for _ in completion_ids])


def _rows_to_stop(observer: DecodeObserver | None, active: list[int]) -> set[int]:
    """Positions in ``active`` (the live rows' batch indices) of the rows the observer asks to
    stop (``rows_to_stop``, an optional observer method: ``contract.Backend.stops_rows``)."""
    ask = getattr(observer, "rows_to_stop", None)
    if ask is None:
        return set()
    wanted = set(ask())
    return {row for row, i in enumerate(active) if i in wanted}
