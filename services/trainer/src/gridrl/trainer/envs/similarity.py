"""Reward helpers shared by the built-in environments (and usable from a ``--reward-file``):
word-sequence similarity in TRL's reward signature
``f(prompts, completions, **columns) -> list[float]`` (see :mod:`gridrl.trainer.rewards`)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any

_WORD = re.compile(r"[a-z0-9']+")


def words_of(text: str) -> list[str]:
    """Lower-cased word tokens of ``text`` (letters, digits, apostrophes); punctuation and
    whitespace are separators."""
    return _WORD.findall(text.lower())


def word_similarity(got: str, want: str) -> float:
    """Similarity of two texts as word sequences: ``difflib.SequenceMatcher`` ratio on the word
    lists, ``2 * matches / (len(got) + len(want))`` in [0, 1]; 1.0 only when the word sequences
    are identical (0.0 when either is empty, 1.0 when both are)."""
    a, b = words_of(got), words_of(want)
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def similarity_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                      **_: Any) -> list[float]:
    """TRL-signature reward: :func:`word_similarity` of each completion to its ``answer``.

    Usable from a ``--reward-file``
    (``from gridrl.trainer.envs.similarity import similarity_reward``).
    """
    return [word_similarity(c, a) for c, a in zip(completions, answer, strict=True)]
