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


def mergeable(directory_or_config: Path | dict[str, Any]) -> bool:
    """True for plain LoRA (no DoRA): an adapter directory or its parsed adapter_config.json."""
    cfg = directory_or_config
    if not isinstance(cfg, dict):
        cfg = json.loads((Path(cfg) / PEFT_CONFIG).read_text())
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


def read_lora(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """The LoRA factors of the peft adapter in ``directory``, per adapted module
    (:func:`lora_pairs` of its config and tensors)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg = json.loads((directory / PEFT_CONFIG).read_text())
    return lora_pairs(cfg, load_file(str(directory / PEFT_WEIGHTS), device="cpu"))


def lora_pairs(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Pair a peft adapter's tensors per adapted module.

    Args:
        cfg: its parsed ``adapter_config.json``.
        tensors: its ``adapter_model.safetensors`` (peft key names).
    Returns:
        module path (``model.layers.0.self_attn.q_proj``) -> ``(A (r, in), B (out, r), scale)``,
        tensors on the CPU as stored, ``scale`` as peft computes it (:func:`peft_scale`).
    Raises:
        ValueError: a tensor that is not a ``lora_A`` / ``lora_B`` weight (embedding LoRA,
            ``modules_to_save``, DoRA magnitudes), or A/B unpaired.
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        path = name.removeprefix(_PREFIX)
        for kind in ("lora_A", "lora_B"):
            suffix = f".{kind}.weight"
            if path.endswith(suffix):
                pairs.setdefault(path[: -len(suffix)], {})[kind] = t
                break
        else:
            raise ValueError(f"{PEFT_WEIGHTS}: {name}: not a LoRA A/B tensor")
    out = {}
    for path, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"{PEFT_WEIGHTS}: {path}: lora_A and lora_B must come in pairs")
        a, b = ab["lora_A"], ab["lora_B"]
        out[path] = (a, b, peft_scale(cfg, path, a.shape[0]))
    return out


def merge_adapter(model: torch.nn.Module,
                  pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                  base: dict[str, torch.Tensor]) -> MergedAdapter:
    """Fold a peft LoRA adapter into copies of ``model``'s weights.

    Args:
        model: the transformers model (its modules' weights are only read).
        pairs: the adapter's factors per module (:func:`lora_pairs` / :func:`read_lora`),
            already checked to fit ``model``.
        base: module path -> the module's original weight tensor (filled in here for modules
            seen for the first time, so the base model can always be restored).
    Returns:
        the merged weights, one tensor per adapted module.
    Raises:
        AttributeError: a module path the model lacks.
    """
    merged = MergedAdapter()
    with torch.no_grad():
        for path, (a, b, scale) in pairs.items():
            module = model.get_submodule(path)
            w = base.setdefault(path, module.weight.data)
            a, b = a.float().to(w.device), b.float().to(w.device)
            if w.dtype == torch.float32:  # one fused pass: W + s * B @ A, no temporary delta
                merged.weights[path] = torch.addmm(w, b, a, alpha=scale)
            else:  # compute in float32, store in the model's dtype
                merged.weights[path] = torch.addmm(w.float(), b, a, alpha=scale).to(w.dtype)
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
