"""A peft LoRA adapter as the torch backend reads it, before any model is touched: LoraSource (its
parsed adapter_config.json and its tensors' shapes, from a directory or from files in memory),
lora_config (the config's checks) and check_fits (its tensors against a model's modules, naming
what does not fit). How a loaded adapter is held is gridrl.engine.backends.torch.adapters'."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gridrl.engine.backends.torch.merge import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    lora_pairs,
    read_lora,
)
from gridrl.engine.contract import AdapterLoadError


@dataclass
class LoraSource:
    """A peft LoRA adapter to load: its parsed ``adapter_config.json`` and its tensors'
    shapes, with the weights on disk (``directory``) or in memory (``files``).

    Build with :meth:`from_directory` or :meth:`from_files`; both check only the files'
    syntax (shapes against a model: :func:`check_fits`).
    """

    config: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    directory: Path | None = None
    files: Mapping[str, bytes] | None = None
    _tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def from_directory(cls, directory: Path) -> LoraSource:
        """Raises :class:`AdapterLoadError`: no ``adapter_config.json`` /
        ``adapter_model.safetensors``, a config that is not LoRA JSON, an unreadable header."""
        from safetensors import safe_open

        directory = Path(directory)
        cfg_path, weights = directory / PEFT_CONFIG, directory / PEFT_WEIGHTS
        if not cfg_path.is_file() or not weights.is_file():
            raise AdapterLoadError(f"{directory}: not a peft adapter (needs {PEFT_CONFIG} and "
                                   f"{PEFT_WEIGHTS})")
        cfg = lora_config(cfg_path.read_bytes())
        try:
            with safe_open(str(weights), framework="pt") as f:
                shapes = {name: tuple(f.get_slice(name).get_shape())
                          for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        except Exception as e:  # a corrupt safetensors header
            raise AdapterLoadError(f"{PEFT_WEIGHTS}: unreadable: {e}") from e
        return cls(cfg, shapes, directory=directory)

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> LoraSource:
        """Files in memory (relative path -> bytes), as a push delivers them; the tensors are
        viewed in place when the buffer is writable (a push's is).

        Raises:
            AdapterLoadError: as :meth:`from_directory`, or a tensor dtype that is not a float.
        """
        if PEFT_CONFIG not in files or PEFT_WEIGHTS not in files:
            raise AdapterLoadError(f"not a peft adapter (needs {PEFT_CONFIG} and {PEFT_WEIGHTS})")
        cfg = lora_config(files[PEFT_CONFIG])
        tensors = _view_tensors(files[PEFT_WEIGHTS])
        return cls(cfg, {n: tuple(t.shape) for n, t in tensors.items()}, files=files,
                   _tensors=tensors)

    @property
    def where(self) -> str:
        """For log lines: the directory, or "memory"."""
        return str(self.directory) if self.directory is not None else "memory"

    def pairs(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        """Module path -> ``(A (r, in), B (out, r), scale)`` (:func:`torch_merge.lora_pairs`).

        Raises:
            ValueError: a tensor that is not a LoRA A/B weight, or A/B unpaired.
        """
        if self._tensors is not None:
            return lora_pairs(self.config, self._tensors)
        assert self.directory is not None
        return read_lora(self.directory)

    @contextlib.contextmanager
    def on_disk(self) -> Iterator[Path]:
        """The adapter as a directory: its own, or a temporary one written from the files
        (removed afterwards: whoever reads it must keep what it needs)."""
        if self.directory is not None:
            yield self.directory
            return
        assert self.files is not None
        with tempfile.TemporaryDirectory(prefix="gridrl-adapter-") as tmp:
            for rel, data in self.files.items():
                target = Path(tmp) / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            yield Path(tmp)


def lora_config(data: bytes) -> dict[str, Any]:
    """Parse ``adapter_config.json`` of a LoRA adapter.

    Raises:
        AdapterLoadError: not JSON, or a peft_type other than LORA.
    """
    try:
        cfg = json.loads(data)
    except ValueError as e:
        raise AdapterLoadError(f"{PEFT_CONFIG}: not JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise AdapterLoadError(f"{PEFT_CONFIG}: not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterLoadError(f"{PEFT_CONFIG}: peft_type {cfg.get('peft_type')!r} is not LORA")
    return cfg


def check_fits(model: Any, source: LoraSource) -> tuple[int, int]:
    """Check a peft adapter's tensors against ``model``'s modules before touching the model.

    Returns:
        ``(rank r of its config, number of adapted modules)``.
    Raises:
        AdapterLoadError: naming the tensor, module or shape that does not fit.
    """
    modules = dict(model.named_modules())
    adapted: set[str] = set()
    for name, shape in source.shapes.items():
        _check_tensor(name, shape, modules, adapted)
    if not adapted:
        raise AdapterLoadError(f"{PEFT_WEIGHTS}: no LoRA tensors")
    return int(source.config.get("r", 0)), len(adapted)


def _check_tensor(name: str, shape: tuple[int, ...], modules: dict[str, Any],
                  adapted: set[str]) -> None:
    path = name.removeprefix("base_model.model.")
    for suffix in (".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector",
                   ".lora_embedding_A", ".lora_embedding_B", ".weight", ".bias"):
        if path.endswith(suffix):
            module_path, kind = path[:-len(suffix)], suffix
            break
    else:
        raise AdapterLoadError(f"{PEFT_WEIGHTS}: tensor {name!r} is not a LoRA tensor")
    if kind in (".weight", ".bias"):  # modules_to_save / trained biases: checked by peft
        return
    module = modules.get(module_path)
    if module is None:
        raise AdapterLoadError(f"{PEFT_WEIGHTS}: {name}: the base model has no module "
                               f"{module_path!r}")
    module = getattr(module, "base_layer", module)
    adapted.add(module_path)
    if kind.startswith(".lora_embedding"):
        return
    fan_in, fan_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if fan_in is None or fan_out is None:
        raise AdapterLoadError(f"{PEFT_WEIGHTS}: {name}: module {module_path!r} is a "
                               f"{type(module).__name__}, not a linear layer")
    if kind == ".lora_A.weight" and (len(shape) != 2 or shape[1] != fan_in):
        raise AdapterLoadError(f"{PEFT_WEIGHTS}: {name}: shape {list(shape)} does not fit "
                               f"{module_path} (in_features {fan_in}): expected [r, {fan_in}]")
    if kind == ".lora_B.weight" and (len(shape) != 2 or shape[0] != fan_out):
        raise AdapterLoadError(f"{PEFT_WEIGHTS}: {name}: shape {list(shape)} does not fit "
                               f"{module_path} (out_features {fan_out}): expected [{fan_out}, r]")
    if kind == ".lora_magnitude_vector" and shape not in ((fan_out,), (1, fan_out)):
        raise AdapterLoadError(f"{PEFT_WEIGHTS}: {name}: shape {list(shape)} does not fit "
                               f"{module_path} (out_features {fan_out})")


def _view_tensors(data: bytes | bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file in memory, as CPU tensors viewing ``data`` (copied
    once first when ``data`` is read-only: torch only views writable buffers).

    Raises:
        AdapterLoadError: the file does not parse, or holds a dtype other than F32/F16/BF16/F64.
    """
    from gridrl.adapters import AdapterError
    from gridrl.adapters import tensors as safetensors_codec

    if not isinstance(data, bytearray):
        data = bytearray(data)
    try:
        parsed = safetensors_codec.load(data, PEFT_WEIGHTS)
    except AdapterError as e:
        raise AdapterLoadError(f"{PEFT_WEIGHTS}: unreadable: {e}") from e
    torch_dtypes = {code: getattr(torch, dtype_name)
                    for dtype_name, code in safetensors_codec.FLOAT_CODES.items()}
    out = {}
    for name, t in parsed.tensors.items():
        dtype = torch_dtypes.get(t.dtype)
        if dtype is None:
            raise AdapterLoadError(f"{PEFT_WEIGHTS}: {name}: dtype {t.dtype} is not a LoRA "
                                   f"weight dtype ({', '.join(torch_dtypes)})")
        flat = torch.frombuffer(t.data, dtype=dtype) if len(t.data) else torch.empty(0, dtype=dtype)
        out[name] = flat.view(t.shape)
    return out
