"""LoRA gradients of a trainer backend's update, as its optimizer gets them, for tests that
compare updates: gradients compare to float32 rounding, the weights after an AdamW step do not
(``float_bounds``). Works on the torch and the MLX backend alike."""

from __future__ import annotations

from typing import Any

import numpy as np

Key = tuple[str, str]  # (module path, "A" or "B"), e.g. ("model.layers.0.self_attn.q_proj", "A")


def random_adapter(files: dict[str, bytes], seed: int) -> dict[str, bytes]:
    """The same peft files with every tensor redrawn (B no longer zero, so A gets a gradient)."""
    from gridrl.adapters.tensors import Tensor, dump, load

    rng = np.random.default_rng(seed)
    parsed = load(files["adapter_model.safetensors"])
    state = {}
    for name, t in parsed.tensors.items():
        arr = (rng.standard_normal(t.shape) * 0.1).astype("<f4")
        state[name] = Tensor("F32", tuple(arr.shape), arr.tobytes())
    return {**files, "adapter_model.safetensors": dump(state, {"format": "pt"})}


def capture_gradients(backend: Any, replace_with: dict[Key, np.ndarray] | None = None
                      ) -> dict[Key, np.ndarray]:
    """Wrap ``backend``'s optimizer so that each step first records the LoRA gradients it is
    given (after the clip) into the returned dict, in peft's orientation (MLX's transposed).

    Args:
        replace_with: gradients (as returned here, e.g. another backend's) that the optimizer
            then steps on instead of its own: two backends' AdamWs get the same input, so their
            weights can be compared to AdamW's own rounding.
    """
    captured: dict[Key, np.ndarray] = {}
    if hasattr(backend.optimizer, "update"):  # mlx.optimizers
        import mlx.core as mx
        from mlx.utils import tree_flatten, tree_unflatten

        update = backend.optimizer.update

        def capture_mlx(model, grads):
            given = []
            for name, g in tree_flatten(grads):
                path, leaf = name.rsplit(".lora_", 1)
                key = (path, leaf.upper())
                captured[key] = np.array(g).T.copy()
                if replace_with is not None:
                    given.append((name, mx.array(replace_with[key].T.copy())))
            return update(model, tree_unflatten(given) if replace_with is not None else grads)

        backend.optimizer.update = capture_mlx
        return captured

    import torch

    trained = [(name, p) for name, p in backend.policy.model.named_parameters()
               if p.requires_grad]

    def capture_torch(optimizer, args, kwargs):
        for name, p in trained:
            path, leaf = name.removeprefix("base_model.model.").split(".lora_")
            key = (path, leaf[0])
            captured[key] = p.grad.detach().numpy().copy()
            if replace_with is not None:
                with torch.no_grad():
                    p.grad.copy_(torch.from_numpy(replace_with[key]))

    backend.optimizer.register_step_pre_hook(capture_torch)
    return captured
