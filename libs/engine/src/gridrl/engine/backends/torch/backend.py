"""The torch backend: transformers + peft on CPU (fp32), CUDA (bf16) or MPS.

This module builds the backend (which forward, which adapter strategy, the context limit),
loads and unloads adapters and picks the forward each call runs on; the decode loop
(``generate``: prefill, one forward a step for all live rows, sample, drop finished rows) is
:mod:`~gridrl.engine.backends.torch.decode`'s.

``score`` runs one teacher-forced forward through the same transform, so the behaviour logprobs
of ``generate`` equal ``score`` up to float rounding of the logits.

The forward of a model the backend owns (a node) is, for llama-family architectures,
:class:`~gridrl.engine.backends.torch.llama.LeanLlama`: fused projections, run in float32 on
CPU by our own fused kernels (3-3.5x faster than the transformers forward at batch 8 on a
2-core CPU), else with weights prepacked for oneDNN (~2.5x). Other architectures run the
transformers forward. How adapters are held -- lean LoRA factors, merged weights, live peft
factors or peft adapters -- is one strategy chosen at construction
(:mod:`~gridrl.engine.backends.torch.adapters`); the backend's start-up log line names the
forward, the strategy and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gridrl.engine.backends.torch import cpu_kernels
from gridrl.engine.backends.torch.adapters import choose_strategy
from gridrl.engine.backends.torch.cores import ThreadGovernor
from gridrl.engine.backends.torch.decode import alternatives, decode, make_steps
from gridrl.engine.backends.torch.device import pick_device, pick_dtype
from gridrl.engine.backends.torch.llama import LeanLlama, LoraFactors
from gridrl.engine.backends.torch.llama_model import unsupported_reason
from gridrl.engine.backends.torch.lora_source import LoraSource, check_fits
from gridrl.engine.backends.torch.memory import trim_heap
from gridrl.engine.backends.torch.prefix_cache import PrefixCache
from gridrl.engine.backends.torch.sampling import RowSampling, transform_logits
from gridrl.engine.backends.torch.steps import LeanSteps, ModelSteps
from gridrl.engine.contract import (
    AdapterLoadError,
    Backend,
    DecodeObserver,
    SamplingConfig,
    SequenceRequest,
    SequenceResult,
    TopLogprobs,
    check_batch,
)
from gridrl.engine.families import context_limit, unsupported_layers
from gridrl.engine.tokens import eos_token_ids
from gridrl.models import ModelIdentity, weights_fingerprint

log = logging.getLogger(__name__)


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
        adapters: how adapters are held (:mod:`~gridrl.engine.backends.torch.adapters`).
        share_prefix: on the lean forward, :meth:`generate` prefills the token prefix that
            all the batch's distinct prompts share (a task's system prompt) once, and the
            prompts' remaining tokens, batched, attend to it, instead of every prompt alone: results
            equal a plain prefill's up to float rounding, but a prompt's prefill then depends
            on the rest of the batch (off by default; the trainer's held-out eval sets it).
        prefix_cache: on the lean forward, the keys/values kept for continuations
            (:mod:`~gridrl.engine.backends.torch.prefix_cache`): a request with
            ``keep_cache`` leaves its samples' there, and a prompt that continues one prefills
            only its new tokens; None: off. The model's own forward neither keeps nor reuses.
    """

    name = "torch"
    adapter_format = "peft"

    def __init__(self, model: Any, tokenizer: Any, identity: ModelIdentity, *,
                 owns_model: bool, lean: bool | None = None,
                 load_model: Callable[[], Any] | None = None,
                 max_context: int | None = None, share_prefix: bool = False,
                 prefix_cache_bytes: int = 0) -> None:
        """Use :meth:`from_pretrained` or :meth:`from_model`.

        Args:
            load_model: for an owned model, loads another copy of it: then the lean forward
                takes the model's weights (one copy in memory, :class:`LeanLlama`'s
                ``take_weights``) and peft adapters get a copy of their own when one comes.
            max_context: a context (prompt + completion tokens) the caller needs, checked
                against the model's limit (:func:`gridrl.engine.families.context_limit`).
            share_prefix: initial :attr:`share_prefix`.
            prefix_cache_bytes: the :attr:`prefix_cache` budget (0: no prefix cache).
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
        self.eos_token_ids = eos_token_ids(tokenizer, self._hf.config,
                                           getattr(self._hf, "generation_config", None))
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
        self._lean = lean_forward
        self.kv_bytes_per_token, self.sequence_bytes = _decode_memory(
            self._hf.config, lean_forward.compute_dtype if lean_forward else self._dtype)
        self.adapters = choose_strategy(
            self._hf, peft, lean_forward, owns=owns_model,
            load_model=load_model if take and lean_forward is not None else None)
        # Time from the start of the last generate() to its first sampled tokens.
        self.last_first_token_s: float | None = None
        # Decoding threads that follow the load other processes put on the cores (share_cores).
        self.threads: ThreadGovernor | None = None
        self.share_prefix = share_prefix
        self.prefix_cache = (PrefixCache(prefix_cache_bytes)
                             if prefix_cache_bytes > 0 and lean_forward is not None else None)
        log.info("torch backend: %s on %s (%s), %d layers; forward: %s (%s); adapters: %s; %s",
                 identity.model_id or type(self._hf).__name__, self.device, self.dtype,
                 identity.num_layers, self.forward_kind, self.forward_reason,
                 self.adapters.describe(), context_note or f"context {limit} tokens")

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, model_dir: Path | str, device: str = "auto", dtype: str = "auto",
                        model_id: str | None = None, lean: bool = True,
                        max_context: int | None = None,
                        prefix_cache_bytes: int = 0) -> TorchBackend:
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
            prefix_cache_bytes: keys/values kept for continuations (:attr:`prefix_cache`; 0:
                none).
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
                   max_context=max_context, prefix_cache_bytes=prefix_cache_bytes)

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

    def share_cores(self, limit: int = 0) -> ThreadGovernor:
        """From now on decode with as many threads as other processes leave cores free,
        re-decided every half second of decoding (:mod:`~gridrl.engine.backends.torch.cores`);
        when the count changes, the kernel race runs again at the new count and its outcome is
        logged, and while other processes take cores the fused kernels hand their column
        blocks out dynamically (a thread that shares its core then does less; same results).
        Call on the thread that decodes (OpenMP's team size is per thread).

        Args:
            limit: most threads (0: one per allowed core).
        """
        lean = self._lean

        def adapt(old: int, new: int) -> None:
            if lean is None or self._device.type != "cpu":
                return
            if lean.kernels is not None:
                lean.kernels.set_dynamic_blocks(new < governor.cores)
            outcome = cpu_kernels.race_again(lean.dtype, lean.kernels is not None)
            if outcome is not None:
                log.info("kernel race at %d threads (was %d): %s", new, old, outcome)

        governor = self.threads = ThreadGovernor(limit, on_change=adapt)
        return governor

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
        if self.prefix_cache is not None:
            self.prefix_cache.drop_adapter(adapter.key)

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
        """Decode ``batch`` together (:mod:`~gridrl.engine.backends.torch.decode`), following the contract's
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
            return self._generate(batch, forward, observer,
                                  "" if adapter is None else adapter.key)

    @property
    def stops_rows(self) -> bool:  # type: ignore[override]
        """On the lean forward with adapters held as factors: single rows stop between two
        decode steps (``observer.rows_to_stop``), and adapters load between two decode steps
        without disturbing the batch in progress (they never touch the weights it reads)."""
        return self.mixes_adapters

    @property
    def mixes_adapters(self) -> bool:  # type: ignore[override]
        """True on the lean forward with adapters held as factors: :meth:`generate_mixed`
        then decodes rows of different adapters in one batch."""
        return self.adapters.lean_factors([]) is not None

    def generate_mixed(self, batch: list[SequenceRequest], adapters: Sequence[Any | None],
                       observer: DecodeObserver | None = None) -> list[SequenceResult]:
        """Decode ``batch`` where row ``i`` uses ``adapters[i]`` (a :class:`TorchAdapter`, or
        None: the base model), all rows together on the lean forward: each distinct
        (adapter, prompt) is prefilled with its adapter, then every decode step is one base
        product per projection for the whole batch plus one small product over the adapters'
        factors stacked along the rank, each row reading its own
        (:meth:`LeanLlama.activate_rows`: S-LoRA / Punica batching). Elsewhere (the
        transformers forward, a DoRA adapter held by peft) one adapter group after the other
        (:meth:`Backend.generate_mixed`). Each row's tokens and logprobs equal those it gets
        in :meth:`generate` with its adapter alone, up to float32 rounding.

        Raises:
            ValueError: as :meth:`generate`; ``adapters`` not as long as ``batch``.
            DecodeInterrupted: ``observer.interrupted()`` returned True (nothing is kept).
        """
        if len(adapters) != len(batch):
            raise ValueError(f"{len(adapters)} adapters for {len(batch)} sequences")
        if not batch:
            return []
        for adapter in adapters:
            if adapter is not None and self._loaded.get(adapter.key) is not adapter:
                raise ValueError(f"adapter {getattr(adapter, 'key', adapter)!r} is not loaded")
        keys = ["" if a is None else a.key for a in adapters]
        if len(set(keys)) == 1:
            return self.generate(batch, adapters[0], observer)
        lean = self.adapters.lean_factors(sorted({k for k in keys if k}))
        if lean is None:
            return super().generate_mixed(batch, adapters, observer)
        check_batch(batch, self.identity.max_context)
        forward, factors = lean
        with self._using(None) as base:
            assert base is forward
            try:
                return self._generate(batch, forward, observer, keys, factors)
            finally:
                forward.activate(None)

    def _steps(self, forward: Any) -> LeanSteps | ModelSteps:
        """The steps object that drives ``forward`` on this backend's device."""
        return make_steps(forward, self._device)

    def _generate(self, batch: list[SequenceRequest], forward: Any,
                  observer: DecodeObserver | None, adapter_key: str | list[str] = "",
                  factors: Mapping[str, LoraFactors] | None = None) -> list[SequenceResult]:
        """The decode loop (:func:`~gridrl.engine.backends.torch.decode.decode`) with this
        backend's device, stop ids, prefix cache, shared-prefix switch and threads."""

        def first_token(seconds: float | None) -> None:
            self.last_first_token_s = seconds

        return decode(batch, self._steps(forward), forward, observer, adapter_key, factors,
                      device=self._device,
                      eos_token_ids=self.eos_token_ids, prefix_cache=self.prefix_cache,
                      share_prefix=self.share_prefix, governor=self.threads,
                      on_first_token=first_token)

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
        return self.score_top(prompt_ids, completion_ids, sampling, adapter, 0)[0]

    def score_top(self, prompt_ids: list[int], completion_ids: list[int],
                  sampling: SamplingConfig, adapter: Any | None, top_n: int
                  ) -> tuple[list[float], list[TopLogprobs]]:
        """:meth:`score` and each position's ``top_n`` most likely tokens under the same
        transform (``contract.Backend.score_top``); ``top_n`` 0: empty lists."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if not completion_ids:
            return [], []
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
            scores = logprobs.gather(-1, target[:, None]).squeeze(-1).cpu().tolist()
            top = alternatives(logprobs, [top_n] * len(completion_ids))
            return scores, top if top is not None else [[] for _ in completion_ids]


def _decode_memory(config: Any, dtype: torch.dtype) -> tuple[int, int]:
    """(KV-cache bytes a token, working bytes a sequence) of decoding ``config``'s model with a
    cache of ``dtype``: keys and values of every layer (``2 L H_kv D`` elements a token);
    a sequence's float32 logits, its transformed logprobs, and the float64 cumulative sum the
    sampler draws from, with room for the temporaries between them (24 bytes a vocabulary
    entry), the peak of one decode step."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv = 2 * int(text.num_hidden_layers) * kv_heads * head_dim * itemsize
    return kv, 24 * int(text.vocab_size)
