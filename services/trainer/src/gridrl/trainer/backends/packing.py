"""Sequences of a micro-batch packed without padding, framework-free: which tokens go in which
row of a packed forward.

    layout = pack_layout(indices, prompt_keys, prompt_lens, completion_lens)
    layout.rows      # list[list[Segment]]: the segments of each row, in row order
    layout.width     # W: the longest segment (every row is W tokens; its tail is padding)
    layout.tokens    # real tokens of the forward; len(rows) * width of them run

A *segment* is a group's prompt once followed by each of the group's completions (the
sequences of the micro-batch with the same prompt): a completion attends to its prompt and to
itself, causally, never to the group's other completions, and its positions continue from the
prompt's (``P, P + 1, ...``) as in its own padded row. The prompt is thus computed once per
group, as the shared-prefix path's KV cache does, and no completion is padded to the group's
longest. Segments are placed first-fit in decreasing length into rows as wide as the longest
one (Johnson 1973's FFD bin packing), so a row's tail is the only padding left and a row's
attention never spans more than ``W`` tokens. The mask and positions are built by the backend
(:mod:`gridrl.trainer.backends.torch.packed` on torch); the planner counts ``rows * W``
tokens for a packed micro-batch (:func:`gridrl.trainer.backends.memory.plan_micro_batches`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """One group's tokens in a packed row.

    Attributes:
        members: the sequence indices of the group in this micro-batch (all with the prompt of
            ``members[0]``), in order.
        start: the segment's first column in its row.
        prompt_len: tokens of the prompt.
        completion_lens: tokens of each member's completion, in ``members`` order.
    """

    members: tuple[int, ...]
    start: int
    prompt_len: int
    completion_lens: tuple[int, ...]

    @property
    def length(self) -> int:
        """Tokens of the segment: the prompt once plus every completion."""
        return self.prompt_len + sum(self.completion_lens)

    def completion_starts(self) -> list[int]:
        """The row column of each member's first completion token."""
        out, col = [], self.start + self.prompt_len
        for c in self.completion_lens:
            out.append(col)
            col += c
        return out


@dataclass(frozen=True)
class PackedLayout:
    """The rows of a packed micro-batch (:func:`pack_layout`).

    Attributes:
        rows: the segments of each row.
        width: tokens of every row (the longest segment).
        tokens: real tokens (prompts once per group and row, completions).
    """

    rows: list[list[Segment]]
    width: int
    tokens: int

    @property
    def padded_tokens(self) -> int:
        """Tokens the forward runs: ``len(rows) * width``."""
        return len(self.rows) * self.width


def pack_layout(indices: Sequence[int], prompt_keys: Sequence[Hashable],
                prompt_lens: Sequence[int], completion_lens: Sequence[int]) -> PackedLayout:
    """The packed rows of the sequences ``indices``.

    Args:
        indices: the micro-batch's sequences.
        prompt_keys: a key per sequence (indexed by the entries of ``indices``) equal for
            equal prompts (the prompt's token ids).
        prompt_lens, completion_lens: token counts, indexed likewise; a prompt has >= 1 token.
    Returns:
        a :class:`PackedLayout`; groups in order of first appearance, segments of equal length
        kept in that order.
    Raises:
        ValueError: ``indices`` is empty or a prompt is empty.
    """
    if not indices:
        raise ValueError("nothing to pack")
    groups: dict[Hashable, list[int]] = {}
    for i in indices:
        if prompt_lens[i] < 1:
            raise ValueError(f"sequence {i} has an empty prompt")
        groups.setdefault(prompt_keys[i], []).append(i)
    lengths = [(prompt_lens[m[0]] + sum(completion_lens[i] for i in m), k)
               for k, m in enumerate(groups.values())]
    width = max(length for length, _ in lengths)
    members = list(groups.values())
    rows: list[list[Segment]] = []
    used: list[int] = []
    for length, k in sorted(lengths, key=lambda lk: -lk[0]):  # stable: ties keep their order
        row = next((r for r, u in enumerate(used) if u + length <= width), None)
        if row is None:
            rows.append([])
            used.append(0)
            row = len(rows) - 1
        group = members[k]
        rows[row].append(Segment(tuple(group), used[row], prompt_lens[group[0]],
                                 tuple(completion_lens[i] for i in group)))
        used[row] += length
    return PackedLayout(rows, width, sum(length for length, _ in lengths))
