"""``reverse-words-retry``: reverse-words with the environment's feedback and a second attempt.

The items are ``reverse-words``' (same phrases, same held-out set). A reply that is not the exact
reversal gets a user turn naming the words that are in the wrong place (or missing), and the
model answers once more. The episode's reward is the word-sequence similarity of its last
attempt, a second attempt's worth ``second_attempt_weight`` of a first one's, so that solving
at once pays most. Its eval reports the success (exact reversal at the end), and first- and
second-attempt success apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from gridrl.trainer.envs.base import Environment, EnvTurn, Message
from gridrl.trainer.tasks import (
    REVERSE_SYSTEM_PROMPT,
    ReverseWords,
    TaskItem,
    word_similarity,
    words_of,
)


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
        seed, min_words, max_words, eval_size: as :class:`~gridrl.trainer.tasks.ReverseWords`.
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
