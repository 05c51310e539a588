"""Checks of a run's inputs that take milliseconds, done before the model loads or a server
binds, so a typo costs a one-line error instead of a minute of loading and a traceback.

    check_inputs(cfg)   # StatusError naming the flag, or None

What is checked (each message names the flag and what to do):

- ``--model``: an alias, an existing directory or an ``org/name`` hub id
  (:func:`gridrl.models.check_model`, which suggests the closest alias);
- ``--task``: it names an environment that can be made (:meth:`TrainConfig.environment`: a
  built-in, ``reasoning-gym:<dataset>`` or ``verifiers:<environment>`` with its extra
  installed and the dataset known, a Python file defining an environment, a readable JSONL
  file), or the one line says what to install or fix;
- ``--eval-file``, ``--reward-file``, ``--eval-reward-file``: the files exist, and every reward
  function is called once on a row of the task with a dummy completion
  (:func:`build_rewards`): a function that needs a column the rows lack, or raises, fails in
  one line naming the function, its file and the column;
- ``--master`` and ``--rollout``: where something answers, it is the service the flag names
  (reflection, :mod:`gridrl.common.rpc.probe`): a master for ``--master``, a rollout node for
  ``--rollout``. Where nothing answers yet the run starts and waits for it, saying so
  (``--start-wait-s``).

The address syntax (host:port) is checked by :meth:`TrainConfig.validate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gridrl.common.errors import invalid_argument
from gridrl.common.rpc.probe import REGISTRY, ROLLOUT, check_service
from gridrl.models import ModelNameError, check_model
from gridrl.trainer.config import TrainConfig
from gridrl.trainer.rewards import (
    EvalScorer,
    RewardSet,
    build_eval_scorer,
    build_reward_set,
    check_reward_functions,
)

if TYPE_CHECKING:
    from gridrl.trainer.envs.base import Environment


def check_inputs(cfg: TrainConfig, probe_timeout_s: float = 3.0) -> None:
    """Check ``cfg``'s model name, files and service addresses (see the module docstring).

    Raises:
        StatusError: INVALID_ARGUMENT (a name or a file) or FAILED_PRECONDITION (another
            service at an address), its message starting with the flag.
    """
    try:
        check_model(cfg.model)
    except ModelNameError as e:
        raise invalid_argument(e.field, e.problem) from None
    for flag, path in [("--eval-file", cfg.eval_file),
                       *(("--reward-file", p) for p in cfg.reward_files),
                       *(("--eval-reward-file", p) for p in cfg.eval_reward_files)]:
        if path is not None and not Path(path).is_file():
            raise invalid_argument(flag, f"{path!r}: no such file")
    build_rewards(cfg, cfg.environment())
    targets = ([("--master", cfg.master, REGISTRY)] if cfg.master else []) + [
        ("--rollout", a, ROLLOUT) for a in cfg.rollout if a != "local"]
    for flag, address, service in targets:
        check_service(address, service, flag, cfg.security, timeout_s=probe_timeout_s)


def build_rewards(cfg: TrainConfig, env: Environment) -> tuple[RewardSet, EvalScorer]:
    """The run's rewards (``--reward-file``, else the environment's own) and the eval's
    scorer (:func:`gridrl.trainer.rewards.build_eval_scorer`), each function called once on
    the first training row and the first held-out row with a dummy completion
    (:func:`gridrl.trainer.rewards.check_reward_functions`): the user's files always, the
    environment's own functions when its ``checked_at_start`` says they need no episode state
    (reverse-words, a JSONL file: one without its answer column and no ``--reward-file`` fails
    here). Needs no model.

    Raises:
        StatusError: INVALID_ARGUMENT on ``--reward-file``, ``--eval-reward-file`` or
            ``--task``: one line naming the function, its file and what failed.
    """
    rewards = build_reward_set(env, cfg.reward_files, cfg.reward_weights)
    scorer = build_eval_scorer(env, rewards, cfg.reward_files, cfg.eval_reward_files)
    checks = [(rewards, "--reward-file" if cfg.reward_files else "--task")]
    if scorer.rewards is not None and scorer.rewards is not rewards:
        checks.append((scorer.rewards, "--eval-reward-file"))
    if not (cfg.reward_files or cfg.eval_reward_files or env.checked_at_start):
        return rewards, scorer  # an environment's own functions may need its episodes' state
    try:
        items = [env.train_item(0), *env.eval_items()[:1]]
    except Exception:  # an environment that needs its tokenizer first (prepare)
        return rewards, scorer
    for funcs, flag in checks:
        if flag != "--task" or env.checked_at_start:
            check_reward_functions(funcs, items, flag)
    return rewards, scorer
