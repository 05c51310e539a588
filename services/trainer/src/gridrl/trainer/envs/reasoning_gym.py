"""``--task reasoning-gym:<dataset>``: a procedural dataset of reasoning-gym (optional extra
``reasoning-gym``; written against 0.1.25) as a single-turn environment.

Training items are ``create_dataset(name, seed=--seed, **params)[index]`` (reasoning-gym's own
generator: entry ``index`` is drawn with ``Random(seed + index)``); the held-out set is the
first ``eval_size`` entries of the same dataset under :data:`~gridrl.trainer.tasks.EVAL_SEED`,
and a training entry whose question is held out is replaced by the next index's (so the splits
are disjoint). The reward is the dataset's own scorer, ``dataset.score_answer(answer, entry)``,
on the answer inside ``<answer>...</answer>`` (reasoning-gym's convention,
``reasoning_gym.utils.extract_answer``) or, without tags, :func:`plain_answer` of the reply.
"""

from __future__ import annotations

from typing import Any, ClassVar

from gridrl.common.errors import invalid_argument
from gridrl.trainer.envs.base import Environment
from gridrl.trainer.rewards import optional_module
from gridrl.trainer.tasks import EVAL_SEED, TaskItem

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


def parse_params(text: str) -> dict[str, Any]:
    """``"min_word_len=3,max_word_len=5"`` -> ``{"min_word_len": 3, "max_word_len": 5}``
    (values read as JSON when they parse, else kept as strings).

    Raises:
        StatusError: INVALID_ARGUMENT on ``--task-params`` for an entry without ``=``.
    """
    import json

    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise invalid_argument("--task-params", f"{part!r} is not key=value")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


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
            dataset unknown (naming the known ones), on ``--task-params`` when the dataset
            refuses its parameters.
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
