"""mlx-lm LoRA adapters held next to the serving weights, switched per batch or set per row.

Layout read (what ``mlx_lm.lora`` writes and ``mlx_lm.tuner.utils.load_adapters`` loads):

- ``adapter_config.json``: ``num_layers`` (the last ``num_layers`` transformer blocks are
  adapted; as in mlx-lm, ``layers[-max(num_layers, 0):]``, so 0 and -1 mean every block),
  ``lora_parameters: {rank, scale, dropout, keys}`` (``keys``: module paths inside a block, e.g.
  ``self_attn.q_proj``, or a full model path such as ``lm_head``; absent: every Linear-like
  module of the blocks) and optionally ``fine_tune_type`` (only ``"lora"`` is served).
- ``adapters.safetensors``: ``<module path>.lora_a`` (in, r) and ``<module path>.lora_b``
  (r, out), e.g. ``model.layers.29.self_attn.q_proj.lora_a``.

A target Linear is wrapped once in :class:`SwitchableLoRALinear`, which computes
``linear(x) + (scale * ((x @ lora_a) @ lora_b)).astype(x.dtype)`` -- exactly mlx-lm's
``LoRALinear`` -- with the arrays of whichever adapter is active, or ``linear(x)`` alone when
none is. The base weights are never modified; each adapter keeps its own arrays.

Rows of several adapters in one batch (:meth:`LoRAManager.activate_rows`, the S-LoRA / Punica
approach): each wrapped module computes its base product ``linear(x)`` once for the whole batch,
then one small product per adapter group, ``scale * ((x[rows] @ lora_a) @ lora_b)`` over that
group's rows only; the groups' updates (and exact zeros for rows whose adapter does not adapt
the module, or the base model's rows) are put back in row order and added. A row's update is
therefore the one it gets in a batch of its adapter alone, up to the rounding of a product over
fewer rows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from gridrl.engine.contract import AdapterLoadError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
_LEAVES = ("lora_a", "lora_b")


@dataclass(frozen=True)
class LoRAWeights:
    """The low-rank update of one module: ``scale * (x @ a) @ b``; a (in, r), b (r, out)."""

    a: mx.array
    b: mx.array
    scale: float


@dataclass(frozen=True)
class RowLoRA:
    """Per-row LoRA updates of one module for a batch of rows of several adapters.

    Attributes:
        groups: per adapter adapting this module, its weights and its rows (int32 (n_g,)
            indices into the batch axis), in order of first appearance.
        base_rows: rows whose adapter does not adapt this module (their update is 0).
        order: int32 (N,): row ``i``'s position in the groups' rows concatenated, then the
            base rows (so ``concat(updates)[order]`` is in batch order).
    """

    groups: tuple[tuple[LoRAWeights, mx.array], ...]
    base_rows: int
    order: mx.array

    def update(self, x: mx.array) -> mx.array:
        """The updates (N, ..., out) of ``x`` (N, ..., in), each row by its own adapter, in
        ``x``'s dtype."""
        parts = [(w.scale * ((x[rows] @ w.a) @ w.b)).astype(x.dtype)
                 for w, rows in self.groups]
        if self.base_rows:
            out_dims = self.groups[0][0].b.shape[-1]
            parts.append(mx.zeros((self.base_rows, *x.shape[1:-1], out_dims), x.dtype))
        return mx.concatenate(parts, axis=0)[self.order]


class SwitchableLoRALinear(nn.Module):
    """A Linear (or QuantizedLinear) plus the LoRA update of the active adapter, if any, or
    each row's own (``rows``).

    ``lora`` / ``rows`` are set by :class:`LoRAManager` (at most one of them); they are plain
    attributes, not parameters, so the model's parameter tree holds the base weights only
    (under ``linear``).
    """

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear
        self.lora: LoRAWeights | None = None
        self.rows: RowLoRA | None = None

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        if self.rows is not None:
            return y + self.rows.update(x)
        w = self.lora
        if w is None:
            return y
        z = (x @ w.a) @ w.b
        return y + (w.scale * z).astype(x.dtype)


@dataclass(eq=False)
class MlxAdapter:
    """Handle of a loaded adapter (what ``MlxBackend.load_adapter`` returns).

    Attributes:
        key: the key it was loaded under.
        directory: where it was read from.
        rank: LoRA rank r.
        scale: the factor applied to ``(x @ a) @ b``.
        num_layers: ``num_layers`` from its config.
        modules: full module path -> its :class:`LoRAWeights`.
        nbytes: bytes held by the arrays.
        loaded: False once unloaded; an unloaded handle cannot be used.
    """

    key: str
    directory: Path
    rank: int
    scale: float
    num_layers: int
    modules: dict[str, LoRAWeights] = field(repr=False)
    nbytes: int = 0
    loaded: bool = True


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.QuantizedLinear))


def _lora_candidate(module: nn.Module) -> bool:
    """Module types mlx-lm's ``linear_to_lora_layers`` adapts when ``keys`` is absent."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    return hasattr(module, "to_lora") or isinstance(module, (
        nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear, nn.Embedding,
        nn.QuantizedEmbedding))


def _linear_dims(module: nn.Module) -> tuple[int, int]:
    """(input_dims, output_dims) of a Linear or QuantizedLinear."""
    out_dims, in_dims = module.weight.shape
    if isinstance(module, nn.QuantizedLinear):
        in_dims = in_dims * 32 // module.bits
    return in_dims, out_dims


class LoRAManager:
    """Loads, validates, installs and frees mlx-lm adapters on one model.

    Args:
        model: an mlx-lm model (has ``layers``), in its pristine state (no LoRA layers).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers = list(model.layers)
        ids = {id(m): p for p, m in model.named_modules()}
        self.layer_paths = [ids[id(layer)] for layer in self.layers]
        self.default_keys = sorted({p for layer in self.layers for p, m in layer.named_modules()
                                    if p and _lora_candidate(m)})
        self.wrappers: dict[str, SwitchableLoRALinear] = {}
        self.adapters: dict[str, MlxAdapter] = {}
        self.active: MlxAdapter | None = None
        # with activate_rows: each live row's modules (path -> weights), in batch order
        self.row_modules: list[dict[str, LoRAWeights]] | None = None

    # -- loading -----------------------------------------------------------------------------

    def load(self, directory: Path | str, key: str) -> MlxAdapter:
        """Read and validate ``directory``, then wrap its target modules (once) and keep it.

        Returns:
            the handle, also kept under ``key`` (replacing the entry, not the earlier handle).
        Raises:
            AdapterLoadError: missing or unreadable files, an unsupported ``fine_tune_type``,
                a bad ``rank`` / ``scale`` / ``num_layers``, a tensor naming a module the config
                does not adapt or the model lacks, a wrong shape or rank, or an incomplete
                lora_a / lora_b pair. Nothing is changed then.
        """
        directory = Path(directory)
        config = self._read_config(directory)
        rank, scale, num_layers, keys = self._parse_config(directory, config)
        targets = self._targets(num_layers, keys)
        weights = self._read_weights(directory)
        modules = self._match(directory, weights, targets, rank, scale, num_layers, keys)
        mx.eval([(w.a, w.b) for w in modules.values()])
        # Validated: only now touch the model, wrapping targets not wrapped yet.
        new = [(path, SwitchableLoRALinear(targets[path])) for path in modules
               if path not in self.wrappers]
        if new:
            self.model.update_modules(tree_unflatten(new))
            self.wrappers.update(new)
        handle = MlxAdapter(
            key=key, directory=directory, rank=rank, scale=scale, num_layers=num_layers,
            modules=modules, nbytes=sum(w.a.nbytes + w.b.nbytes for w in modules.values()))
        self.adapters[key] = handle
        return handle

    def unload(self, handle: MlxAdapter) -> None:
        """Drop ``handle``'s arrays (and its ``key`` entry when it is the handle kept there)."""
        if self.adapters.get(handle.key) is handle:
            del self.adapters[handle.key]
        if self.active is handle:
            self.activate(None)
        handle.modules = {}
        handle.loaded = False

    def activate(self, handle: MlxAdapter | None) -> None:
        """Install ``handle``'s arrays in every wrapped module (None: the base model), for
        every row of the batches that follow (ends :meth:`activate_rows`).

        Raises:
            ValueError: ``handle`` was unloaded, or is not an :class:`MlxAdapter`.
        """
        self.check_handle(handle)
        if handle is self.active and self.row_modules is None:
            return
        modules = handle.modules if handle is not None else {}
        for path, wrapper in self.wrappers.items():
            wrapper.lora = modules.get(path)
            wrapper.rows = None
        self.active = handle
        self.row_modules = None

    def activate_rows(self, handles: Sequence[MlxAdapter | None]) -> None:
        """Give row ``i`` of the batches that follow the adapter ``handles[i]`` (None: the
        base model), until :meth:`activate`; :meth:`keep_rows` follows rows leaving the batch.
        Each row keeps the arrays it started with even if its handle is unloaded meanwhile.

        Raises:
            ValueError: a handle was unloaded, or is not an :class:`MlxAdapter`.
        """
        for handle in handles:
            self.check_handle(handle)
        self.row_modules = [dict(h.modules) if h is not None else {} for h in handles]
        self.active = None
        self._install_rows()

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Only rows ``keep`` (indices into the current rows, in their new order) go on."""
        assert self.row_modules is not None, "keep_rows without activate_rows"
        self.row_modules = [self.row_modules[i] for i in keep]
        self._install_rows()

    def _install_rows(self) -> None:
        """Set every wrapped module's :class:`RowLoRA` (None where no row's adapter adapts
        it: the base product alone)."""
        assert self.row_modules is not None
        n = len(self.row_modules)
        for path, wrapper in self.wrappers.items():
            wrapper.lora = None
            groups: dict[int, tuple[LoRAWeights, list[int]]] = {}
            base: list[int] = []
            for row, modules in enumerate(self.row_modules):
                w = modules.get(path)
                if w is None:
                    base.append(row)
                else:
                    groups.setdefault(id(w), (w, []))[1].append(row)
            if not groups:
                wrapper.rows = None
                continue
            order = [0] * n
            concatenated = [row for _, rows in groups.values() for row in rows] + base
            for position, row in enumerate(concatenated):
                order[row] = position
            wrapper.rows = RowLoRA(
                tuple((w, mx.array(rows, mx.int32)) for w, rows in groups.values()),
                len(base), mx.array(order, mx.int32))

    @staticmethod
    def check_handle(handle: MlxAdapter | None) -> None:
        """Check that ``handle`` is None or a loaded :class:`MlxAdapter`.

        Raises:
            ValueError: it was unloaded, or is not an :class:`MlxAdapter`.
        """
        if handle is not None:
            if not isinstance(handle, MlxAdapter):
                raise ValueError(f"not an MLX adapter handle: {type(handle).__name__}")
            if not handle.loaded:
                raise ValueError(f"adapter {handle.key!r} was unloaded")

    # -- validation --------------------------------------------------------------------------

    @staticmethod
    def _read_config(directory: Path) -> dict[str, Any]:
        path = directory / CONFIG_FILE
        if not path.is_file():
            raise AdapterLoadError(f"{directory}: no {CONFIG_FILE}")
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise AdapterLoadError(f"{path}: unreadable JSON: {e}") from e
        if not isinstance(config, dict):
            raise AdapterLoadError(f"{path}: expected a JSON object")
        return config

    def _parse_config(self, directory: Path, config: dict[str, Any]
                      ) -> tuple[int, float, int, list[str]]:
        where = f"{directory / CONFIG_FILE}"
        fine_tune_type = config.get("fine_tune_type", "lora")
        if fine_tune_type != "lora":
            raise AdapterLoadError(f"{where}: fine_tune_type {fine_tune_type!r} is not served "
                                   "(only 'lora')")
        params = config.get("lora_parameters")
        if not isinstance(params, dict):
            raise AdapterLoadError(f"{where}: missing 'lora_parameters' object")
        rank = params.get("rank")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise AdapterLoadError(f"{where}: lora_parameters.rank must be a positive integer, "
                                   f"got {rank!r}")
        if "scale" not in params:
            hint = " (found 'alpha'; mlx-lm uses 'scale')" if "alpha" in params else ""
            raise AdapterLoadError(f"{where}: lora_parameters.scale is missing{hint}")
        scale = params["scale"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale):
            raise AdapterLoadError(f"{where}: lora_parameters.scale must be a finite number, "
                                   f"got {scale!r}")
        num_layers = config.get("num_layers")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int):
            raise AdapterLoadError(f"{where}: num_layers must be an integer, got {num_layers!r}")
        if num_layers > len(self.layers):
            raise AdapterLoadError(f"{where}: num_layers={num_layers} but the base model has "
                                   f"{len(self.layers)} layers")
        keys = params.get("keys")
        if keys is None:
            keys = list(self.default_keys)
        elif not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise AdapterLoadError(f"{where}: lora_parameters.keys must be a list of strings")
        return rank, float(scale), num_layers, keys

    def _targets(self, num_layers: int, keys: list[str]) -> dict[str, nn.Module]:
        """Full module path -> base module, for every module the config adapts."""
        key_set = set(keys)
        targets: dict[str, nn.Module] = {}
        first = len(self.layers) - len(self.layers[-max(num_layers, 0):])
        for i in range(first, len(self.layers)):
            for rel, module in self.layers[i].named_modules():
                if rel in key_set:
                    targets[f"{self.layer_paths[i]}.{rel}"] = module
        for path, module in self.model.named_modules():
            if path in key_set:
                targets[path] = module
        # Modules already wrapped by an earlier adapter: the target is the base inside.
        return {p: (m.linear if isinstance(m, SwitchableLoRALinear) else m)
                for p, m in targets.items()}

    @staticmethod
    def _read_weights(directory: Path) -> dict[str, mx.array]:
        path = directory / WEIGHTS_FILE
        if not path.is_file():
            raise AdapterLoadError(f"{directory}: no {WEIGHTS_FILE}")
        try:
            weights = mx.load(str(path))
        except Exception as e:  # mlx raises RuntimeError / ValueError on corrupt files
            raise AdapterLoadError(f"{path}: unreadable safetensors: {e}") from e
        if not isinstance(weights, dict):
            raise AdapterLoadError(f"{path}: not a safetensors file")
        return weights

    def _match(self, directory: Path, weights: dict[str, mx.array],
               targets: dict[str, nn.Module], rank: int, scale: float, num_layers: int,
               keys: list[str]) -> dict[str, LoRAWeights]:
        where = f"{directory / WEIGHTS_FILE}"
        model_modules = {p for p, _ in self.model.named_modules()}
        first = len(self.layers) - len(self.layers[-max(num_layers, 0):])
        pairs: dict[str, dict[str, mx.array]] = {}
        for name in sorted(weights):
            path, _, leaf = name.rpartition(".")
            if leaf not in _LEAVES:
                raise AdapterLoadError(f"{where}: {name}: not a LoRA tensor (expected "
                                       "'<module>.lora_a' or '<module>.lora_b')")
            if path not in targets:
                raise AdapterLoadError(f"{where}: {name}: "
                                       + self._why_not_target(path, model_modules, first,
                                                              num_layers, keys))
            module = targets[path]
            if not _is_linear(module):
                raise AdapterLoadError(f"{where}: {name}: module {path} is a "
                                       f"{type(module).__name__}; only Linear LoRA is served")
            w = weights[name]
            if not mx.issubdtype(w.dtype, mx.floating):
                raise AdapterLoadError(f"{where}: {name}: dtype {w.dtype} is not floating")
            in_dims, out_dims = _linear_dims(module)
            want = (in_dims, rank) if leaf == "lora_a" else (rank, out_dims)
            if tuple(w.shape) != want:
                raise AdapterLoadError(
                    f"{where}: {name}: shape {tuple(w.shape)} does not fit {path} "
                    f"(in {in_dims}, out {out_dims}) at rank {rank}: expected {want}")
            pairs.setdefault(path, {})[leaf] = w
        modules: dict[str, LoRAWeights] = {}
        for path, leaves in pairs.items():
            missing = [leaf for leaf in _LEAVES if leaf not in leaves]
            if missing:
                raise AdapterLoadError(f"{where}: {path}.{missing[0]} is missing "
                                       f"(only {', '.join(sorted(leaves))} given)")
            modules[path] = LoRAWeights(leaves["lora_a"], leaves["lora_b"], scale)
        return modules

    def _why_not_target(self, path: str, model_modules: set[str], first: int, num_layers: int,
                        keys: list[str]) -> str:
        if path not in model_modules:
            return f"the base model has no module {path}"
        for i, layer_path in enumerate(self.layer_paths):
            if path.startswith(layer_path + "."):
                rel = path[len(layer_path) + 1:]
                if i < first:
                    return (f"layer {i} is not adapted (num_layers={num_layers} adapts layers "
                            f"{first}..{len(self.layers) - 1})")
                return f"{rel} is not in lora_parameters.keys {keys}"
        return f"module {path} is not in lora_parameters.keys {keys}"
