"""The reverse-words environments.

- ``reverse-words`` (:class:`ReverseWords`): reverse the order of ``min_words..max_words``
  distinct words drawn from a bank of common English words, single-turn; dense reward by
  word-sequence similarity, 1.0 only for the exact reversal.
- ``reverse-words-retry`` (:class:`ReverseWordsRetry`): the same items with the environment's
  feedback and a second attempt. A reply that is not the exact reversal gets a user turn naming
  the words that are in the wrong place (or missing), and the model answers once more. The
  episode's reward is the word-sequence similarity of its last attempt, a second attempt's worth
  ``second_attempt_weight`` of a first one's, so that solving at once pays most. Its eval reports
  the success (exact reversal at the end), and first- and second-attempt success apart.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from gridrl.common.errors import invalid_argument
from gridrl.trainer.envs.base import EVAL_SEED, Environment, EnvTurn, Message, TaskItem
from gridrl.trainer.envs.similarity import similarity_reward, word_similarity, words_of

_WORDS = """
apple river stone cloud green house table chair bread water light music paper
garden window summer winter orange yellow silver golden forest ocean mountain valley
little happy quiet bright simple gentle yellow purple candle pencil basket bottle
rabbit turtle monkey tiger horse sheep mouse eagle falcon salmon spider zebra
doctor farmer singer teacher sailor driver baker painter lawyer pilot writer
morning evening garden village city market bridge tower castle island desert
coffee butter cheese honey lemon pepper sugar salt rice carrot potato tomato
happy brave calm clever eager fancy jolly kind lucky proud silly swift
run jump swim read write sing dance paint build climb laugh travel
blue red black white brown pink gray dark warm cold soft loud
table window door floor wall roof clock phone glass plate spoon knife
"""
WORD_BANK: tuple[str, ...] = tuple(dict.fromkeys(_WORDS.split()))  # de-duplicated, in order

REVERSE_SYSTEM_PROMPT = (
    "You reverse the order of words. Reply with the same words in reverse order, separated by "
    "spaces, and nothing else.\n"
    "Example:\n"
    "Words: green apple river\n"
    "Reversed: river apple green"
)


def check_word_range(min_words: int, max_words: int) -> None:
    """reverse-words' phrase lengths.

    Raises:
        StatusError: INVALID_ARGUMENT naming ``--min-words/--max-words`` unless
            2 <= min_words <= max_words <= the word bank's size.
    """
    if not 2 <= min_words <= max_words <= len(WORD_BANK):
        raise invalid_argument("--min-words/--max-words",
                               f"need 2 <= min <= max <= {len(WORD_BANK)}, got "
                               f"{min_words}..{max_words}")


@dataclass
class ReverseWords(Environment):
    """The built-in ``reverse-words`` environment (single-turn).

    Args:
        seed: seed of the training stream (the eval set uses :data:`EVAL_SEED`).
        min_words, max_words: phrase length range, inclusive (3..4 by default, as
            ``gridrl-trainer run``).
        eval_size: number of held-out phrases.
        system_prompt: the system message (an instruction with one worked example).
    Raises:
        StatusError: INVALID_ARGUMENT for a bad word range or eval size.
    """

    seed: int = 0
    min_words: int = 3
    max_words: int = 4
    eval_size: int = 16
    system_prompt: str = REVERSE_SYSTEM_PROMPT
    name: str = "reverse-words"
    #: New tokens a completion needs (``--max-tokens``' default): a reversed phrase of a few
    #: words is ~2 tokens a word, and 24 leaves no room to ramble.
    max_tokens: ClassVar[int] = 24
    #: ``--eval-tasks``' default: the per-prompt standard deviation of the score in runs so far
    #: reached 0.275 (docs/benchmarks.md, section 4), so 128 phrases keep the eval's standard
    #: error <= 0.025; generated, they cost no training data.
    eval_tasks: ClassVar[int] = 128
    checked_at_start: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_word_range(self.min_words, self.max_words)
        if self.eval_size < 1:
            raise invalid_argument("--eval-tasks", "must be >= 1")
        self._eval_phrases: list[tuple[str, ...]] = []
        seen: set[tuple[str, ...]] = set()
        j = 0
        while len(self._eval_phrases) < self.eval_size:
            phrase = self._phrase(f"eval:{EVAL_SEED}:{j}")
            j += 1
            if phrase not in seen:
                seen.add(phrase)
                self._eval_phrases.append(phrase)
        self._eval_set = seen

    def _phrase(self, key: str) -> tuple[str, ...]:
        rng = random.Random(key)
        k = rng.randint(self.min_words, self.max_words)
        return tuple(rng.sample(WORD_BANK, k))

    def item_for(self, phrase: Sequence[str]) -> TaskItem:
        """The item asking to reverse ``phrase``."""
        words = " ".join(phrase)
        return TaskItem(
            prompt=f"Words: {words}",
            messages=({"role": "system", "content": self.system_prompt},
                      {"role": "user", "content": f"Words: {words}"}),
            columns={"answer": " ".join(reversed(phrase))},
        )

    def train_item(self, index: int) -> TaskItem:
        attempt = 0
        while True:  # skip the (rare) phrases that are in the held-out set
            phrase = self._phrase(f"train:{self.seed}:{index}:{attempt}")
            if phrase not in self._eval_set:
                return self.item_for(phrase)
            attempt += 1

    def eval_items(self) -> list[TaskItem]:
        return [self.item_for(p) for p in self._eval_phrases]

    @property
    def score_name(self) -> str:
        """What :meth:`score` measures, in words (the eval's scorer)."""
        return "reverse-words word similarity (1.0 only for the exact reversal)"

    def score(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        return similarity_reward(prompts, completions, **columns)


def feedback(reply: str, answer: str) -> str:
    """The environment's message after a wrong reply: which of its words are not in the phrase,
    which are in the wrong place, which are missing, then the request to try again."""
    got, want = words_of(reply), words_of(answer)
    foreign = [w for w in dict.fromkeys(got) if w not in want]
    misplaced = [w for i, w in enumerate(got)
                 if w in want and (i >= len(want) or want[i] != w)]
    missing = [w for w in want if w not in got]
    parts = []
    if foreign:
        parts.append("not in the phrase: " + ", ".join(foreign))
    if misplaced:
        parts.append("in the wrong place: " + ", ".join(dict.fromkeys(misplaced)))
    if missing:
        parts.append("missing: " + ", ".join(missing))
    if not parts:
        parts.append(f"expected {len(want)} words, got {len(got)}")
    return "Not quite (" + "; ".join(parts) + "). Reply again with the words in reverse order."


class ReverseWordsRetry(Environment):
    """Two attempts at reverse-words, with feedback between them.

    Args:
        seed, min_words, max_words, eval_size: as :class:`ReverseWords`.
        second_attempt_weight: a second attempt's rewards are a first one's times this.
        solved_weight: the weight of ``solved`` (exact reversal) beside ``attempt``'s
            ``1 - solved_weight`` (similarity).
        system_prompt: the instruction (default: reverse-words' own, so the first attempt is
            exactly a reverse-words prompt; the feedback says a second attempt is allowed).
    """

    name = "reverse-words-retry"
    max_tokens: ClassVar[int] = 24
    eval_tasks: ClassVar[int] = 128
    max_turns: ClassVar[int] = 2

    def __init__(self, seed: int = 0, min_words: int = 3, max_words: int = 4,
                 eval_size: int = 128, second_attempt_weight: float = 0.75,
                 solved_weight: float = 0.5, system_prompt: str | None = None) -> None:
        self.words = ReverseWords(seed=seed, min_words=min_words, max_words=max_words,
                                  eval_size=eval_size,
                                  system_prompt=system_prompt or REVERSE_SYSTEM_PROMPT)
        self.second_attempt_weight = second_attempt_weight
        self.solved_weight = solved_weight

    def train_item(self, index: int) -> TaskItem:
        return self.words.train_item(index)

    def eval_items(self) -> list[TaskItem]:
        return self.words.eval_items()

    def respond(self, item: TaskItem, transcript: list[Message],
                state: dict[str, Any]) -> EnvTurn:
        reply = transcript[-1]["content"]
        answer = item.columns["answer"]
        attempts = sum(m["role"] == "assistant" for m in transcript)
        if words_of(reply) == words_of(answer) or attempts >= 2:
            return EnvTurn(done=True)
        return EnvTurn([{"role": "user", "content": feedback(reply, answer)}])

    @property
    def score_name(self) -> str:
        """What :meth:`score` measures."""
        return "word similarity of the last attempt (1.0 only for the exact reversal)"

    def score(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """Similarity of the last attempt to the answer (the eval's score; exact = success)."""
        return [word_similarity(c, a) for c, a in zip(completions, columns["answer"],
                                                      strict=True)]

    def _by_attempt(self, values: list[float], turns: Sequence[int] | None) -> list[float]:
        """``values`` with a second attempt's times ``second_attempt_weight``."""
        turns = turns or [1] * len(values)
        return [v * (1.0 if t <= 1 else self.second_attempt_weight)
                for v, t in zip(values, turns, strict=True)]

    def attempt_reward(self, prompts: list[str], completions: list[str], answer: Sequence[str],
                       turns: Sequence[int] | None = None, **_: Any) -> list[float]:
        """TRL-signature reward: the last attempt's similarity, a second attempt's times
        ``second_attempt_weight``."""
        return self._by_attempt([word_similarity(c, a) for c, a in
                                 zip(completions, answer, strict=True)], turns)

    def solved_reward(self, prompts: list[str], completions: list[str], answer: Sequence[str],
                      turns: Sequence[int] | None = None, **_: Any) -> list[float]:
        """TRL-signature reward: 1 for the exact reversal at the first attempt,
        ``second_attempt_weight`` at the second, else 0."""
        return self._by_attempt([float(words_of(c) == words_of(a)) for c, a in
                                 zip(completions, answer, strict=True)], turns)

    def reward_funcs(self) -> list[tuple[str, Any, float]]:
        return [(f"{self.name}:attempt", self.attempt_reward, 1.0 - self.solved_weight),
                (f"{self.name}:solved", self.solved_reward, self.solved_weight)]

    def eval_metrics(self, columns: dict[str, list[Any]], scores: Sequence[float]
                     ) -> dict[str, float]:
        """``first_attempt_success`` (exact at once), ``second_attempt_success`` (exact on the
        second attempt), over every held-out episode; they add up to the eval's exact."""
        n = max(len(scores), 1)
        turns = columns.get("turns") or [1] * len(scores)
        first = sum(s >= 1.0 and t <= 1 for s, t in zip(scores, turns, strict=True))
        second = sum(s >= 1.0 and t >= 2 for s, t in zip(scores, turns, strict=True))
        return {"first_attempt_success": first / n, "second_attempt_success": second / n}
