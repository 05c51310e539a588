"""The torch backend: transformers + peft on CPU (fp32), CUDA (bf16) or MPS.

Decoding (``generate``), a lean loop over the model's forward (no ``model.generate``):

1. Every distinct prompt is prefilled alone (batch 1, last-position logits only), so a
   prompt's cache and first-token logits never depend on the rest of the batch; the ``n``
   samples of a GRPO group share one prefill. (With ``share_prefix``, for many prompts that
   begin alike such as an eval set under one system prompt, their common token prefix is
   prefilled once and the prompts' remaining tokens attend to it, many prompts a forward:
   ``LeanSteps.prefill_batch``.)
2. The prefills are assembled into one left-padded, preallocated KV cache
   (:class:`~gridrl.engine.backends.torch_cache.SlabCache`) with per-row positions and an
   additive padding mask.
3. One forward per step for all live rows; each step applies
   :func:`~gridrl.engine.backends.torch_sampling.transform_logits` to float32 logits and draws
   with each row's counter-based uniform (:mod:`gridrl.engine.rng`). Finished rows are
   dropped from the cache once enough of them have finished.

``score`` runs one teacher-forced forward through the same transform, so the behaviour logprobs
of ``generate`` equal ``score`` up to float rounding of the logits.

The forward of a model the backend owns (a node) is, for llama-family architectures,
:class:`~gridrl.engine.backends.torch_llama.LeanLlama`: fused projections, run in float32 on
CPU by our own fused kernels (3-3.5x faster than the transformers forward at batch 8 on a
2-core CPU), else with weights prepacked for oneDNN (~2.5x). Other architectures run the
transformers forward. How adapters are held -- lean LoRA factors, merged weights, live peft
factors or peft adapters -- is one strategy chosen at construction
(:mod:`~gridrl.engine.backends.torch_adapters`); the backend's start-up log line names the
forward, the strategy and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gridrl.engine import rng
from gridrl.engine.backends.torch_adapters import (
    LoraSource,
    check_fits,
    choose_strategy,
)
from gridrl.engine.backends.torch_llama import LeanLlama, unsupported_reason
from gridrl.engine.backends.torch_memory import trim_heap
from gridrl.engine.backends.torch_sampling import RowSampling, draw_tokens, transform_logits
from gridrl.engine.backends.torch_steps import LeanSteps, ModelSteps
from gridrl.engine.contract import (
    AdapterLoadError,
    Backend,
    DecodeInterrupted,
    DecodeObserver,
    SamplingConfig,
    SequenceRequest,
    SequenceResult,
    check_batch,
)
from gridrl.engine.families import context_limit, unsupported_layers
from gridrl.models import ModelIdentity, weights_fingerprint

log = logging.getLogger(__name__)

#: shortest shared prefix (tokens) that :attr:`TorchBackend.share_prefix` prefills once
MIN_SHARED_PREFIX = 8

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TorchAdapter:
    """Handle of a peft adapter loaded into the backend's model.

    Attributes:
        key: the peft adapter name it is loaded under.
        directory: where it was loaded from ("" for files loaded from memory).
        rank: LoRA rank r of its config.
        modules: number of adapted modules.
    """

    key: str
    directory: str
    rank: int
    modules: int


def pick_device(device: str = "auto") -> torch.device:
    """``"auto"``: CUDA if available, else MPS if available, else CPU; otherwise the named one.

    Raises:
        ValueError: a device this torch build cannot use.
    """
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available in this torch build")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device}: MPS is not available")
    return dev


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on CUDA, float32 elsewhere; otherwise the named dtype.

    Raises:
        ValueError: an unknown dtype name.
    """
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype: {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """eos ids of the tokenizer, the model config and its generation config, together."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)

    add(getattr(tokenizer, "eos_token_id", None))
    add(getattr(model.config, "eos_token_id", None))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        add(getattr(gen, "eos_token_id", None))
    return frozenset(ids)


def _identity_of(model: Any, model_id: str) -> ModelIdentity:
    cfg = model.config
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return ModelIdentity(
        model_id=model_id, architecture=str(getattr(cfg, "model_type", "")),
        hidden_size=int(text.hidden_size), num_layers=int(text.num_hidden_layers),
        vocab_size=int(text.vocab_size),
        max_context=int(getattr(text, "max_position_embeddings", 2048) or 2048))


class TorchBackend(Backend):
    """A transformers causal LM that decodes batches with exact behaviour logprobs and holds
    peft LoRA adapters.

    Build it with :meth:`from_pretrained` (a node: it owns the model; ``adapter=None`` means
    the base model) or :meth:`from_model` (in-process, e.g. the trainer's peft model;
    ``adapter=None`` means the model exactly as it is, active adapter included). All calls must
    come from one thread at a time.

    Attributes:
        forward_kind: ``"lean"`` (:class:`LeanLlama`) or ``"transformers"``.
        forward_reason: why that forward runs.
        adapters: how adapters are held (:mod:`~gridrl.engine.backends.torch_adapters`).
        share_prefix: on the lean forward, :meth:`generate` prefills the token prefix that
            all the batch's distinct prompts share (a task's system prompt) once, and the
            prompts' remaining tokens, batched, attend to it, instead of every prompt alone: results
            equal a plain prefill's up to float rounding, but a prompt's prefill then depends
            on the rest of the batch (off by default; the trainer's held-out eval sets it).
    """

    name = "torch"
    adapter_format = "peft"

    def __init__(self, model: Any, tokenizer: Any, identity: ModelIdentity, *,
                 owns_model: bool, lean: bool | None = None,
                 load_model: Callable[[], Any] | None = None,
                 max_context: int | None = None, share_prefix: bool = False) -> None:
        """Use :meth:`from_pretrained` or :meth:`from_model`.

        Args:
            load_model: for an owned model, loads another copy of it: then the lean forward
                takes the model's weights (one copy in memory, :class:`LeanLlama`'s
                ``take_weights``) and peft adapters get a copy of their own when one comes.
            max_context: a context (prompt + completion tokens) the caller needs, checked
                against the model's limit (:func:`gridrl.engine.families.context_limit`).
            share_prefix: initial :attr:`share_prefix`.
        Raises:
            ValueError: layers other than attention, or ``max_context`` beyond the limit.
        """
        from peft import PeftModel

        self._wrapper = model  # what the caller gave: its train/eval mode is kept
        peft = model if isinstance(model, PeftModel) else None
        self._hf = model.get_base_model() if peft is not None else model
        config = self._hf.config.to_dict()
        refused = unsupported_layers(config)
        if refused is not None:
            raise ValueError(f"torch backend: {type(self._hf).__name__}: {refused}")
        limit, context_note = context_limit(config, max_context)
        self._owns = owns_model
        self.tokenizer = tokenizer
        self.identity = dataclasses.replace(identity, max_context=limit)
        self.eos_token_ids = _eos_ids(self._hf, tokenizer)
        param = next(self._hf.parameters())
        self._device = param.device
        self._dtype = param.dtype
        self.device = str(self._device) if self._device.type != "cuda" else f"cuda:{self._device.index or 0}"
        self.dtype = str(self._dtype).removeprefix("torch.")
        self.vocab_size = int(self._hf.get_output_embeddings().weight.shape[0])
        self._loaded: dict[str, TorchAdapter] = {}
        # A llama-family model runs the lean forward, adapters as LoRA factors: an owned model
        # (a node), or a peft model wrapped in-process whose base weights are frozen (the
        # trainer's eval and local rollouts; on CPU by default, as the lean forward keeps
        # fused copies of the base weights).
        lean_forward: LeanLlama | None = None
        if lean is None:
            lean = owns_model or self._device.type == "cpu"
        refusal = self._lean_refusal(owns_model, peft) if lean else "disabled (--forward " \
            "transformers)" if owns_model else "disabled"
        take = owns_model and peft is None and load_model is not None
        if refusal is None:
            lean_forward = LeanLlama(self._hf, take_weights=take)
            if take:
                trim_heap()  # the packing's temporaries
            self.forward_reason = (f"{identity.architecture or 'llama-family'} model, "
                                   f"{lean_forward.products} products")
        else:
            self.forward_reason = f"lean forward: {refusal}"
        self.forward_kind = "lean" if lean_forward is not None else "transformers"
        self.adapters = choose_strategy(
            self._hf, peft, lean_forward, owns=owns_model,
            load_model=load_model if take and lean_forward is not None else None)
        # Time from the start of the last generate() to its first sampled tokens.
        self.last_first_token_s: float | None = None
        self.share_prefix = share_prefix
        log.info("torch backend: %s on %s (%s), %d layers; forward: %s (%s); adapters: %s; %s",
                 identity.model_id or type(self._hf).__name__, self.device, self.dtype,
                 identity.num_layers, self.forward_kind, self.forward_reason,
                 self.adapters.describe(), context_note or f"context {limit} tokens")

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_dir: Path | str, device: str = "auto", dtype: str = "auto",
                        model_id: str | None = None, lean: bool = True,
                        max_context: int | None = None) -> TorchBackend:
        """Load a local Hugging Face directory with transformers.

        Args:
            model_dir: a resolved model directory (``gridrl.models.resolve_model``).
            device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``"mps"``.
            dtype: ``"auto"`` (float32 on CPU/MPS, bfloat16 on CUDA), ``"float32"``,
                ``"bfloat16"`` or ``"float16"``.
            model_id: what to report as the model id (default: ``model_dir``).
            lean: run llama-family models through :class:`LeanLlama` (False: always the
                transformers forward, adapters merged).
            max_context: a context the caller needs (None: the model's, capped at a sliding
                window; :mod:`gridrl.engine.families`).
        Raises:
            ValueError: unknown device or dtype, an unsupported architecture, or
                ``max_context`` beyond the model's limit.
            OSError: the directory has no loadable model.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dev = pick_device(device)
        torch_dtype = pick_dtype(dtype, dev)

        def load_model() -> Any:
            # transformers maps safetensors files: weights stay file-backed until read
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype)
            model.to(dev).eval()
            model.requires_grad_(False)
            return model

        model = load_model()
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        identity = dataclasses.replace(_identity_of(model, model_id or str(model_dir)),
                                       weights_fingerprint=weights_fingerprint(model_dir))
        return cls(model, tokenizer, identity, owns_model=True, lean=lean, load_model=load_model,
                   max_context=max_context)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, model_id: str = "",
                   lean: bool | None = None, max_context: int | None = None) -> TorchBackend:
        """Wrap a model already in memory (a transformers causal LM or a peft ``PeftModel``).

        ``generate(batch, None)`` then decodes with the model as it is (its active adapter
        included), in eval mode for the call; the caller's train/eval mode is restored after.

        Args:
            lean: run a peft LoRA model with frozen base weights through :class:`LeanLlama`,
                its current LoRA weights read at every call (None: on CPU only; the lean
                forward keeps fused copies of the base weights).
            max_context: as for :meth:`from_pretrained`.
        """
        identity = _identity_of(model.get_base_model() if hasattr(model, "get_base_model")
                                else model, model_id or str(getattr(model.config, "_name_or_path", "")))
        return cls(model, tokenizer, identity, owns_model=False, lean=lean,
                   max_context=max_context)

    def _lean_refusal(self, owns_model: bool, peft: Any | None) -> str | None:
        """Why the lean forward cannot stand in for this model (None: it can)."""
        reason = unsupported_reason(self._hf)
        if reason is not None:
            return reason
        if owns_model:
            return None if peft is None else "a peft model"
        if peft is None:
            return "a model owned by the caller without peft (its weights may change)"
        if any(p.requires_grad for n, p in self._hf.named_parameters() if "lora_" not in n):
            return "base weights are trainable"
        return None

    # -- adapters ----------------------------------------------------------------------------

    def load_adapter(self, directory: Path, key: str) -> TorchAdapter:
        """Load the peft LoRA adapter in ``directory`` next to the serving weights under
        ``key``; the serving adapter and the active selection are untouched.

        Returns:
            a :class:`TorchAdapter` handle for :meth:`generate` / :meth:`score`.
        Raises:
            AdapterLoadError: not a peft adapter, a key already loaded, or tensors that do not
                fit the base model (the message names the tensor, module or shape); nothing is
                changed then.
        """
        if key in self._loaded:
            raise AdapterLoadError(f"adapter key {key!r} is already loaded")
        return self._load(key, LoraSource.from_directory(Path(directory)))

    def load_adapter_files(self, files: Mapping[str, bytes], key: str) -> TorchAdapter:
        """:meth:`load_adapter` from a push's files in memory: tensors are read in place from
        the bytes (viewed, not copied, when the buffer is writable, as a push's is; no disk)
        unless the adapter goes through peft, which reads a temporary directory.

        Raises:
            AdapterLoadError: as :meth:`load_adapter`; nothing is changed then.
        """
        if key in self._loaded:
            raise AdapterLoadError(f"adapter key {key!r} is already loaded")
        return self._load(key, LoraSource.from_files(files))

    def _load(self, key: str, source: LoraSource) -> TorchAdapter:
        rank, modules = check_fits(self._hf, source)
        start = time.perf_counter()
        nbytes = self.adapters.load(key, source)
        handle = TorchAdapter(key=key, directory=str(source.directory or ""), rank=rank,
                              modules=modules)
        self._loaded[key] = handle
        log.info("LoRA adapter %r loaded from %s as %s: rank %d, %d modules, %.1f MB, %.3fs",
                 key, source.where, self.adapters.strategy_of(key), rank, modules, nbytes / 1e6,
                 time.perf_counter() - start)
        return handle

    def unload_adapter(self, adapter: Any) -> None:
        """Delete ``adapter``'s weights from the model; the handle cannot be used afterwards.

        Raises:
            ValueError: ``adapter`` is not a handle of this backend.
        """
        if not isinstance(adapter, TorchAdapter) or self._loaded.get(adapter.key) is not adapter:
            raise ValueError(f"not a loaded torch adapter handle: {adapter!r}")
        del self._loaded[adapter.key]
        self.adapters.unload(adapter.key)

    @contextlib.contextmanager
    def _using(self, adapter: TorchAdapter | None) -> Iterator[Any]:
        """Run with ``adapter`` (None: base model for an owned model, the model as it is
        otherwise), in eval mode and inference mode; yields the forward that serves the call
        (a :class:`LeanLlama` or a transformers model)."""
        if adapter is not None and self._loaded.get(adapter.key) is not adapter:
            raise ValueError(f"adapter {getattr(adapter, 'key', adapter)!r} is not loaded")
        model = self._wrapper
        was_training = model.training
        if was_training:
            model.eval()
        try:
            with torch.inference_mode(), self.adapters.active(
                    None if adapter is None else adapter.key) as forward:
                yield forward
        finally:
            if was_training:
                model.train()

    # -- decoding ----------------------------------------------------------------------------

    def generate(self, batch: list[SequenceRequest], adapter: Any | None,
                 observer: DecodeObserver | None = None) -> list[SequenceResult]:
        """Decode ``batch`` together (see the module docstring), following the contract's
        semantics (:mod:`gridrl.engine.contract`).

        Args:
            batch: sequences; prompts of any lengths >= 1, each with its sampling and seed.
            adapter: a :class:`TorchAdapter` from :meth:`load_adapter`, or None.
            observer: told each step's tokens and asked between steps whether to stop.
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
        with self._using(adapter) as forward:
            return self._generate(batch, forward, observer)

    def _steps(self, forward: Any) -> LeanSteps | ModelSteps:
        if isinstance(forward, LeanLlama):
            return LeanSteps(forward, self._device, self._dtype)
        return ModelSteps(forward, self._device)

    def _generate(self, batch: list[SequenceRequest], forward: Any,
                  observer: DecodeObserver | None) -> list[SequenceResult]:
        steps = self._steps(forward)
        start = time.perf_counter()
        dev = self._device
        n = len(batch)
        # 1. prefill each distinct prompt alone (after a shared prefix: batched).
        prompt_index: dict[tuple[int, ...], int] = {}
        row_prefill = [prompt_index.setdefault(tuple(r.prompt_ids), len(prompt_index))
                       for r in batch]
        prefills, first_logits = [], []
        prefix = self._shared_prefix(steps, list(prompt_index))
        if prefix is not None:  # the prompts' rest after the prefix, many rows a forward
            assert isinstance(steps, LeanSteps)
            if observer is not None and observer.interrupted():
                raise DecodeInterrupted(0)
            prefills, first_logits = steps.prefill_batch([list(p) for p in prompt_index],
                                                         prefix)
        else:
            for prompt in prompt_index:
                if observer is not None and observer.interrupted():
                    raise DecodeInterrupted(0)
                kv, logits = steps.prefill(list(prompt))
                prefills.append(kv)
                first_logits.append(logits)
        logits = torch.stack(first_logits).index_select(
            0, torch.tensor(row_prefill, dtype=torch.int64, device=dev))
        max_tokens = [r.sampling.max_tokens for r in batch]
        steps.start(prefills, [len(p) for p in prompt_index], row_prefill, max(max_tokens))
        del prefills, first_logits

        # 2. per-row state; `active` maps cache rows to batch indices.
        sampling = RowSampling.from_configs([r.sampling for r in batch], logits.shape[-1], dev)
        seeds = rng.seeds_array([r.seed for r in batch])
        stops = [self.eos_token_ids | set(r.sampling.stop_token_ids) for r in batch]
        stop_table = _stop_table(stops, dev)
        limit = torch.tensor(max_tokens, dtype=torch.int64, device=dev)
        out_tokens = torch.zeros((n, max(max_tokens)), dtype=torch.int64, device=dev)
        out_logprobs = torch.zeros((n, max(max_tokens)), dtype=torch.float32, device=dev)
        length = [0] * n
        reason: list[str] = ["length"] * n
        active = torch.arange(n, device=dev)
        active_list = list(range(n))
        rows = sampling
        step = 0
        self.last_first_token_s = None
        while True:
            logprobs = transform_logits(logits, rows)
            u = torch.from_numpy(rng.step_uniforms(seeds[active_list], step)) \
                if not rows.all_greedy else None
            tokens, token_logprobs = draw_tokens(logits, logprobs, rows, u)
            out_tokens[active, step] = tokens
            out_logprobs[active, step] = token_logprobs
            if observer is not None:
                observer.on_tokens(list(active_list), tokens.tolist(), token_logprobs.tolist())
            if self.last_first_token_s is None:
                self.last_first_token_s = time.perf_counter() - start
            hit_stop = (stop_table.index_select(0, active) == tokens[:, None]).any(dim=-1)
            hit_len = limit.index_select(0, active) <= step + 1
            done = hit_stop | hit_len
            done_list = done.tolist()
            if any(done_list):
                stop_list = hit_stop.tolist()
                for row, i in enumerate(active_list):
                    if done_list[row]:
                        length[i] = step + 1
                        reason[i] = "stop" if stop_list[row] else "length"
                if all(done_list):
                    break
                keep = [row for row, d in enumerate(done_list) if not d]
                keep_t = torch.tensor(keep, dtype=torch.int64, device=dev)
                steps.keep(keep_t)
                active = active.index_select(0, keep_t)
                active_list = [active_list[row] for row in keep]
                tokens = tokens.index_select(0, keep_t)
                rows = rows.select(keep_t)
            step += 1
            if observer is not None and observer.interrupted():
                raise DecodeInterrupted(step)
            logits = steps.step(tokens)
        tokens_cpu = out_tokens.cpu()
        logprobs_cpu = out_logprobs.cpu()
        return [SequenceResult(token_ids=tokens_cpu[i, :length[i]].tolist(),
                               logprobs=logprobs_cpu[i, :length[i]].tolist(),
                               finish_reason=reason[i])  # type: ignore[arg-type]
                for i in range(n)]

    def _shared_prefix(self, steps: LeanSteps | ModelSteps, prompts: list[tuple[int, ...]]
                       ) -> Any | None:
        """With :attr:`share_prefix` on the lean forward: the prefill of the longest token
        prefix that every distinct prompt of the batch starts with (each keeps at least its
        last token), when it is at least :data:`MIN_SHARED_PREFIX` tokens; else None."""
        if not self.share_prefix or len(prompts) < 2 or not isinstance(steps, LeanSteps):
            return None
        length = min(len(p) for p in prompts) - 1
        first = prompts[0]
        for p in prompts[1:]:
            length = next((j for j in range(length) if p[j] != first[j]), length)
        if length < MIN_SHARED_PREFIX:
            return None
        return steps.shared_prefix(list(first[:length]))

    def score(self, prompt_ids: list[int], completion_ids: list[int], sampling: SamplingConfig,
              adapter: Any | None) -> list[float]:
        """Teacher-forced logprobs of ``completion_ids`` after ``prompt_ids``: one forward over
        both (no cache), float32 logits at the positions that predict each completion token,
        then the same transform as :meth:`generate` (contract.py steps 1-3).

        Returns:
            one float per completion token (natural log), ``-inf`` for tokens outside the
            top-k / top-p support; ``[]`` for an empty completion.
        Raises:
            ValueError: empty ``prompt_ids``, or an unloaded adapter handle.
        """
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if not completion_ids:
            return []
        with self._using(adapter) as forward:
            ids = torch.tensor([list(prompt_ids) + list(completion_ids)], dtype=torch.int64,
                               device=self._device)
            if isinstance(forward, LeanLlama):
                positions = torch.arange(ids.shape[1], device=self._device)[None]
                logits = forward.forward(ids, positions)
            else:
                logits = forward(input_ids=ids, use_cache=False).logits
            logits = logits[0, len(prompt_ids) - 1:-1].float()
            rows = RowSampling.from_configs([sampling] * len(completion_ids), logits.shape[-1],
                                            self._device)
            logprobs = transform_logits(logits, rows)
            target = torch.tensor(completion_ids, dtype=torch.int64, device=self._device)
            return logprobs.gather(-1, target[:, None]).squeeze(-1).cpu().tolist()


def _stop_table(stops: list[set[int]], device: torch.device) -> torch.Tensor:
    """(N, S) int64 table of each row's stop ids, padded with -1 (never a token id)."""
    width = max(1, max(len(s) for s in stops))
    table = torch.full((len(stops), width), -1, dtype=torch.int64)
    for i, s in enumerate(stops):
        if s:
            table[i, :len(s)] = torch.tensor(sorted(s), dtype=torch.int64)
    return table.to(device)
