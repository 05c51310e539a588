"""``--task verifiers:<taskset>``: an installed verifiers environment package (optional extra
``verifiers``; written against the ``verifiers.v1`` API of verifiers 0.4.0, read from its
source: ``verifiers/v1/{taskset,task,env,agent}.py``).

In verifiers 0.4 an environment package exports a ``Taskset`` (``load()`` yields ``Task`` s whose
``TaskData`` carries ``prompt`` / ``system_prompt`` and the task's own fields; the ``Task``'s
``@vf.reward`` methods score a run, ``@vf.metric`` ones describe it) and, for control flow other
than one reply, an ``Env`` subclass whose ``async run(task, agents)`` exchanges turns with its
agents (``async with agents.<seat>.interaction(task) as i: segment = await i.turn(message)``).
``verifiers.v1.utils.loaders`` resolves both from the taskset id, as ``vf-eval`` does.

What gridrl does with them, offline and token-exact:

- **Items**: every task of the taskset (a finite one, or its first ``max_tasks``); the held-out
  split is the first ``eval_size`` tasks of a seeded shuffle (:data:`~gridrl.trainer.envs.base.
  EVAL_SEED`), training walks the rest in a fresh seeded permutation each epoch.
- **Turns**: the model is the policy seat. A taskset without an ``Env`` of its own (verifiers'
  ``SingleAgentEnv``) is single-turn: the task's prompt, one reply. An ``Env`` subclass's
  ``run`` is driven as a coroutine: each ``await interaction.turn(message)`` of it becomes an
  environment turn (``message`` appended as a user message) followed by a model turn whose
  reply comes back as the ``Segment``; ``run`` returning ends the episode. An ``Env`` whose
  ``run`` awaits anything else (a harness program, a sandbox, another model as a simulated
  user) cannot run inside gridrl's episode and is dropped with that message (counted).
- **Rewards**: the task's ``@vf.reward`` methods with their weights (a keyed result counts as
  several functions), called with ``task`` (its data) and ``trace`` (:class:`TraceView`: the
  episode's messages as verifiers' message types, ``last_reply``, ``num_turns``...; not a full
  ``vf.Trace``, which records harness programs gridrl does not run). Rewards needing a runtime
  are skipped, as verifiers does offline.

Harness programs, MCP tool servers, sandboxes and judges are verifiers' machinery for agents
in containers; gridrl does not run them.
"""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gridrl.common.errors import invalid_argument
from gridrl.trainer.envs.base import EVAL_SEED, Environment, EnvTurn, Message, TaskItem
from gridrl.trainer.rewards import optional_module

INSTALL_HINT = "pip install 'gridrl-trainer[verifiers]' (verifiers 0.4.x)"


def load_verifiers() -> Any:
    """The ``verifiers.v1`` module.

    Raises:
        StatusError: INVALID_ARGUMENT on ``--task`` naming what to install when it is missing.
    """
    return optional_module("verifiers.v1", "--task", "verifiers", INSTALL_HINT)


# --------------------------------------------------------------------------- driving Env.run

@dataclass
class _Ask:
    """What ``Env.run`` awaits from the policy: its reply to ``message``."""

    message: Any

    def __await__(self):
        reply = yield self
        return reply


class _Interaction:
    async def __aenter__(self) -> _Interaction:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    async def turn(self, message: Any = None) -> Any:
        return await _Ask(message)


class _Seat:
    """Every agent seat of the ``Env``: the policy being trained."""

    trainable = True

    def interaction(self, task: Any, **_: Any) -> _Interaction:
        return _Interaction()

    async def run(self, task: Any, **_: Any) -> Any:
        return await _Ask(None)


class _Agents:
    def __getattr__(self, name: str) -> _Seat:
        return _Seat()


def _text(message: Any) -> str:
    if isinstance(message, str):
        return message
    if isinstance(message, list):  # Messages: the last one's text
        last = message[-1]
        content = last.get("content") if isinstance(last, Mapping) else last.content
        return content if isinstance(content, str) else str(content)
    return str(message)


# --------------------------------------------------------------------------- scoring

@dataclass
class TraceView:
    """What a verifiers reward function reads of a run, for one gridrl episode.

    Attributes:
        messages: the conversation (prompt included) as ``verifiers.v1`` message types.
        state: a dict the ``Env`` and the rewards may share.
        info, metrics, rewards: as ``vf.Trace``'s (filled by nobody here but the rewards).
    """

    messages: list[Any]
    state: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    rewards: dict[str, Any] = field(default_factory=dict)
    is_completed: bool = True

    @property
    def assistant_messages(self) -> list[Any]:
        return [m for m in self.messages if m.role == "assistant"]

    @property
    def last_reply(self) -> str:
        replies = self.assistant_messages
        return (replies[-1].content or "").strip() if replies else ""

    @property
    def num_turns(self) -> int:
        return len(self.assistant_messages)

    @property
    def last_message(self) -> Any:
        return self.messages[-1]

    @property
    def transcript(self) -> str:
        return "\n".join(f"{m.role}: {m.content}" for m in self.messages)


def _vf_messages(vf: Any, messages: list[Message]) -> list[Any]:
    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage,
             "assistant": vf.AssistantMessage}
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            out.append(vf.ToolMessage(tool_call_id=str(i), content=m["content"],
                                      name=m.get("name")))
        else:
            out.append(kinds[m["role"]](content=m["content"]))
    return out


def _call(fn: Callable[..., Any], available: dict[str, Any]) -> Any:
    params = inspect.signature(fn).parameters
    result = fn(**{k: v for k, v in available.items() if k in params})
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


async def _await(x: Any) -> Any:
    return await x


# --------------------------------------------------------------------------- the environment

class VerifiersEnv(Environment):
    """An installed verifiers (0.4, ``verifiers.v1``) taskset and its ``Env``.

    Args:
        taskset_id: the package's taskset id (what ``vf-eval`` takes).
        seed: the training permutation's seed.
        eval_size: held-out tasks.
        max_tasks: tasks read from an infinite taskset.
    Raises:
        StatusError: INVALID_ARGUMENT on ``--task`` when verifiers is missing (naming what to
            install), no taskset of that id is installed, or it has too few tasks.
    """

    max_tokens: ClassVar[int] = 64
    eval_tasks: ClassVar[int] = 16
    max_turns: ClassVar[int] = 4

    def __init__(self, taskset_id: str, *, seed: int = 0, eval_size: int = 16,
                 max_tasks: int = 100_000) -> None:
        self.vf = load_verifiers()
        from verifiers.v1.configs.taskset import TasksetConfig
        from verifiers.v1.envs.single_agent import SingleAgentEnv
        from verifiers.v1.utils.loaders import environment_class, load_taskset

        self.name = f"verifiers:{taskset_id}"
        try:
            taskset = load_taskset(TasksetConfig(id=taskset_id))
        except (ModuleNotFoundError, ImportError, TypeError, AttributeError, ValueError) as e:
            raise invalid_argument("--task", f"no verifiers taskset {taskset_id!r} is "
                                             f"installed (pip install its package): {e}") from e
        tasks = list(taskset if taskset.bounded else taskset.take(max_tasks))
        if len(tasks) <= eval_size:
            raise invalid_argument("--task", f"{self.name}: {len(tasks)} tasks, need more than "
                                             f"--eval-tasks={eval_size} to hold out")
        order = list(range(len(tasks)))
        random.Random(f"verifiers-eval:{EVAL_SEED}").shuffle(order)
        self._eval = [tasks[i] for i in order[:eval_size]]
        self._train = [tasks[i] for i in order[eval_size:]]
        self.seed = seed
        env_cls = environment_class(taskset_id)
        self._env: Any = None
        if env_cls is not SingleAgentEnv:
            self._env = self._build_env(env_cls, taskset_id)
        self.max_turns = 1 if self._env is None else type(self).max_turns  # type: ignore[misc]
        self._weights = self._reward_weights(tasks[0])

    def _build_env(self, env_cls: type, taskset_id: str) -> Any:
        from verifiers.v1.configs.env import EnvConfig
        from verifiers.v1.utils.generic import concrete_type

        config_cls = concrete_type(env_cls, EnvConfig) or EnvConfig
        try:
            return env_cls(config_cls(taskset={"id": taskset_id}))
        except Exception as e:
            raise invalid_argument("--task", f"{self.name}: its Env {env_cls.__name__} could "
                                             f"not be built: {e}") from e

    # items

    def _item(self, task: Any) -> TaskItem:
        data = task.data
        messages: list[dict[str, str]] = []
        if data.system_prompt:
            messages.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages += [{"role": m.role, "content": _text([m])} for m in data.prompt or []]
        return TaskItem(prompt=data.prompt_text, messages=tuple(messages),
                        columns={"vf_task": task})

    def train_item(self, index: int) -> TaskItem:
        epoch, pos = divmod(index, len(self._train))
        perm = list(range(len(self._train)))
        random.Random(f"verifiers-train:{self.seed}:{epoch}").shuffle(perm)
        return self._item(self._train[perm[pos]])

    def eval_items(self) -> list[TaskItem]:
        return [self._item(t) for t in self._eval]

    # turns

    def start(self, item: TaskItem) -> dict[str, Any]:
        if self._env is None:
            return {}
        coro = self._env.run(item.columns["vf_task"], _Agents())
        state: dict[str, Any] = {"run": coro}
        ask = self._advance(state, None)
        if ask is None or ask.message not in (None, item.prompt):
            coro.close()
            raise RuntimeError(f"{type(self._env).__name__}.run does not open with the task's "
                               "prompt")
        return state

    def _advance(self, state: dict[str, Any], reply: Any) -> _Ask | None:
        coro = state["run"]
        try:
            got = coro.send(reply)
        except StopIteration:
            return None
        if not isinstance(got, _Ask):
            coro.close()
            raise RuntimeError(f"{type(self._env).__name__}.run awaited {got!r}, not a turn of "
                               "its agents: gridrl runs verifiers environments whose run() only "
                               "exchanges turns with the policy")
        return got

    def respond(self, item: TaskItem, transcript: list[Message],
                state: dict[str, Any]) -> EnvTurn:
        if self._env is None:
            return EnvTurn(done=True)
        from verifiers.v1.agent import Segment

        reply = self.vf.AssistantMessage(content=transcript[-1]["content"])
        ask = self._advance(state, Segment(messages=[reply]))
        if ask is None:
            return EnvTurn(done=True)
        return EnvTurn([{"role": "user", "content": _text(ask.message)}])

    # rewards

    def _reward_weights(self, task: Any) -> dict[str, float]:
        return {fn.__name__: float(getattr(fn, "_vf_weight", 1.0))
                for fn in task.hooks("reward") if "runtime" not in
                {n for n, p in inspect.signature(fn).parameters.items()
                 if p.default is inspect.Parameter.empty}}

    def _scores(self, item_prompt: str, columns: dict[str, Any], i: int) -> dict[str, float]:
        task = columns["vf_task"][i]
        item = self._item(task)
        transcripts = columns.get("transcript")
        transcript = (transcripts[i] if transcripts
                      else [{"role": "assistant", "content": columns["_reply"][i]}])
        states = columns.get("state")
        state = states[i] if states else {}
        view = TraceView(_vf_messages(self.vf, [*item.messages, *transcript]),
                         state={k: v for k, v in state.items() if k != "run"})
        out: dict[str, float] = {}
        for fn in task.hooks("reward"):
            if fn.__name__ not in self._weights:
                continue
            value = _call(fn, {"task": task.data, "trace": view})
            if isinstance(value, Mapping):
                out.update({str(k): float(v) for k, v in value.items()})
            else:
                out[fn.__name__] = float(value)
        return out

    def reward_funcs(self) -> list[tuple[str, Any, float]]:
        """One function per ``@vf.reward`` of the taskset's tasks, with its weight."""
        def one(name: str) -> Callable[..., list[float]]:
            def reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
                columns = {**columns, "_reply": completions}
                return [self._scores(p, columns, i).get(name, float("nan"))
                        for i, p in enumerate(prompts)]

            reward.__name__ = name
            return reward

        return [(f"verifiers:{n}", one(n), w) for n, w in self._weights.items()]

    def score(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """The weighted mean of the task's rewards (verifiers' trace reward, the weighted
        sum, over the sum of the weights: in [0, 1] when every reward is)."""
        columns = {**columns, "_reply": completions}
        out = []
        for i, p in enumerate(prompts):
            scores = self._scores(p, columns, i)
            total = sum(self._weights.get(k, 1.0) for k in scores) or 1.0
            out.append(sum(self._weights.get(k, 1.0) * v for k, v in scores.items()) / total)
        return out
