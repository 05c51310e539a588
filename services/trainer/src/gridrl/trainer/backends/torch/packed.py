"""The torch tensors of a packed micro-batch (:mod:`gridrl.trainer.backends.packing`): token ids,
positions, the block-diagonal causal mask, and where each completion token's prediction sits.

A group's prompt is in the row once, followed by its completions; a completion attends to its
prompt and causally to itself, and its positions continue from the prompt's, so each
completion token sees exactly the context (and positions) of its own padded row
(:func:`gridrl.trainer.backends.torch.update.collate`): same logprobs and gradients up to
float rounding. A padding token at a row's tail attends only to itself (a query row with
nothing to attend to would be NaN) and is never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
            to token ``k``.
        predicts: (n, C) int64 indices into the (R * W) flattened positions: the position
            whose output predicts completion token ``t`` of sequence ``i`` (the prompt's last
            token for ``t = 0``); 0 past the sequence's completion (masked by the caller).
        layout: the rows (:class:`PackedLayout`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    predicts: torch.Tensor
    layout: PackedLayout


def packed_layout(seqs: Sequence[TrainSequence]) -> PackedLayout:
    """:func:`pack_layout` of every sequence of ``seqs`` (grouped by equal prompts)."""
    return pack_layout(range(len(seqs)), [s.prompt_ids for s in seqs],
                       [len(s.prompt_ids) for s in seqs], [len(s.completion_ids) for s in seqs])


def pack(seqs: Sequence[TrainSequence], pad_id: int, completion_width: int,
         device: torch.device) -> PackedBatch:
    """The :class:`PackedBatch` of ``seqs`` (completions read up to ``completion_width``
    tokens, the collated batch's ``C``)."""
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
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    same_segment = seg.unsqueeze(2) == seg.unsqueeze(1)
    visible = (owner.unsqueeze(1) == 0) | (owner.unsqueeze(2) == owner.unsqueeze(1))
    allowed = (same_segment & visible & causal).unsqueeze(1)
    return PackedBatch(ids.to(device), pos.to(device), allowed.to(device), predicts.to(device),
                       layout)
