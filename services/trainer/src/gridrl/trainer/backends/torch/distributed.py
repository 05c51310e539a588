"""Data parallelism: the same trainer under ``torchrun`` (torch.distributed DDP; NCCL on
GPUs, gloo on CPU).

Every rank holds the policy and computes the loss on its share of the step's groups (groups
``rank, rank + W, ...``); DDP averages the LoRA gradients, so every rank applies the same
update. Rank 0 alone talks to rollout nodes, pushes adapters, evaluates, checkpoints and
writes the run directory; it broadcasts each step's training sequences to the other ranks
(``broadcast_object_list``).

Single-process runs use :class:`SingleProcess`, which has the same interface and does nothing
collective, so the training code has one path.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch


class SingleProcess:
    """One process, no collectives. ``model`` is the policy's peft model."""

    rank = 0
    world_size = 1
    is_main = True

    def __init__(self, model: Any) -> None:
        self.model = model

    def run(self, policy: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        """``policy.<method>(*args, **kwargs)``: one forward pass of the update (e.g.
        ``"completion_hidden"``); under DDP through the wrapper, so its hooks see it."""
        return getattr(policy, method)(*args, **kwargs)

    def local_share(self, groups: Sequence[int]) -> list[int]:
        """Indices of the sequences this rank trains on, given each sequence's group index."""
        return list(range(len(groups)))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no all-reduce) inside the block."""
        yield

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks, in place; returns it."""
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of ``tensor`` over ranks, in place; returns it."""
        return tensor

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def barrier(self) -> None:
        """Wait for every rank."""

    def close(self, wait: bool = True) -> None:
        """Leave the process group; ``wait``: also end its communication threads (see
        :meth:`DataParallel.close`)."""


class PolicyPasses(torch.nn.Module):
    """The module DDP wraps: ``forward(method, ...)`` runs ``policy.<method>(...)``, so every
    forward pass of the update (hidden states or logits, whole sequences or a shared prefix)
    goes through DDP's forward, and a rank computes exactly what one process does on the same
    groups (the same products: the fused head included)."""

    def __init__(self, policy: Any) -> None:
        super().__init__()
        self.model = policy.model  # a submodule: its LoRA parameters are DDP's parameters
        self._policy = policy

    def forward(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._policy, method)(*args, **kwargs)


class DataParallel(SingleProcess):
    """DDP over the policy's passes (:class:`PolicyPasses`) in an initialised process group.

    Args:
        policy: a :class:`gridrl.trainer.backends.torch.policy.Policy` (its LoRA parameters are the DDP
            parameters).
        device: this rank's device; CUDA devices get ``device_ids=[index]``.
    """

    def __init__(self, policy: Any, device: torch.device) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.is_main = self.rank == 0
        self.device = device
        ids = [device.index] if device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers at construction: every rank starts
        # from the same LoRA init even if their seeds differed.
        self.model = DistributedDataParallel(PolicyPasses(policy), device_ids=ids,
                                             find_unused_parameters=False)

    def run(self, policy: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.model(method, *args, **kwargs)

    def local_share(self, groups: Sequence[int]) -> list[int]:
        return [i for i, g in enumerate(groups) if g % self.world_size == self.rank]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.model.no_sync():
            yield

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def _all_reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        import torch.distributed as dist

        if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
            moved = tensor.to(self.device)
            dist.all_reduce(moved, op=op)
            tensor.copy_(moved.to(tensor.device))
            return tensor
        dist.all_reduce(tensor, op=op)
        return tensor

    def broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0,
                                   device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def close(self, wait: bool = True) -> None:
        """Leave the process group.

        Args:
            wait: every rank is past its last collective (the run ended or stopped): also end
                the group's gloo threads, which waits for any collective still running. False
                after a failure, when a collective may be in flight for up to the group's
                timeout; the threads then live until the process exits.

        Why the threads must end here: gloo runs each collective on a worker thread, which
        drops its references to the collective's tensors just after waking the caller. When
        the caller's Python tensor is already gone, that release decrefs the tensor's Python
        object and takes the GIL. If the interpreter has begun finalizing by then, CPython ends
        the thread inside a noexcept destructor: ``terminate called without an active
        exception``, SIGABRT (rank 1 exits right after its last broadcast: 1 run in ~11 on two
        shared cores). ``destroy_process_group`` alone does not stop the threads (gloo has no
        ``shutdown()``): they end when the last reference to the group is released, and DDP's
        reducer holds one from C++. So DDP goes first, then the group's registrations, then
        our own reference, whose release (torch's holder drops the GIL for it, so a worker
        can finish its release) joins the worker threads while Python still runs.
        """
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if not dist.is_initialized():
            return
        if not wait:
            dist.destroy_process_group()
            return
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.model.module  # the reducer, and its reference, go with DDP
        group = dist.group.WORLD
        dist.destroy_process_group()
        del group  # the last reference: ~ProcessGroupGloo joins the worker threads


def launched_by_torchrun() -> bool:
    """True when the environment of ``torchrun`` (WORLD_SIZE > 1) is present."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_process_group(device: torch.device, *, init_method: str | None = None,
                       rank: int | None = None, world_size: int | None = None,
                       timeout_s: float = 1800.0) -> None:
    """Join the process group: NCCL when ``device`` is CUDA, gloo otherwise.

    Without arguments it reads torchrun's environment (``env://``). The long default timeout
    covers rank 0 waiting on rollouts and evals while the other ranks block in a collective.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    # torch.distributed.nn.functional binds ``group.WORLD`` as a default argument when first
    # imported (DDP's constructor imports it through torch._dynamo). Imported after the group
    # exists, those defaults hold the group, and its gloo threads, until interpreter shutdown,
    # past destroy_process_group (see DataParallel.close). Imported now, they hold None.
    import torch.distributed.nn.functional

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=rank, world_size=world_size)
    dist.init_process_group(**kwargs)


def make_parallel(policy: Any, device: torch.device) -> SingleProcess:
    """:class:`DataParallel` over ``policy`` when a process group is initialised with more
    than one rank, else :class:`SingleProcess`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return DataParallel(policy, device)
    return SingleProcess(policy.model)
