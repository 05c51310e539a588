"""The training primitives on MLX: :class:`MlxTrainableModel`, one training model of
``gridrl-trainer serve-api --backend mlx`` (an all-Mac team's Tinker; Linux CPU through
``mlx[cpu]``), the :class:`gridrl.trainer.primitives.model.TrainableModel` of
:class:`~gridrl.trainer.backends.mlx.backend.MlxTrainerBackend`.

It reuses the MLX trainer backend's pieces: the model loaded by the engine's MLX backend with
mlx-lm's LoRA layers on it (A uniform in ``+-1/sqrt(in)`` seeded, B zero: the base model at
start), its sampler over the live weights, its peft-layout adapter files and its
checkpoint files (adapter, AdamW state).

Per datum of N positions, ``logp[t]`` is the logprob of ``target_ids[t]`` under
``softmax(logits[t])`` (temperature 1) from one forward of ``input_ids`` (datums one at a
time: no padding); the losses are those of :mod:`gridrl.trainer.primitives.torch_model` (the
formulas and their sources are in its docstring), summed. Gradients (``nn.value_and_grad``)
add up over forward-backward calls until :meth:`MlxTrainableModel.optim_step`
(``mlx.optimizers.AdamW`` with bias correction, torch's AdamW, with the step's settings).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from gridrl.common.errors import failed_precondition, invalid_argument
from gridrl.trainer.backends.base import LoraSettings, UpdateConfig
from gridrl.trainer.backends.mlx.backend import OPTIMIZER, MlxTrainerBackend
from gridrl.trainer.primitives.types import (
    CISPO,
    CROSS_ENTROPY,
    DRO,
    HEAD_MODULE,
    IMPORTANCE_SAMPLING,
    AdamSettings,
    Datum,
    ForwardResult,
    LossSpec,
    OptimResult,
    check_datums,
)

STEPS_FILE = "steps.json"  # optimizer steps taken, beside the backend's checkpoint files
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _adamw() -> optim.AdamW:
    """A fresh AdamW (each step sets its learning rate, betas, eps and weight decay)."""
    return optim.AdamW(learning_rate=1e-4, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0,
                       bias_correction=True)


def token_loss(loss: LossSpec, d: Datum, logp: mx.array) -> mx.array:
    """The summed loss of one datum from its (N,) float32 logprobs (the formulas of
    :mod:`gridrl.trainer.primitives.torch_model`)."""
    if loss.name == CROSS_ENTROPY:
        return -(logp * mx.array(d.weights)).sum() if d.weights is not None else -logp.sum()
    q, adv = mx.array(d.sampling_logprobs), mx.array(d.advantages)
    ratio = mx.exp(logp - q)
    if loss.name == IMPORTANCE_SAMPLING:
        return -(ratio * adv).sum()
    if loss.name == CISPO:
        weight = mx.stop_gradient(mx.clip(ratio, loss.clip_low, loss.clip_high))
        return -(weight * logp * adv).sum()
    if loss.name == DRO:
        return -(logp * adv - 0.5 * loss.beta * (logp - q) ** 2).sum()
    return -mx.minimum(ratio * adv, mx.clip(ratio, loss.clip_low, loss.clip_high) * adv).sum()


class MlxTrainableModel:
    """An mlx-lm LoRA on an MLX causal LM, its AdamW state and accumulated gradient.

    Args:
        backend: the :class:`MlxTrainerBackend` over the model (its sampler and files).
        lora: the adapter's settings.
        model_path: the resolved base model.
    """

    def __init__(self, backend: MlxTrainerBackend, lora: LoraSettings, model_path: str) -> None:
        self.backend = backend
        self.model = backend.model
        self.tokenizer = backend.tokenizer
        self.identity = backend.identity
        self.model_path = model_path
        self.lora_rank = lora.rank
        self.lora_alpha = lora.alpha
        self.target_modules = sorted(backend._target_modules())
        self.steps = 0
        self.pending_datums = 0
        self._grads: Any = None

    @classmethod
    def load(cls, base_model: str, lora: LoraSettings, *, seed: int, device: str = "auto",
             dtype: str = "auto") -> MlxTrainableModel:
        """Load ``base_model`` (alias, directory or hub id) with a fresh adapter (A seeded with
        ``seed``, B zero) and an AdamW over it.

        Raises:
            StatusError: INVALID_ARGUMENT for a ``dtype`` MLX has not, or when no module
                matches ``lora.target_modules``; FAILED_PRECONDITION for ``lm_head`` among
                them (train_unembed) on a model whose head is tied to its embeddings.
        """
        from mlx_lm.tuner.utils import linear_to_lora_layers

        from gridrl.engine.backends.mlx.backend import MlxBackend
        from gridrl.models import model_identity, resolve_model
        from gridrl.trainer.backends.mlx.backend import _lora_keys

        if dtype != "auto" and dtype not in DTYPES:
            raise invalid_argument("--dtype", f"{dtype!r} is not one of auto, "
                                              f"{', '.join(DTYPES)} for --backend mlx")
        path = resolve_model(base_model)
        engine = MlxBackend.from_pretrained(path, device=device)
        model = engine.model
        if dtype != "auto":
            model.set_dtype(DTYPES[dtype])
            engine.dtype = dtype
        names = [t.strip() for t in lora.target_modules.split(",")]
        head = HEAD_MODULE in names  # train_unembed: mlx-lm's top-level key "lm_head"
        keys = _lora_keys(model, ",".join(n for n in names if n != HEAD_MODULE))
        if head:
            if getattr(model.args, "tie_word_embeddings", False) or not hasattr(model,
                                                                                HEAD_MODULE):
                raise failed_precondition(
                    f"train_unembed=True: {base_model}'s output head is tied to its embeddings "
                    "(mlx-lm computes it as embed_tokens.as_linear, no lm_head module to put "
                    "a LoRA on); pass train_unembed=False or use --backend torch")
            keys.append(HEAD_MODULE)
        scale = lora.alpha / (math.sqrt(lora.rank) if lora.rslora else lora.rank)
        mx.random.seed(seed % (2 ** 32))  # the LoRA A initialisation
        model.freeze()
        with mx.stream(engine._device):
            linear_to_lora_layers(model, len(model.layers), {
                "rank": lora.rank, "scale": scale, "dropout": lora.dropout, "keys": keys})
        mx.eval(model.parameters())
        backend = MlxTrainerBackend(engine, lora, _adamw(), UpdateConfig(), base_model,
                                    model_identity(path, model_id=base_model), lr=1e-4,
                                    seed=seed)
        return cls(backend, lora, str(path))

    # ---------------------------------------------------------------- forward / backward

    def _logprobs(self, d: Datum) -> mx.array:
        """(N,) float32 logprobs of ``d``'s targets (one forward of its inputs)."""
        logits = self.model(mx.array(d.input_ids.astype(np.int32))[None])[0].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = mx.array(d.target_ids.astype(np.int32))[:, None]
        return mx.take_along_axis(logp, targets, axis=-1)[:, 0]

    def forward(self, data: Sequence[Datum], loss: LossSpec, *, backward: bool) -> ForwardResult:
        """See :meth:`gridrl.trainer.primitives.model.TrainableModel.forward`."""
        check_datums(data, loss, self.identity.vocab_size)
        logprobs: list[np.ndarray] = []
        total = 0.0

        def datum_loss(d: Datum) -> tuple[mx.array, mx.array]:
            logp = self._logprobs(d)
            return token_loss(loss, d, logp), logp

        with mx.stream(self.backend.engine._device):
            self.model.train(backward)  # LoRA dropout only while training
            for d in data:
                if backward:
                    (part, logp), grads = nn.value_and_grad(self.model, datum_loss)(d)
                    self._grads = (grads if self._grads is None
                                   else tree_map(mx.add, self._grads, grads))
                    mx.eval(part, logp, self._grads)
                else:
                    part, logp = datum_loss(d)
                    mx.eval(part, logp)
                total += float(part.item())
                logprobs.append(np.array(logp, dtype=np.float32))
            self.model.eval()
        if backward:
            self.pending_datums += len(data)
        return ForwardResult(logprobs=logprobs, loss=total, datums=len(data))

    # ---------------------------------------------------------------- optimizer

    def optim_step(self, adam: AdamSettings) -> OptimResult:
        """See :meth:`gridrl.trainer.primitives.model.TrainableModel.optim_step`."""
        adam.check()
        if self.pending_datums == 0 or self._grads is None:
            raise failed_precondition("optim_step: no forward_backward since the last step "
                                      "(nothing to apply)")
        grads = self._grads
        with mx.stream(self.backend.engine._device):
            if adam.grad_clip_norm > 0:
                grads, norm = optim.clip_grad_norm(grads, adam.grad_clip_norm)
            else:
                norm = mx.sqrt(sum((g.astype(mx.float32) ** 2).sum()
                                   for _, g in tree_flatten(grads)))
            opt = self.backend.optimizer
            opt.learning_rate = adam.lr
            opt.betas = [adam.beta1, adam.beta2]
            opt.eps = adam.eps
            opt.weight_decay = adam.weight_decay
            opt.update(self.model, grads)
            mx.eval(self.model.parameters(), opt.state, norm)
        self._grads = None
        datums, self.pending_datums = self.pending_datums, 0
        self.steps += 1
        return OptimResult(grad_norm=float(norm.item()), steps=self.steps, datums=datums)

    # ---------------------------------------------------------------- files and sampling

    def adapter_files(self) -> dict[str, bytes]:
        return self.backend.adapter_files()

    def load_adapter_files(self, files: Mapping[str, bytes]) -> None:
        self.backend.load_adapter_files(files)

    def state_files(self) -> dict[str, bytes]:
        return {**self.backend.checkpoint_files(),
                STEPS_FILE: json.dumps({"steps": self.steps}).encode()}

    def load_state_files(self, files: Mapping[str, bytes], *, with_optimizer: bool) -> None:
        """Raises FAILED_PRECONDITION when the optimizer is asked of a state another backend
        saved (its optimizer state is torch's)."""
        self._grads, self.pending_datums = None, 0
        if with_optimizer:
            if OPTIMIZER not in files:
                raise failed_precondition("the state was saved by another backend (no "
                                          f"{OPTIMIZER}): load it without the optimizer")
            self.backend.restore_checkpoint(files)
            self.steps = int(json.loads(files.get(STEPS_FILE, b'{"steps": 0}'))["steps"])
        else:
            self.load_adapter_files({k: v for k, v in files.items()
                                     if k.startswith("adapter_")})
            self.backend.optimizer = _adamw()
            self.steps = 0

    def prompt_topk(self, prompt: Sequence[int], k: int) -> tuple[np.ndarray, np.ndarray]:
        """See :meth:`TrainableModel.prompt_topk`."""
        with mx.stream(self.backend.engine._device):
            logits = self.model(mx.array([list(prompt[:-1])], dtype=mx.int32))[0]
            logp = logits.astype(mx.float32)
            logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
            k = min(k, logp.shape[-1])
            top = mx.argsort(-logp, axis=-1)[:, :k]
            values = mx.take_along_axis(logp, top, axis=-1)
            mx.eval(top, values)
        return np.array(top, dtype=np.int32), np.array(values, dtype=np.float32)

    def generate(self, prompts: Sequence[Sequence[int]], config: Any,
                 seeds: Sequence[int]) -> list[Any]:
        return self.backend.generate(prompts, config, seeds)

    def close(self) -> None:
        self.backend.close()
