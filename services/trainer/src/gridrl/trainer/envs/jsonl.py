"""A JSONL file as a single-turn environment (``--task data.jsonl``): one object per line with
a prompt column (or chat ``messages``) and an answer column; the default reward is the
word-sequence similarity against the answer (:mod:`.similarity`)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from gridrl.common.errors import invalid_argument
from gridrl.trainer.envs.base import EVAL_SEED, Environment, TaskItem
from gridrl.trainer.envs.similarity import similarity_reward


@dataclass
class JsonlEnv(Environment):
    """A single-turn environment of prompts and answers from a JSONL file, one JSON object per
    line.

    A row holds its prompt as text in ``prompt_column``, or as chat messages in a ``messages``
    column (``[{"role": "system"|"user"|"assistant", "content": ...}, ...]``, rendered as they
    are; the reward functions' prompt is the last user message's content).

    The first ``eval_size`` rows of a seeded shuffle are held out for eval (or every row of
    ``eval_path`` when given); training walks the remaining rows in a fresh seeded permutation
    each epoch. Every column of a row is passed to reward functions by name.

    Args:
        path: the JSONL file.
        prompt_column, answer_column: column names (``answer_column`` may be absent from the
            rows when every reward comes from ``--reward-file``; :meth:`score` is then
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
    checked_at_start: ClassVar[bool] = True

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
