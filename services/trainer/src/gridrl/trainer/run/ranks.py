"""Data parallelism seen from the run: rank 0 steps, every other rank trains what it is sent.

Under ``torchrun`` every rank builds the run (:func:`gridrl.trainer.run.build.build_run`: same
model, same LoRA init, the same checkpoint and resumed version, by broadcasts); rank 0 alone
samples, scores, syncs, evaluates, checkpoints and writes. Once per step it broadcasts a
:class:`RankMessage` with the step's sequences, and every rank (rank 0 included) calls
``backend.update`` on them, which trains each rank's share of the groups
(:meth:`gridrl.trainer.backends.base.TrainerBackend.update`). The collectives run in the same
order on every rank: the checkpoint and the resumed version at setup, then one message and one
update per step, then a stop (or an error) message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gridrl.trainer.backends.base import TrainerBackend, TrainSequence
from gridrl.trainer.run.state import TrainerState


@dataclass(frozen=True)
class RankMessage:
    """What rank 0 broadcasts to the other ranks once per step.

    Attributes:
        step: the step to train.
        version: the policy version the update will produce.
        sequences: the step's training sequences (every rank gets all; each trains its share).
        stop: the run is over (finished or stopped): return.
        error: rank 0 failed with this message: fail too.
    """

    step: int = 0
    version: int = 0
    sequences: tuple[TrainSequence, ...] = ()
    stop: bool = False
    error: str | None = None


def send_step(backend: TrainerBackend, step: int, version: int,
              sequences: Sequence[TrainSequence]) -> None:
    """Rank 0: give the other ranks the step to train (nothing when alone)."""
    if backend.world_size > 1:
        backend.broadcast(RankMessage(step=step, version=version, sequences=tuple(sequences)))


def send_stop(backend: TrainerBackend) -> None:
    """Rank 0: the run is over; the other ranks return (nothing when alone)."""
    if backend.world_size > 1:
        backend.broadcast(RankMessage(stop=True))


def send_error(backend: TrainerBackend, error: BaseException) -> None:
    """Rank 0 failed: release the other ranks from their broadcast (they fail too); a
    failure to tell them is ignored (they may be gone)."""
    if backend.rank != 0 or backend.world_size == 1:
        return
    try:
        backend.broadcast(RankMessage(error=f"{type(error).__name__}: {error}"))
    except Exception:
        pass


def run_worker(backend: TrainerBackend, state: TrainerState) -> None:
    """Ranks > 0: train on the broadcast sequences until rank 0 says stop.

    Raises:
        RuntimeError: rank 0 failed (its message).
    """
    while True:
        msg: RankMessage = backend.broadcast(RankMessage())
        if msg.error is not None:
            raise RuntimeError(f"rank 0 failed: {msg.error}")
        if msg.stop:
            return
        if msg.sequences:
            backend.update(msg.sequences)
            state.adopt(msg.version, msg.step)
        state.step = msg.step
