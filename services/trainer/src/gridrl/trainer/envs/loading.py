"""``--task``: the environment a run trains on, by name.

==============================  ===========================================================
``--task``                      environment
==============================  ===========================================================
``reverse-words``               the built-in task, single-turn (:class:`.reverse.ReverseWords`)
``reverse-words-retry``         reverse-words with feedback and a second attempt (:mod:`.reverse`)
``tool-arithmetic``             arithmetic with ``add`` / ``multiply`` tools (:mod:`.tools`)
``reasoning-gym:<dataset>``     a reasoning-gym dataset (extra ``reasoning-gym``; :mod:`.reasoning_gym`)
``verifiers:<environment>``     an installed verifiers environment (extra ``verifiers``; :mod:`.verifiers`)
``path/to/env.py``              a user's :class:`~gridrl.trainer.envs.base.Environment` subclass
``path/to/data.jsonl``          a JSONL file of prompts (or chat ``messages``) and answers (:mod:`.jsonl`)
==============================  ===========================================================

:func:`make_environment` needs no model: the run calls it before loading one, so a ``--task``
naming a missing extra, an unknown dataset or a broken file fails in one line first.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from gridrl.common.errors import StatusError, invalid_argument
from gridrl.trainer.envs.base import Environment
from gridrl.trainer.rewards import import_file

BUILTIN = ("reverse-words", "reverse-words-retry", "tool-arithmetic")

#: kind of ``--task`` (:func:`task_kind`) -> (module under ``gridrl.trainer.envs``, class);
#: imported when asked for (reasoning-gym and verifiers import their extra only when built)
CLASSES = {"reverse-words": ("reverse", "ReverseWords"),
           "reverse-words-retry": ("reverse", "ReverseWordsRetry"),
           "tool-arithmetic": ("tools", "ToolArithmetic"),
           "reasoning-gym:": ("reasoning_gym", "ReasoningGymEnv"),
           "verifiers:": ("verifiers", "VerifiersEnv"),
           ".jsonl": ("jsonl", "JsonlEnv")}


def task_kind(spec: str) -> str:
    """Which row of the module's table ``--task`` ``spec`` names: a built-in name,
    ``"reasoning-gym:"``, ``"verifiers:"``, ``".py"``, ``".jsonl"`` (a ``.jsonl`` path, or any
    other existing file that is not ``.py``), or ``""`` for none."""
    if spec in BUILTIN:
        return spec
    for prefix in ("reasoning-gym:", "verifiers:"):
        if spec.startswith(prefix):
            return prefix
    if spec.endswith(".py"):
        return ".py"
    if spec.endswith(".jsonl") or Path(spec).is_file():
        return ".jsonl"
    return ""


def _class_of(kind: str) -> Any:
    module, name = CLASSES[kind]
    return getattr(importlib.import_module(f"gridrl.trainer.envs.{module}"), name)


def make_environment(spec: str, *, seed: int, eval_size: int, min_words: int = 3,
                     max_words: int = 4, prompt_column: str = "prompt",
                     answer_column: str = "answer", system_prompt: str | None = None,
                     eval_file: str | None = None, task_params: str = "") -> Environment:
    """The environment named by ``--task`` (module docstring).

    Raises:
        StatusError: INVALID_ARGUMENT on ``--task`` for an unknown name, a missing extra
            (naming what to install), an unknown dataset or a file that does not define an
            environment; on ``--task-params`` for parameters the dataset refuses.
    """
    kind = task_kind(spec)
    if not kind:
        raise invalid_argument("--task", f"{spec!r} is none of {', '.join(BUILTIN)}, "
                                         "reasoning-gym:<dataset>, verifiers:<environment>, a "
                                         ".py file or a .jsonl file")
    if kind == ".py":
        return load_environment_file(Path(spec), seed=seed, eval_size=eval_size)
    cls = _class_of(kind)
    system = {"system_prompt": system_prompt} if system_prompt else {}
    if kind == "reverse-words":
        return cls(seed=seed, min_words=min_words, max_words=max_words, eval_size=eval_size,
                   **system)
    if kind == "reverse-words-retry":
        return cls(seed=seed, min_words=min_words, max_words=max_words, eval_size=eval_size,
                   system_prompt=system_prompt)
    if kind == "reasoning-gym:":
        from gridrl.trainer.envs.reasoning_gym import parse_params

        return cls(spec.split(":", 1)[1], parse_params(task_params), seed=seed,
                   eval_size=eval_size, **system)
    if kind == "verifiers:":
        return cls(spec.split(":", 1)[1], seed=seed, eval_size=eval_size)
    if kind == ".jsonl":
        return cls(Path(spec), seed=seed, eval_size=eval_size, prompt_column=prompt_column,
                   answer_column=answer_column, system_prompt=system_prompt,
                   eval_path=Path(eval_file) if eval_file else None)
    return cls(seed=seed, eval_size=eval_size)  # tool-arithmetic


def environment_defaults(spec: str) -> type[Environment] | Environment:
    """The class whose ``max_tokens`` / ``eval_tasks`` / ``max_turns`` are the flags' defaults
    for ``--task`` ``spec`` (a class attribute read, nothing imported that is optional)."""
    kind = task_kind(spec)
    if kind == ".py":
        try:
            return environment_in_file(Path(spec))
        except StatusError:  # the pre-flight check and the run's build report it
            return Environment
    return _class_of(kind) if kind else Environment


def default_max_tokens(spec: str) -> int:
    """``--max-tokens``' default for the task named by ``--task`` (``spec``): new tokens per
    model turn that its answers need (``reverse-words``: 24; a JSONL file: 40; other
    environments: their class's ``max_tokens``)."""
    return environment_defaults(spec).max_tokens


def default_eval_tasks(spec: str) -> int:
    """``--eval-tasks``' default for the task named by ``--task`` (``spec``): held-out eval
    prompts (``reverse-words``: 128 generated phrases; a JSONL file: 16 of its rows; other
    environments: their class's ``eval_tasks``)."""
    return environment_defaults(spec).eval_tasks


def load_environment_file(path: Path, *, seed: int, eval_size: int) -> Environment:
    """The environment a user's Python file defines: its ``ENVIRONMENT`` (a class or an
    instance) when set, else the one :class:`Environment` subclass defined in the file. A class
    is built with the keyword arguments it accepts among ``seed`` and ``eval_size``.

    Raises:
        StatusError: INVALID_ARGUMENT on ``--task`` when the file is missing, fails to import,
            defines no environment or several without ``ENVIRONMENT``, or its class fails to
            build.
    """
    chosen = environment_in_file(path)
    if isinstance(chosen, Environment):
        return chosen
    params = inspect.signature(chosen).parameters
    kw = {k: v for k, v in (("seed", seed), ("eval_size", eval_size)) if k in params}
    try:
        return chosen(**kw)
    except Exception as e:
        raise invalid_argument("--task", f"{path}: {chosen.__name__}() failed: {e!r}") from e


def environment_in_file(path: Path) -> type[Environment] | Environment:
    """What a user's Python file offers to run (:func:`load_environment_file`): its
    ``ENVIRONMENT``, or its one :class:`Environment` subclass; not built.

    Raises:
        StatusError: INVALID_ARGUMENT on ``--task`` (see :func:`load_environment_file`).
    """
    module = import_file(path, "--task")
    chosen = getattr(module, "ENVIRONMENT", None)
    if chosen is None:
        found = [c for c in vars(module).values()
                 if inspect.isclass(c) and issubclass(c, Environment)
                 and c.__module__ == module.__name__ and not inspect.isabstract(c)]
        if len(found) != 1:
            raise invalid_argument("--task", f"{path}: defines {len(found)} Environment "
                                             "subclasses; set ENVIRONMENT = <the one to run>")
        chosen = found[0]
    if isinstance(chosen, Environment) or (inspect.isclass(chosen)
                                           and issubclass(chosen, Environment)):
        return chosen
    raise invalid_argument("--task", f"{path}: ENVIRONMENT is not an Environment")
