"""A lean forward for llama-family decoders: the rollout node's fast path on an owned model.

Where the time goes in a decode step of a small model (SmolLM2-135M, batch 8, 2-core CPU):
almost all of it is the ~210 matrix products, and ``F.linear`` on a plain row-major weight
streams it at ~9 GB/s of a ~30 GB/s memory. This module runs the same maths as transformers'
``LlamaForCausalLM`` with changes that do not alter the function computed:

1. **Fused projections**: q/k/v is one product against the concatenated weight, gate/up another
   (4 products per layer instead of 7).
2. **Fused float32 kernels on CPU** (:mod:`.cpu_kernels`, compiled on first use): each
   projection is one pass over a weight packed for it, with the RMSNorm before it (its weight
   folded into the packed weight), the residual add after it, SwiGLU's ``silu(gate) * up``
   and the LoRA term done in the same pass: 27-33 GB/s against oneDNN's 13-25 here, and
   ~90 elementwise kernels a step fewer. Where they cannot be built, and in bfloat16, each
   weight is instead reordered once into oneDNN's blocked layout
   (``torch.ops.mkldnn._reorder_linear_weight``, the packing ``torch.compile``'s CPU freezing
   pass uses) and multiplied with ``torch.ops.mkldnn._linear_pointwise``: ~2.4x faster than
   ``F.linear`` in float32 at batch 8 here. Other devices and non-x86 CPUs keep plain weights.
3. **Unmerged LoRA at rank-r cost**: an adapter is held as low-rank factors per fused product,
   ``y = x W^T + (x A^T) (s B)^T`` with ``A`` the adapted modules' ``lora_A`` stacked and
   ``s B`` their scaled ``lora_B`` placed block-diagonally (Hu et al., LoRA, arXiv:2106.09685,
   eq. 3 -- the formula peft evaluates). Two small products per fused projection; loading or
   switching an adapter never touches the base weights, so a new adapter serves in the time it
   takes to read its factors.

4. **Fewer kernels per layer** (each small op costs ~20-30 us right after a product has
   streamed megabytes of weights through the caches, ~3x its cost alone): q/k rows reordered
   so rotary is one complex product, the attention scaling folded into the q weights (see
   :meth:`LeanLlama._qkv_layout`), residual adds done inside the o/down products' kernels,
   and on CPU a decode token's attention as two batched products instead of SDPA's flash
   kernel (~60 vs ~130 us a layer at a few hundred cached keys).

Numerics: float32 results match transformers' to float rounding (~1e-6 relative); bfloat16
follows its upcasts (RMSNorm and softmax in float32). Attention for one decode token packs the
``G`` query heads that share a key/value head as ``G`` query rows (no key/value repeat). The
KV cache holds keys in the reordered layout, so it is only read by this forward.

Supported: ``model_type`` llama / mistral / qwen2, SiLU MLP, no MLP bias,
``pretraining_tp == 1`` (:func:`~.llama_model.unsupported_reason` says why not otherwise). Rotary embeddings
come from the model's own ``rotary_emb`` module, so every rope scaling transformers implements
is used as is. Attention is over the whole context: a model with a sliding window (Mistral
7B v0.1) is served with its context capped at the window (:mod:`gridrl.engine.families`),
where the two are the same function.

What the forward reads from the transformers model (and how a node's own model hands over its
weights) is :mod:`.llama_model`'s; the kernel-backed projection :mod:`.kernel_projection`'s, the
other :mod:`.projection`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from gridrl.engine.backends.torch import cpu_kernels
from gridrl.engine.backends.torch.cache import SlabCache
from gridrl.engine.backends.torch.kernel_projection import KernelProjection
from gridrl.engine.backends.torch.llama_model import (
    own_the_rest,
    projections_of,
    release,
    text_config,
    unsupported_reason,
)
from gridrl.engine.backends.torch.memory import drop_mapped_pages, trim_heap
from gridrl.engine.backends.torch.projection import (
    Projection,
    RowLora,
    RowRanks,
)


def _decode_kernels(dtype: torch.dtype, device: torch.device) -> Any:
    """The fused C kernels (:mod:`.cpu_kernels`) when this forward can use them -- float32 or
    bfloat16 weights on CPU, and they built, verified and won the race for that dtype -- else
    None."""
    if dtype not in cpu_kernels.DTYPES.values() or device.type != "cpu":
        return None
    return cpu_kernels.load(dtype)


@dataclass
class _Layer:
    qkv: Projection | KernelProjection  # input RMSNorm, then q/k/v
    o: Projection | KernelProjection
    gate_up: Projection | KernelProjection  # post-attention RMSNorm, gate/up, SwiGLU
    down: Projection | KernelProjection


#: fused projection -> the transformers modules it stacks, in order (relative to a layer).
FUSED = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


@dataclass
class LoraFactors:
    """One adapter as low-rank factors of the fused projections.

    ``factors[(layer, name)] = (A, Bs_t)`` for each fused projection (see :data:`FUSED`) with
    at least one adapted module; ``name`` is ``"lm_head"`` with layer -1 for the output head.
    """

    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held by the factors."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.factors.values())


#: :attr:`LeanLlama._active` while :meth:`LeanLlama.activate_rows` serves rows of several adapters.
_MIXED: Any = LoraFactors()


class LeanLlama:
    """Inference-only forward over a transformers llama-family model's weights.

    Holds its own (fused, prepacked) copies of the projection weights; embeddings, norms and
    the rotary module are shared with the model. Not thread-safe; call under
    ``torch.inference_mode()``.

    Args:
        model: a transformers llama-family causal LM (:func:`unsupported_reason` is None).
        take_weights: the model is only read through this forward from now on (a node's own
            model): each projection weight (and bias) of the decoder layers, and an output
            head not tied to the embeddings, is replaced in the model by a ``meta`` tensor of
            the same shape once packed, so the process holds one copy of it -- the packed one
            (:mod:`.torch_memory`: pages of a memory-mapped checkpoint are handed back as
            soon as a weight is packed). Norms and biases are copied into memory of their
            own; the embedding table stays where it is (in a mapped checkpoint, resident
            only in the rows looked up). The model's own forward cannot run afterwards (its
            modules keep their shapes, for adapter checks).
    """

    def __init__(self, model: Any, take_weights: bool = False) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"lean llama forward: {reason}")
        cfg = text_config(model.config)
        inner = model.model
        head_weight = model.get_output_embeddings().weight
        tied = head_weight is inner.embed_tokens.weight
        if take_weights:
            taken = [m for layer in inner.layers for m in projections_of(layer)]
            if not tied:
                taken.append(model.get_output_embeddings())
            own_the_rest(model, taken, keep_mapped=inner.embed_tokens.weight)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.rotary = inner.rotary_emb
        self.dtype = self.embed.dtype
        self.kernels = _decode_kernels(self.dtype, self.embed.device)
        kernels = self.kernels
        # The kernels compute in float32 whatever the weights' dtype: activations, KV cache
        # and logits are float32 then (bfloat16 weights: half the bytes read a step).
        self.compute_dtype = torch.float32 if kernels is not None else self.dtype
        self.scaling = self.head_dim ** -0.5
        # The scaling goes into the q weights where that rounds nothing that matters (float32,
        # or a power of two); else attention applies it.
        fold = self.compute_dtype == torch.float32 or math.log2(self.scaling).is_integer()
        self._attn_scale = 1.0 if fold else self.scaling
        self._qkv_rows, self._qkv_scale = self._qkv_layout(self.scaling if fold else 1.0)

        def proj(weight: torch.Tensor, bias: torch.Tensor | None = None,
                 drop_source: bool = False, **kw: Any) -> Projection | KernelProjection:
            if kernels is not None:
                return KernelProjection(kernels, weight, bias, drop_source=drop_source,
                                        dtype=self.dtype, **kw)
            return Projection(weight, bias, **kw)

        self.layers: list[_Layer] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv_bias = None
            if attn.q_proj.bias is not None:
                qkv_bias = self._to_qkv_layout(
                    torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])[:, None])[:, 0]
            self.layers.append(_Layer(
                qkv=proj(self._to_qkv_layout(torch.cat(
                    [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])), qkv_bias,
                    norm=layer.input_layernorm.weight, eps=self.eps),
                o=proj(attn.o_proj.weight, attn.o_proj.bias),
                gate_up=proj(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                             norm=layer.post_attention_layernorm.weight, eps=self.eps,
                             swiglu=True),
                down=proj(mlp.down_proj.weight)))
            if take_weights:
                release(projections_of(layer))
                trim_heap()  # this layer's temporaries, before the next one's come
        # The head's source pages go back chunk by chunk as it is packed (the whole table
        # and its packed copy would otherwise be resident together at the peak of loading).
        self.head = proj(head_weight, norm=self.norm, eps=self.eps, drop_source=take_weights)
        if take_weights:
            if not tied:
                release([model.get_output_embeddings()])
            # Lookups read a few rows a step: the table can stay in the checkpoint's mapping,
            # paged in row by row (packing the head read all of it when tied).
            drop_mapped_pages([self.embed])
        del head_weight
        # Decode attention on CPU as two batched products: SDPA's flash kernel costs ~100 us
        # a call at one query row over <~1k cached keys, the products ~50 (measured, 2 cores).
        self._product_attention = self.embed.device.type == "cpu"
        self._active: LoraFactors | None = None
        self._row_ranks: list[RowRanks] = []  # activate_rows: each row's ranks

    @property
    def products(self) -> str:
        """How the projections run: "fused C kernel" (float32 CPU), else "oneDNN prepacked"
        or "plain" -- with why the kernels are not used where they could be."""
        kind = self.head.kind
        if kind == "kernel":
            return ("fused C kernel" if self.dtype == torch.float32 else
                    f"fused C kernel ({str(self.dtype)[6:]} weights, float32 arithmetic)")
        name = "oneDNN prepacked" if kind == "onednn" else "plain"
        if self.dtype in cpu_kernels.DTYPES.values() and self.embed.device.type == "cpu":
            return f"{name} (fused C kernels unavailable: {cpu_kernels.unavailable_reason()})"
        return name

    def _qkv_layout(self, q_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused q/k/v product's output layout: (rows, scale), both (out,).

        ``rows`` reorders each q and k head's ``D`` dims from rotate-half order (dim ``j``
        pairs with ``j + D/2`` in rotary) to interleaved pairs (``2j``, ``2j + 1``), so rotary
        is one complex product; ``scale`` (float32) is ``q_scale`` (the attention scaling
        ``D**-0.5``, or 1 when attention applies it) on the q rows and 1 elsewhere. Neither
        changes what attention computes: a q.k dot product is the same in any common order of
        the dims, and ``(s q).k = s (q.k)``. v keeps its order.
        """
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        pairs = torch.arange(d).view(2, d // 2).t().reshape(-1)  # 0, D/2, 1, D/2 + 1, ...
        heads = torch.arange(hq + hkv)[:, None] * d
        rows = torch.cat([(heads + pairs).reshape(-1),
                          torch.arange((hq + hkv) * d, (hq + 2 * hkv) * d)])
        scale = torch.ones(rows.numel(), dtype=torch.float32)
        scale[:hq * d] = q_scale
        return rows, scale

    def _to_qkv_layout(self, w: torch.Tensor) -> torch.Tensor:
        """Rows of ``w`` (out, ...) in the fused q/k/v product's layout (see _qkv_layout); in
        float32 for the kernels (they round their packed copy once), else in ``w``'s dtype."""
        rows = self._qkv_rows.to(w.device)
        scale = self._qkv_scale.to(w.device)
        out = w.detach().index_select(0, rows).float() * scale[:, None]
        return out if self.kernels is not None else out.to(w.dtype)

    # -- adapters ------------------------------------------------------------------------------

    def lora_factors(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> LoraFactors:
        """Build an adapter's factors from its per-module LoRA weights.

        Args:
            pairs: module path (``model.layers.3.self_attn.q_proj``, ``lm_head``) ->
                ``(A (r, in), B (out, r), scale)``; float tensors on any device.
        Returns:
            the fused factors, in the model's dtype and device.
        Raises:
            ValueError: a module this forward does not have a projection for (e.g. embeddings),
                or A/B shapes that do not fit it.
        """
        groups: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        for path, (a, b, scale) in pairs.items():
            layer, name, slot = self._locate(path)
            groups.setdefault((layer, name), {})[slot] = (a, b, scale)
        out = LoraFactors()
        dev = self.embed.device
        for (layer, name), slots in groups.items():
            proj = self.head if layer < 0 else getattr(self.layers[layer], name)
            sizes = self._slot_sizes(name, proj)
            for slot, (a, b, _) in slots.items():
                size = sizes[slot]
                if a.dim() != 2 or a.shape[1] != proj.in_features or tuple(b.shape) != (
                        size, a.shape[0]):
                    raise ValueError(f"LoRA of layer {layer} {name}[{slot}]: A {list(a.shape)} / "
                                     f"B {list(b.shape)} do not fit ({size} x "
                                     f"{proj.in_features})")
            # A (R, in): the slots' A stacked; Bs_t (R, out): row block i holds (s_i B_i)^T
            # under the output columns of slot i, zero elsewhere (a block diagonal; a slot
            # not adapted is zero columns). Filled in place: one copy of each weight.
            total_rank = sum(a.shape[0] for a, _, _ in slots.values())
            a_all = torch.empty((total_rank, proj.in_features), dtype=torch.float32, device=dev)
            bs_t = torch.zeros((total_rank, sum(sizes)), dtype=torch.float32, device=dev)
            row = col = 0
            for slot, size in enumerate(sizes):
                if slot in slots:
                    a, b, scale = slots[slot]
                    r = a.shape[0]
                    a_all[row:row + r].copy_(a)
                    torch.mul(b.t().to(dev, torch.float32), scale,
                              out=bs_t[row:row + r, col:col + size])
                    row += r
                col += size
            if name == "qkv":  # output columns in the fused product's layout (_qkv_layout)
                bs_t = bs_t.index_select(1, self._qkv_rows.to(dev)) * self._qkv_scale.to(dev)
            out.factors[(layer, name)] = proj.prepare_lora(a_all, bs_t)
        return out

    def _slot_sizes(self, name: str, proj: Projection) -> list[int]:
        if name == "qkv":
            kv = self.num_kv_heads * self.head_dim
            return [self.num_heads * self.head_dim, kv, kv]
        if name == "gate_up":
            return [proj.out_features // 2] * 2
        return [proj.out_features]

    def _locate(self, path: str) -> tuple[int, str, int]:
        """module path -> (layer index or -1, fused projection name, slot in it)."""
        if path == "lm_head" or path.endswith(".lm_head"):
            return -1, "lm_head", 0
        _, sep, rest = path.partition("layers.")
        index, _, module = rest.partition(".")
        if sep and index.isdigit() and int(index) < len(self.layers):
            for name, members in FUSED.items():
                if module in members:
                    return int(index), name, members.index(module)
        raise ValueError(f"LoRA on {path!r}: not a projection of this model's decoder layers "
                         "or its output head")

    def activate(self, adapter: LoraFactors | None) -> None:
        """Serve ``adapter`` (None: the base model). Pointer swaps only."""
        self._row_ranks = []
        if adapter is self._active:
            return
        for layer in self.layers:
            for name in FUSED:
                getattr(layer, name).lora = None
        self.head.lora = None
        if adapter is not None:
            for (layer, name), ab in adapter.factors.items():
                proj = self.head if layer < 0 else getattr(self.layers[layer], name)
                proj.lora = ab
        self._active = adapter

    def activate_rows(self, adapters: list[LoraFactors | None]) -> None:
        """Serve row ``m`` of the next forwards with ``adapters[m]`` (None: the base model),
        for decode steps of a batch whose rows belong to different adapters: for each fused
        projection, the factors of the adapters present are stacked along the rank once, and
        each row reads only its own ranks (:class:`RowRanks`: one base product for the batch,
        one small product over the stacked factors -- S-LoRA / Punica batching). Every row's
        result equals its result alone with its adapter up to float32 rounding (the foreign
        ranks add exact zeros). :meth:`keep_rows` follows the batch's rows as they finish;
        :meth:`activate` ends it.

        Args:
            adapters: one entry per row of the batch (the cache's row order).
        """
        self.activate(None)
        distinct: list[LoraFactors] = []
        for adapter in adapters:
            if adapter is not None and not any(adapter is d for d in distinct):
                distinct.append(adapter)
        if not distinct:
            return
        if len(distinct) == 1 and all(a is distinct[0] for a in adapters):
            self.activate(distinct[0])
            return
        shared: dict[tuple[tuple[int, int], ...], RowRanks] = {}
        keys = {key for adapter in distinct for key in adapter.factors}
        for key in keys:
            layer, name = key
            proj = self.head if layer < 0 else getattr(self.layers[layer], name)
            parts, spans, at = [], {}, 0
            for adapter in distinct:
                ab = adapter.factors.get(key)
                if ab is not None:
                    parts.append(ab)
                    spans[id(adapter)] = (at, at + ab[0].shape[0])
                    at += ab[0].shape[0]
            rows = tuple(spans.get(id(a), (0, 0)) if a is not None else (0, 0)
                         for a in adapters)
            ranks = shared.get(rows)
            if ranks is None:
                ranks = shared[rows] = RowRanks(
                    torch.tensor(rows, dtype=torch.int32, device=self.embed.device), at)
            a, b = proj.stack_lora(parts)
            proj.lora = RowLora(a, b, ranks)
        self._active = _MIXED
        self._row_ranks = list(shared.values())

    def keep_rows(self, rows: torch.Tensor) -> None:
        """After :meth:`activate_rows`: keep only ``rows`` (int64 indices of the live rows),
        in that order, as the batch's cache does."""
        for ranks in self._row_ranks:
            ranks.keep(rows)

    def release(self, adapter: LoraFactors) -> None:
        """Forget ``adapter`` (serving the base model first if it is active)."""
        if adapter is self._active:
            self.activate(None)
        adapter.factors.clear()

    # -- forward -------------------------------------------------------------------------------

    def _rotary(self, x: torch.Tensor, position_ids: torch.Tensor
                ) -> Callable[[torch.Tensor], torch.Tensor]:
        """Rotary embedding for ``position_ids`` (B, T) as a function of (B, T, H, D) heads in
        the interleaved-pair layout (see :meth:`_qkv_layout`). cos/sin come from the model's
        own rotary module (every rope scaling it implements), whose two halves are equal:
        pair (2j, 2j+1) turns by angle j. float32: one complex product; other dtypes: the
        same products as transformers' rotate-half, in that dtype."""
        cos, sin = self.rotary(x, position_ids)  # (B, T, D) each, halves equal
        half = self.head_dim // 2
        if x.dtype == torch.float32:
            turn = torch.complex(cos[..., :half], sin[..., :half])[:, :, None, :]

            def rotate(heads: torch.Tensor) -> torch.Tensor:
                pairs = torch.view_as_complex(heads.unflatten(-1, (half, 2)))
                return torch.view_as_real(pairs * turn).flatten(-2)
            return rotate
        cos = cos[..., :half].repeat_interleave(2, dim=-1)[:, :, None, :]
        sin = sin[..., :half].repeat_interleave(2, dim=-1)[:, :, None, :]

        def rotate_pairs(heads: torch.Tensor) -> torch.Tensor:
            pairs = heads.unflatten(-1, (half, 2))
            turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
            return heads * cos + turned * sin
        return rotate_pairs

    def _attention(self, qkv: torch.Tensor, rotate: Callable[[torch.Tensor], torch.Tensor],
                   cache: SlabCache | list[tuple[torch.Tensor, torch.Tensor]] | None, i: int,
                   attention_mask: torch.Tensor | None,
                   past: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """Layer ``i``'s attention in torch ops: qkv (B, T, Hq + 2 Hkv, D) -> (B T, Hq D);
        ``past``: a prefix's keys/values per layer (see :meth:`forward`)."""
        b, t, _, d = qkv.shape
        hq, hkv = self.num_heads, self.num_kv_heads
        qk = rotate(qkv[:, :, :hq + hkv])
        q, k, v = qk[:, :, :hq], qk[:, :, hq:], qkv[:, :, hq + hkv:]
        if isinstance(cache, SlabCache):
            keys, values = cache.layers[i].update(k.transpose(1, 2), v.transpose(1, 2))
            # t == 1: the G query heads of each kv head attend as G query rows.
            q = q.reshape(b, hkv, hq // hkv, d)
            if self._product_attention:
                scores = torch.matmul(q, keys.transpose(-1, -2))
                if self._attn_scale != 1.0:
                    scores.mul_(self._attn_scale)
                if attention_mask is not None:
                    scores.add_(attention_mask)
                attn = torch.matmul(scores.softmax(-1), values)
            else:
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=attention_mask,
                                                      scale=self._attn_scale)
        else:
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
            mask, causal = None, t > 1
            if past is not None:  # the T new tokens follow a prefix of P tokens
                past_keys, past_values = past[i]
                keys = torch.cat([past_keys.expand(b, -1, -1, -1), keys], dim=2)
                values = torch.cat([past_values.expand(b, -1, -1, -1), values], dim=2)
                p = past_keys.shape[2]
                # new token j sees the prefix and new tokens 0..j (causal, bottom-right)
                mask = (torch.arange(p + t, device=qkv.device)[None, :]
                        <= p + torch.arange(t, device=qkv.device)[:, None])
                causal = False
            if cache is not None:
                cache.append((keys.contiguous(), values.contiguous()))
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal,
                scale=self._attn_scale, enable_gqa=hq != hkv).transpose(1, 2)
        return attn.reshape(b * t, hq * d)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: SlabCache | list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                attention_mask: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None,
                past: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """Logits of ``input_ids`` given the cache.

        Args:
            input_ids: int64 (B, T).
            position_ids: int64 (B, T), each token's rotary position.
            cache: a :class:`SlabCache` to attend to and append to (decode, ``T == 1``); a list
                to fill with each layer's (keys, values) of shape (B, H_kv, T, D) (prefill:
                causal attention within the T tokens); None for causal attention without
                keeping keys/values (teacher-forced scoring).
            attention_mask: with a SlabCache: additive (B, 1, 1, L) over the cache columns
                including the new token (:meth:`SlabCache.next_step`); else ignored.
            logits_at: int64 (K,) indices into T: only those positions get logits
                (default: all); or (B, K): per row (rows of different lengths).
            past: with a list or None as ``cache`` (prefill): per layer the (keys, values)
                (1, H_kv, P, D) of a prefix of P tokens these T tokens follow (what a list
                ``cache`` filled by a prefill of that prefix holds; ``position_ids`` then start
                at P). Each new token attends to the prefix and causally within the T; a list
                ``cache`` receives the prefix's keys/values followed by the new ones, as a
                prefill of the whole sequence would (equal up to float rounding).
        Returns:
            logits (B, K or T, V) in :attr:`compute_dtype`.
        """
        b, t = input_ids.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(input_ids, self.embed).view(b * t, -1).to(self.compute_dtype)
        # Decode on CPU in float32 with the fused kernels: rotary, cache write and attention
        # are one kernel call per layer.
        fused = self.kernels is not None and isinstance(cache, SlabCache) and t == 1
        if fused:
            cos, sin = self.rotary(x, position_ids)  # (B, 1, D), halves equal
            cos, sin = (c[:, 0, :d // 2].contiguous() for c in (cos, sin))
        else:
            rotate = self._rotary(x, position_ids)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            if fused:
                slab = cache.layers[i]  # type: ignore[union-attr]
                attn = self.kernels.attention(qkv, hq, hkv, cos, sin, slab.kbuf, slab.vbuf,
                                              slab.claim(), attention_mask, self._attn_scale)
            else:
                attn = self._attention(qkv.view(b, t, hq + 2 * hkv, d), rotate, cache, i,
                                       attention_mask, past)
            x = layer.o(attn, residual=x)
            x = layer.down(layer.gate_up(x), residual=x)
        x = x.view(b, t, -1)
        if logits_at is not None and logits_at.dim() == 2:
            x = x.gather(1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        elif logits_at is not None:
            x = x.index_select(1, logits_at)
        k_out = x.shape[1]
        return self.head(x.reshape(b * k_out, -1)).view(b, k_out, -1)
