"""End-of-sequence token ids: the one derivation every backend uses.

A sequence stops at a token of ``eos_token_ids | stop_token_ids`` (:mod:`gridrl.engine.contract`),
so a torch node, an MLX node, a vLLM node and the trainer's own sampler stop at the same tokens
only if they derive the same eos set: exact behaviour logprobs across backends depend on it.
The set is the union of the tokenizer's ``eos_token_id`` and the ``eos_token_id`` of the model's
config and generation config (each an int or a list of ints).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CONFIG_FILES = ("config.json", "generation_config.json")


def eos_token_ids(tokenizer: Any, *configs: Any) -> frozenset[int]:
    """The eos ids of ``tokenizer`` and ``configs`` together.

    Args:
        tokenizer: anything with an ``eos_token_id`` attribute (int, list of ints or None).
        configs: the model's config and generation config, as mappings (config.json read as
            a dict) or objects (transformers' ``PretrainedConfig`` / ``GenerationConfig``);
            None entries are skipped.
    Returns:
        every int found; bools and other values are ignored.
    """
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)

    add(getattr(tokenizer, "eos_token_id", None))
    for config in configs:
        if isinstance(config, Mapping):
            add(config.get("eos_token_id"))
        elif config is not None:
            add(getattr(config, "eos_token_id", None))
    return frozenset(ids)


def model_dir_configs(model_dir: Path | str) -> list[dict[str, Any]]:
    """``config.json`` and ``generation_config.json`` of ``model_dir`` as dicts (a file that is
    missing or unreadable is skipped, with a warning when it exists)."""
    out = []
    for name in CONFIG_FILES:
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            log.warning("could not read eos_token_id from %s", path)
            continue
        if isinstance(config, dict):
            out.append(config)
    return out
