"""Held-out eval on the trainer's own weights: greedy episodes of the environment's held-out
items (one greedy completion each for a single-turn task), scored by the eval's scorer
(:class:`~gridrl.trainer.rewards.EvalScorer`: the ``--eval-reward-file`` functions, else the
run's ``--reward-file`` functions, else the environment's own score), which every result names.

An eval of more than :data:`FIRST_BATCH` prompts decodes its first :data:`FIRST_BATCH` first,
then the rest: the first batch's time gives the whole eval's expected time, reported to
``on_progress`` (:class:`EvalProgress`) with the prompts done so far.

The eval never asks a rollout node: a node may hold stale weights, and an eval of those would
report the wrong policy. Every result carries the policy version it measured.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.envs.base import Environment, TaskItem
from gridrl.trainer.envs.chat import ChatDelta, prompt_ids
from gridrl.trainer.envs.episode import EpisodeLimits, reward_columns, run_episodes
from gridrl.trainer.rewards import EvalScorer
from gridrl.trainer.rollouts import EpisodeStats

log = logging.getLogger(__name__)

#: prompts decoded first, whose time gives the eval's expected time
FIRST_BATCH = 16
#: eval episodes kept whole (prompt, every turn, score) for the log, summary and dashboard
EXAMPLES = 3


@dataclass(frozen=True)
class EvalProgress:
    """A held-out eval in progress.

    Attributes:
        done: prompts decoded so far; total: prompts in the eval.
        elapsed_s: seconds since it started.
        expected_s: seconds the whole eval is expected to take, from its first batch (None
            before that batch is done).
    """

    done: int
    total: int
    elapsed_s: float
    expected_s: float | None = None


@dataclass
class EvalResult:
    """A held-out eval.

    Attributes:
        score: mean score over the eval set, in [0, 1] for task scores.
        exact: fraction of completions scoring 1.0.
        policy_version: trainer policy version of the weights measured.
        n: eval prompts.
        seconds: wall-clock time.
        examples: the first :data:`EXAMPLES` episodes, whole (:func:`eval_example`), for the
            log, the summary and the dashboard.
        stderr: standard error of ``score`` as the mean of ``n`` draws,
            ``s / sqrt(n)`` with ``s`` the sample (Bessel-corrected) std of the per-prompt
            scores (0 when ``n < 2``). Two evals of one set differ by more than noise when
            they are ~2 * sqrt(2) stderr apart.
        metrics: the environment's own figures of the eval
            (:meth:`~gridrl.trainer.envs.base.Environment.eval_metrics`, e.g. first- and
            second-attempt success), and for episodes of more than one turn ``turns_mean`` and
            ``truncated`` (the fraction cut by a limit).
        scorer: what scored it, in words (:attr:`gridrl.trainer.rewards.EvalScorer.name`).
        scores: every prompt's score, in the order of the eval's items.
    """

    score: float
    exact: float
    policy_version: int
    n: int
    seconds: float
    examples: list[dict[str, Any]] = field(default_factory=list)
    stderr: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    scorer: str = ""
    scores: tuple[float, ...] = ()


class Evaluator:
    """Greedy eval of an environment's held-out items on the trainer's own weights.

    Args:
        backend: the :class:`gridrl.trainer.backends.base.TrainerBackend` being trained (its
            ``generate`` decodes with the current weights; its tokenizer encodes and decodes).
        env: the :class:`~gridrl.trainer.envs.base.Environment`.
        max_tokens: new tokens per model turn.
        scorer: what scores the eval (None: the environment's own score, named by its
            ``score_name``).
        shared_prefix: let the backend prefill the eval prompts' common prefix (the task's
            system prompt, chat template included) once (the same greedy completions up to
            float rounding of the logits; False: every prompt prefilled whole).
        status_delay_s: an eval still decoding after this many seconds says so, with the
            time it has taken, on a status line (a log line off a terminal,
            :class:`gridrl.common.progress.StatusLine`): a slow backend (MLX's CPU build, a
            large model) is not silence. Evals faster than that show nothing.
        limits: turns and episode tokens (None: the environment's ``max_turns``, no episode
            token limit).
        eval_tasks: ``--eval-tasks``: the first this many of the environment's
            ``eval_items()`` (None: all). An environment that makes its own fixed set (a
            user's Python file) gets the flag too; one that gives fewer is evaluated on all it
            gives, with a warning saying so.
    """

    def __init__(self, backend: Any, env: Environment, *, max_tokens: int,
                 scorer: EvalScorer | None = None, shared_prefix: bool = True,
                 status_delay_s: float = 30.0, limits: EpisodeLimits | None = None,
                 eval_tasks: int | None = None) -> None:
        self.backend = backend
        self.shared_prefix = shared_prefix
        self.status_delay_s = status_delay_s
        self.env = env
        self.max_tokens = max_tokens
        self.limits = limits or EpisodeLimits(max_turns=self.env.max_turns,
                                              max_tokens=max_tokens)
        self.scorer = scorer or EvalScorer(None, self.env.score_name)
        self.tokenizer = backend.tokenizer
        self.items: list[TaskItem] = list(self.env.eval_items())
        if eval_tasks is not None and len(self.items) > eval_tasks:
            self.items = self.items[:eval_tasks]
        elif eval_tasks is not None and len(self.items) < eval_tasks:
            log.warning("--eval-tasks %d: the environment %s gives %d held-out item(s); the eval "
                        "runs on those %d (set --eval-tasks, or the class's eval_tasks, to at "
                        "most %d)", eval_tasks, self.env.name, len(self.items), len(self.items),
                        len(self.items))
        tools = self.env.template_tools()
        self.delta = ChatDelta(self.tokenizer, tools)
        self.prompt_ids = [prompt_ids(self.tokenizer, item.messages, tools)
                           for item in self.items]

    def run(self, policy_version: int,
            on_progress: Callable[[EvalProgress], None] | None = None) -> EvalResult:
        """Run one greedy episode (temperature 0) of every held-out item with the backend and
        score it. ``policy_version`` is the trainer's version, recorded with the result;
        ``on_progress`` hears when it starts, after its first batch (with the expected time)
        and when every prompt is decoded.

        Raises:
            RewardError: a function of the scorer failed (named, with its file).
        """
        from gridrl.common.progress import StatusLine
        from gridrl.trainer.local import LocalRollout

        start = time.perf_counter()
        local = LocalRollout(self.backend, version=lambda: policy_version)
        greedy = SamplingConfig(max_tokens=self.max_tokens, temperature=0.0)
        n = len(self.items)
        report = on_progress or (lambda _progress: None)

        def sample(requests: list[Any]) -> list[Any]:
            return local.sample_turns(requests, greedy, shared_prefix=self.shared_prefix)

        # the first batch alone (its time: the whole eval's expected time), then the rest
        bounds = [0, FIRST_BATCH, n] if n > FIRST_BATCH else [0, n]
        groups: list[Any] = []
        expected = None
        report(EvalProgress(0, n, 0.0))
        with StatusLine(f"held-out eval of policy version {policy_version}: "
                        f"{n} prompts, greedy, on the trainer's weights",
                        delay_s=self.status_delay_s):
            for lo, hi in itertools.pairwise(bounds):
                groups += run_episodes(self.env, self.items[lo:hi], self.prompt_ids[lo:hi],
                                       sample, self.delta, self.limits, group_size=1, seed=0,
                                       decode=lambda ids: self.tokenizer.decode(
                                           ids, skip_special_tokens=True))
                elapsed = time.perf_counter() - start
                if expected is None:
                    expected = elapsed * n / hi
                report(EvalProgress(hi, n, elapsed, expected))
        episodes = [g[0] for g in groups]
        completions = [ep.last_reply for ep in episodes]
        prompts = [item.prompt for item in self.items]
        columns = reward_columns(episodes)
        if self.scorer.rewards is not None:
            scores, _ = self.scorer.rewards(prompts, completions, columns)
            scores = [0.0 if s != s else s for s in scores]  # NaN: no function applied
        else:
            scores = [float(s) for s in self.env.score(prompts, completions, **columns)]
        scores = [0.0 if ep.dropped else s for ep, s in zip(episodes, scores, strict=True)]
        n = len(scores)
        metrics = dict(self.env.eval_metrics(columns, scores))
        if self.limits.max_turns > 1:
            stats = EpisodeStats.of(episodes)
            metrics.update(turns_mean=stats.turns_mean, truncated=stats.truncated / max(n, 1))
        examples = [eval_example(p, ep, s) for p, ep, s
                    in list(zip(prompts, episodes, scores, strict=True))[:EXAMPLES]]
        return EvalResult(score=sum(scores) / n, exact=sum(s >= 1.0 for s in scores) / n,
                          policy_version=policy_version, n=n,
                          seconds=time.perf_counter() - start, examples=examples,
                          stderr=standard_error(scores), metrics=metrics,
                          scorer=self.scorer.name, scores=tuple(scores))


def eval_example(prompt: str, episode: Any, score: float) -> dict[str, Any]:
    """One eval episode for the log, the summary and the dashboard: ``prompt``, ``completion``
    (the model's last reply, what the score is of), ``score``, ``turns`` (model turns) and
    ``transcript``: every message after the prompt in order, ``{"role", "content"}``, the
    model's replies as role ``assistant`` and the environment's turns with the role it gave
    them (``user`` feedback, ``tool`` results...); ``dropped`` and ``error`` when the episode
    was dropped (then its score is 0)."""
    transcript = [{"role": str(m.get("role", "")), "content": _text(m.get("content"))}
                  for m in episode.transcript]
    out: dict[str, Any] = {"prompt": prompt, "completion": episode.last_reply, "score": score,
                           "turns": episode.turns, "transcript": transcript}
    if episode.dropped:
        out |= {"dropped": episode.dropped.value, "error": episode.error}
    return out


def _text(content: Any) -> str:
    """A message's content as text (a list of parts: their ``text`` joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


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
