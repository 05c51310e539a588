"""The MLX trainer's files (:class:`MlxAdapterFiles`, a part of
:class:`~gridrl.trainer.backends.mlx.backend.MlxTrainerBackend`): the adapter as peft files
(``lora_A = lora_a.T``, ``lora_B = lora_b.T``, bit for bit) and in mlx-lm's layout, loading peft
files back, and the checkpoint (the adapter, ``optimizer.safetensors``: the AdamW state, and
``rng.json``: python and numpy RNG states)."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from safetensors import numpy as safetensors_numpy

from gridrl.adapters import convert_files
from gridrl.adapters.tensors import Tensor, cast, dump, load, to_float64
from gridrl.trainer.backends.base import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSettings

OPTIMIZER = "optimizer.safetensors"
RNG = "rng.json"
PEFT_PREFIX = "base_model.model."


class MlxAdapterFiles:
    """The files of the MLX trainer's adapter (:attr:`modules`, mlx-lm ``LoRALinear`` by
    path, made with :attr:`lora`) and of its checkpoint (with :attr:`optimizer`)."""

    model: nn.Module
    modules: dict[str, Any]
    lora: LoraSettings
    optimizer: optim.Optimizer
    model_id: str
    identity: Any


    def lora_arrays(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Module path -> (``lora_a`` (in, r), ``lora_b`` (r, out)) as float32 numpy copies."""
        mx.eval([(m.lora_a, m.lora_b) for m in self.modules.values()])
        return {p: (np.array(m.lora_a.astype(mx.float32)), np.array(m.lora_b.astype(mx.float32)))
                for p, m in self.modules.items()}

    def _target_modules(self) -> list[str]:
        """peft's ``target_modules`` as ``get_peft_model`` records it: ``all-linear`` resolved
        to the adapted modules' full paths, a list kept as the set of its names."""
        if self.lora.target_modules == "all-linear":
            return sorted(self.modules)
        return sorted({t.strip() for t in self.lora.target_modules.split(",") if t.strip()})

    def adapter_config_json(self) -> bytes:
        """peft's ``adapter_config.json`` of this adapter: the fields ``LoraConfig`` writes
        for a causal-LM LoRA (``r``, ``lora_alpha``, ``lora_dropout``, ``use_rslora``,
        ``target_modules``, ``base_model_name_or_path`` the
        ``--model`` string...), serialized as peft does (indent 2, keys sorted)."""
        lora = self.lora
        cfg = {
            "alpha_pattern": {}, "base_model_name_or_path": self.model_id, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "layers_pattern": None, "layers_to_transform": None, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "modules_to_save": None, "peft_type": "LORA",
            "r": lora.rank, "rank_pattern": {}, "target_modules": self._target_modules(),
            "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": lora.rslora,
        }
        return json.dumps(cfg, indent=2, sort_keys=True).encode()

    def adapter_files(self) -> dict[str, bytes]:
        """See :meth:`TrainerBackend.adapter_files`: ``lora_A = lora_a.T``,
        ``lora_B = lora_b.T`` in float32 under peft's key names."""
        if sys.byteorder != "little":
            raise ValueError("safetensors data is little-endian; this host is big-endian")
        state = {}
        for path, (a, b) in self.lora_arrays().items():
            for name, arr in ((f"{PEFT_PREFIX}{path}.lora_A.weight", a.T),
                              (f"{PEFT_PREFIX}{path}.lora_B.weight", b.T)):
                arr = np.ascontiguousarray(arr, dtype="<f4")
                state[name] = Tensor("F32", tuple(arr.shape), arr.tobytes())
        return {ADAPTER_CONFIG: self.adapter_config_json(),
                ADAPTER_WEIGHTS: dump(state, {"format": "pt"})}

    def mlx_adapter_files(self) -> dict[str, bytes]:
        """The adapter in mlx-lm's layout as it is trained (``adapter_config.json`` with
        ``num_layers``, ``lora_parameters`` {rank, scale, dropout, keys}; ``adapters.safetensors``
        with ``<path>.lora_a`` / ``.lora_b``): what ``gridrl.adapters.convert_files(
        adapter_files(), "mlx", num_layers)`` gives, tensor for tensor."""
        return convert_files(self.adapter_files(), "mlx", self.identity.num_layers)

    def load_adapter_files(self, files: Mapping[str, bytes]) -> None:
        """See :meth:`TrainerBackend.load_adapter_files` (peft files, float tensors cast to
        float32).

        Raises:
            ValueError: missing, unexpected or misshapen tensors.
        """
        parsed = load(bytes(files[ADAPTER_WEIGHTS]), ADAPTER_WEIGHTS)
        want = {f"{PEFT_PREFIX}{p}.lora_{x}.weight" for p in self.modules for x in "AB"}
        got = set(parsed.tensors)
        if got != want:
            raise ValueError(f"adapter does not fit the policy: unexpected "
                             f"{sorted(got - want)[:3]}, missing {sorted(want - got)[:3]}")
        updates = []
        for path, m in self.modules.items():
            for leaf, current in (("A", m.lora_a), ("B", m.lora_b)):
                t = cast(parsed.tensors[f"{PEFT_PREFIX}{path}.lora_{leaf}.weight"], "F32")
                value = to_float64(t).astype(np.float32).T
                if value.shape != tuple(current.shape):
                    raise ValueError(f"adapter does not fit the policy: {path}.lora_{leaf} "
                                     f"has shape {value.T.shape}, expected "
                                     f"{tuple(current.shape)[::-1]}")
                updates.append((f"{path}.lora_{leaf.lower()}", mx.array(value)))
        self.model.update(tree_unflatten(updates))
        mx.eval(self.model.parameters())

    def checkpoint_files(self) -> dict[str, bytes]:
        """See :meth:`TrainerBackend.checkpoint_files` (module docstring)."""
        files = self.adapter_files()
        state = {k: np.array(v) for k, v in tree_flatten(self.optimizer.state)}
        files[OPTIMIZER] = safetensors_numpy.save(state)
        np_state = np.random.get_state()
        rng = {"python": [random.getstate()[0], list(random.getstate()[1]),
                          random.getstate()[2]],
               "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]),
                         float(np_state[4])]}
        files[RNG] = json.dumps(rng).encode()
        return files

    def restore_checkpoint(self, files: Mapping[str, bytes]) -> None:
        """See :meth:`TrainerBackend.restore_checkpoint`."""
        self.load_adapter_files({k: v for k, v in files.items() if k.startswith("adapter_")})
        state = safetensors_numpy.load(bytes(files[OPTIMIZER]))
        self.optimizer.state = tree_unflatten([(k, mx.array(v)) for k, v in state.items()])
        rng = json.loads(files[RNG])
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, np.array(keys, np.uint32), pos, has_gauss, cached))
