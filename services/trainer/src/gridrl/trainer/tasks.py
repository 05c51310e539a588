"""Tasks: where prompts come from and how a completion is scored.

A task yields :class:`TaskItem` s (chat messages, the prompt text reward functions see, and
extra columns such as ``answer``), deterministically by index, so the data position of a run
is a single integer and a resumed run continues with exactly the next prompt. Every task keeps
a held-out eval set that is disjoint from its training prompts.

Built-in tasks:
- ``reverse-words``: reverse the order of ``min_words..max_words`` distinct words drawn from a
  bank of common English words; dense reward by word-sequence similarity, 1.0 only for the
  exact reversal.
- a JSONL file (``--task data.jsonl``): one object per line with a prompt column and an answer
  column; default reward is the same similarity against the answer.

Rewards use TRL's signature ``f(prompts, completions, **columns) -> list[float]`` (see
``rewards.py``).
"""

from __future__ import annotations

import difflib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from gridrl.common.errors import invalid_argument

EVAL_SEED = 20240601  # fixed: the same held-out set for every run, whatever --seed


@dataclass(frozen=True)
class TaskItem:
    """One prompt of a task.

    Attributes:
        prompt: the text reward functions receive as ``prompts[i]`` (the user's request).
        messages: chat messages ``[{"role", "content"}, ...]`` to render with the tokenizer's
            chat template (a generation prompt is added when rendering).
        columns: extra columns passed to reward functions by name (e.g. ``answer``).
    """

    prompt: str
    messages: tuple[dict[str, str], ...]
    columns: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    """What the training loop needs from a task."""

    name: str

    def train_item(self, index: int) -> TaskItem:
        """The ``index``-th training prompt (deterministic; index = data position)."""

    def eval_items(self) -> list[TaskItem]:
        """The held-out eval set (deterministic, disjoint from training prompts)."""

    def score(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """The task's own score in [0, 1] per completion (TRL reward signature); the eval
        score is its mean over the held-out set under greedy decoding."""


# --------------------------------------------------------------------------- reward helpers

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

    Usable from a ``--reward-file`` (``from gridrl.trainer.tasks import similarity_reward``).
    """
    return [word_similarity(c, a) for c, a in zip(completions, answer, strict=True)]


# --------------------------------------------------------------------------- reverse-words

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


@dataclass
class ReverseWords:
    """The built-in ``reverse-words`` task.

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
    #: what :meth:`score` measures, in words (the eval's scorer)
    score_name: ClassVar[str] = "reverse-words word similarity (1.0 only for the exact reversal)"

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
        """The task item asking to reverse ``phrase``."""
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

    def score(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        return similarity_reward(prompts, completions, **columns)


# --------------------------------------------------------------------------- JSONL

@dataclass
class JsonlTask:
    """Prompts and answers from a JSONL file, one JSON object per line.

    A row holds its prompt as text in ``prompt_column``, or as chat messages in a ``messages``
    column (``[{"role": "system"|"user"|"assistant", "content": ...}, ...]``, rendered as they
    are; the reward functions' prompt is the last user message's content).

    The first ``eval_size`` rows of a seeded shuffle are held out for eval (or every row of
    ``eval_path`` when given); training walks the remaining rows in a fresh seeded permutation
    each epoch. Every column of a row is passed to reward functions by name.

    Args:
        path: the JSONL file.
        prompt_column, answer_column: column names (``answer_column`` may be absent from the
            rows when every reward comes from ``--reward-file``; the task score is then
            unavailable and the eval uses the combined reward).
        system_prompt: optional system message.
    Raises:
        StatusError: INVALID_ARGUMENT naming the file and line for unreadable rows, a missing
            prompt column, or too few rows for the eval split.
    """

    path: Path
    seed: int = 0
    eval_size: int = 16
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    system_prompt: str | None = None
    eval_path: Path | None = None
    name: str = "jsonl"
    #: ``--max-tokens``' default for a JSONL task (short answers; raise it for longer ones).
    max_tokens: ClassVar[int] = 40
    #: ``--eval-tasks``' default for a JSONL task: rows held out of a file that may be small
    #: (``--eval-file`` gives a separate eval set of any size).
    eval_tasks: ClassVar[int] = 16

    def __post_init__(self) -> None:
        rows = _read_jsonl(Path(self.path), self.prompt_column)
        self.name = Path(self.path).name
        if self.eval_path is not None:
            self._eval_rows = _read_jsonl(Path(self.eval_path), self.prompt_column)
            self._train_rows = rows
        else:
            if len(rows) <= self.eval_size:
                raise invalid_argument("--task", f"{self.path}: {len(rows)} rows, need more than "
                                                 f"--eval-tasks={self.eval_size} to hold out")
            order = list(range(len(rows)))
            random.Random(f"jsonl-eval:{EVAL_SEED}").shuffle(order)
            self._eval_rows = [rows[i] for i in order[:self.eval_size]]
            self._train_rows = [rows[i] for i in order[self.eval_size:]]
        held_out = {self._key(r) for r in self._eval_rows}
        self._train_rows = [r for r in self._train_rows if self._key(r) not in held_out]
        if not self._train_rows:
            raise invalid_argument("--task", f"{self.path}: no training rows left after the eval "
                                             "split")
        self.has_answer = all(self.answer_column in r for r in self._train_rows + self._eval_rows)
        self._perm_cache: dict[int, list[int]] = {}

    @property
    def score_name(self) -> str:
        """What :meth:`score` measures, in words (the eval's scorer without ``--reward-file``)."""
        return (f"word similarity to the {self.answer_column!r} column (case-insensitive; 1.0 "
                "for the same words in the same order)")

    def _key(self, row: dict[str, Any]) -> str:
        """What makes two rows the same prompt (for the eval split)."""
        if self.prompt_column in row:
            return str(row[self.prompt_column])
        return json.dumps(row["messages"], sort_keys=True)

    def _row_item(self, row: dict[str, Any]) -> TaskItem:
        messages: list[dict[str, str]] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        if self.prompt_column in row:
            prompt = str(row[self.prompt_column])
            messages.append({"role": "user", "content": prompt})
        else:
            chat = [{"role": str(m["role"]), "content": str(m["content"])}
                    for m in row["messages"]]
            if messages and chat[0]["role"] == "system":
                messages = []
            messages += chat
            prompt = next((m["content"] for m in reversed(chat) if m["role"] == "user"), "")
        columns = {k: v for k, v in row.items() if k not in (self.prompt_column, "messages")}
        if self.answer_column in columns and self.answer_column != "answer":
            columns.setdefault("answer", columns[self.answer_column])
        return TaskItem(prompt=prompt, messages=tuple(messages), columns=columns)

    def train_item(self, index: int) -> TaskItem:
        n = len(self._train_rows)
        epoch, pos = divmod(index, n)
        perm = self._perm_cache.get(epoch)
        if perm is None:
            perm = list(range(n))
            random.Random(f"jsonl-train:{self.seed}:{epoch}").shuffle(perm)
            self._perm_cache = {epoch: perm}
        return self._row_item(self._train_rows[perm[pos]])

    def eval_items(self) -> list[TaskItem]:
        return [self._row_item(r) for r in self._eval_rows]

    def score(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        if not self.has_answer:
            raise ValueError(f"{self.name}: rows have no {self.answer_column!r} column to score "
                             "against; score them with --reward-file, or name the answer "
                             "column with --answer-column")
        return similarity_reward(prompts, completions, **columns)


def _read_jsonl(path: Path, prompt_column: str) -> list[dict[str, Any]]:
    if not path.is_file():
        raise invalid_argument("--task", f"{path}: no such file")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise invalid_argument("--task", f"{path}:{n}: not JSON ({e.msg})") from e
        if not isinstance(row, dict) or (prompt_column not in row and "messages" not in row):
            raise invalid_argument("--task", f"{path}:{n}: no {prompt_column!r} or 'messages' "
                                             "column")
        if prompt_column not in row and not _chat_messages(row["messages"]):
            raise invalid_argument("--task", f"{path}:{n}: 'messages' must be a non-empty list "
                                             "of {\"role\", \"content\"} objects")
        rows.append(row)
    return rows


def _chat_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
        for m in value)


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


def make_task(spec: str, *, seed: int, eval_size: int, min_words: int = 3, max_words: int = 4,
              prompt_column: str = "prompt", answer_column: str = "answer",
              system_prompt: str | None = None, eval_file: str | None = None) -> Task:
    """Build the task named by ``--task``: ``"reverse-words"`` or a path to a ``.jsonl`` file.

    Raises:
        StatusError: INVALID_ARGUMENT for an unknown task or bad task options.
    """
    if spec == "reverse-words":
        kw = {"system_prompt": system_prompt} if system_prompt else {}
        return ReverseWords(seed=seed, min_words=min_words, max_words=max_words,
                            eval_size=eval_size, **kw)
    if spec.endswith(".jsonl") or Path(spec).is_file():
        return JsonlTask(Path(spec), seed=seed, eval_size=eval_size, prompt_column=prompt_column,
                         answer_column=answer_column, system_prompt=system_prompt,
                         eval_path=Path(eval_file) if eval_file else None)
    raise invalid_argument("--task", f"{spec!r} is neither 'reverse-words' nor a .jsonl file")


# --------------------------------------------------------------------------- chat rendering

def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], *, generation_prompt: bool,
                tools: Sequence[Any] | None = None) -> str:
    """The chat template's text for ``messages`` (``apply_chat_template(tokenize=False)``).

    A template that rejects the system role gets the system text prepended to the first user
    message instead.

    Args:
        generation_prompt: end with the assistant turn's opening (``add_generation_prompt``).
        tools: functions or JSON schemas passed as ``tools=`` (templates that ignore them
            render as without).
    Raises:
        StatusError: INVALID_ARGUMENT on ``--model`` when the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise invalid_argument("--model", "the tokenizer has no chat template")
    msgs = [dict(m) for m in messages]
    kw: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation_prompt}
    if tools:
        kw["tools"] = list(tools)
    try:
        return tokenizer.apply_chat_template(msgs, **kw)
    except Exception:  # jinja raise_exception, e.g. "System role not supported"
        if not msgs or msgs[0]["role"] != "system" or len(msgs) < 2:
            raise
        system = msgs.pop(0)["content"]
        msgs[0] = {**msgs[0], "content": f"{system}\n\n{msgs[0]['content']}"}
        return tokenizer.apply_chat_template(msgs, **kw)


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, Any]],
                tools: Sequence[Any] | None = None) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template plus the generation prompt and
    return the prompt token ids (the template's own special tokens are kept, none added;
    :func:`render_chat`).

    Raises:
        StatusError: INVALID_ARGUMENT on ``--model`` when the tokenizer has no chat template.
    """
    text = render_chat(tokenizer, messages, generation_prompt=True, tools=tools)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
