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
- ``--eval-file``, ``--reward-file``: the files exist;
- ``--master`` and ``--rollout``: where something answers, it is the service the flag names
  (reflection, :mod:`gridrl.common.rpc.probe`): a master for ``--master``, a rollout node for
  ``--rollout``. Where nothing answers yet the run starts and waits for it, saying so
  (``--node-wait-s``).

The address syntax (host:port) is checked by :meth:`TrainConfig.validate`.
"""

from __future__ import annotations

from pathlib import Path

from gridrl.common.errors import invalid_argument
from gridrl.common.rpc.probe import REGISTRY, ROLLOUT, check_service
from gridrl.models import ModelNameError, check_model
from gridrl.trainer.config import TrainConfig


def check_inputs(cfg: TrainConfig, probe_timeout_s: float = 3.0) -> None:
    """Check ``cfg``'s model name, files and service addresses (see the module docstring).

    Raises:
        StatusError: INVALID_ARGUMENT (a name or a file) or FAILED_PRECONDITION (another
            service at an address), its message starting with the flag.
    """
    try:
        check_model(cfg.model)
    except ModelNameError as e:
        flag, _, problem = str(e).partition(": ")
        raise invalid_argument(flag, problem) from None
    for flag, path in [("--eval-file", cfg.eval_file),
                       *(("--reward-file", p) for p in cfg.reward_files)]:
        if path is not None and not Path(path).is_file():
            raise invalid_argument(flag, f"{path!r}: no such file")
    cfg.environment()
    targets = ([("--master", cfg.master, REGISTRY)] if cfg.master else []) + [
        ("--rollout", a, ROLLOUT) for a in cfg.rollout if a != "local"]
    for flag, address, service in targets:
        check_service(address, service, flag, cfg.security, timeout_s=probe_timeout_s)
