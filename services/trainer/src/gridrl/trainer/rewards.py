"""Reward functions with TRL's signature, loaded from ``--reward-file`` and combined.

A reward function is ``f(prompts, completions, **columns) -> list[float]`` exactly as in TRL's
GRPOTrainer (standard, non-conversational format): ``prompts[i]`` and ``completions[i]`` are
strings, every dataset column arrives as a keyword list aligned with them, plus
``completion_ids`` (list of token-id lists). An entry may be ``None`` when the function does not
apply to that sample; like TRL, the combined reward is the weighted ``nansum`` over functions.

A ``--reward-file`` is a Python file; the functions used are its ``REWARD_FUNCS`` list when it
defines one, else every public top-level function defined in the file itself. Built-ins can be
imported there, e.g. ``from gridrl.trainer.envs.similarity import similarity_reward``.

Reward bugs surface early and in one line: :func:`check_reward_functions` calls every function
once at start-up, before the model loads, on one row of the task with a dummy completion (a
function that needs a column the rows lack is named with its file and the column), and a
function that raises or returns the wrong number of values mid-run is a :class:`RewardError`
naming the function, its file and the step.
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

#: the completion a reward function is called with at start-up (:func:`check_reward_functions`)
DUMMY_COMPLETION = "gridrl start-up check"


class RewardError(RuntimeError, ValueError):
    """A reward function failed: it raised, or returned the wrong number of values or a
    non-number. A RuntimeError, so a run failing on it checkpoints its finished steps and
    exits non-zero (:mod:`gridrl.trainer.run.driver`); a ValueError, as a bad value.

    Attributes:
        function: the function's name; source: its file's name (or module).
        problem: what went wrong, in words; step: the step it happened at (None: not known).
    """

    def __init__(self, function: str, source: str, problem: str, step: int | None = None) -> None:
        self.function, self.source, self.problem, self.step = function, source, problem, step
        where = f" at step {step}" if step is not None else ""
        super().__init__(f"reward function {function} ({source}){where}: {problem}")

    def at_step(self, step: int) -> RewardError:
        """The same error, saying the step it happened at."""
        return RewardError(self.function, self.source, self.problem, step)


def source_of(f: Any) -> str:
    """Where reward function ``f`` is defined, for messages: its file's name
    (``upper_reward.py``), else its module, else ``"?"``."""
    code = getattr(f, "__code__", None) or getattr(getattr(f, "__func__", None), "__code__", None)
    if code is not None and code.co_filename and not code.co_filename.startswith("<"):
        return Path(code.co_filename).name
    return getattr(f, "__module__", None) or "?"


def load_reward_file(path: str | Path, flag: str = "--reward-file"
                     ) -> list[tuple[str, RewardFunc]]:
    """Import ``path`` and return its reward functions as ``(name, function)`` pairs.

    Raises:
        StatusError: INVALID_ARGUMENT on ``flag`` when the file is missing, fails to import,
            defines no function, or a function cannot take ``(prompts, completions)``.
    """
    p = Path(path)
    module = import_file(p, flag)
    mod_name = module.__name__
    listed = getattr(module, "REWARD_FUNCS", None)
    if listed is not None:
        funcs = [getattr(module, f) if isinstance(f, str) else f for f in listed]
    else:
        funcs = [f for name, f in vars(module).items()
                 if inspect.isfunction(f) and not name.startswith("_")
                 and f.__module__ == mod_name]
    if not funcs:
        raise invalid_argument(flag, f"{p}: defines no reward function")
    out = []
    for f in funcs:
        if not callable(f):
            raise invalid_argument(flag, f"{p}: {f!r} is not callable")
        _check_signature(f, p, flag)
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
        sys.modules.pop(name, None)
        raise invalid_argument(flag, import_error_message(path, e)) from e
    return module


def import_error_message(path: Path, error: BaseException) -> str:
    """What went wrong importing the user's file ``path``, as one line a user can act on:
    ``FILE:LINE[:COL]: import failed: <Type>: <message>``, plus the offending source text for a
    syntax error (``env.py:3:9: import failed: SyntaxError: invalid syntax: 'class X(:'``).
    The line is the syntax error's, else that of the innermost frame in ``path`` (the file's
    line that raised, or called what raised), else absent."""
    where, detail = str(path), ""
    if isinstance(error, SyntaxError):
        if error.lineno is not None:
            where += f":{error.lineno}" + (f":{error.offset}" if error.offset else "")
        message = error.msg
        if error.text and error.text.strip():
            detail = f": {error.text.strip()!r}"
    else:
        message = str(error)
        target = str(path.resolve())
        frame_line = None
        tb = error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename in (target, str(path)):
                frame_line = tb.tb_lineno
            tb = tb.tb_next
        if frame_line is not None:
            where += f":{frame_line}"
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return f"{where}: import failed: {text}{detail}"


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


def _check_signature(f: RewardFunc, path: Path, flag: str) -> None:
    try:
        inspect.signature(f).bind(prompts=[], completions=[])
    except TypeError as e:
        # Missing required column arguments are fine (they come as keywords); anything else
        # means f cannot be called as f(prompts=..., completions=...).
        params = inspect.signature(f).parameters
        if "prompts" not in params and not any(
                p.kind is p.VAR_KEYWORD for p in params.values()):
            raise invalid_argument(flag, f"{path}: {f.__name__} must accept "
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
        """The functions' names, in order."""
        return [n for n, _ in self.funcs]

    def describe(self) -> str:
        """The functions in words, e.g. ``"reward upper (upper_reward.py)"`` or ``"rewards
        a (r.py) x 1, b (r.py) x 0.5"`` (at most 256 characters: the wire's bound)."""
        parts = [f"{n} ({source_of(f)})" + (f" x {w:g}" if len(self.funcs) > 1 else "")
                 for (n, f), w in zip(self.funcs, self.weights, strict=True)]
        text = ("reward " if len(parts) == 1 else "rewards ") + ", ".join(parts)
        return text if len(text) <= 256 else text[:253] + "..."

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
            RewardError: a function raised, needs a column ``columns`` lacks, or returned
                the wrong number of values or a non-number (a ValueError too).
        """
        n = len(completions)
        per: dict[str, list[float]] = {}
        totals = [0.0] * n
        for (name, f), w, accepts in zip(self.funcs, self.weights, self._accepts, strict=True):
            kwargs = dict(columns) if accepts is None else {
                k: v for k, v in columns.items() if k in accepts}
            missing = missing_columns(f, columns)
            if missing:
                raise RewardError(name, source_of(f), f"needs column {missing[0]!r}, which the "
                                  f"rows lack (they have {', '.join(sorted(columns)) or 'none'})")
            try:
                values = list(f(prompts=list(prompts), completions=list(completions), **kwargs))
            except Exception as e:
                raise RewardError(name, source_of(f), f"raised {type(e).__name__}: {e}") from e
            if len(values) != n:
                raise RewardError(name, source_of(f), f"returned {len(values)} values for {n} "
                                  "completions")
            clean = []
            for v in values:
                if v is None:
                    clean.append(math.nan)
                    continue
                try:
                    clean.append(float(v))
                except (TypeError, ValueError) as e:
                    raise RewardError(name, source_of(f), f"returned {v!r}, not a number "
                                      "or None") from e
            per[name] = clean
            for i, v in enumerate(clean):
                if not math.isnan(v):
                    totals[i] += w * v
        return totals, per


def missing_columns(f: RewardFunc, columns: Mapping[str, Any]) -> list[str]:
    """The parameters ``f`` requires (no default) that are neither ``prompts`` /
    ``completions`` nor a key of ``columns``: the columns it needs that the rows lack."""
    try:
        params = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to tell
        return []
    return [p.name for p in params
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in ("prompts", "completions") and p.name not in columns]


def check_reward_functions(rewards: RewardSet, items: Sequence[Any], what: str) -> None:
    """Call every function of ``rewards`` once, before the model loads, on each of ``items``
    (task items: the first training row, the first eval row) with a dummy completion, the
    row's columns and the columns every episode adds (``completion_ids``, ``transcript``,
    ``turns``, ``truncated``, ``state``).

    Raises:
        StatusError: INVALID_ARGUMENT on ``what`` (``--reward-file``, ``--eval-reward-file``)
            in one line naming the function, its file and what failed (e.g. the column it
            needs that the rows lack).
    """
    for item in items:
        columns: dict[str, list[Any]] = {k: [v] for k, v in item.columns.items()}
        columns.update({
            "completion_ids": [[0]], "turns": [1], "truncated": [None], "state": [{}],
            "transcript": [[{"role": "assistant", "content": DUMMY_COMPLETION}]]})
        try:
            rewards([item.prompt], [DUMMY_COMPLETION], columns)
        except RewardError as e:
            raise invalid_argument(what, f"{e} (called at start-up on a row of the task with "
                                         "a dummy completion)") from None


def _accepted_keywords(f: RewardFunc) -> set[str] | None:
    """None when ``f`` takes ``**kwargs`` (gets every column), else its parameter names."""
    params = inspect.signature(f).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def build_reward_set(env: Any, reward_files: Sequence[str], weights: str | None) -> RewardSet:
    """The run's rewards: the functions of every ``--reward-file`` (in order), or, with none,
    the environment's own (``env.reward_funcs()``: ``(name, function, weight)`` each, e.g.
    its score, reverse-words-retry's attempt reward or a verifiers rubric). ``weights`` is
    ``--reward-weights`` (it replaces the environment's weights).

    Args:
        env: the run's :class:`~gridrl.trainer.envs.base.Environment`.
    """
    funcs: list[tuple[str, RewardFunc]] = []
    for path in reward_files:
        funcs.extend(load_reward_file(path))
    if funcs:
        return RewardSet(funcs, parse_weights(weights, len(funcs)))
    listed = env.reward_funcs()
    env_weights = [float(w) for _, _, w in listed]
    return RewardSet([(n, f) for n, f, _ in listed],
                     parse_weights(weights, len(listed)) if weights else env_weights)


@dataclass(frozen=True)
class EvalScorer:
    """What scores the held-out eval.

    Attributes:
        rewards: the reward functions that score it (combined as the run's), or None: the
            environment's own score (:meth:`~gridrl.trainer.envs.base.Environment.score`).
        name: the scorer in words, shown on the console, in ``log.jsonl``, ``summary.json``,
            the plot's title and ``GetRunStatus`` (at most 256 characters).
    """

    rewards: RewardSet | None
    name: str


def build_eval_scorer(env: Any, run_rewards: RewardSet, reward_files: Sequence[str],
                      eval_reward_files: Sequence[str]) -> EvalScorer:
    """The eval's scorer: the functions of every ``--eval-reward-file`` (weight 1 each) when
    given; else the run's own rewards when ``--reward-file`` replaced the task's score (the eval
    measures what the run trains on); else the environment's own score (its ``score_name``
    says what it is)."""
    if eval_reward_files:
        funcs = [f for path in eval_reward_files for f in load_reward_file(path,
                                                                          "--eval-reward-file")]
        scorer = RewardSet(funcs, [1.0] * len(funcs))
        return EvalScorer(scorer, scorer.describe())
    if reward_files:
        return EvalScorer(run_rewards, run_rewards.describe())
    return EvalScorer(None, str(env.score_name)[:256])
