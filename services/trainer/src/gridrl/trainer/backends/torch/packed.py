"""The torch tensors of a packed micro-batch (:mod:`gridrl.trainer.backends.packing`): token ids,
positions, the block-diagonal causal mask, and where each completion token's prediction sits.

A group's prompt is in the row once, followed by its completions; a completion attends to its
prompt and causally to itself, and its positions continue from the prompt's, so each
completion token sees exactly the context (and positions) of its own padded row
(:func:`gridrl.trainer.backends.torch.update.collate`): same logprobs and gradients up to
float rounding. A padding token at a row's tail attends only to itself (a query row with
nothing to attend to would be NaN) and is never read.

Attention runs either densely over each row with the block-diagonal mask (``allowed``: every
query scores all ``W`` keys of its row, so a row of one group's eight two-turn episodes, ~950
tokens, costs 950 x 950 scores) or per segment (:class:`SegmentAttention`, the default where
the model's attention is sdpa): each group's prompt attends causally to itself, and each
completion to its prompt and causally to itself, as one batch of units padded only to the
longest unit, through :func:`segment_attention` registered in transformers'
``AttentionInterface``. The linear layers run over the packed rows either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gridrl.trainer.backends.base import TrainSequence
from gridrl.trainer.backends.packing import PackedLayout, pack_layout


@dataclass(frozen=True)
class PackedBatch:
    """A packed micro-batch of ``n`` sequences in ``R`` rows of ``W`` tokens.

    Attributes:
        input_ids: (R, W) int64.
        position_ids: (R, W) int64: a prompt's from 0, its completions' from the prompt's
            length (each), 0 on padding.
        allowed: (R, 1, W, W) bool: ``allowed[r, 0, q, k]`` is True where token ``q`` attends
            to token ``k``; None when the batch was packed for :attr:`segments` only.
        predicts: (n, C) int64 indices into the (R * W) flattened positions: the position
            whose output predicts completion token ``t`` of sequence ``i`` (the prompt's last
            token for ``t = 0``); 0 past the sequence's completion (masked by the caller).
        layout: the rows (:class:`PackedLayout`).
        segments: the same attention as :class:`SegmentAttention` (per prompt and completion,
            no row-wide scores).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor | None
    predicts: torch.Tensor
    layout: PackedLayout
    segments: SegmentAttention


@dataclass(frozen=True)
class SegmentAttention:
    """The attention of a packed batch as ``U`` units (a group's prompt, or one completion),
    each a set of query tokens and of the key tokens they may see, padded to the longest:
    ``Q`` query slots and ``K`` key slots a unit. Token indices are into the (R * W)
    flattened positions of the packed rows.

    Attributes:
        q_index: (U, Q) int64: the token of each query slot (a padding slot repeats the unit's
            first query).
        k_index: (U, K) int64: the token of each key slot (a prompt unit's keys are its prompt;
            a completion unit's its prompt then itself; a padding slot repeats the first key).
        allowed: (U, 1, Q, K) bool: query slot ``q`` attends to key slot ``k`` (causal within
            the unit; a padding query slot attends to key slot 0 at least: never a NaN row,
            never read).
        slots: (T,) int64 indices into the (U * Q) flattened query slots of the real ones.
        tokens: (T,) int64: the flattened position of each of those (every real token once).
        positions: R * W.
    """

    q_index: torch.Tensor
    k_index: torch.Tensor
    allowed: torch.Tensor
    slots: torch.Tensor
    tokens: torch.Tensor
    positions: int

    @staticmethod
    def of(layout: PackedLayout, device: torch.device) -> SegmentAttention:
        """The units of ``layout``'s rows: per segment its prompt, then each non-empty
        completion."""
        units: list[tuple[list[int], list[int], int]] = []  # (queries, keys, keys before)
        for r, row in enumerate(layout.rows):
            base = r * layout.width
            for segment in row:
                a, p = base + segment.start, segment.prompt_len
                prompt = list(range(a, a + p))
                units.append((prompt, prompt, 0))
                for b, c in zip(segment.completion_starts(), segment.completion_lens,
                                strict=True):
                    if c:
                        own = list(range(base + b, base + b + c))
                        units.append((own, prompt + own, p))
        q_width = max(len(q) for q, _, _ in units)
        k_width = max(len(k) for _, k, _ in units)
        q_index = torch.zeros((len(units), q_width), dtype=torch.long)
        k_index = torch.zeros((len(units), k_width), dtype=torch.long)
        q_real = torch.zeros((len(units), q_width), dtype=torch.bool)
        k_real = torch.zeros((len(units), k_width), dtype=torch.bool)
        before = torch.zeros((len(units), 1), dtype=torch.long)
        for u, (queries, keys, prior) in enumerate(units):
            q_index[u] = queries[0]
            q_index[u, :len(queries)] = torch.tensor(queries)
            k_index[u] = keys[0]
            k_index[u, :len(keys)] = torch.tensor(keys)
            q_real[u, :len(queries)] = True
            k_real[u, :len(keys)] = True
            before[u] = prior
        # query slot q is the unit's key slot prior + q: it sees key slots up to that one
        q_slot = torch.arange(q_width).unsqueeze(0) + before  # (U, Q)
        allowed = (torch.arange(k_width).view(1, 1, -1) <= q_slot.unsqueeze(-1)) \
            & k_real.unsqueeze(1)
        allowed[:, :, 0] |= ~q_real  # a padding query slot sees key slot 0 (no NaN row)
        slots = q_real.reshape(-1).nonzero().squeeze(-1)
        return SegmentAttention(q_index.to(device), k_index.to(device),
                                allowed.unsqueeze(1).to(device), slots.to(device),
                                q_index.reshape(-1)[slots].to(device),
                                len(layout.rows) * layout.width)


#: The name :func:`segment_attention` is registered under in transformers'
#: ``AttentionInterface`` (:func:`register_segment_attention`).
SEGMENT_ATTENTION = "gridrl_segments"


def segment_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, *, gridrl_segments: SegmentAttention,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function (``AttentionInterface``) over a packed batch's
    units (:class:`SegmentAttention`, passed as the forward's ``gridrl_segments`` keyword):
    the queries and keys of each unit are gathered, attended with transformers' own sdpa
    function (``sdpa_attention_forward``: the same kernel and grouped-query handling as the
    model's ``sdpa``) under the unit's mask, and scattered back to their tokens; a row's
    padding tail gets 0. ``attention_mask`` is ignored (the units carry the mask).

    Args:
        query: (R, Hq, W, D); key, value: (R, Hkv, W, D).
    Returns:
        ((R, W, Hq, D) attention output, None) as transformers' attention functions return.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seg = gridrl_segments
    rows, heads, width, dim = query.shape
    flat_q = query.transpose(1, 2).reshape(rows * width, heads, dim)
    flat_k = key.transpose(1, 2).reshape(rows * width, key.shape[1], dim)
    flat_v = value.transpose(1, 2).reshape(rows * width, value.shape[1], dim)
    q = flat_q[seg.q_index].transpose(1, 2)  # (U, Hq, Q, D)
    k = flat_k[seg.k_index].transpose(1, 2)  # (U, Hkv, K, D)
    v = flat_v[seg.k_index].transpose(1, 2)
    kwargs.pop("is_causal", None)
    out, _ = sdpa_attention_forward(module, q, k, v, seg.allowed, is_causal=False, **kwargs)
    picked = out.reshape(-1, heads, dim)[seg.slots]  # (T, Hq, D), out is (U, Q, Hq, D)
    full = picked.new_zeros((rows * width, heads, dim)).index_copy(0, seg.tokens, picked)
    return full.reshape(rows, width, heads, dim), None


_registered = False


def register_segment_attention() -> str:
    """Register :func:`segment_attention` in transformers' ``AttentionInterface`` (once);
    returns its name, :data:`SEGMENT_ATTENTION`."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
        _registered = True
    return SEGMENT_ATTENTION


def packed_layout(seqs: Sequence[TrainSequence]) -> PackedLayout:
    """:func:`pack_layout` of every sequence of ``seqs`` (grouped by equal prompts)."""
    return pack_layout(range(len(seqs)), [s.prompt_ids for s in seqs],
                       [len(s.prompt_ids) for s in seqs], [len(s.completion_ids) for s in seqs])


def pack(seqs: Sequence[TrainSequence], pad_id: int, completion_width: int,
         device: torch.device, *, dense_mask: bool = True) -> PackedBatch:
    """The :class:`PackedBatch` of ``seqs`` (completions read up to ``completion_width``
    tokens, the collated batch's ``C``); ``dense_mask`` False leaves out the (R, 1, W, W)
    ``allowed`` (a forward that attends per :attr:`PackedBatch.segments` does not read it)."""
    layout = packed_layout(seqs)
    rows, width = len(layout.rows), layout.width
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    pos = torch.zeros((rows, width), dtype=torch.long)
    # segment of each token (padding: a negative id of its own) and owner within the segment
    # (0: the prompt, j + 1: the completion of member j)
    seg = -1 - torch.arange(width, dtype=torch.long).repeat(rows, 1)
    owner = torch.zeros((rows, width), dtype=torch.long)
    predicts = torch.zeros((len(seqs), completion_width), dtype=torch.long)
    for r, row in enumerate(layout.rows):
        for k, segment in enumerate(row):
            p, a = segment.prompt_len, segment.start
            first = seqs[segment.members[0]]
            ids[r, a:a + p] = torch.tensor(first.prompt_ids, dtype=torch.long)
            pos[r, a:a + p] = torch.arange(p)
            seg[r, a:a + segment.length] = k
            last_prompt = r * width + a + p - 1
            for j, (i, b) in enumerate(zip(segment.members, segment.completion_starts(),
                                           strict=True)):
                c = segment.completion_lens[j]
                if not c:
                    continue
                ids[r, b:b + c] = torch.tensor(seqs[i].completion_ids, dtype=torch.long)
                pos[r, b:b + c] = torch.arange(p, p + c)
                owner[r, b:b + c] = j + 1
                predicts[i, 0] = last_prompt
                predicts[i, 1:c] = r * width + torch.arange(b, b + c - 1)
    allowed = None
    if dense_mask:
        causal = torch.ones((width, width), dtype=torch.bool).tril()
        same_segment = seg.unsqueeze(2) == seg.unsqueeze(1)
        visible = (owner.unsqueeze(1) == 0) | (owner.unsqueeze(2) == owner.unsqueeze(1))
        allowed = (same_segment & visible & causal).unsqueeze(1).to(device)
    return PackedBatch(ids.to(device), pos.to(device), allowed, predicts.to(device),
                       layout, SegmentAttention.of(layout, device))
