"""What the primitives take and give, framework-free, with the checks every wire shares.

A :class:`Datum` is one training example as Tinker defines it (``tinker.Datum``: a
``model_input`` of N tokens and ``loss_fn_inputs``): per position ``t`` the model reads
``input_ids[: t + 1]`` and the loss scores ``target_ids[t]``. The losses
(:data:`LOSS_FUNCTIONS`) and what each needs are documented in
``protos/gridrl/v1/primitives.proto`` (``LossFunction``) and computed in
:mod:`gridrl.trainer.primitives.torch_model`; sums, never means (Tinker's convention).

Every check raises :class:`gridrl.common.errors.StatusError` INVALID_ARGUMENT naming the field,
e.g. ``data[2].advantages: 5 values for 7 input tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gridrl.common.errors import invalid_argument

if TYPE_CHECKING:
    from gridrl.engine.contract import FinishReason

CROSS_ENTROPY, IMPORTANCE_SAMPLING, PPO = "cross_entropy", "importance_sampling", "ppo"
CISPO, DRO = "cispo", "dro"
LOSS_FUNCTIONS = (CROSS_ENTROPY, IMPORTANCE_SAMPLING, PPO, CISPO, DRO)
# Per-position inputs each loss reads besides the targets; `weights` is optional (all 1).
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    CROSS_ENTROPY: (),
    IMPORTANCE_SAMPLING: ("advantages", "sampling_logprobs"),
    PPO: ("advantages", "sampling_logprobs"),
    CISPO: ("advantages", "sampling_logprobs"),
    DRO: ("advantages", "sampling_logprobs"),
}
# Settings each loss reads from Tinker's loss_fn_config
LOSS_SETTINGS: dict[str, tuple[str, ...]] = {
    CROSS_ENTROPY: (), IMPORTANCE_SAMPLING: (),
    PPO: ("clip_low_threshold", "clip_high_threshold"),
    CISPO: ("clip_low_threshold", "clip_high_threshold"),
    DRO: ("beta",),
}
DEFAULT_CLIP_LOW, DEFAULT_CLIP_HIGH = 0.8, 1.2  # Tinker's PPO: epsilon 0.2 both sides
# DRO's beta when loss_fn_config gives none: Tinker's documentation gives no default (its
# example sets 0.05), so gridrl takes that value.
DEFAULT_DRO_BETA = 0.05


@dataclass(frozen=True)
class Datum:
    """One training example.

    Attributes:
        input_ids: (N,) int64, N >= 1: the model's input.
        target_ids: (N,) int64: the token position ``t`` predicts.
        weights: (N,) float32 loss weights (cross_entropy), or None (all 1).
        advantages: (N,) float32 (importance_sampling, ppo), or None.
        sampling_logprobs: (N,) float32 logprobs of the targets under the sampling policy
            (importance_sampling, ppo), or None.
    """

    input_ids: np.ndarray
    target_ids: np.ndarray
    weights: np.ndarray | None = None
    advantages: np.ndarray | None = None
    sampling_logprobs: np.ndarray | None = None

    @classmethod
    def of(cls, input_ids: Sequence[int], target_ids: Sequence[int], *,
           weights: Sequence[float] | None = None, advantages: Sequence[float] | None = None,
           sampling_logprobs: Sequence[float] | None = None) -> Datum:
        """A datum from lists (empty per-position lists read as absent)."""
        def floats(v: Sequence[float] | None) -> np.ndarray | None:
            return None if v is None or len(v) == 0 else np.asarray(v, dtype=np.float32)

        return cls(np.asarray(input_ids, dtype=np.int64), np.asarray(target_ids, dtype=np.int64),
                   floats(weights), floats(advantages), floats(sampling_logprobs))

    @property
    def length(self) -> int:
        """N, the number of positions."""
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class LossSpec:
    """A loss by name and its settings.

    Attributes:
        name: one of :data:`LOSS_FUNCTIONS`.
        clip_low, clip_high: PPO's and CISPO's clip of the ratio
            ``exp(logp - sampling_logprobs)``.
        beta: DRO's weight of the quadratic penalty ``(logp - sampling_logprobs)^2 / 2``.
    """

    name: str
    clip_low: float = DEFAULT_CLIP_LOW
    clip_high: float = DEFAULT_CLIP_HIGH
    beta: float = DEFAULT_DRO_BETA

    def check(self, field_name: str = "loss_fn") -> None:
        """Raises INVALID_ARGUMENT for an unknown name or a clip range that is not
        ``0 < clip_low <= 1 <= clip_high``."""
        if self.name not in LOSS_FUNCTIONS:
            raise invalid_argument(field_name, f"{self.name!r} is not supported here (gridrl "
                                   f"implements {', '.join(LOSS_FUNCTIONS)})")
        if not 0 < self.clip_low <= 1:
            raise invalid_argument("loss_fn_config.clip_low_threshold",
                                   f"must be in (0, 1], got {self.clip_low}")
        if not math.isfinite(self.clip_high) or self.clip_high < 1:
            raise invalid_argument("loss_fn_config.clip_high_threshold",
                                   f"must be a finite number >= 1, got {self.clip_high}")
        if not math.isfinite(self.beta) or self.beta < 0:
            raise invalid_argument("loss_fn_config.beta",
                                   f"must be a finite number >= 0, got {self.beta}")


def check_datums(data: Sequence[Datum], loss: LossSpec, vocab_size: int) -> None:
    """The preconditions of forward / forward-backward.

    Raises:
        StatusError: INVALID_ARGUMENT naming the field: no datum, an empty input, a target or
            input id outside ``[0, vocab_size)``, a per-position list of the wrong length, an
            input the loss needs missing, a non-finite value.
    """
    loss.check()
    if not data:
        raise invalid_argument("data", "at least one datum is needed")
    needed = LOSS_INPUTS[loss.name]
    for i, d in enumerate(data):
        n = d.length
        if n < 1:
            raise invalid_argument(f"data[{i}].input_ids", "is empty")
        for name, ids in (("input_ids", d.input_ids), ("target_ids", d.target_ids)):
            if ids.ndim != 1 or ids.shape[0] != n:
                raise invalid_argument(f"data[{i}].{name}",
                                       f"{ids.size} ids for {n} input tokens")
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise invalid_argument(f"data[{i}].{name}",
                                       f"token ids must be in [0, {vocab_size})")
        for name in ("weights", "advantages", "sampling_logprobs"):
            values = getattr(d, name)
            if values is None:
                if name in needed:
                    raise invalid_argument(f"data[{i}].{name}",
                                           f"the {loss.name} loss needs it")
                continue
            if values.ndim != 1 or values.shape[0] != n:
                raise invalid_argument(f"data[{i}].{name}",
                                       f"{values.size} values for {n} input tokens")
            if not np.isfinite(values).all():
                raise invalid_argument(f"data[{i}].{name}", "has a NaN or infinite value")


@dataclass(frozen=True)
class AdamSettings:
    """AdamW's settings for one step (Tinker's ``AdamParams``; its defaults).

    Attributes:
        lr: learning rate, > 0.
        beta1, beta2: moment decays in [0, 1).
        eps: > 0.
        weight_decay: decoupled weight decay, >= 0.
        grad_clip_norm: clip the global L2 norm of the gradient to this; 0: off.
    """

    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def check(self, prefix: str = "adam_params") -> None:
        """Raises INVALID_ARGUMENT naming the first setting out of its range."""
        rules = (("learning_rate", self.lr, self.lr > 0), ("beta1", self.beta1,
                 0 <= self.beta1 < 1), ("beta2", self.beta2, 0 <= self.beta2 < 1),
                 ("eps", self.eps, self.eps > 0),
                 ("weight_decay", self.weight_decay, self.weight_decay >= 0),
                 ("grad_clip_norm", self.grad_clip_norm, self.grad_clip_norm >= 0))
        for name, value, ok in rules:
            if not ok or not math.isfinite(value):
                raise invalid_argument(f"{prefix}.{name}", f"out of range: {value}")


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample one prompt (the engine's semantics, :mod:`gridrl.engine.contract`).

    Attributes:
        n: samples, >= 1.
        max_tokens: new tokens per sample, >= 1.
        temperature: >= 0 (0: greedy).
        top_p: in (0, 1].
        top_k: 0: off.
        seed: the sampler's seed (None: a random one).
        stop_token_ids: ids that end a sample besides the tokenizer's eos.
        stop_strings: strings that end a sample (cut after the token completing one).
    """

    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def check(self, prefix: str = "sampling_params") -> None:
        """Raises INVALID_ARGUMENT naming the first parameter out of range."""
        if self.n < 1:
            raise invalid_argument("num_samples", f"must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise invalid_argument(f"{prefix}.max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise invalid_argument(f"{prefix}.temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise invalid_argument(f"{prefix}.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise invalid_argument(f"{prefix}.top_k", f"must be >= 0 (0 or -1: off), got "
                                   f"{self.top_k}")
        if any(not s for s in self.stop_strings):
            raise invalid_argument(f"{prefix}.stop", "an empty stop string")


#: The output head's module name (LoRA on it: Tinker's ``train_unembed``; the same name as
#: :data:`gridrl.adapters.adapter.HEAD_MODULE` in both adapter layouts).
HEAD_MODULE = "lm_head"


@dataclass(frozen=True)
class LoraRequest:
    """The LoRA of a new training model.

    Attributes:
        rank: r >= 1.
        seed: seed of the adapter's initialisation (None: the server's).
        train_attn, train_mlp: which projections carry LoRA (at least one).
        train_unembed: the output head (``lm_head``, the unembedding) carries LoRA too
            (Tinker's ``train_unembed``).
    """

    rank: int = 32
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False

    def check(self) -> None:
        """Raises INVALID_ARGUMENT for rank < 1 or no module family chosen."""
        if self.rank < 1:
            raise invalid_argument("lora_config.rank", f"must be >= 1, got {self.rank}")
        if not (self.train_attn or self.train_mlp):
            raise invalid_argument("lora_config", "train_attn or train_mlp must be true "
                                   "(gridrl adapts the attention and MLP projections)")


@dataclass
class ForwardResult:
    """What forward / forward-backward computed.

    Attributes:
        logprobs: one (N,) float32 array per datum: ``logp`` of the targets at temperature 1
            under the weights before any update.
        loss: the loss summed over datums and positions.
        datums: datums scored.
    """

    logprobs: list[np.ndarray]
    loss: float
    datums: int


@dataclass(frozen=True)
class OptimResult:
    """What an optimizer step did.

    Attributes:
        grad_norm: the accumulated gradient's global L2 norm before clipping.
        steps: optimizer steps taken, this one included.
        datums: datums whose gradient it applied.
    """

    grad_norm: float
    steps: int
    datums: int


@dataclass(frozen=True)
class SampledSequence:
    """One sample.

    Attributes:
        token_ids: sampled ids (the stop token included when it stopped on one).
        logprobs: processed logprobs: under the distribution each token was drawn from
            (temperature, top-k, top-p applied).
        finish_reason: ``"stop"`` or ``"length"``.
        policy_version: the weights' version (0: base model).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int


@dataclass
class SampleResult:
    """The samples of one prompt.

    Attributes:
        sequences: in sample-index order.
        sampled_by: a rollout node's address, or ``"trainer"``.
        prompt_logprobs: with prompt logprobs asked: per prompt position, the logprob of that
            token given the ones before (temperature 1, the sampled weights); None at
            position 0.
        topk_prompt: with top-k prompt logprobs asked: ``(token_ids, logprobs)``, both
            ``(len(prompt) - 1, k)`` (int32, float32), row ``i`` the k most likely tokens
            after ``prompt[: i + 1]``, most likely first (temperature 1).
    """

    sequences: list[SampledSequence]
    sampled_by: str
    prompt_logprobs: list[float | None] | None = None
    topk_prompt: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class ModelInfo:
    """A training model as :meth:`PrimitivesService.info` reports it.

    Attributes:
        model_id: its id.
        base_model: the base model string it was created with.
        tokenizer_dir: where its tokenizer is (a model directory), or the hub id.
        architecture: config.json ``model_type``.
        lora_rank, lora_alpha: the adapter's r and alpha.
        target_modules: module names the adapter is on.
        steps: optimizer steps taken.
        policy_version: newest snapshot saved for sampling (0: none).
        pending_datums: datums accumulated since the last step.
    """

    model_id: str
    base_model: str
    tokenizer_dir: str
    architecture: str
    lora_rank: int
    lora_alpha: float
    target_modules: list[str] = field(default_factory=list)
    steps: int = 0
    policy_version: int = 0
    pending_datums: int = 0
