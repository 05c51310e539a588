"""A preallocated, left-padded batch KV cache for transformers decoder models.

``DynamicCache`` concatenates every step (O(length) copies per token per layer). Here each
layer holds one buffer written in place, and the model sees views of the filled prefix. The
buffer starts at the prompt plus :data:`FIRST_BLOCK` tokens and doubles when full, up to the
batch's final length (longest prompt + largest ``max_tokens``), so a batch that may decode
thousands of tokens but stops early never holds memory for all of them.

Rows are left-padded: row ``r``'s prompt occupies the last ``P_r`` columns before
``prompt_len`` (the longest prompt), and the padding columns are masked out by
:meth:`SlabCache.next_step`. Finished rows are dropped with :meth:`SlabCache.keep_rows`.

Only full-attention decoders are supported (no sliding-window or linear-attention layers);
:func:`supports` checks a config.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

FIRST_BLOCK = 128  # decode columns allocated at first


def supports(config: Any) -> bool:
    """True when every layer of ``config`` (a transformers config) is full attention."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return all(t == "full_attention" for t in layer_types)
    return not (getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True))


class _SlabLayer(DynamicLayer):
    """One layer's keys and values in a preallocated (B, H, T, D) buffer; ``keys`` /
    ``values`` are views of the first ``length`` columns (what ``DynamicLayer`` reads)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.kbuf, self.vbuf = keys, values
        self.length = length
        self.device = keys.device
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self.kbuf[:, :, :self.length]
        self.values = self.vbuf[:, :, :self.length]

    def reserve(self, columns: int) -> None:
        """Make the buffers at least ``columns`` wide (the filled prefix is kept)."""
        if columns <= self.kbuf.shape[2]:
            return
        for name in ("kbuf", "vbuf"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], old.shape[1], columns, old.shape[3]))
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)
        self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.claim(key_states.shape[-2])
        self.kbuf[:, :, start:self.length] = key_states
        self.vbuf[:, :, start:self.length] = value_states
        return self.keys, self.values

    def claim(self, columns: int = 1) -> int:
        """The next ``columns`` columns, counted as written from now on; returns the first.
        :meth:`update` fills them from tensors; the fused CPU attention kernel writes its
        column into ``kbuf`` / ``vbuf`` itself."""
        start, end = self.length, self.length + columns
        if end > self.kbuf.shape[2]:
            raise RuntimeError(f"decode cache overflow: {end} > {self.kbuf.shape[2]} columns "
                               "(SlabCache.next_step makes room before each step)")
        self.length = end
        self._views()
        return start

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.kbuf = self.kbuf.index_select(0, indices)
        self.vbuf = self.vbuf.index_select(0, indices)
        self._views()


class SlabCache(Cache):
    """The batch's KV cache: one :class:`_SlabLayer` per decoder layer.

    Build with :meth:`from_prefills`. ``prompt_len`` is the padded prompt length; column ``j``
    of row ``r`` is padding when ``j < prompt_len - P_r``.
    """

    def __init__(self, layers: list[_SlabLayer], pad: torch.Tensor, prompt_len: int,
                 total: int, mask_dtype: torch.dtype) -> None:
        super().__init__(layers=layers)
        self.pad = pad  # int64 (B,), left padding of each row
        self.prompt_len = prompt_len
        self.total = total  # the most columns the batch can need
        self._mask_dtype = mask_dtype
        self._mask: torch.Tensor | None = None

    @classmethod
    def from_prefills(cls, prefills: list[list[tuple[torch.Tensor, torch.Tensor]]],
                      lengths: list[int], row_prefill: list[int], max_new: int,
                      mask_dtype: torch.dtype) -> SlabCache:
        """Assemble the batch cache from per-prompt prefills.

        Args:
            prefills: for each distinct prompt, per layer ``(keys, values)`` of shape
                (1, H, P, D) from a batch-1 forward over the whole prompt.
            lengths: P of each distinct prompt.
            row_prefill: for each batch row, the index of its prompt in ``prefills``.
            max_new: columns to reserve after the longest prompt (tokens to decode).
            mask_dtype: dtype of the additive attention mask (the model's compute dtype).
        """
        prompt_len = max(lengths)
        rows = len(row_prefill)
        total = prompt_len + max_new
        width = min(total, prompt_len + FIRST_BLOCK)
        device = prefills[0][0][0].device
        index = torch.tensor(row_prefill, dtype=torch.int64, device=device)
        pad = torch.tensor([prompt_len - lengths[i] for i in row_prefill], dtype=torch.int64,
                           device=device)
        layers = []
        for layer in range(len(prefills[0])):
            k0, v0 = prefills[0][layer]
            kbuf = k0.new_zeros((rows, k0.shape[1], width, k0.shape[3]))
            vbuf = v0.new_zeros((rows, v0.shape[1], width, v0.shape[3]))
            if len(prefills) == 1:
                kbuf[:, :, :prompt_len] = k0
                vbuf[:, :, :prompt_len] = v0
            else:
                # Distinct prompts: stack them left-padded, then gather one row per sequence.
                kp = k0.new_zeros((len(prefills), k0.shape[1], prompt_len, k0.shape[3]))
                vp = v0.new_zeros((len(prefills), v0.shape[1], prompt_len, v0.shape[3]))
                for j, kv in enumerate(prefills):
                    p = lengths[j]
                    kp[j, :, prompt_len - p:] = kv[layer][0][0]
                    vp[j, :, prompt_len - p:] = kv[layer][1][0]
                kbuf[:, :, :prompt_len] = kp.index_select(0, index)
                vbuf[:, :, :prompt_len] = vp.index_select(0, index)
            layers.append(_SlabLayer(kbuf, vbuf, prompt_len))
        return cls(layers, pad, prompt_len, total, mask_dtype)

    def next_step(self, always: bool = False) -> torch.Tensor | None:
        """Make room for one more token in every layer (doubling the buffers when full, up to
        the batch's total) and return the attention mask for that step: additive, 4-D
        (B, 1, 1, length + 1), 0 where a row may attend and the dtype's minimum on its
        padding; None when no row is padded, unless ``always``.

        (On CPU a mask is worth giving even without padding: with one, transformers' SDPA
        path packs the query heads of each key/value head together instead of using
        ``enable_gqa``, as fast in float32 and about 4x faster in bfloat16.)
        """
        layer = self.layers[0]
        if layer.length + 1 > layer.kbuf.shape[2]:
            width = min(self.total, max(layer.length + 1, 2 * layer.kbuf.shape[2]))
            for each in self.layers:
                each.reserve(width)
            self._mask = None
        if not always and not bool(self.pad.any()):
            return None
        if self._mask is None:
            total = layer.kbuf.shape[2]
            cols = torch.arange(total, device=self.pad.device)[None, :]
            blocked = cols < self.pad[:, None]
            self._mask = torch.zeros(blocked.shape, dtype=self._mask_dtype,
                                     device=self.pad.device).masked_fill_(
                blocked, torch.finfo(self._mask_dtype).min)[:, None, None, :]
        return self._mask[..., :layer.length + 1]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (int64 indices into the current batch), in that order."""
        for layer in self.layers:
            layer.batch_select_indices(rows)
        self.pad = self.pad.index_select(0, rows)
        if self._mask is not None:
            self._mask = self._mask.index_select(0, rows)
