"""Stopping a run and continuing it: the stop request and every message about it.

    control = StopControl()
    signal.signal(SIGTERM, lambda *_: control.request("SIGTERM"))   # the CLI
    control.stop_requested          # the loop, between steps and during waits
    control.unsaved_steps("runs/r")   # a second signal: what aborting loses

A stop asked during a step lets it finish and checkpoints it (``--resume`` continues from
there); asked during the setup (model load, node wait, baseline eval), the run stops before
its first step. This module words what a stop will do, what an abort loses, where a stopped
or failed run stands and the command that continues it, so those words live in one place.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from gridrl.common.security.policy import Security
from gridrl.trainer.run.state import TrainerState


@dataclass
class StopControl:
    """The stop request of one run (set from a signal handler, read by the loop).

    Attributes:
        reason: what asked the run to stop (the signal's name, ``SIGINT``, ``SIGTERM``), or
            None while nobody did.
        stepping: the step loop has begun (the setup is over).
        checkpointed: the step of the newest checkpoint (0: none); the loop writes it.
        state: the run's state once built (its step), for :meth:`notice` and
            :meth:`unsaved_steps`.
    """

    reason: str | None = None
    stepping: bool = False
    checkpointed: int = 0
    state: TrainerState | None = None

    @property
    def step(self) -> int:
        """The last finished step (0 before the run is built)."""
        return self.state.step if self.state is not None else 0

    def request(self, reason: str) -> None:
        """Stop after the step in progress (safe from a signal handler)."""
        self.reason = reason

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`request` was called."""
        return self.reason is not None

    def notice(self) -> str:
        """What a stop asked now will do, in words (printed at once by the CLI)."""
        if self.stepping:
            return f"finishing step {self.step + 1}, then checkpointing"
        return (f"stopping before step {self.step + 1} once the setup in progress "
                "(model load, node wait, baseline eval) ends")

    def unsaved_steps(self, run_dir: str | None) -> str:
        """What aborting now loses, in words: the finished steps since the last checkpoint and
        the step in progress, and where ``--resume`` would continue from."""
        done, saved = self.step, self.checkpointed
        lost = (f"steps {saved + 1}-{done}" if done > saved + 1
                else f"step {done}" if done == saved + 1 else "")
        lost = ", ".join(filter(None, [lost and f"finished {lost}",
                                       f"step {done + 1} in progress"]))
        if not saved:
            return f"no checkpoint yet: {lost} lost"
        return (f"{lost} lost; --resume {run_dir} continues from the checkpoint of "
                f"step {saved}")


def trainer_executable() -> str:
    """``gridrl-trainer`` as the user can run it from where they are: its bare name when that
    name on ``PATH`` is this program, else its own path (``.venv/bin/gridrl-trainer`` from the
    repository root, an absolute path elsewhere), shell-quoted."""
    name = "gridrl-trainer"
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    own = argv0 if argv0.name == name else Path(sys.executable).parent / name
    if not own.is_file():
        return name
    on_path = shutil.which(name)
    if on_path is not None and Path(on_path).resolve() == own.resolve():
        return name
    absolute = own.absolute()
    try:
        shown = os.path.relpath(absolute)
    except ValueError:  # another drive (Windows)
        shown = str(absolute)
    if shown.startswith(".."):
        shown = str(absolute)
    elif "/" not in shown:
        shown = f"./{shown}"
    return shlex.quote(shown)


def resume_command(run_dir: str, security: Security | None) -> str:
    """The command that continues the run in ``run_dir``, with the trainer as the user can run
    it (:func:`trainer_executable`); the security flags are not saved with it, so a secured
    run's command says to give them again."""
    secured = security is not None and bool(
        security.token or security.tls.cert or security.tls.ca or security.authorized)
    return (f"{trainer_executable()} run --resume {shlex.quote(run_dir)}"
            + (" and this start's --tls-*, --authorized-tokens and --auth-token-file "
               "flags (credentials are never saved with a run)" if secured else ""))


def stopped_message(step: int, total_steps: int, reason: str | None, checkpointed: bool,
                    resume: str) -> str:
    """Where a run stopped on request stands (``resume``: :func:`resume_command`)."""
    if checkpointed:
        return (f"stopped after step {step} of {total_steps} ({reason}); "
                f"continue with: {resume}")
    return f"stopped before step 1 of {total_steps} ({reason}); no step to checkpoint"


def failed_run_message(step: int, error: BaseException, resume: str) -> str:
    """A failed run that checkpointed its finished steps: how to continue it."""
    return (f"run failed after step {step} ({type(error).__name__}); checkpointed "
            f"it: continue with: {resume}")
