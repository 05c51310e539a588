"""The seam between the primitives and a tensor framework: one :class:`TrainableModel` per
training model (a base model, a LoRA adapter on it, AdamW over the adapter, an accumulated
gradient). The torch implementation is
:class:`gridrl.trainer.primitives.torch_model.TorchTrainableModel`.

Calls never overlap: :class:`gridrl.trainer.primitives.service.PrimitivesService` makes every
call from its one model thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gridrl.trainer.primitives.types import (
    AdamSettings,
    Datum,
    ForwardResult,
    LossSpec,
    OptimResult,
)


class TrainableModel(Protocol):
    """A base model with a trainable LoRA adapter.

    Attributes:
        tokenizer: the model directory's ``transformers`` tokenizer.
        identity: the base model's :class:`gridrl.models.ModelIdentity`.
        model_path: the resolved base model (a directory, or a hub id).
        lora_rank, lora_alpha, target_modules: the adapter.
        steps: optimizer steps taken.
        pending_datums: datums whose gradient is accumulated since the last step.
    """

    tokenizer: Any
    identity: Any
    model_path: str
    lora_rank: int
    lora_alpha: float
    target_modules: list[str]
    steps: int
    pending_datums: int

    def forward(self, data: Sequence[Datum], loss: LossSpec, *, backward: bool) -> ForwardResult:
        """Score ``data`` under the current weights (``logp`` at temperature 1); with
        ``backward``, add the gradient of the summed loss to the accumulated gradient. The
        datums are checked (:func:`gridrl.trainer.primitives.types.check_datums`) first."""

    def optim_step(self, adam: AdamSettings) -> OptimResult:
        """One AdamW step with ``adam``'s settings on the accumulated gradient (clipped to
        ``adam.grad_clip_norm`` when > 0), then zero it.

        Raises:
            StatusError: FAILED_PRECONDITION when nothing is accumulated.
        """

    def adapter_files(self) -> dict[str, bytes]:
        """The adapter as peft files (``adapter_config.json``, ``adapter_model.safetensors``)."""

    def load_adapter_files(self, files: Mapping[str, bytes]) -> None:
        """Set the adapter's weights from peft files of the same shape.

        Raises:
            ValueError: the files do not fit.
        """

    def state_files(self) -> dict[str, bytes]:
        """Adapter and optimizer state as files (what :meth:`load_state_files` takes)."""

    def load_state_files(self, files: Mapping[str, bytes], *, with_optimizer: bool) -> None:
        """Restore :meth:`state_files`; without ``with_optimizer`` the optimizer starts afresh.
        Drops any accumulated gradient."""

    def prompt_topk(self, prompt: Sequence[int], k: int) -> tuple[Any, Any]:
        """Per prompt position after the first, the ``k`` most likely next tokens and their
        logprobs (temperature 1): ``(ids, logprobs)`` numpy arrays, both
        ``(len(prompt) - 1, k)``, int32 and float32, most likely first."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], config: Any,
                 seeds: Sequence[int]) -> list[Any]:
        """The engine's sampling on the current weights
        (:meth:`gridrl.trainer.backends.base.TrainerBackend.generate`)."""

    def close(self) -> None:
        """Release the model. Idempotent."""


@dataclass
class ModelEntry:
    """An open training model in the service's table: its model, its policy versions saved
    for sampling (directory per version, the unnamed ones in order), the newest version and
    the version equal to the current weights (None: trained since)."""

    model: TrainableModel
    model_id: str
    base_model: str
    base_files: dict[str, bytes]  # version 0: B = 0, the base model
    versions: dict[int, Path] = field(default_factory=dict)  # sampler directory per version
    unnamed: list[int] = field(default_factory=list)
    version: int = 0  # newest snapshot
    live: int | None = 0  # the version equal to the current weights; None: trained since
