"""Snapshots and saved states on the trainer's disk: what a saved training state and a policy
version saved for sampling are (:class:`Snapshot`), how their files are written (peft layout,
and the mlx-lm layout converted by :mod:`gridrl.adapters`) and read back. Layout in
:mod:`gridrl.trainer.primitives.paths`. Plain functions; the caller (the primitives' model
thread) owns the directories.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gridrl.common.errors import not_found
from gridrl.trainer.backends.base import LoraSettings
from gridrl.trainer.primitives import paths

log = logging.getLogger(__name__)

# Unnamed snapshots (Tinker's save_weights_and_get_sampling_client) kept on disk per model;
# older ones are deleted as new ones are saved (an RL loop saves one a step).
KEEP_UNNAMED = 4
SNAPSHOT_FILE = "snapshot.json"
EXTERNAL_FILE = "external.json"


@dataclass(frozen=True)
class Snapshot:
    """A policy version saved for sampling.

    Attributes:
        version: its policy version.
        uri: ``tinker://<model>/sampler_weights/<name>``.
        peft_dir: the adapter in peft layout.
        mlx_dir: in mlx-lm layout (None: not written, unnamed snapshots; or not convertible).
        nodes_synced: rollout nodes serving it now.
    """

    version: int
    uri: str
    peft_dir: Path
    mlx_dir: Path | None
    nodes_synced: list[str] = field(default_factory=list)


def read_state(root: Path, where: paths.WeightsPath
               ) -> tuple[dict[str, bytes], LoraSettings, str]:
    """The files of the training state saved at ``where`` under ``root``, its LoRA
    settings and its base model.

    Raises:
        StatusError: NOT_FOUND naming the path.
    """
    directory = where.directory(root)
    meta_file = directory / "state.json"
    if not meta_file.is_file():
        raise not_found(f"{where.uri}: no saved state (looked in {directory})")
    meta = json.loads(meta_file.read_text())
    files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    settings = LoraSettings(rank=int(meta["lora_rank"]), alpha=float(meta["lora_alpha"]),
                            target_modules=lora_targets(meta["target_modules"]))
    return files, settings, meta["base_model"]


def write_mlx(files: Mapping[str, bytes], directory: Path, model_id: str,
              num_layers: int, base_model: str | None = None) -> Path | None:
    """``files`` (a peft adapter) converted to the mlx-lm layout and written as
    ``directory``; None (logged) when the conversion does not cover the model: among others an
    adapted output head (``train_unembed``) on a ``base_model`` whose head is tied to its
    embeddings, which mlx-lm computes with ``embed_tokens.as_linear`` (no ``lm_head`` module
    for the LoRA: it would load and change nothing)."""
    from gridrl.adapters import convert_files, read_adapter

    try:
        if base_model is not None and read_adapter(files).head() is not None and _tied(
                base_model):
            raise ValueError("train_unembed: the output head is tied to the embeddings, and "
                             "mlx-lm has no lm_head module to put its LoRA on")
        return write_dir(convert_files(files, "mlx", num_layers), directory)
    except Exception as e:  # the peft directory is there; MLX may not cover the model
        log.warning("%s: no mlx-lm copy of the snapshot: %s", model_id, e)
        return None


def lora_targets(modules: str | Sequence[str]) -> str:
    """``LoraSettings.target_modules`` of a saved adapter's module list."""
    return modules if isinstance(modules, str) else ",".join(sorted(modules))


def write_dir(files: Mapping[str, bytes], directory: Path) -> Path:
    """Write ``files`` as ``directory``, replacing what was there (atomically)."""
    from gridrl.adapters import write_dir as write_adapter_dir

    directory.parent.mkdir(parents=True, exist_ok=True)
    return write_adapter_dir(files, directory)


def _tied(base_model: str) -> bool:
    """Whether ``base_model``'s output head shares its weights with the input embeddings."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base_model)
    text = getattr(config, "get_text_config", lambda: config)()
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings",
                                                             False)))
