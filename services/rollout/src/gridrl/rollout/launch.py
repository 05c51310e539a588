"""Building a node from its settings: resolve the model, load the backend on the thread that
will run the engine's scheduler, and wire the node around it (``gridrl-rollout serve``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from gridrl.engine.contract import Backend
from gridrl.models import resolve_model
from gridrl.rollout.config import NodeConfig, adapter_root
from gridrl.rollout.server import RolloutNode, run_on_engine_thread


def build_backend(config: NodeConfig, model_dir: Path | str) -> Backend:
    """The backend ``config`` names, loaded from ``model_dir`` (on the calling thread).

    Raises:
        ValueError: a device, dtype or model the backend refuses.
        VllmError: the vLLM server is unreachable or refused (its message says which flag).
    """
    if config.backend == "torch":
        # Before torch loads OpenMP: idle workers spin ~10k iterations (tens of us) before
        # sleeping. Enough to catch the next parallel region of a decode step (sleeping at
        # once, OMP_WAIT_POLICY=PASSIVE, cost ~20% of fp32 decode speed here), short enough
        # not to steal a core from a trainer on the same machine.
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
        import torch

        from gridrl.engine.backends.torch.backend import TorchBackend

        if config.threads:
            torch.set_num_threads(config.threads)
        backend = TorchBackend.from_pretrained(model_dir, device=config.device,
                                               dtype=config.dtype, model_id=config.model,
                                               lean=config.forward == "lean",
                                               prefix_cache_bytes=config.prefix_cache_mb << 20)
        if not config.threads and backend.device == "cpu":
            backend.share_cores()  # on the thread that loaded it, which decodes
        return backend
    if config.backend == "vllm":
        from gridrl.engine.backends.vllm.backend import VllmBackend

        return VllmBackend.connect(config.vllm_url, model_dir, adapter_root(config) / ".vllm",
                                   api_key=config.vllm_api_key(), model_id=config.model,
                                   max_concurrency=config.capacity)
    from gridrl.engine.backends.mlx.backend import MlxBackend

    backend = MlxBackend.from_pretrained(model_dir,
                                         device={"mps": "gpu"}.get(config.device, config.device))
    backend.identity = dataclasses.replace(backend.identity, model_id=config.model)
    return backend


def load_node(config: NodeConfig) -> RolloutNode:
    """The node of ``config``, its engine running, not yet serving (:meth:`RolloutNode.start`).

    The model is loaded on the thread that then runs the engine's scheduler: every torch
    parallel region of the process starts from that one thread. An OpenMP thread team left
    behind by another thread makes libgomp throttle its spin-waits, costing ~20% of the
    decode speed on 2 cores (docs/benchmarks.md).

    Raises:
        FileNotFoundError: the model cannot be resolved; and what :func:`build_backend` raises.
    """
    model_dir = resolve_model(config.model)
    return run_on_engine_thread(lambda: RolloutNode(build_backend(config, model_dir), config))
