"""The torch backend's policy: a base causal LM with a trainable peft LoRA adapter, and the
forward passes the trainer needs (completion logprobs of a padded batch, reference logprobs
with the adapter disabled). Also serializes the adapter to peft files in memory for pushes and
checkpoints.

Base weights load in float32 on CPU and bfloat16 on CUDA; LoRA weights stay float32 (peft's
``autocast_adapter_dtype``). Only LoRA parameters require grad.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gridrl.adapters.tensors import FLOAT_CODES, Tensor, dump
from gridrl.common.errors import invalid_argument
from gridrl.engine.backends.torch.device import DeviceError, pick_device
from gridrl.models import ModelIdentity, model_identity, resolve_model
from gridrl.trainer.backends.base import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSettings


def peft_lora_config(lora: LoraSettings) -> Any:
    """The ``peft.LoraConfig`` of ``lora`` (causal LM, no bias)."""
    from peft import LoraConfig, TaskType

    targets: str | list[str] = lora.target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=targets, use_rslora=lora.rslora, bias="none",
                      task_type=TaskType.CAUSAL_LM)


def torch_device(device: str = "auto") -> torch.device:
    """The trainer's torch device of ``--device``: the engine's
    (:func:`gridrl.engine.backends.torch.device.pick_device`; ``"auto"``: ``cuda:$LOCAL_RANK``
    when CUDA is available, else the CPU).

    Raises:
        StatusError: INVALID_ARGUMENT ``--device`` for a device torch does not know or this
            build cannot use.
    """
    try:
        return pick_device(device, mps=False)
    except DeviceError as e:
        raise invalid_argument("--device", f"{e.device!r}: {e.problem}") from e


class Policy:
    """A causal LM wrapped by peft with one trainable LoRA adapter named ``default``.

    Attributes:
        model: the ``peft.PeftModel``.
        tokenizer: the model directory's tokenizer (a pad id is guaranteed).
        identity: the base model's identity.
        device, dtype: where and in what the base weights live.
        model_id: the ``--model`` string (for manifests and logs).
        head_weight: (V, H) the frozen output projection when the model's logits are exactly
            ``final_hidden @ head_weight.T`` (:func:`plain_head_weight`), else None; with it
            the update computes logprobs from hidden states
            (:func:`gridrl.trainer.backends.torch.losses.head_logprobs`) instead of full logits.
    """

    def __init__(self, model: Any, tokenizer: Any, identity: ModelIdentity, model_id: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.identity = identity
        self.model_id = model_id
        p = next(model.parameters())
        self.device = p.device
        self.dtype = next(iter(model.get_base_model().parameters())).dtype
        self.pad_id = pad_token_id(tokenizer)
        forward = inspect.signature(model.get_base_model().forward).parameters
        self._cache_kw = "cache" if "cache" in forward else "past_key_values"
        self.head_weight = plain_head_weight(model.get_base_model())
        self.checkpointing = False  # within :meth:`activation_checkpointing`
        self._state_params: dict[str, torch.nn.Parameter] | None = None
        self._cast_weights: dict[torch.dtype, list[tuple[torch.nn.Parameter, torch.Tensor]]] = {}
        self._cast_heads: dict[torch.dtype, torch.Tensor] = {}
        #: Inside :meth:`frozen_weights_as`: the plain head as a copy of that dtype, for the
        #: update's head products (:func:`~gridrl.trainer.backends.torch.losses.head_logprobs`);
        #: None outside it.
        self.update_head: torch.Tensor | None = None

    @contextlib.contextmanager
    def frozen_weights_as(self, dtype: torch.dtype) -> Iterator[None]:
        """Within the block, the frozen weights of the model's ``nn.Linear`` layers are
        ``dtype`` copies (made on first use, then kept: +2 bytes a weight for bfloat16).

        For an update under autocast: autocast casts a frozen weight anew at every product
        (its cast cache keeps only leaves that require grad), ~a quarter of a bfloat16 update
        on a CPU. The copies round as autocast's own cast does, so products and gradients are
        bit-identical. Left alone: embedding weights (a tied output head too), which autocast
        does not cast. The plain output head (:attr:`head_weight`) stays as it is too (it
        may be the embedding table), and :attr:`update_head` holds a ``dtype`` copy of it
        (made once) for the head's products, which autocast would otherwise cast anew for
        each chunk of rows, forward and gradient (a 49k x 576 head: 113 MB read and 57 MB
        written a chunk). The float32 weights are back when the block ends, on error too;
        nothing may change the weights inside it.
        """
        if dtype not in self._cast_weights:
            kept = {m.weight.data_ptr() for m in self.model.modules()
                    if isinstance(m, torch.nn.Embedding)}
            if self.head_weight is not None:  # read outside autocast in head_logprobs' backward
                kept.add(self.head_weight.data_ptr())
            self._cast_weights[dtype] = [
                (m.weight, m.weight.detach().to(dtype)) for m in self.model.modules()
                if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
                and m.weight.dtype != dtype and m.weight.data_ptr() not in kept]
        if self.head_weight is not None and dtype not in self._cast_heads:
            self._cast_heads[dtype] = self.head_weight.detach().to(dtype)
        swapped = [(param, param.data) for param, _ in self._cast_weights[dtype]]
        try:
            for param, cast in self._cast_weights[dtype]:
                param.data = cast
            self.update_head = self._cast_heads.get(dtype)
            yield
        finally:
            self.update_head = None
            for param, original in swapped:
                param.data = original

    @contextlib.contextmanager
    def activation_checkpointing(self, enabled: bool = True) -> Iterator[None]:
        """Within the block (when ``enabled``), the decoder layers keep only their inputs for
        the backward and recompute the rest there (transformers' gradient checkpointing,
        non-reentrant): activations of about one layer instead of every layer, for a second
        forward. A checkpointed layer drops a KV cache passed to it, so a checkpointed forward
        must not use the shared-prefix path."""
        if not enabled:
            yield
            return
        base = self.model.get_base_model()
        # transformers 5 renamed gradient_* to activation_checkpointing_* (old names warn)
        prefix = ("activation_checkpointing" if hasattr(base, "activation_checkpointing_enable")
                  else "gradient_checkpointing")
        with warnings.catch_warnings():  # peft reads the deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            getattr(base, f"{prefix}_enable")(**{f"{prefix.split('_')[0]}_checkpointing_kwargs":
                                                  {"use_reentrant": False}})
        self.checkpointing = True
        try:
            yield
        finally:
            self.checkpointing = False
            getattr(base, f"{prefix}_disable")()
            if hasattr(base, "disable_input_require_grads"):  # the enable's embedding hook
                base.disable_input_require_grads()

    # ---------------------------------------------------------------- parameters and files

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The LoRA parameters (float32), in a stable order."""
        return [p for _, p in sorted(self.model.named_parameters()) if p.requires_grad]

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The LoRA state dict with peft's on-disk key names (``...lora_A.weight``), on CPU
        (views of the parameters when they live on the CPU, copies otherwise)."""
        if self._state_params is None:
            self._state_params = self._map_state_to_parameters()
        if self._state_params:
            return {k: p.detach().to("cpu").contiguous() for k, p in self._state_params.items()}
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model, save_embedding_layers=False)
        return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}

    def _map_state_to_parameters(self) -> dict[str, torch.nn.Parameter]:
        """peft's state-dict key -> the Parameter it reads, so each sync skips peft's walk over
        the whole model's state dict (~20 ms for SmolLM2-135M). Parameters are updated in place
        by the optimizer and by :meth:`load_adapter_files`, so the mapping stays valid; {} when
        some entry is not a parameter (then peft is asked every time)."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model, save_embedding_layers=False)
        by_storage = {(p.data_ptr(), tuple(p.shape)): p for p in self.model.parameters()}
        mapping = {k: by_storage.get((v.data_ptr(), tuple(v.shape))) for k, v in state.items()}
        if any(p is None for p in mapping.values()):
            return {}
        return mapping  # type: ignore[return-value]

    def adapter_config_json(self) -> bytes:
        """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it (sets as lists,
        ``inference_mode`` true, ``base_model_name_or_path`` the model id)."""
        cfg = self.model.peft_config["default"].to_dict()
        for key, value in list(cfg.items()):
            if isinstance(value, set):
                cfg[key] = sorted(value)
        cfg["inference_mode"] = True
        cfg["base_model_name_or_path"] = self.model_id
        return json.dumps(cfg, indent=2, sort_keys=True, default=str).encode()

    def adapter_files(self) -> dict[str, bytes]:
        """The adapter as peft files in memory: ``{"adapter_config.json": ...,
        "adapter_model.safetensors": ...}`` (no disk round trip).

        The weights file is byte for byte what ``safetensors.torch.save(adapter_state(),
        metadata={"format": "pt"})`` (hence peft's ``save_pretrained``) writes, built by
        :func:`gridrl.adapters.tensors.dump` from views of the parameters: one copy of the
        bytes instead of the library's three (~4 ms instead of ~17 ms for 19.6 MB), which is
        on the path of every adapter push.
        """
        state = {k: stored_tensor(v) for k, v in self.adapter_state().items()}
        return {ADAPTER_CONFIG: self.adapter_config_json(),
                ADAPTER_WEIGHTS: dump(state, {"format": "pt"})}

    def load_adapter_files(self, files: Mapping[str, bytes]) -> None:
        """Set the LoRA weights from peft files (as :meth:`adapter_files` returns).

        Raises:
            ValueError: a key is missing or unexpected (a different adapter layout).
        """
        from peft import set_peft_model_state_dict
        from safetensors.torch import load

        state = load(files[ADAPTER_WEIGHTS])
        result = set_peft_model_state_dict(self.model, state)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        missing = [k for k in getattr(result, "missing_keys", []) or [] if "lora_" in k]
        if unexpected or missing:
            raise ValueError(f"adapter does not fit the policy: unexpected {unexpected[:3]}, "
                             f"missing {missing[:3]}")

    def save_adapter(self, directory: Path) -> dict[str, bytes]:
        """Write the peft files into ``directory`` (created); returns them."""
        directory.mkdir(parents=True, exist_ok=True)
        files = self.adapter_files()
        for name, data in files.items():
            (directory / name).write_bytes(data)
        return files

    # ---------------------------------------------------------------- forward passes

    def completion_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          completion_width: int) -> torch.Tensor:
        """Logits predicting the completion columns of a prompt-left-padded batch.

        Args:
            input_ids: (N, P + C) int64, prompts left-padded to width P, completions after
                them, right-padded to width C.
            attention_mask: (N, P + C) 1 on real tokens.
            completion_width: C.
        Returns:
            (N, C, V) logits in the model's dtype; ``[:, t]`` predicts completion token ``t``.
            Positions are ``cumsum(attention_mask) - 1`` so padding does not shift them.
        """
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, logits_to_keep=completion_width + 1,
                         use_cache=False)
        return out.logits[:, :-1]

    def completion_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          completion_width: int) -> torch.Tensor:
        """:meth:`completion_logits` before the output projection: (N, C, H) final hidden
        states (after the model's last norm) whose ``[:, t]`` predicts completion token ``t``.
        Calls the decoder of :attr:`model` directly (the LoRA layers are in it); under DDP the
        update calls it through :class:`gridrl.trainer.backends.torch.distributed.PolicyPasses`."""
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model.get_base_model().get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=False)
        return out.last_hidden_state[:, -(completion_width + 1):-1]

    @property
    def packs(self) -> bool:
        """True when the model takes a packed forward
        (:mod:`gridrl.trainer.backends.torch.packed`): a decoder of
        :data:`PLAIN_HEAD_MODEL_TYPES` (their masks pass a 4-D mask through as it is) with
        ``sdpa`` or ``eager`` attention (the two whose mask this module builds)."""
        config = self.model.get_base_model().config
        return (getattr(config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES
                and getattr(config, "_attn_implementation", None) in ("sdpa", "eager"))

    def _packed_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """``allowed`` (R, 1, W, W) bool as the attention implementation takes it: as it is for
        sdpa (True attends), an additive float mask (0 or the dtype's minimum) for eager."""
        config = self.model.get_base_model().config
        if config._attn_implementation == "sdpa":
            return allowed
        floor = torch.finfo(torch.float32).min
        return torch.zeros(allowed.shape, dtype=torch.float32,
                           device=allowed.device).masked_fill_(~allowed, floor)

    @property
    def attends_per_segment(self) -> bool:
        """True when a packed forward attends per segment
        (:class:`gridrl.trainer.backends.torch.packed.SegmentAttention`: no row-wide scores):
        :attr:`packs` with ``sdpa`` attention (the kernel the units run on)."""
        config = self.model.get_base_model().config
        return self.packs and config._attn_implementation == "sdpa"

    def packed_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      allowed: torch.Tensor | None, segments: Any = None) -> torch.Tensor:
        """Logits of a packed batch (:class:`gridrl.trainer.backends.torch.packed.PackedBatch`:
        ``input_ids`` and ``position_ids`` (R, W) int64, ``allowed`` (R, 1, W, W) bool or
        ``segments`` its :class:`~gridrl.trainer.backends.torch.packed.SegmentAttention`,
        which is used when given): (R, W, V) in the model's dtype, ``[r, q]`` predicting the
        token after ``q`` in its sequence."""
        with self._packed_attention(input_ids, allowed, segments) as kwargs:
            out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                             **kwargs)
        return out.logits

    def packed_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      allowed: torch.Tensor | None, segments: Any = None) -> torch.Tensor:
        """:meth:`packed_logits` before the output projection: (R, W, H) final hidden states,
        through the decoder of :attr:`model`."""
        with self._packed_attention(input_ids, allowed, segments) as kwargs:
            out = self.model.get_base_model().get_decoder()(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        return out.last_hidden_state

    @contextlib.contextmanager
    def _packed_attention(self, input_ids: torch.Tensor, allowed: torch.Tensor | None,
                          segments: Any) -> Iterator[dict[str, Any]]:
        """The forward's attention keywords for a packed batch: the dense mask, or (with
        ``segments``) :func:`~gridrl.trainer.backends.torch.packed.segment_attention` as the
        model's attention implementation for the block (restored after, on error too) with
        the units passed along and a placeholder 4-D mask (transformers passes a 4-D mask
        through as it is; the units carry the real one).

        Raises:
            ValueError: ``segments`` under activation checkpointing (its recomputation would
                run after the implementation is restored: use the dense mask there).
        """
        if segments is None:
            if allowed is None:
                raise ValueError("a packed forward needs its dense mask or its segments")
            yield {"attention_mask": self._packed_mask(allowed)}
            return
        from gridrl.trainer.backends.torch.packed import register_segment_attention

        if self.checkpointing:
            raise ValueError("attention per segment cannot run under activation "
                             "checkpointing: pass the dense mask")
        config = self.model.get_base_model().config
        name = register_segment_attention()
        previous = config._attn_implementation
        config._attn_implementation = name
        try:
            yield {"attention_mask": torch.ones((input_ids.shape[0], 1, 1, 1), dtype=torch.bool,
                                                device=input_ids.device),
                   "gridrl_segments": segments}
        finally:
            config._attn_implementation = previous

    def shared_prefix_logits(self, prompts: Sequence[Sequence[int]],
                             completion_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`completion_logits` computed once per distinct prompt instead of per sequence.

        The G completions of a GRPO group share their prompt, so the prompt is run once (batch 1,
        with gradient) and its KV cache is repeated G times for the completions' forward; the
        gradient flows into the prompt's activations through the cache. Same logits and
        gradient as the padded path up to float rounding, for ``P + G * C`` tokens of compute
        instead of ``G * (P + C)`` (about 4x less for reverse-words: P ~ 95, C ~ 15, G = 8).

        Args:
            prompts: n prompts (token ids); equal prompts are grouped.
            completion_ids: (n, C) int64, completions right-padded (padding is never attended
                to by a real token: it comes after them).
        Returns:
            (n, C, V) logits in the model's dtype; ``[:, t]`` predicts completion token ``t``.
        """
        return self._shared_prefix(prompts, completion_ids, self.model, hidden=False)

    def shared_prefix_hidden(self, prompts: Sequence[Sequence[int]],
                             completion_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`shared_prefix_logits` before the output projection: (n, C, H) final hidden
        states, through the decoder of :attr:`model` (under DDP the update calls it through
        :class:`gridrl.trainer.backends.torch.distributed.PolicyPasses`)."""
        return self._shared_prefix(prompts, completion_ids,
                                   self.model.get_base_model().get_decoder(), hidden=True)

    def _shared_prefix(self, prompts: Sequence[Sequence[int]], completion_ids: torch.Tensor,
                       run: Any, *, hidden: bool) -> torch.Tensor:
        n, width = completion_ids.shape
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(tuple(p), []).append(i)

        def result(out: Any) -> torch.Tensor:
            return out.last_hidden_state if hidden else out.logits

        parts: list[torch.Tensor] = []
        order: list[int] = []
        for prompt, rows in groups.items():
            ids = torch.tensor([prompt], dtype=torch.long, device=completion_ids.device)
            out = run(input_ids=ids, use_cache=True, **({} if hidden else {"logits_to_keep": 1}))
            first = result(out)[:, -1:].expand(len(rows), -1, -1)
            if width > 1:
                cache = getattr(out, self._cache_kw)  # "cache" (transformers 5) or the old name
                cache.batch_repeat_interleave(len(rows))
                rest = result(run(input_ids=completion_ids[rows, :width - 1],
                                  **{self._cache_kw: cache}, use_cache=True))
                parts.append(torch.cat([first, rest], dim=1))
            else:
                parts.append(first)
            order.extend(rows)
        out_all = torch.cat(parts, dim=0)
        if order == list(range(n)):
            return out_all
        inverse = torch.empty(n, dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(n)
        return out_all[inverse.to(out_all.device)]

    @torch.no_grad()
    def reference_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         completion_width: int) -> torch.Tensor:
        """:meth:`completion_logits` of the reference policy: the base model with the adapter
        disabled (no gradient)."""
        with self.model.disable_adapter():
            return self.completion_logits(input_ids, attention_mask, completion_width)


#: model types whose causal-LM forward is exactly ``lm_head(final_hidden)`` (no logit
#: soft-capping or scaling; gemma2 soft-caps, so it is not here), checked against
#: transformers 5's modeling code.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3"})


def plain_head_weight(base: Any) -> torch.Tensor | None:
    """The output projection's (V, H) weight of ``base`` (a transformers causal LM) when its
    logits are ``final_hidden @ weight.T`` and the weight is frozen: a model type in
    :data:`PLAIN_HEAD_MODEL_TYPES`, a bias-free ``nn.Linear`` head not wrapped by peft (LoRA
    or ``modules_to_save`` on the head make it something else). None otherwise."""
    if getattr(base.config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    return None if head.weight.requires_grad else head.weight


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its eos id, else 0 (padding is always masked)."""
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return v
        if isinstance(v, list | tuple) and v:
            return int(v[0])
    return 0


def load_policy(model: str, *, lora: LoraSettings, device: str = "auto", dtype: str = "auto",
                seed: int = 0) -> Policy:
    """Load ``--model`` (alias, directory or hub id) and wrap it with a fresh LoRA adapter.

    The LoRA init (A random, B zero, so the policy starts equal to the base model) is seeded
    with ``seed``.

    Args:
        model: model id/alias/path, resolved with :func:`gridrl.models.resolve_model`.
        lora: LoRA settings.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        dtype: ``"auto"`` (float32 on CPU, bfloat16 on CUDA), ``"float32"``, ``"bfloat16"``.
    Raises:
        StatusError: INVALID_ARGUMENT on ``--lora-target-modules`` when no module matches.
    """
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer


    path = resolve_model(model)
    dev = torch_device(device)
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(dev)
    base.config.use_cache = False
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated
            # is_gradient_checkpointing while wrapping: a FutureWarning on every start that is
            # not the user's to act on.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            peft_model = get_peft_model(base, peft_lora_config(lora))
    except ValueError as e:
        raise invalid_argument("--lora-target-modules", str(e)) from e
    identity = model_identity(path, model_id=model) if Path(str(path)).is_dir() else None
    if identity is None:
        cfg = base.config
        identity = ModelIdentity(model_id=model, architecture=cfg.model_type,
                                 hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
                                 vocab_size=cfg.vocab_size,
                                 max_context=getattr(cfg, "max_position_embeddings", 2048))
    return Policy(peft_model, tokenizer, identity, model)


def stored_tensor(t: torch.Tensor):
    """A CPU tensor as a :class:`gridrl.adapters.tensors.Tensor` whose ``data`` is a view of
    its bytes (no copy; valid while ``t`` is unchanged).

    Args:
        t: contiguous CPU tensor of float32/float16/bfloat16/float64, any shape.
    Raises:
        ValueError: another dtype, a non-contiguous or non-CPU tensor, or a big-endian host.
    """
    if sys.byteorder != "little":
        raise ValueError("safetensors data is little-endian; this host is big-endian")
    code = FLOAT_CODES.get(str(t.dtype).removeprefix("torch."))
    if code is None:
        raise ValueError(f"cannot store a {t.dtype} tensor (expected one of "
                         f"{sorted(FLOAT_CODES)})")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("expected a contiguous CPU tensor")
    data = memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())
    return Tensor(code, tuple(t.shape), data)
