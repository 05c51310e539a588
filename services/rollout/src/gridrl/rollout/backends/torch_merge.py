"""LoRA adapters served as merged weights: zero per-token cost on the node.

peft evaluates a LoRA layer as ``W x + s * B (A x)``: two extra small matmuls and several
kernel launches per adapted linear layer and token, which on a CPU made decoding about 3x
slower than the base model. A rollout node never trains, so it folds each adapter into
copies of the weights once, at load time (``W' = W + s * B @ A``, computed in float32, stored
in the model's dtype), and switching adapters between batches is a pointer swap of each
module's weight tensor. Loading keeps the serving weights untouched (the new copies live next
to them), which is what makes the swap atomic.

Exactness: ``W' x`` differs from ``W x + s * B (A x)`` only by float rounding (about 1e-6
relative in float32), far inside the 1e-4 logprob tolerance the node promises against peft.
DoRA adapters are not merged here (the torch backend serves them through peft).

Formula source: Hu et al., LoRA (arXiv:2106.09685), eq. 3; the scale ``s = alpha / r``, or
``alpha / sqrt(r)`` under rsLoRA (Kalajdzievski, arXiv:2312.03732), as peft computes it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def mergeable(directory: Path) -> bool:
    """True for plain LoRA (no DoRA) with a uniform or per-module scale this module computes."""
    cfg = json.loads((Path(directory) / PEFT_CONFIG).read_text())
    return not cfg.get("use_dora") and str(cfg.get("peft_type", "LORA")).upper() == "LORA"


def peft_scale(cfg: dict[str, Any], module_path: str, rank: int) -> float:
    """peft's scaling for one module: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), with
    ``alpha_pattern`` / ``rank_pattern`` overrides matched on the module path's suffix."""
    alpha = float(cfg.get("lora_alpha", 8))
    for pattern, value in (cfg.get("alpha_pattern") or {}).items():
        if module_path == pattern or module_path.endswith("." + pattern):
            alpha = float(value)
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


@dataclass
class MergedAdapter:
    """Merged weights of one adapter: module path -> ``W + s * B @ A`` (model dtype/device)."""

    weights: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held by the merged copies."""
        return sum(t.numel() * t.element_size() for t in self.weights.values())


def merge_adapter(model: torch.nn.Module, directory: Path,
                  base: dict[str, torch.Tensor]) -> MergedAdapter:
    """Fold the peft adapter in ``directory`` into copies of ``model``'s weights.

    Args:
        model: the transformers model (not a PeftModel); only read.
        directory: a peft LoRA adapter (already checked to fit ``model``).
        base: module path -> the module's original weight tensor (filled in here for modules
            seen for the first time, so the base model can always be restored).
    Returns:
        the merged weights, one tensor per adapted module.
    Raises:
        KeyError / ValueError: a tensor names a module the model lacks, or A/B come unpaired.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg = json.loads((directory / PEFT_CONFIG).read_text())
    tensors = load_file(str(directory / PEFT_WEIGHTS), device="cpu")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        path = name.removeprefix(_PREFIX)
        for kind in ("lora_A", "lora_B"):
            suffix = f".{kind}.weight"
            if path.endswith(suffix):
                pairs.setdefault(path[: -len(suffix)], {})[kind] = t
                break
        else:
            raise ValueError(f"{PEFT_WEIGHTS}: {name}: not a LoRA A/B tensor, cannot merge")
    merged = MergedAdapter()
    with torch.no_grad():
        for path, ab in pairs.items():
            if set(ab) != {"lora_A", "lora_B"}:
                raise ValueError(f"{PEFT_WEIGHTS}: {path}: lora_A and lora_B must come in pairs")
            module = model.get_submodule(path)
            w = base.setdefault(path, module.weight.data)
            a, b = ab["lora_A"].float(), ab["lora_B"].float()
            scale = peft_scale(cfg, path, a.shape[0])
            if w.dtype == torch.float32:  # one fused pass: W + s * B @ A, no temporary delta
                merged.weights[path] = torch.addmm(w, b.to(w.device), a.to(w.device), alpha=scale)
            else:  # compute in float32, store in the model's dtype
                full = torch.addmm(w.float(), b.to(w.device), a.to(w.device), alpha=scale)
                merged.weights[path] = full.to(w.dtype)
    return merged


class WeightSwitcher:
    """Puts one adapter's merged weights (or the base weights) into the model's modules."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self.base: dict[str, torch.Tensor] = {}
        self._active: MergedAdapter | None = None

    def activate(self, adapter: MergedAdapter | None) -> None:
        """Serve ``adapter`` (None: the base model). A no-op when it is already active."""
        if adapter is self._active:
            return
        previous = self._active.weights if self._active is not None else {}
        wanted = adapter.weights if adapter is not None else {}
        for path in set(previous) | set(wanted):
            module = self._model.get_submodule(path)
            module.weight.data = wanted[path] if path in wanted else self.base[path]
        self._active = adapter

    def release(self, adapter: MergedAdapter) -> None:
        """Forget ``adapter`` (restoring the base weights first if it is serving)."""
        if adapter is self._active:
            self.activate(None)
        adapter.weights.clear()
