"""The forward side of the torch backend's decode loop, one class per forward.

:func:`~gridrl.engine.backends.torch.decode.decode` owns the loop (prefill each distinct prompt alone, sample, drop
finished rows); a *steps* object owns the forward and its KV cache:

- :class:`LeanSteps` -- :class:`~gridrl.engine.backends.torch.llama.LeanLlama` with the
  preallocated :class:`~gridrl.engine.backends.torch.cache.SlabCache`;
- :class:`ModelSteps` -- the model's own transformers forward (any family transformers
  implements, peft's layers included) with transformers' public cache API: a ``DynamicCache``
  built from the prompts' keys and values, a 2-D padding mask and per-row positions from which
  the model builds its own causal / sliding-window masks, and
  ``DynamicCache.batch_select_indices`` to drop finished rows.

Both take the same calls: :meth:`prefill` per distinct prompt, :meth:`start` once, then
:meth:`step` and :meth:`keep` as the loop goes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from gridrl.engine.backends.torch.cache import SlabCache, left_padded
from gridrl.engine.backends.torch.llama import LeanLlama

#: per layer (keys, values), each (1, H, P, D): one prompt's prefill
Prefill = list[tuple[torch.Tensor, torch.Tensor]]

#: suffix tokens (rows x longest suffix) of one batched forward of :meth:`LeanSteps.prefill_batch`
PREFILL_BATCH_TOKENS = 2048


class LeanSteps:
    """Decode steps of the lean forward."""

    def __init__(self, lean: LeanLlama, device: torch.device, dtype: torch.dtype) -> None:
        self.lean, self.device, self.dtype = lean, device, dtype
        self.cache: SlabCache | None = None

    def prefill(self, prompt: list[int], prefix: Prefill | None = None
                ) -> tuple[Prefill, torch.Tensor]:
        """One batch-1 forward over ``prompt``: its keys/values and the float32 logits (V,)
        of the token after it. ``prefix``: the prefill of ``prompt``'s first P tokens
        (computed once for prompts that share them): only the other tokens go through the
        forward, attending to it; the keys/values returned are then the whole prompt's."""
        kv, logits = self.prefill_batch([prompt], prefix)
        return kv[0], logits[0]

    def prefill_batch(self, prompts: list[list[int]], prefix: Prefill | None = None,
                      max_tokens: int = PREFILL_BATCH_TOKENS) -> tuple[list[Prefill],
                                                                       list[torch.Tensor]]:
        """:meth:`prefill` of many prompts that all start with ``prefix`` (its P tokens; None:
        P = 0), in batched forwards of at most ``max_tokens`` tokens after the prefix (a prompt
        longer than that goes alone): each prompt's remaining tokens, right-padded to the
        chunk's longest, attend to the prefix and causally to their own row, so a real token
        never sees padding (it comes after it) and no mask is needed; the padding's outputs
        are dropped.

        Returns:
            per prompt, in order: its keys/values (1, H_kv, len, D) per layer (views into the
            chunk's tensors) and the float32 logits (V,) of the token after it; equal to a
            prompt's own batch-1 prefill up to float rounding (the products run with more rows).
        """
        done = 0 if prefix is None else prefix[0][0].shape[2]
        out_kv: list[Prefill] = []
        out_logits: list[torch.Tensor] = []
        start = 0
        while start < len(prompts):
            end, width = start, 0
            while end < len(prompts):
                w = max(width, len(prompts[end]) - done)
                if end > start and w * (end - start + 1) > max_tokens:
                    break
                width, end = w, end + 1
            chunk = prompts[start:end]
            ids = torch.zeros((len(chunk), width), dtype=torch.int64)
            for r, p in enumerate(chunk):
                ids[r, :len(p) - done] = torch.tensor(p[done:], dtype=torch.int64)
            last = torch.tensor([[len(p) - done - 1] for p in chunk], device=self.device)
            positions = torch.arange(done, done + width, device=self.device)[None].expand(
                len(chunk), -1)
            layers: Prefill = []
            logits = self.lean.forward(ids.to(self.device), positions, cache=layers,
                                       logits_at=last, past=prefix)
            for r, p in enumerate(chunk):
                out_kv.append([(k[r:r + 1, :, :len(p)], v[r:r + 1, :, :len(p)])
                               for k, v in layers])
                out_logits.append(logits[r, -1].float())
            start = end
        return out_kv, out_logits

    def shared_prefix(self, prefix: list[int]) -> Prefill:
        """The keys/values of ``prefix`` (P tokens), for :meth:`prefill` of prompts that
        start with it."""
        layers, _ = self.prefill(prefix)
        return layers

    def start(self, prefills: list[Prefill], lengths: list[int], row_prefill: list[int],
              max_new: int) -> None:
        """The batch's cache: row ``r`` holds prompt ``row_prefill[r]`` (left-padded)."""
        self.cache = SlabCache.from_prefills(prefills, lengths, row_prefill, max_new, self.dtype)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) in the model dtype after each live row's token ``tokens`` (N,)."""
        cache = self.cache
        assert cache is not None
        positions = (cache.layers[0].length - cache.pad)[:, None]
        mask = cache.next_step()  # only for padded rows
        return self.lean.forward(tokens[:, None], positions, cache=cache,
                                 attention_mask=mask)[:, -1]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (int64 indices into the live rows), in that order."""
        assert self.cache is not None
        self.cache.keep_rows(rows)

    def row_prefill(self, row: int) -> Prefill:
        """A copy of live row ``row``'s keys/values: every column fed so far (its prompt and
        the tokens decoded before the last draw), (1, H, L, D) per layer."""
        cache = self.cache
        assert cache is not None
        start = int(cache.pad[row])
        return [(layer.kbuf[row:row + 1, :, start:layer.length].clone(),
                 layer.vbuf[row:row + 1, :, start:layer.length].clone())
                for layer in cache.layers]


class ModelSteps:
    """Decode steps of the model's own forward over transformers' ``DynamicCache``."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device = model, device
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # int64 (N, columns): 0 on left padding
        self.positions: torch.Tensor | None = None  # int64 (N,): next token's position

    def _new_cache(self, data: Any = None) -> Any:
        from transformers import DynamicCache

        return DynamicCache(data, config=self.model.config)

    def prefill(self, prompt: list[int]) -> tuple[Prefill, torch.Tensor]:
        """As :meth:`LeanSteps.prefill`, through the model with a fresh ``DynamicCache``."""
        ids = torch.tensor([prompt], dtype=torch.int64, device=self.device)
        # An index (not the int 1) makes the last hidden state a contiguous copy, so the head
        # is one matrix-vector product (a strided slice sends bf16 through a full weight copy).
        last = torch.tensor([len(prompt) - 1], device=self.device)
        cache = self._new_cache()
        logits = self.model(input_ids=ids, use_cache=True, logits_to_keep=last,
                            **{self._cache_kw: cache}).logits
        return [(keys, values) for keys, values, *_ in cache], logits[0, -1].float()

    def start(self, prefills: list[Prefill], lengths: list[int], row_prefill: list[int],
              max_new: int) -> None:
        """The batch's ``DynamicCache``, its padding mask and positions (``max_new`` unused:
        the cache grows as it goes)."""
        index = torch.tensor(row_prefill, dtype=torch.int64, device=self.device)
        layers = [(left_padded([p[i][0] for p in prefills], lengths, index),
                   left_padded([p[i][1] for p in prefills], lengths, index))
                  for i in range(len(prefills[0]))]
        self.cache = self._new_cache(layers)
        width = max(lengths)
        rows = torch.tensor([lengths[j] for j in row_prefill], dtype=torch.int64,
                            device=self.device)
        self.mask = (torch.arange(width, device=self.device)[None, :]
                     >= (width - rows)[:, None]).to(torch.int64)
        self.positions = rows

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """As :meth:`LeanSteps.step`."""
        assert self.mask is not None and self.positions is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask,
                         position_ids=self.positions[:, None], use_cache=True,
                         **{self._cache_kw: self.cache})
        self.positions = self.positions + 1
        return out.logits[:, -1]

    def keep(self, rows: torch.Tensor) -> None:
        """As :meth:`LeanSteps.keep` (``DynamicCache.batch_select_indices``)."""
        assert self.mask is not None and self.positions is not None
        self.cache.batch_select_indices(rows)
        self.mask = self.mask.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)
