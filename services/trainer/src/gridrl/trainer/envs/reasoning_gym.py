"""``--task reasoning-gym:<dataset>``: a procedural dataset of reasoning-gym (optional extra
``reasoning-gym``; written against 0.1.25) as a single-turn environment.

Training items are ``create_dataset(name, seed=--seed, **params)[index]`` (reasoning-gym's own
generator: entry ``index`` is drawn with ``Random(seed + index)``); the held-out set is the
first ``eval_size`` entries of the same dataset under :data:`~gridrl.trainer.envs.base.EVAL_SEED`,
and a training entry whose question is held out is replaced by the next index's (so the splits
are disjoint). The reward is the dataset's own scorer, ``dataset.score_answer(answer, entry)``,
on the answer inside ``<answer>...</answer>`` (reasoning-gym's convention,
``reasoning_gym.utils.extract_answer``) or, without tags, :func:`plain_answer` of the reply.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

from gridrl.common.errors import invalid_argument
from gridrl.trainer.envs.base import EVAL_SEED, Environment, TaskItem
from gridrl.trainer.rewards import optional_module

INSTALL_HINT = "pip install 'gridrl-trainer[reasoning-gym]' (or pip install reasoning-gym==0.1.25)"

RG_SYSTEM_PROMPT = ("Answer the question. Reply with the answer only, between <answer> and "
                    "</answer> tags, nothing else.")

#: entries a training dataset spans (reasoning-gym draws entry i from Random(seed + i))
TRAIN_SIZE = 1_000_000


def load_reasoning_gym() -> Any:
    """The ``reasoning_gym`` module.

    Raises:
        StatusError: INVALID_ARGUMENT on ``--task`` naming what to install when it is missing.
    """
    return optional_module("reasoning_gym", "--task", "reasoning-gym", INSTALL_HINT)


PARAMS_SYNTAX = (
    "'key=value,key=value' (no spaces needed); a value is read as: true/false/yes/no (any "
    "case) -> bool, none/null -> None, an integer or a float, a list in brackets "
    "([+,-] or [1,2]; commas inside brackets do not split pairs), JSON ({...}, \"...\"), "
    "'quoted' text kept as it is, else a string")


def _split_top(text: str, sep: str = ",") -> list[str]:
    """``text`` cut at each ``sep`` outside brackets, braces and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(depth - 1, 0)
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_value(text: str) -> Any:
    """One ``--task-params`` value (the syntax: :data:`PARAMS_SYNTAX`): ``"False"`` -> False,
    ``"no"`` -> False, ``"None"`` -> None, ``"3"`` -> 3, ``"0.5"`` -> 0.5, ``"[+,-]"`` ->
    ``["+", "-"]``, ``'["a", 1]'`` -> ``["a", 1]``, ``"'3'"`` -> ``"3"``, ``"abc"`` ->
    ``"abc"``."""

    t = text.strip()
    low = t.lower()
    if low in ("true", "yes"):
        return True
    if low in ("false", "no"):
        return False
    if low in ("none", "null", "~"):
        return None
    for number in (int, float):
        try:
            return number(t)
        except ValueError:
            pass
    if len(t) >= 2 and t[0] == t[-1] == "'":
        return t[1:-1]
    if t[:1] in ("[", "{", '"'):
        try:
            return json.loads(t)
        except json.JSONDecodeError:
            if t[0] == "[" and t[-1] == "]":
                inner = t[1:-1].strip()
                return [parse_value(v) for v in _split_top(inner)] if inner else []
    return t


def parse_params(text: str) -> dict[str, Any]:
    """``--task-params`` -> keyword arguments: ``"min_word_len=3,allow_negation=False,
    operators=[+,-]"`` -> ``{"min_word_len": 3, "allow_negation": False, "operators": ["+",
    "-"]}`` (each value by :func:`parse_value`; the syntax: :data:`PARAMS_SYNTAX`).

    Raises:
        StatusError: INVALID_ARGUMENT on ``--task-params`` for an entry without ``=``, a key
            given twice, or unbalanced brackets.
    """
    out: dict[str, Any] = {}
    for raw in _split_top(text):
        part = raw.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise invalid_argument("--task-params", f"{part!r} is not key=value")
        if key in out:
            raise invalid_argument("--task-params", f"{key!r} is given twice")
        if value.strip()[:1] == "[" and not value.strip().endswith("]"):
            raise invalid_argument("--task-params", f"{part!r}: a list ends with ']'")
        out[key] = parse_value(value)
    return out


def dataset_fields(dataset: str) -> list[str]:
    """The parameters ``--task-params`` may set for a reasoning-gym dataset: the fields of its
    config dataclass but ``seed`` and ``size`` (gridrl sets those: ``--seed``,
    ``--eval-tasks``)."""

    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[dataset][1]
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in _OWN_FIELDS]


_OWN_FIELDS = ("seed", "size")


class ReasoningGymEnv(Environment):
    """One reasoning-gym dataset.

    Args:
        dataset: its registered name (``spell_backward``, ``letter_counting``...).
        params: the dataset's configuration fields (``--task-params``).
        seed: the training stream's seed.
        eval_size: held-out entries.
        system_prompt: the instruction (default: the answer between ``<answer>`` tags).
    Raises:
        StatusError: INVALID_ARGUMENT on ``--task`` when reasoning-gym is missing or the
            dataset unknown (naming the known ones), on ``--task-params`` for a key the
            dataset does not have (naming the ones it has) or values it refuses.
    """

    max_tokens: ClassVar[int] = 32
    eval_tasks: ClassVar[int] = 64

    def __init__(self, dataset: str, params: dict[str, Any] | None = None, *, seed: int = 0,
                 eval_size: int = 64, system_prompt: str = RG_SYSTEM_PROMPT) -> None:
        rg = load_reasoning_gym()
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            raise invalid_argument("--task", f"reasoning-gym has no dataset {dataset!r} "
                                             f"(known: {', '.join(sorted(DATASETS))})")
        self.name = f"reasoning-gym:{dataset}"
        self.system_prompt = system_prompt
        params = dict(params or {})
        valid = dataset_fields(dataset)
        own = sorted(set(params) & set(_OWN_FIELDS))
        if own:
            raise invalid_argument("--task-params", (
                f"{', '.join(own)}: set by gridrl (--seed, --eval-tasks), not here"))
        unknown = sorted(set(params) - set(valid))
        if unknown:
            raise invalid_argument("--task-params", (
                f"{dataset} has no parameter {', '.join(map(repr, unknown))}; its parameters: "
                f"{', '.join(valid)}"))
        try:
            self.train = rg.create_dataset(dataset, seed=seed, size=TRAIN_SIZE, **params)
            self.held = rg.create_dataset(dataset, seed=EVAL_SEED, size=eval_size, **params)
        except (TypeError, ValueError, AssertionError) as e:
            raise invalid_argument("--task-params", f"{dataset}: {e}") from e
        self._eval = [self.held[i] for i in range(eval_size)]
        self._held_questions = {e["question"] for e in self._eval}

    def _item(self, entry: dict[str, Any]) -> TaskItem:
        return TaskItem(prompt=entry["question"],
                        messages=({"role": "system", "content": self.system_prompt},
                                  {"role": "user", "content": entry["question"]}),
                        columns={"answer": str(entry["answer"]), "entry": entry})

    def train_item(self, index: int) -> TaskItem:
        i = index
        while True:
            entry = self.train[i % TRAIN_SIZE]
            if entry["question"] not in self._held_questions:
                return self._item(entry)
            i += TRAIN_SIZE // 2 + 1  # another entry, far from the stream's next ones

    def eval_items(self) -> list[TaskItem]:
        return [self._item(e) for e in self._eval]

    def score(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """The dataset's own ``score_answer`` of each reply's answer."""
        from reasoning_gym.utils import extract_answer

        out = []
        for reply, entry in zip(completions, columns["entry"], strict=True):
            answer = extract_answer(reply)
            out.append(float(self.train.score_answer(
                plain_answer(reply) if answer is None else answer, entry)))
        return out


def plain_answer(reply: str) -> str:
    """The answer of a reply without ``<answer>`` tags: its last non-empty line, after the last
    ``answer is``, ``:`` or ``=`` in it, without surrounding quotes or a final period (small
    models say ``The answer is: "nus".`` or ``1 - 1 = 0.`` before they learn the tags)."""
    lines = [line for line in reply.strip().splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    low = text.lower()
    cut = max(low.rfind("answer is") + len("answer is") if "answer is" in low else -1,
              text.rfind(":") + 1 if ":" in text else -1,
              text.rfind("=") + 1 if "=" in text else -1)
    if cut > 0:
        text = text[cut:]
    return text.strip().strip(":").strip().strip("\"'`").rstrip(".").strip("\"'`").strip()
