"""A model directory's ``config.json`` that every consumer reads the same way.

transformers 5 writes the rope base and scaling only under ``rope_parameters``; readers written
for the older layout look at the top level and silently fall back to their defaults: mlx-lm's
llama reads ``rope_theta`` (default 10000, where SmolLM2 needs 100000), llama.cpp's
``convert_hf_to_gguf.py`` reads ``rope_theta`` and ``rope_scaling``, transformers 4.x reads
``rope_theta``, ``rope_scaling``, ``partial_rotary_factor`` and ``torch_dtype``. The keys added
here repeat what ``rope_parameters`` and ``dtype`` say, so transformers 5 (which gives
``rope_parameters`` priority over them) loads the same model either way.

    portable_config(cfg)            # the keys to add, {} when none are missing
    make_config_portable(model_dir) # add them to model_dir/config.json in place (atomic)

A per-layer-type ``rope_parameters`` (``{"full_attention": {...}, "sliding_attention": {...}}``)
has no single top-level equivalent and is left as it is.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

#: Keys of a flat ``rope_parameters`` that older readers take from the top level.
_ROPE_TOP_LEVEL = ("rope_theta", "partial_rotary_factor")


def portable_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The top-level keys ``cfg`` lacks that older readers need (module docstring), also for a
    nested ``text_config``.

    Args:
        cfg: a parsed ``config.json``.
    Returns:
        the keys to add (``rope_theta``, ``partial_rotary_factor``, ``rope_scaling`` for a rope
        type other than ``default``, ``torch_dtype``); ``{}`` when nothing is missing.
    """
    out: dict[str, Any] = {}
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and not any(isinstance(v, dict) for v in rope.values()):
        for key in _ROPE_TOP_LEVEL:
            if key in rope and key not in cfg:
                out[key] = rope[key]
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default" and not cfg.get("rope_scaling"):
            # transformers 5 takes a top-level rope_scaling as the whole rope_parameters:
            # it must say everything rope_parameters says
            out["rope_scaling"] = {**rope, "rope_type": kind, "type": kind}
    if "dtype" in cfg and "torch_dtype" not in cfg:
        out["torch_dtype"] = cfg["dtype"]
    text = cfg.get("text_config")
    if isinstance(text, dict) and (inner := portable_config(text)):
        out["text_config"] = {**text, **inner}
    return out


def make_config_portable(model_dir: Path | str) -> bool:
    """Add :func:`portable_config`'s keys to ``model_dir/config.json``, atomically (a
    temporary file renamed over it), keeping every other key and the file's mode.

    Returns:
        True when the file was rewritten, False when nothing was missing.
    Raises:
        OSError: the file cannot be read or written; ValueError: it is not JSON.
    """
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    extra = portable_config(cfg)
    if not extra:
        return False
    fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(portable_config_text({**cfg, **extra}))
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def portable_config_text(cfg: dict[str, Any]) -> str:
    """``cfg`` with :func:`portable_config`'s keys, as ``config.json`` text (sorted keys, two
    spaces, as transformers writes it)."""
    return json.dumps({**cfg, **portable_config(cfg)}, indent=2, sort_keys=True) + "\n"
