"""A preallocated, left-padded batch KV cache for the lean forward
(:class:`~gridrl.engine.backends.torch.llama.LeanLlama`; other forwards use transformers'
``DynamicCache``).

A growing cache concatenates every step (O(length) copies per token per layer). Here each
layer holds one buffer written in place, and the forward reads views of the filled prefix. The
buffer starts at the prompt plus :data:`FIRST_BLOCK` tokens and doubles when full, up to the
batch's final length (longest prompt + largest ``max_tokens``), so a batch that may decode
thousands of tokens but stops early never holds memory for all of them.

Rows are left-padded: row ``r``'s prompt occupies the last ``P_r`` columns before
``prompt_len`` (the longest prompt), and the padding columns are masked out by
:meth:`SlabCache.next_step`. Finished rows are dropped with :meth:`SlabCache.keep_rows`.

Attention is over every cached column (no sliding window: a model with one is served with its
context capped at the window, :mod:`gridrl.engine.families`).
"""

from __future__ import annotations

import torch

FIRST_BLOCK = 128  # decode columns allocated at first


def left_padded(tensors: list[torch.Tensor], lengths: list[int], index: torch.Tensor
                ) -> torch.Tensor:
    """One layer's keys (or values) of a batch, from its distinct prompts' prefills.

    Args:
        tensors: per distinct prompt ``j``, shape (1, H, P_j, D).
        lengths: ``P_j`` of each.
        index: int64 (B,), the prompt of each batch row.
    Returns:
        (B, H, P, D) with ``P = max(lengths)``, row ``r``'s prompt in its last ``P_j``
        columns and zeros before (a view that repeats one prompt when there is only one).
    """
    first = tensors[0]
    if len(tensors) == 1:
        return first.expand(len(index), -1, -1, -1)
    width = max(lengths)
    out = first.new_zeros((len(tensors), first.shape[1], width, first.shape[3]))
    for j, t in enumerate(tensors):
        out[j, :, width - lengths[j]:] = t[0]
    return out.index_select(0, index)


class _SlabLayer:
    """One layer's keys and values in a preallocated (B, H, T, D) buffer; ``keys`` /
    ``values`` are views of the first ``length`` columns."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self.kbuf, self.vbuf = keys, values
        self.length = length
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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H, T, D) keys and values; returns every filled column's."""
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

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.kbuf = self.kbuf.index_select(0, indices)
        self.vbuf = self.vbuf.index_select(0, indices)
        self._views()


class SlabCache:
    """The batch's KV cache: one :class:`_SlabLayer` per decoder layer.

    Build with :meth:`from_prefills`. ``prompt_len`` is the padded prompt length; column ``j``
    of row ``r`` is padding when ``j < prompt_len - P_r``.
    """

    def __init__(self, layers: list[_SlabLayer], pad: torch.Tensor, prompt_len: int,
                 total: int, mask_dtype: torch.dtype) -> None:
        self.layers = layers
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
            kbuf[:, :, :prompt_len] = left_padded([p[layer][0] for p in prefills], lengths, index)
            vbuf[:, :, :prompt_len] = left_padded([p[layer][1] for p in prefills], lengths, index)
            layers.append(_SlabLayer(kbuf, vbuf, prompt_len))
        return cls(layers, pad, prompt_len, total, mask_dtype)

    def next_step(self, always: bool = False) -> torch.Tensor | None:
        """Make room for one more token in every layer (doubling the buffers when full, up to
        the batch's total) and return the attention mask for that step: additive, 4-D
        (B, 1, 1, length + 1), 0 where a row may attend and the dtype's minimum on its
        padding; None when no row is padded, unless ``always``.

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
