"""Reward functions with TRL's signature, loaded from ``--reward-file`` and combined.

A reward function is ``f(prompts, completions, **columns) -> list[float]`` exactly as in TRL's
GRPOTrainer (standard, non-conversational format): ``prompts[i]`` and ``completions[i]`` are
strings, every dataset column arrives as a keyword list aligned with them, plus
``completion_ids`` (list of token-id lists). An entry may be ``None`` when the function does not
apply to that sample; like TRL, the combined reward is the weighted ``nansum`` over functions.

A ``--reward-file`` is a Python file; the functions used are its ``REWARD_FUNCS`` list when it
defines one, else every public top-level function defined in the file itself. Built-ins can be
imported there, e.g. ``from gridrl.trainer.tasks import similarity_reward``.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gridrl.common.errors import invalid_argument

RewardFunc = Callable[..., Sequence[float | None]]


def load_reward_file(path: str | Path) -> list[tuple[str, RewardFunc]]:
    """Import ``path`` and return its reward functions as ``(name, function)`` pairs.

    Raises:
        StatusError: INVALID_ARGUMENT on ``--reward-file`` when the file is missing, fails to
            import, defines no function, or a function cannot take ``(prompts, completions)``.
    """
    p = Path(path)
    module = import_file(p, "--reward-file")
    mod_name = module.__name__
    listed = getattr(module, "REWARD_FUNCS", None)
    if listed is not None:
        funcs = [getattr(module, f) if isinstance(f, str) else f for f in listed]
    else:
        funcs = [f for name, f in vars(module).items()
                 if inspect.isfunction(f) and not name.startswith("_")
                 and f.__module__ == mod_name]
    if not funcs:
        raise invalid_argument("--reward-file", f"{p}: defines no reward function")
    out = []
    for f in funcs:
        if not callable(f):
            raise invalid_argument("--reward-file", f"{p}: {f!r} is not callable")
        _check_signature(f, p)
        out.append((getattr(f, "__name__", repr(f)), f))
    return out


def import_file(path: Path, flag: str) -> Any:
    """Import the Python file ``path`` as a module of its own (a user's reward or environment
    file).

    Raises:
        StatusError: INVALID_ARGUMENT on ``flag`` when the file is missing or fails to import.
    """
    if not path.is_file():
        raise invalid_argument(flag, f"{path}: no such file")
    name = f"gridrl_user_file_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise invalid_argument(flag, f"{path}: cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise invalid_argument(flag, f"{path}: import failed: {e!r}") from e
    return module


def optional_module(name: str, flag: str, what: str, hint: str) -> Any:
    """Import ``name``, an optional extra's module.

    Raises:
        StatusError: INVALID_ARGUMENT on ``flag`` saying ``what`` is not installed and ``hint``
            (the command that installs it) when the import fails.
    """
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise invalid_argument(flag, f"{what} is not installed: {hint}") from e


def _check_signature(f: RewardFunc, path: Path) -> None:
    try:
        inspect.signature(f).bind(prompts=[], completions=[])
    except TypeError as e:
        # Missing required column arguments are fine (they come as keywords); anything else
        # means f cannot be called as f(prompts=..., completions=...).
        params = inspect.signature(f).parameters
        if "prompts" not in params and not any(
                p.kind is p.VAR_KEYWORD for p in params.values()):
            raise invalid_argument("--reward-file", f"{path}: {f.__name__} must accept "
                                                    f"(prompts, completions, **kwargs): {e}") from e


def parse_weights(text: str | None, count: int) -> list[float]:
    """``"1,0.5"`` -> ``[1.0, 0.5]``; None/empty -> ``[1.0] * count``.

    Raises:
        StatusError: INVALID_ARGUMENT on ``--reward-weights`` for a non-number or a count that
            differs from the number of reward functions.
    """
    if not text:
        return [1.0] * count
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError as e:
        raise invalid_argument("--reward-weights", f"{text!r} is not a comma-separated list of "
                                                   "numbers") from e
    if len(weights) != count:
        raise invalid_argument("--reward-weights", f"{len(weights)} weights for {count} reward "
                                                   "functions")
    return weights


@dataclass
class RewardSet:
    """Several reward functions combined with weights (TRL's ``reward_weights``)."""

    funcs: list[tuple[str, RewardFunc]]
    weights: list[float]

    def __post_init__(self) -> None:
        if len(self.funcs) != len(self.weights):
            raise ValueError("one weight per reward function")
        self._accepts = [_accepted_keywords(f) for _, f in self.funcs]

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.funcs]

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 columns: Mapping[str, Sequence[Any]]) -> tuple[list[float], dict[str, list[float]]]:
        """Score ``len(completions)`` samples.

        Args:
            prompts, completions: aligned strings.
            columns: keyword lists aligned with them (dataset columns, ``completion_ids``).
        Returns:
            ``(total, per_function)``: the weighted nansum per sample, and each function's raw
            values (NaN for None).
        Raises:
            ValueError: a function returned the wrong number of values or a non-number.
        """
        n = len(completions)
        per: dict[str, list[float]] = {}
        totals = [0.0] * n
        for (name, f), w, accepts in zip(self.funcs, self.weights, self._accepts, strict=True):
            kwargs = dict(columns) if accepts is None else {
                k: v for k, v in columns.items() if k in accepts}
            values = f(prompts=list(prompts), completions=list(completions), **kwargs)
            values = list(values)
            if len(values) != n:
                raise ValueError(f"reward function {name} returned {len(values)} values for "
                                 f"{n} completions")
            clean = []
            for v in values:
                if v is None:
                    clean.append(math.nan)
                    continue
                try:
                    clean.append(float(v))
                except (TypeError, ValueError) as e:
                    raise ValueError(f"reward function {name} returned {v!r}") from e
            per[name] = clean
            for i, v in enumerate(clean):
                if not math.isnan(v):
                    totals[i] += w * v
        return totals, per


def _accepted_keywords(f: RewardFunc) -> set[str] | None:
    """None when ``f`` takes ``**kwargs`` (gets every column), else its parameter names."""
    params = inspect.signature(f).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def build_reward_set(task: Any, reward_files: Sequence[str], weights: str | None) -> RewardSet:
    """The run's rewards: the functions of every ``--reward-file`` (in order), or, with none,
    the environment's own (``task.reward_funcs()``: ``(name, function, weight)`` each, e.g.
    reverse-words-retry's attempt reward or a verifiers rubric) or, for a plain task, its
    score. ``weights`` is ``--reward-weights`` (it replaces the environment's weights)."""
    funcs: list[tuple[str, RewardFunc]] = []
    for path in reward_files:
        funcs.extend(load_reward_file(path))
    if funcs:
        return RewardSet(funcs, parse_weights(weights, len(funcs)))
    own = getattr(task, "reward_funcs", None)
    if own is None:
        funcs = [(f"{task.name}:score", task.score)]
        return RewardSet(funcs, parse_weights(weights, 1))
    listed = own()
    env_weights = [float(w) for _, _, w in listed]
    return RewardSet([(n, f) for n, f, _ in listed],
                     parse_weights(weights, len(listed)) if weights else env_weights)
