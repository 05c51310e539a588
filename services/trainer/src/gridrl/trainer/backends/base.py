"""The trainer's model side behind one interface: :class:`TrainerBackend`.

The training loop (``loop.py``) knows no tensor framework. It samples (rollout nodes, or the
backend itself for ``--rollout local``), scores, admits samples by staleness and computes group
advantages (numpy: :mod:`gridrl.trainer.grpo.advantages`, :mod:`gridrl.trainer.grpo.batch`), then hands the
backend the step's :class:`TrainSequence` s. Everything that touches weights, gradients, an
optimizer, a random generator of the framework or a device belongs to the backend:

=========================  ===================================================================
what the loop needs        method
=========================  ===================================================================
load model + LoRA          ``cls.from_config(cfg)``
local rollouts, eval       :meth:`TrainerBackend.generate` (sampled or greedy, own weights)
behaviour-aligned scores   :meth:`TrainerBackend.logprobs`
one GRPO step              :meth:`TrainerBackend.update` -> :class:`UpdateStats`
adapter out / in           :meth:`TrainerBackend.adapter_files` / ``load_adapter_files``
exact resume               :meth:`TrainerBackend.checkpoint_files` / ``restore_checkpoint``
data parallelism           ``rank``, ``world_size``, :meth:`TrainerBackend.broadcast`
=========================  ===================================================================

``--backend NAME`` picks the implementation from :data:`gridrl.trainer.config.BACKENDS`
(imported only when chosen, so ``gridrl-trainer --help`` and the loop import no framework). ``torch`` is
:class:`gridrl.trainer.backends.torch.backend.TorchTrainerBackend` (a peft LoRA on a transformers model;
DDP under ``torchrun``).

Adding an implementation (e.g. MLX with mlx-lm's LoRA layers, issue 16):

1. Subclass :class:`TrainerBackend` in ``gridrl/trainer/<name>_backend.py`` and implement every
   abstract method as its docstring specifies. The docstrings are the contract; the numbers
   that must agree with the torch backend are the ones the conformance suite
   (``tests/trainer/backends/test_trainer_backends.py``) checks.
2. Add ``"<name>": "gridrl.trainer.backends.<name>.backend:<Class>"`` to
   :data:`gridrl.trainer.config.BACKENDS`; the ``--backend`` flag's choices come from it.
3. Add ``<name>`` to the conformance suite's parameters.

What an implementation reuses rather than re-derives (so that every backend learns from the
same targets): the advantages and the staleness admission are computed by the loop before
:meth:`~TrainerBackend.update` is called (each :class:`TrainSequence` carries its advantage);
the loss weights come from :func:`gridrl.trainer.grpo.advantages.sequence_weights`; the sampling semantics
are the engine's (:mod:`gridrl.engine.contract`); adapters leave in peft layout and
``gridrl.adapters`` converts them for mlx nodes and the final ``adapter-mlx/``. The per-token
formulas it re-implements on its framework are in :mod:`gridrl.trainer.backends.torch.losses` (clipped
surrogate with clip-higher, k3 KL to the reference, mismatch KL) with their sources.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from gridrl.common.errors import invalid_argument
from gridrl.trainer.config import BACKENDS, TrainConfig
from gridrl.trainer.grpo.sequences import TrainSequence

if TYPE_CHECKING:
    from gridrl.engine.contract import SamplingConfig, SequenceResult
    from gridrl.models import ModelIdentity

T = TypeVar("T")

# File names a checkpoint keeps for itself; checkpoint_files() must not use them.
RESERVED_CHECKPOINT_FILES = frozenset({"state.json", "config.json"})
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters (the same meaning in peft and mlx-lm).

    Attributes:
        rank: r.
        alpha: lora_alpha; the update is scaled by ``alpha / r`` (``alpha / sqrt(r)`` with
            rsLoRA, Kalajdzievski 2023, arXiv:2312.03732).
        dropout: dropout on the adapter input (training mode only).
        target_modules: ``"all-linear"`` (every linear layer but the output head) or a
            comma-separated list of module names (``"q_proj,v_proj"``).
        rslora: use rank-stabilised scaling.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str = "all-linear"
    rslora: bool = False

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> LoraSettings:
        """The ``--lora-*`` and ``--rslora`` settings of a run."""
        return cls(rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                   target_modules=cfg.lora_target_modules, rslora=cfg.rslora)


@dataclass(frozen=True)
class UpdateConfig:
    """Loss and optimisation settings of a step (formulas: :mod:`gridrl.trainer.backends.torch.losses`).

    Attributes:
        temperature: the sampling temperature; trainer logprobs use ``logits / temperature``.
        eps_low, eps_high: clip range (``eps_high`` None: symmetric).
        beta: KL-to-reference coefficient (0: off, no reference forward).
        aggregation: ``"sequence"``, ``"token"`` or ``"constant"``
            (:func:`gridrl.trainer.grpo.advantages.sequence_weights`).
        max_tokens: sampling ``max_tokens`` (the ``"constant"`` normaliser).
        micro_batch_size: sequences per forward/backward; 0 = the whole share at once.
        max_grad_norm: clip the LoRA gradient's global L2 norm to this; 0 = no clipping.
        shared_prefix: run each group's prompt once and repeat its KV cache for the group's
            completions; False: one padded forward over prompt + completion per sequence. Same
            maths, different float rounding (a backend may ignore it).
        pack: run a micro-batch's sequences packed without padding where the backend allows
            (:mod:`gridrl.trainer.backends.packing`: each group's prompt once, then its
            completions, in rows of the longest group; attention per segment or a
            block-diagonal causal mask, ``segment_attention``); it replaces
            ``shared_prefix``'s cache. False (the default): the padded paths. Same maths,
            different float rounding. Off by default: with the dense mask it measured faster
            for one-turn groups but slower for long multi-turn ones on a CPU; per segment it
            measured 0.84x the padded update's time on one turn and 0.94x on two (quiet,
            docs/benchmarks.md section 19); it becomes the default once the whole suite has
            run on it.
        segment_attention: a packed forward attends per prompt and per completion
            (:class:`gridrl.trainer.backends.torch.packed.SegmentAttention`: no row-wide
            scores) where the model's attention is sdpa; False: over the whole row with the
            block-diagonal mask. Same maths, different float rounding.
        top_p, top_k: the sampler's truncation. The loss uses the untruncated policy
            ``softmax(logits / T)`` (as TRL does); the mismatch KL and :meth:`TrainerBackend.
            logprobs` use the sampler's own transform (engine contract steps 1-3), so
            truncation is not reported as a node mismatch.
        is_correction: importance-sampling correction against the behaviour logprobs:
            ``"none"`` (the surrogate's ratio runs against the behaviour logprobs and its clip
            is the only guard), ``"tis"`` (truncated) or ``"mis"`` (masked)
            (:func:`gridrl.trainer.backends.torch.losses.importance_weights`).
        is_level: ``"token"`` or ``"sequence"`` ratios.
        is_cap: the cap ``C`` of the ratio (TIS truncates to it, MIS drops what exceeds it).
        update_dtype: ``"float32"``, or ``"bfloat16"``: the update's forward and backward
            run under autocast (mixed precision, Micikevicius et al. 2018, arXiv:1710.03740:
            float32 master weights, gradients and optimizer state; logprobs and the loss in
            float32 from bfloat16 logits).
    """

    temperature: float = 1.0
    eps_low: float = 0.2
    eps_high: float | None = None
    beta: float = 0.0
    aggregation: str = "sequence"
    max_tokens: int = 256
    micro_batch_size: int = 0
    max_grad_norm: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    shared_prefix: bool = True
    pack: bool = False
    segment_attention: bool = True
    is_correction: str = "none"
    is_level: str = "token"
    is_cap: float = 2.0
    update_dtype: str = "float32"
    skip_no_signal: bool = False

    @property
    def truncated(self) -> bool:
        """True when the sampler drops tokens (top-k or top-p)."""
        return self.top_k > 0 or self.top_p < 1.0

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> UpdateConfig:
        """The loss settings of a run (``--temperature``, ``--clip-eps``, ``--kl-beta``...)."""
        return cls(temperature=cfg.temperature, eps_low=cfg.clip_eps, eps_high=cfg.clip_eps_high,
                   beta=cfg.kl_beta, aggregation=cfg.loss_aggregation, max_tokens=cfg.max_tokens,
                   micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm,
                   top_p=cfg.top_p, top_k=cfg.top_k, is_correction=cfg.is_correction,
                   is_level=cfg.is_level, is_cap=cfg.is_cap, update_dtype=cfg.update_dtype,
                   skip_no_signal=cfg.skip_no_signal)


@dataclass
class UpdateStats:
    """What a step did. Scalars are over all ranks' sequences.

    Attributes:
        loss: the aggregated loss (surrogate + beta * KL).
        mismatch_kl: k3 KL(behaviour || trainer) per token, nats (before the update).
        per_sequence_mismatch_kl: (N,) the same per sequence, in the order of the sequences
            given to :meth:`TrainerBackend.update`.
        clip_fraction: fraction of completion tokens where the clipped branch was taken.
        ref_kl: mean k3 KL(trainer || reference) per token, or None when beta == 0.
        grad_norm: the LoRA gradient's L2 norm before clipping.
        lr: learning rate used by this step.
        tokens: completion tokens trained on.
        is_weight_mean: with an importance-sampling correction, the mean raw ratio
            ``pi_trainer / pi_behaviour`` over the tokens (token level) or sequences (sequence
            level) before truncation/masking (1 in expectation when the samples are on-policy);
            None without a correction.
        is_weight_max: the largest raw ratio; None without a correction.
        is_limited_fraction: fraction of those tokens or sequences whose ratio exceeded the cap
            (truncated by TIS, masked by MIS); None without a correction.
        skipped_groups, skipped_sequences: groups (and their sequences) left out of the forward
            and backward (``skip_no_signal``) because all their advantages are 0 and ``beta ==
            0``: their gradient
            is exactly 0 (:func:`gridrl.trainer.grpo.advantages.groups_with_signal`). Their
            ``per_sequence_mismatch_kl`` is NaN (not measured) and ``mismatch_kl`` is over the
            trained sequences only; ``tokens`` and ``clip_fraction`` count them (a token of
            advantage 0 never takes the clipped branch).
        micro_batches, checkpointed_micro_batches: forward/backward passes the update ran,
            and how many of them recomputed their activations (``--memory-mb``).
        peak_rss_bytes: this process's peak resident memory during the update (bytes), None
            where the backend does not measure it.
        threads: the CPU threads the update ended with (``--threads 0``: re-decided between
            micro-batches from the cores other processes leave free), None where not known.
    """

    loss: float
    mismatch_kl: float
    per_sequence_mismatch_kl: list[float] = field(default_factory=list)
    clip_fraction: float = 0.0
    ref_kl: float | None = None
    grad_norm: float = 0.0
    lr: float = 0.0
    tokens: int = 0
    is_weight_mean: float | None = None
    is_weight_max: float | None = None
    is_limited_fraction: float | None = None
    skipped_groups: int = 0
    skipped_sequences: int = 0
    micro_batches: int = 0
    checkpointed_micro_batches: int = 0
    peak_rss_bytes: int | None = None
    threads: int | None = None


class TrainerBackend(abc.ABC):
    """A trainable policy on one framework: a base model with a LoRA adapter, its optimizer and
    learning-rate schedule, and a sampler over its current weights.

    Attributes set by implementations:
        name: the ``--backend`` value.
        tokenizer: a ``transformers`` tokenizer of the model directory (chat template, decode,
            eos ids); the loop encodes prompts with it.
        identity: the base model's :class:`gridrl.models.ModelIdentity` (checked against every
            rollout node's; ``num_layers`` drives the mlx conversion).
        low_precision: True when the trainer computes its logprobs in a 16-bit float type (the
            node monitor then holds mismatch KLs to ``--mismatch-kl-max-16bit``).
        rank, world_size: this process's place in data parallelism (0 and 1 when alone). Rank 0
            alone samples, scores, syncs, evaluates, checkpoints and writes; every rank calls
            :meth:`update` with the same sequences.

    Threading: calls never overlap. The training loop makes them from its own thread (the
    local sampler and the evaluator included; ``--async-steps``, whose prefetch thread samples
    ahead, needs remote nodes). A helper thread that scores with :meth:`logprobs` while the loop
    runs must serialise with :meth:`update` itself (a lock around both); implementations need
    no locking of their own.
    """

    name: str
    tokenizer: Any
    identity: ModelIdentity
    low_precision: bool = False
    rank: int = 0
    world_size: int = 1

    @classmethod
    @abc.abstractmethod
    def from_config(cls, cfg: TrainConfig) -> TrainerBackend:
        """Load ``cfg.model`` (:func:`gridrl.models.resolve_model`) on ``cfg.device`` in
        ``cfg.dtype`` and put a fresh LoRA adapter on it (:meth:`LoraSettings.from_config`:
        A random, B zero, so the policy starts equal to the base model; LoRA weights float32),
        after seeding every random generator the run draws from (python ``random``, numpy and
        the framework's) with ``cfg.seed``. Build AdamW (``cfg.lr``, ``cfg.weight_decay``,
        betas (0.9, 0.999), eps 1e-8) over the LoRA parameters and the schedule of
        ``cfg.lr_schedule`` / ``cfg.warmup_steps`` / ``cfg.steps`` (linear warmup, then
        constant, linear or half-cosine decay to 0, stepped once per update). The loss settings
        are :meth:`UpdateConfig.from_config`. ``cfg.threads`` (> 0) caps the CPU threads. Join
        data parallelism when the process was launched for it.

        Raises:
            StatusError: INVALID_ARGUMENT naming the flag (e.g. ``--lora-target-modules`` when
                no module matches, ``--device`` / ``--dtype`` the framework cannot use).
        """

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], config: SamplingConfig,
                 seeds: Sequence[int], *, shared_prefix: bool = False) -> list[SequenceResult]:
        """Decode one completion per prompt with the current weights (adapter included), no
        dropout and no gradient, with exactly the engine's sampling semantics
        (:mod:`gridrl.engine.contract`: ``temperature == 0`` is greedy; each sequence's RNG is
        seeded with its own seed, so the same seed and weights give the same tokens). This is
        ``--rollout local`` and the held-out eval on the trainer's own weights.

        Args:
            prompts: token ids, each non-empty.
            config: the sampling parameters, shared by every sequence of the call.
            seeds: one per prompt.
            shared_prefix: the prompts begin alike (a task's system prompt; the held-out
                eval): the backend may compute the common prefix once for all of them
                (results equal up to float rounding).
        Returns:
            one :class:`~gridrl.engine.contract.SequenceResult` per prompt, in order; its
            logprobs are the behaviour logprobs (under the distribution each token was drawn
            from).
        """

    @abc.abstractmethod
    def logprobs(self, seqs: Sequence[TrainSequence]) -> list[list[float]]:
        """Teacher-forced logprobs of each completion under the current weights, no dropout,
        no gradient, under the sampler's transform of the run (``--temperature``, ``--top-k``,
        ``--top-p``: engine contract steps 1-3, renormalised over the kept support; a token
        outside it gets -100). For a completion a node sampled with the same weights, these
        equal its behaviour logprobs up to float rounding: the invariant the mismatch KL
        measures (``behaviour_logprobs`` and ``advantage`` of ``seqs`` are ignored).

        Returns:
            one list per sequence, ``len(completion_ids)`` floats each, natural log.
        """

    @abc.abstractmethod
    def update(self, seqs: Sequence[TrainSequence]) -> UpdateStats:
        """One GRPO optimizer step over the step's sequences.

        Per completion token ``t`` of sequence ``i``: ``logp`` = log-softmax of
        ``logits / temperature`` (untruncated, with gradient, dropout active), ratio
        ``exp(logp - behaviour)``, loss ``-min(ratio * A_i, clip(ratio, 1 - eps_low,
        1 + eps_high) * A_i)`` plus, when ``beta > 0``, ``beta * k3(trainer || reference)`` with
        the reference the base model (adapter disabled). The step's loss is
        ``sum_i sum_t c_i * loss_it`` with ``c = grpo.sequence_weights(lengths, aggregation,
        max_tokens)`` over *all* sequences, so micro-batches (``micro_batch_size``) and ranks
        add up to the full-batch gradient. Then clip the LoRA gradient's global L2 norm to
        ``max_grad_norm`` (0: off), step AdamW, step the schedule once. Under data parallelism
        every rank gets the same ``seqs`` and trains on the groups ``rank, rank + W, ...``.

        Returns:
            :class:`UpdateStats`, identical on every rank; ``mismatch_kl`` is measured before
            the step, under the sampler's transform (as :meth:`logprobs`).
        Raises:
            ValueError: ``seqs`` is empty, or a rank's share is.
        """

    @abc.abstractmethod
    def adapter_files(self) -> dict[str, bytes]:
        """The adapter as peft files in memory, whatever the framework:
        ``adapter_config.json`` (as ``PeftModel.save_pretrained`` writes it: ``r``,
        ``lora_alpha``, ``target_modules``, ``use_rslora``, ``base_model_name_or_path`` the
        ``--model`` string...) and ``adapter_model.safetensors`` (float32, peft key names
        ``base_model.model.<module path>.lora_A.weight`` (r, in) and ``...lora_B.weight``
        (out, r), metadata ``{"format": "pt"}``). These are pushed to nodes (converted for mlx
        nodes by ``gridrl.adapters``), checkpointed and written as the final ``adapter/``."""

    @abc.abstractmethod
    def load_adapter_files(self, files: Mapping[str, bytes]) -> None:
        """Set the LoRA weights from files as :meth:`adapter_files` returns them.

        Raises:
            ValueError: the files do not fit this policy (missing or unexpected tensors).
        """

    @abc.abstractmethod
    def checkpoint_files(self) -> dict[str, bytes]:
        """Everything :meth:`restore_checkpoint` needs to continue exactly: the adapter files,
        the optimizer state, the schedule state and every random generator's state, as files
        (name -> bytes) written next to the loop's own ``state.json`` and ``config.json``
        (names in :data:`RESERVED_CHECKPOINT_FILES` are not allowed). Torch writes
        ``optimizer.pt``, ``scheduler.pt`` and ``rng.pt``."""

    @abc.abstractmethod
    def restore_checkpoint(self, files: Mapping[str, bytes]) -> None:
        """Continue from :meth:`checkpoint_files` of an earlier run with the same settings:
        afterwards the next :meth:`update` on the same sequences, the next sample and the next
        random draw are those the checkpointed run would have made.

        Raises:
            ValueError: the adapter does not fit; KeyError: a file is missing.
        """

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank (a collective: every rank calls it). Alone: ``obj``."""
        return obj

    @abc.abstractmethod
    def close(self, wait: bool = True) -> None:
        """Leave data parallelism and release what the backend holds. Idempotent.

        Args:
            wait: every rank is past its last collective (the run ended or stopped), so the
                process group's threads can be ended too; False after a failure, when a
                collective may still be in flight (see ``distributed.DataParallel.close``).
        """


def backend_class(name: str) -> type[TrainerBackend]:
    """The :class:`TrainerBackend` subclass registered as ``name`` in
    :data:`gridrl.trainer.config.BACKENDS`.

    Raises:
        StatusError: INVALID_ARGUMENT ``--backend: ...`` for an unknown name;
        ImportError: the backend's framework is not installed.
    """
    target = BACKENDS.get(name)
    if target is None:
        raise invalid_argument("--backend", f"{name!r} is not one of {', '.join(BACKENDS)}")
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def create_backend(cfg: TrainConfig) -> TrainerBackend:
    """The run's backend (``--backend``), loaded with :meth:`TrainerBackend.from_config`."""
    return backend_class(cfg.backend).from_config(cfg)
