"""The environment interface: what an episode is, and what the trainer asks of an environment.

An episode starts from a :class:`TaskItem` (chat messages and columns).
The model answers (a *model turn*); the environment reads the answer and either ends the
episode or appends messages (an *environment turn*: user feedback, tool results), and the model
answers again, until the environment says done or a limit cuts the episode (``--max-turns``,
``--max-episode-tokens``). The reward comes from the environment's reward functions, in TRL's
signature ``f(prompts, completions, **columns) -> list[float]`` and combined with weights
(:class:`gridrl.trainer.rewards.RewardSet`):

- ``prompts[i]``: the item's prompt text; ``completions[i]``: the model's last reply (text);
- the item's columns (``answer``...), ``completion_ids`` (every id after the prompt: model and
  environment tokens), and for episodes ``transcript`` (the messages after the prompt, TRL's
  conversational form: ``[{"role": "assistant", "content": ...}, {"role": "user", ...}, ...]``),
  ``turns`` (model turns), ``truncated`` (None, ``"max_turns"`` or ``"max_episode_tokens"``)
  and ``state`` (the environment's own dict of the episode).

A single-turn task is the one-turn case (the default :meth:`Environment.respond`; the built-in
``reverse-words`` of :mod:`.reverse` and a JSONL file's :mod:`.jsonl`). Items are deterministic
by index, so a run's data position is one integer and a resumed run continues with exactly the
next item; the held-out items are disjoint from the training ones. This is the shape of verifiers'
``MultiTurnEnv`` (``env_response`` / ``is_completed`` over a message list, a rubric of weighted
reward functions) and of TRL's reward functions.

Writing one (the README's "Your own environment")::

    class Guess(Environment):
        name = "guess"
        def train_item(self, index): ...          # TaskItem(prompt, messages, columns)
        def eval_items(self): ...                 # the held-out items
        def respond(self, item, transcript, state):
            if transcript[-1]["content"].strip() == item.columns["answer"]:
                return EnvTurn(done=True)
            return EnvTurn([{"role": "user", "content": "No. Again."}])
        def score(self, prompts, completions, answer, **_):
            return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gridrl.trainer.envs.chat import tool_schema
from gridrl.trainer.rewards import RewardFunc

Message = dict[str, Any]

#: fixed: the same held-out set for every run, whatever ``--seed``
EVAL_SEED = 20240601


@dataclass(frozen=True)
class TaskItem:
    """One item (prompt) of an environment.

    Attributes:
        prompt: the text reward functions receive as ``prompts[i]`` (the user's request).
        messages: chat messages ``[{"role", "content"}, ...]`` to render with the tokenizer's
            chat template (a generation prompt is added when rendering).
        columns: extra columns passed to reward functions by name (e.g. ``answer``).
    """

    prompt: str
    messages: tuple[dict[str, str], ...]
    columns: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvTurn:
    """What the environment does after a model turn.

    Attributes:
        messages: messages appended to the conversation (``user`` or ``tool`` roles), shown
            to the model in its next turn; ignored when ``done``.
        done: the episode ends here (its reward is computed on the conversation so far).
        counts: counters of this turn, summed over the episode (e.g. ``tool_calls``,
            ``tool_errors``, ``tool_timeouts``), reported per step.
    """

    messages: tuple[Message, ...] | list[Message] = ()
    done: bool = False
    counts: dict[str, int] = field(default_factory=dict)


class Environment(abc.ABC):
    """An environment: a source of items (prompts), the turns that follow a model reply, and
    the rewards of an episode.

    Class attributes (defaults of the run's flags when this environment is chosen):
        name: shown in logs and the reward function names.
        max_tokens: ``--max-tokens`` (new tokens per model turn).
        eval_tasks: ``--eval-tasks`` (held-out items).
        max_turns: ``--max-turns`` (model turns per episode; 1: single-turn).
        checked_at_start: the run calls its own reward functions once before the model
            loads, on its first training and eval item with a dummy completion (they need no
            episode state): a JSONL file without its answer column fails there, in one line.

    Threading: one episode's calls come in order; calls of different episodes may interleave
    (never overlap) on the thread that runs the episodes. Keep per-episode data in ``state``.
    """

    name: str = "environment"
    max_tokens: ClassVar[int] = 40
    eval_tasks: ClassVar[int] = 16
    max_turns: ClassVar[int] = 1
    checked_at_start: ClassVar[bool] = False

    @abc.abstractmethod
    def train_item(self, index: int) -> TaskItem:
        """The ``index``-th training item (deterministic: index = data position)."""

    @abc.abstractmethod
    def eval_items(self) -> list[TaskItem]:
        """The held-out items (deterministic, disjoint from the training items)."""

    def prepare(self, tokenizer: Any) -> None:
        """Called once with the run's tokenizer after the model loads, before any item is
        asked for (e.g. a tool environment reads the chat template's tool format). Nothing by
        default."""
        return None

    def tools(self) -> list[Callable[..., Any]]:
        """Functions offered to the model through the chat template (``tools=``); none by
        default (:class:`gridrl.trainer.envs.tools.ToolEnv` offers its own)."""
        return []

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template gets as ``tools=`` when rendering this environment's
        conversations: the JSON schemas of :meth:`tools` (None without tools)."""
        if not self.tools():
            return None
        return [tool_schema(f) for f in self.tools()]

    def start(self, item: TaskItem) -> dict[str, Any]:
        """A fresh ``state`` for an episode of ``item`` (passed to :meth:`respond` and to the
        reward functions)."""
        return {}

    def respond(self, item: TaskItem, transcript: list[Message],
                state: dict[str, Any]) -> EnvTurn:
        """The environment turn after a model turn. ``transcript`` holds the messages after
        the prompt, the model's reply last (``{"role": "assistant", "content": text}``).
        Default: done after the first reply (single-turn). An exception drops the episode
        (counted, logged with its message); the step goes on."""
        return EnvTurn(done=True)

    @abc.abstractmethod
    def score(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """The environment's own score in [0, 1] per episode (TRL's signature; columns as in
        the module docstring): the held-out eval is its mean under greedy decoding, and it is
        the reward unless :meth:`reward_funcs` says otherwise."""

    @property
    def score_name(self) -> str:
        """What :meth:`score` measures, in words: the held-out eval's scorer when the run has
        no ``--reward-file`` (console, ``log.jsonl``, ``summary.json``, the plot)."""
        return f"{self.name} score"

    def reward_funcs(self) -> list[tuple[str, RewardFunc, float]]:
        """``(name, function, weight)`` of each reward function (TRL's signature), combined
        as TRL's weighted nansum. Default: :meth:`score` with weight 1."""
        return [(f"{self.name}:score", self.score, 1.0)]

    def eval_metrics(self, columns: dict[str, list[Any]], scores: Sequence[float]
                     ) -> dict[str, float]:
        """Extra figures of a held-out eval (e.g. first- and second-attempt success), from the
        reward columns of its episodes and their scores; none by default."""
        return {}
