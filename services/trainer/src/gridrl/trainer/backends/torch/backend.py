"""``--backend torch``: the :class:`~gridrl.trainer.backends.base.TrainerBackend` on torch.

A transformers causal LM with a peft LoRA adapter (``policy.py``), the GRPO step over padded
micro-batches (``update.py``, per-token maths in ``grpo_torch.py``), AdamW and a ``LambdaLR``
schedule, local sampling through the inference engine's torch backend over the same peft model
(``gridrl.engine.backends.torch.backend``: the lean forward reads the live LoRA weights), and DDP under
``torchrun`` (``distributed.py``).

Checkpoint files: the peft adapter files, ``optimizer.pt`` (AdamW state dict), ``scheduler.pt``
(the schedule's state dict) and ``rng.pt`` (python, numpy, torch CPU and every CUDA device's
RNG state), each written with ``torch.save``.
"""

from __future__ import annotations

import io
import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gridrl.common.errors import invalid_argument, resource_exhausted
from gridrl.engine.backends.torch.backend import TorchBackend
from gridrl.engine.backends.torch.cores import ThreadGovernor
from gridrl.engine.backends.torch.projection import cpu_has_bf16_compute
from gridrl.engine.contract import SequenceRequest
from gridrl.trainer.backends.base import (
    LoraSettings,
    TrainerBackend,
    TrainSequence,
    UpdateConfig,
    UpdateStats,
)
from gridrl.trainer.backends.memory import MIB, MemoryBudgetError, resolve_memory_mb
from gridrl.trainer.backends.torch.distributed import (
    SingleProcess,
    init_process_group,
    launched_by_torchrun,
    make_parallel,
)
from gridrl.trainer.backends.torch.memory import UpdateMemory, check_weights_fit
from gridrl.trainer.backends.torch.policy import load_policy, torch_device
from gridrl.trainer.backends.torch.update import (
    grpo_update,
    make_optimizer,
    make_scheduler,
    sequence_logprobs,
)

OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
RNG = "rng.pt"

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Python ``random``, numpy and torch (CPU and every CUDA device) RNG states."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# Checkpoints load with torch.load(weights_only=True): tensors, containers and numbers only, no
# code from the file runs. numpy's RNG state (a uint32 array) is the one other type a checkpoint
# holds; these are the globals that rebuild a plain uint32 array.
_NUMPY_ARRAY_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
                        np._core.multiarray._reconstruct]


def load_state_bytes(data: bytes) -> Any:
    """A ``torch.save``d checkpoint file (optimizer, scheduler or RNG state) from its bytes.

    Raises pickle.UnpicklingError for anything but tensors, containers, numbers and numpy
    arrays (a crafted ``.pt`` file cannot run code)."""
    with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
        return torch.load(io.BytesIO(data), weights_only=True)


class TorchTrainerBackend(TrainerBackend):
    """The torch implementation (see the module docstring).

    Args:
        policy: the :class:`gridrl.trainer.backends.torch.policy.Policy` (peft model, tokenizer, identity).
        optimizer: over ``policy.trainable_parameters()``.
        scheduler: a ``torch.optim.lr_scheduler`` stepped once per update, or None.
        update_cfg: the loss settings.
        parallel: :class:`~gridrl.trainer.backends.torch.distributed.DataParallel` under torchrun, else None
            (one process).
        max_batch: sequences :meth:`generate` decodes together.
        memory: the update's memory bound (``--memory-mb``), or None (unbounded).
        cores: the update's core sharing (``--threads 0`` on a CPU: the node's
            :class:`~gridrl.engine.backends.torch.cores.ThreadGovernor`), or None (the
            threads as set).
    """

    name = "torch"

    def __init__(self, policy: Any, optimizer: torch.optim.Optimizer, scheduler: Any | None,
                 update_cfg: UpdateConfig, parallel: SingleProcess | None = None,
                 max_batch: int = 64, memory: UpdateMemory | None = None,
                 cores: ThreadGovernor | None = None) -> None:
        self.policy = policy
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.update_cfg = update_cfg
        self.parallel = parallel or SingleProcess(policy.model)
        self.max_batch = max_batch
        self.memory = memory
        self.cores = cores
        self.tokenizer = policy.tokenizer
        self.identity = policy.identity
        self.low_precision = (policy.dtype in (torch.bfloat16, torch.float16)
                              or update_cfg.update_dtype != "float32")
        self.rank = self.parallel.rank
        self.world_size = self.parallel.world_size
        self._sampler: Any = None

    @classmethod
    def from_config(cls, cfg: Any) -> TorchTrainerBackend:
        """See :meth:`TrainerBackend.from_config`. Under ``torchrun`` (WORLD_SIZE > 1) it joins
        the process group (NCCL on CUDA, gloo on CPU) and wraps the model in DDP, whose
        construction broadcasts rank 0's LoRA init to every rank."""
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if launched_by_torchrun():
            init_process_group(torch_device(cfg.device))
        seed_everything(cfg.seed)
        limit_mb = resolve_memory_mb(getattr(cfg, "memory_mb", 0))
        on_cpu = torch_device(cfg.device).type == "cpu"
        if limit_mb and on_cpu:
            check_weights_fit(cfg.model, cfg.dtype, limit_mb)
        policy = load_policy(cfg.model, lora=LoraSettings.from_config(cfg), device=cfg.device,
                             dtype=cfg.dtype, seed=cfg.seed)
        optimizer = make_optimizer(policy.trainable_parameters(), lr=cfg.lr,
                                   weight_decay=cfg.weight_decay)
        update_cfg = UpdateConfig.from_config(cfg)
        memory = None
        if limit_mb and on_cpu:  # resident memory bounds a CPU update (CUDA: the GPU's own)
            try:
                memory = UpdateMemory(policy, update_cfg, limit_mb * MIB,
                                      optimizer=optimizer)
            except MemoryBudgetError as e:
                raise invalid_argument("--memory-mb", str(e)) from e
        scheduler = make_scheduler(optimizer, schedule=cfg.lr_schedule,
                                   warmup_steps=cfg.warmup_steps, total_steps=cfg.steps)
        if cfg.update_dtype == "bfloat16" and policy.device.type == "cpu" \
                and not cpu_has_bf16_compute():
            log.warning("--update-dtype bfloat16 on a CPU where oneDNN has no bfloat16 path "
                        "(no AVX-512 or AVX-NE-CONVERT): the update runs ~20x slower than "
                        "float32 (measured on an AVX2 CPU, docs/benchmarks.md); use "
                        "--update-dtype float32")
        # --threads 0 on a CPU: the cores other processes leave free, as a node shares them
        # (at most torch's own count: OMP_NUM_THREADS where set, else one per core)
        cores = (ThreadGovernor(limit=torch.get_num_threads()) if not cfg.threads and on_cpu
                 else None)
        return cls(policy, optimizer, scheduler, update_cfg,
                   make_parallel(policy, policy.device), memory=memory, cores=cores)

    # ---------------------------------------------------------------- sampling and scoring

    def generate(self, prompts: Sequence[Sequence[int]], config: Any,
                 seeds: Sequence[int], *, shared_prefix: bool = False) -> list[Any]:
        """See :meth:`TrainerBackend.generate`: the engine's torch backend over the live peft
        model, in eval mode and without gradient, ``max_batch`` sequences at a time;
        ``shared_prefix``: the lean forward prefills the prompts' common token prefix once
        per batch (``TorchBackend.share_prefix``)."""
        if self._sampler is None:  # rank 0 only, on first use: the lean forward packs weights
            self._sampler = TorchBackend.from_model(self.policy.model, self.tokenizer)
        requests = [SequenceRequest(prompt_ids=list(p), sampling=config, seed=s)
                    for p, s in zip(prompts, seeds, strict=True)]
        model = self.policy.model
        was_training = model.training
        model.eval()
        self._sampler.share_prefix = shared_prefix
        try:
            results: list[Any] = []
            with torch.no_grad():
                for i in range(0, len(requests), self.max_batch):
                    results.extend(self._sampler.generate(requests[i:i + self.max_batch], None))
            return results
        finally:
            self._sampler.share_prefix = False
            if was_training:
                model.train()

    def logprobs(self, seqs: Sequence[TrainSequence]) -> list[list[float]]:
        """See :meth:`TrainerBackend.logprobs`
        (:func:`gridrl.trainer.backends.torch.update.sequence_logprobs`)."""
        try:
            return sequence_logprobs(self.policy, seqs, self.update_cfg, self.memory)
        except MemoryBudgetError as e:
            raise resource_exhausted(str(e), field="--memory-mb") from e

    # ---------------------------------------------------------------- training

    def update(self, seqs: Sequence[TrainSequence]) -> UpdateStats:
        """See :meth:`TrainerBackend.update` (:func:`gridrl.trainer.backends.torch.update.grpo_update`)."""
        try:
            return grpo_update(self.policy, self.optimizer, self.scheduler, seqs,
                               self.update_cfg, self.parallel, self.memory, self.cores)
        except MemoryBudgetError as e:  # before any weight changed
            raise resource_exhausted(str(e), field="--memory-mb") from e

    # ---------------------------------------------------------------- files

    def adapter_files(self) -> dict[str, bytes]:
        return self.policy.adapter_files()

    def load_adapter_files(self, files: Mapping[str, bytes]) -> None:
        self.policy.load_adapter_files(files)

    def checkpoint_files(self) -> dict[str, bytes]:
        files = self.adapter_files()
        files[OPTIMIZER] = _to_bytes(self.optimizer.state_dict())
        if self.scheduler is not None:
            files[SCHEDULER] = _to_bytes(self.scheduler.state_dict())
        files[RNG] = _to_bytes(rng_state())
        return files

    def restore_checkpoint(self, files: Mapping[str, bytes]) -> None:
        """See :meth:`TrainerBackend.restore_checkpoint`. Every rank restores the same files
        (rank 0 read and broadcast them), so DDP's replicas stay equal."""
        self.load_adapter_files({k: v for k, v in files.items() if k.startswith("adapter_")})
        self.optimizer.load_state_dict(load_state_bytes(files[OPTIMIZER]))
        if self.scheduler is not None and SCHEDULER in files:
            self.scheduler.load_state_dict(load_state_bytes(files[SCHEDULER]))
        set_rng_state(load_state_bytes(files[RNG]))

    # ---------------------------------------------------------------- data parallelism

    def broadcast(self, obj: Any) -> Any:
        return self.parallel.broadcast(obj)

    def close(self, wait: bool = True) -> None:
        self.parallel.close(wait=wait)
