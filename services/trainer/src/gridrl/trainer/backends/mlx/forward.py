"""The MLX trainer's forward passes (:class:`MlxForwardPasses`, a part of
:class:`~gridrl.trainer.backends.mlx.backend.MlxTrainerBackend`): the collated rows of a
micro-batch, the completion logits from the shared-prefix forward (each group's prompt once, its
KV cache repeated for the group's completions) or from right-padded rows, the sampler's
logprobs, and the reference policy (every LoRA ``scale`` 0)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.backends.base import TrainSequence, UpdateConfig

# mlx-lm model types whose __call__ is ``head(self.model(inputs))`` with the head
# ``lm_head`` or the tied ``model.embed_tokens.as_linear``: the head can be applied to the
# completion positions only.
PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class MlxForwardPasses:
    """The forward passes of the MLX trainer over :attr:`model` (an mlx-lm model carrying
    the LoRA layers :attr:`modules`), with the settings :attr:`update_cfg`."""

    model: nn.Module
    modules: dict[str, Any]
    update_cfg: UpdateConfig
    _plain_head: bool


    def _collate(self, seqs: Sequence[TrainSequence], *, behaviour: bool = True
                 ) -> dict[str, mx.array]:
        """Right-padded rows ``prompt + completion`` and the completion columns.

        Returns:
            ``input_ids`` (n, L) int32 (L = the longest prompt + completion, padding 0),
            ``positions`` (n, C) int32: the row position whose output predicts completion token
            ``t`` (``len(prompt) - 1 + t``; clamped on padding), ``completion_ids`` (n, C)
            int32, ``mask`` (n, C) float32 (1 on the tokens that carry a loss: 0 on padding and
            on a multi-turn episode's environment tokens, :attr:`TrainSequence.loss_mask`),
            ``behaviour`` (n, C) float32 (0 where the mask is) and ``advantages`` (n,) float32.
        """
        n = len(seqs)
        width = max(len(s.prompt_ids) + len(s.completion_ids) for s in seqs)
        c_width = max(max(len(s.completion_ids) for s in seqs), 1)
        ids = np.zeros((n, width), np.int32)
        positions = np.zeros((n, c_width), np.int32)
        comp = np.zeros((n, c_width), np.int32)
        mask = np.zeros((n, c_width), np.float32)
        beh = np.zeros((n, c_width), np.float32)
        for i, s in enumerate(seqs):
            p, c = len(s.prompt_ids), len(s.completion_ids)
            ids[i, :p] = s.prompt_ids
            ids[i, p:p + c] = s.completion_ids
            positions[i] = np.minimum(np.arange(p - 1, p - 1 + c_width), width - 1)
            comp[i, :c] = s.completion_ids
            mask[i, :c] = s.mask_row()
            if behaviour and c:
                beh[i, :c] = np.asarray(s.behaviour_logprobs, np.float32) * mask[i, :c]
        return {"input_ids": mx.array(ids), "positions": mx.array(positions),
                "completion_ids": mx.array(comp), "mask": mx.array(mask),
                "behaviour": mx.array(beh),
                "advantages": mx.array(np.array([s.advantage for s in seqs], np.float32))}

    def _head(self, hidden: mx.array) -> mx.array:
        """The output head of a plain-head architecture on hidden states (..., D)."""
        if getattr(self.model.args, "tie_word_embeddings", False):
            return self.model.model.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    def _completion_logits(self, seqs: Sequence[TrainSequence],
                           batch: dict[str, mx.array]) -> mx.array:
        """(n, C, V) logits predicting each completion token of ``seqs`` (collated as
        ``batch``): the shared-prefix forward (:meth:`_shared_prefix_hidden`) when
        ``shared_prefix`` is set and the architecture has a plain head, else the padded rows,
        the head applied at the completion positions only where the architecture allows it."""
        positions = batch["positions"]
        if self._plain_head and self.update_cfg.shared_prefix:
            return self._head(self._shared_prefix_hidden(seqs, batch["completion_ids"]))
        if self._plain_head:
            hidden = self.model.model(batch["input_ids"])
            return self._head(mx.take_along_axis(hidden, positions[..., None], axis=1))
        logits = self.model(batch["input_ids"])
        return mx.take_along_axis(logits, positions[..., None], axis=1)

    def _shared_prefix_hidden(self, seqs: Sequence[TrainSequence],
                              completion_ids: mx.array) -> mx.array:
        """Hidden states (n, C, D) predicting each completion token, each distinct prompt run
        once: the prompt's forward (batch 1) fills an mlx-lm ``ConcatenateKVCache`` per layer
        whose keys and values are repeated for the group's completions, which then run on it
        (positions continue from the prompt's length; the causal mask is offset by it). The
        gradient reaches the prompt's activations through the cache (concatenation and repeat
        are differentiable). Same values as the padded rows up to float rounding, for
        ``P + G * C`` tokens of compute instead of ``G * (P + C)`` (as the torch backend's
        ``Policy.shared_prefix_logits``)."""
        from mlx_lm.models.cache import ConcatenateKVCache

        width = completion_ids.shape[1]
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, s in enumerate(seqs):
            groups.setdefault(tuple(s.prompt_ids), []).append(i)
        parts: list[mx.array] = []
        order: list[int] = []
        for prompt, rows in groups.items():
            cache = [ConcatenateKVCache() for _ in self.model.layers]
            hidden = self.model.model(mx.array([list(prompt)], mx.int32), cache=cache)
            first = mx.repeat(hidden[:, -1:, :], len(rows), axis=0)
            if width > 1:
                for c in cache:
                    c.state = (mx.repeat(c.keys, len(rows), axis=0),
                               mx.repeat(c.values, len(rows), axis=0))
                rest = self.model.model(completion_ids[mx.array(rows), :width - 1], cache=cache)
                parts.append(mx.concatenate([first, rest], axis=1))
            else:
                parts.append(first)
            order.extend(rows)
        inverse = np.empty(len(order), np.int32)
        inverse[np.array(order)] = np.arange(len(order))
        return mx.concatenate(parts, axis=0)[mx.array(inverse)]

    def _sampler_logprobs(self, logits: mx.array, tokens: mx.array) -> mx.array:
        """Logprobs of ``tokens`` under the rollout sampler's transform (temperature, top-k,
        top-p, renormalised: :func:`gridrl.engine.backends.mlx.sampling.transform_logits`);
        tokens outside the kept support get -100 (as the torch backend)."""

        from gridrl.engine.backends.mlx.sampling import transform_logits
        n, c, v = logits.shape
        cfg = self.update_cfg
        config = SamplingConfig(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                top_p=cfg.top_p, top_k=cfg.top_k)
        lp = transform_logits(logits.reshape(n * c, v).astype(mx.float32), [config] * (n * c))
        picked = mx.take_along_axis(lp, tokens.reshape(-1, 1), axis=-1).reshape(n, c)
        return mx.maximum(picked, -100.0)

    @contextmanager
    def _adapter_disabled(self):
        """The base model: every LoRA ``scale`` 0 for the duration."""
        scales = {p: m.scale for p, m in self.modules.items()}
        for m in self.modules.values():
            m.scale = 0.0
        try:
            yield
        finally:
            for p, m in self.modules.items():
                m.scale = scales[p]
