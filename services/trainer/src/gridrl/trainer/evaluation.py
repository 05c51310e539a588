"""Held-out eval on the trainer's own weights: greedy decoding of the task's eval set, scored
by the task (or by the run's rewards when the task has no score of its own).

The eval never asks a rollout node: a node may hold stale weights, and an eval of those would
report the wrong policy. Every result carries the policy version it measured.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gridrl.trainer.tasks import Task, TaskItem, encode_chat


@dataclass
class EvalResult:
    """A held-out eval.

    Attributes:
        score: mean score over the eval set, in [0, 1] for task scores.
        exact: fraction of completions scoring 1.0.
        policy_version: trainer policy version of the weights measured.
        n: eval prompts.
        seconds: wall-clock time.
        examples: the first few (prompt, completion, score) for the log.
        stderr: standard error of ``score`` as the mean of ``n`` draws,
            ``s / sqrt(n)`` with ``s`` the sample (Bessel-corrected) std of the per-prompt
            scores (0 when ``n < 2``). Two evals of one set differ by more than noise when
            they are ~2 * sqrt(2) stderr apart.
    """

    score: float
    exact: float
    policy_version: int
    n: int
    seconds: float
    examples: list[dict[str, Any]] = field(default_factory=list)
    stderr: float = 0.0


class Evaluator:
    """Greedy eval of a task's held-out items on the trainer's own weights.

    Args:
        backend: the :class:`gridrl.trainer.backend.TrainerBackend` being trained (its
            ``generate`` decodes with the current weights; its tokenizer encodes and decodes).
        task: the task (its ``eval_items`` and ``score``).
        max_tokens: new tokens per eval completion.
        rewards: the run's :class:`~gridrl.trainer.rewards.RewardSet`, used when the task
            cannot score (a JSONL task without an answer column).
        shared_prefix: let the backend prefill the eval prompts' common prefix (the task's
            system prompt, chat template included) once (the same greedy completions up to
            float rounding of the logits; False: every prompt prefilled whole).
        status_delay_s: an eval still decoding after this many seconds says so, with the
            time it has taken, on a status line (a log line off a terminal,
            :class:`gridrl.common.progress.StatusLine`): a slow backend (MLX's CPU build, a
            large model) is not silence. Evals faster than that show nothing.
    """

    def __init__(self, backend: Any, task: Task, *, max_tokens: int,
                 rewards: Any | None = None, shared_prefix: bool = True,
                 status_delay_s: float = 30.0) -> None:
        self.backend = backend
        self.shared_prefix = shared_prefix
        self.status_delay_s = status_delay_s
        self.task = task
        self.max_tokens = max_tokens
        self.rewards = rewards
        self.tokenizer = backend.tokenizer
        self.items: list[TaskItem] = task.eval_items()
        self.prompt_ids = [encode_chat(self.tokenizer, item.messages) for item in self.items]

    def run(self, policy_version: int) -> EvalResult:
        """Decode every eval prompt greedily (temperature 0) with the backend and score it.
        ``policy_version`` is the trainer's version, recorded with the result."""
        from gridrl.common.progress import StatusLine
        from gridrl.engine.contract import SamplingConfig

        start = time.perf_counter()
        config = SamplingConfig(max_tokens=self.max_tokens, temperature=0.0)
        with StatusLine(f"held-out eval of policy version {policy_version}: "
                        f"{len(self.prompt_ids)} prompts, greedy, on the trainer's weights",
                        delay_s=self.status_delay_s):
            results = self.backend.generate(self.prompt_ids, config,
                                            [0] * len(self.prompt_ids),
                                            shared_prefix=self.shared_prefix)
        completions = [self.tokenizer.decode(r.token_ids, skip_special_tokens=True)
                       for r in results]
        prompts = [item.prompt for item in self.items]
        columns: dict[str, list[Any]] = {}
        for item in self.items:
            for key in item.columns:
                columns.setdefault(key, [])
        for key in columns:
            columns[key] = [item.columns.get(key) for item in self.items]
        if getattr(self.task, "has_answer", True):
            scores = [float(s) for s in self.task.score(prompts, completions, **columns)]
        elif self.rewards is not None:
            columns["completion_ids"] = [list(r.token_ids) for r in results]
            scores, _ = self.rewards(prompts, completions, columns)
        else:
            raise ValueError(f"task {self.task.name} cannot score its eval set")
        n = len(scores)
        examples = [{"prompt": p, "completion": c, "score": s}
                    for p, c, s in list(zip(prompts, completions, scores, strict=True))[:3]]
        return EvalResult(score=sum(scores) / n, exact=sum(s >= 1.0 for s in scores) / n,
                          policy_version=policy_version, n=n,
                          seconds=time.perf_counter() - start, examples=examples,
                          stderr=standard_error(scores))


def standard_error(scores: Sequence[float]) -> float:
    """Standard error of the mean of ``scores``: ``sqrt(sum (x - mean)^2 / (n - 1)) / sqrt(n)``
    (0 for fewer than 2 scores). For scores in [0, 1] it is at most ``0.5 / sqrt(n - 1)``:
    279 prompts keep it <= 0.03 whatever the scores."""
    n = len(scores)
    if n < 2:
        return 0.0
    mean = sum(scores) / n
    var = sum((x - mean) ** 2 for x in scores) / (n - 1)
    return math.sqrt(var / n)
