"""``gridrl-trainer serve-api``: the training primitives on this machine's trainer, as gRPC
``TrainingService`` (``--listen``) and as the Tinker-compatible REST facade (``--http-listen``),
both over one :class:`~gridrl.trainer.primitives.service.PrimitivesService`; samples go to the
rollout nodes given (``--rollout``, ``--master``) when they serve the version asked for.

    gridrl-trainer serve-api --rollout 127.0.0.1:50051
    TINKER_BASE_URL=http://127.0.0.1:8100 TINKER_API_KEY=tml-local python my_loop.py

Both listen on loopback by default; beyond it they need the same TLS files and credentials as
every gridrl server (``--tls-cert``/``--tls-key``, ``--authorized-tokens``), the HTTP facade
taking a ``trainer``-scoped token as its API key.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gridrl.common.address import parse_listen

log = logging.getLogger("gridrl.trainer")
SWEEP_S = 5.0  # seconds between deletions of checkpoints whose TTL passed


@dataclass
class ApiSettings:
    """What ``serve-api`` was started with (one field per flag; see ``cli.py``)."""

    model: str
    rollout: list[str]
    master: str | None
    http_listen: str
    api_dir: str
    lora_alpha: float
    seed: int
    max_models: int
    backend: str
    device: str
    dtype: str
    threads: int
    session_timeout_s: float
    sync_deadline_s: float
    wait_for_nodes_s: float


def torch_loader(device: str, dtype: str) -> Any:
    """The :data:`~gridrl.trainer.primitives.service.ModelLoader` of the torch backend."""
    from gridrl.trainer.primitives.torch_model import TorchTrainableModel

    def load(base_model: str, lora: Any, seed: int) -> Any:
        return TorchTrainableModel.load(base_model, lora, seed=seed, device=device, dtype=dtype)

    return load


def mlx_loader(device: str, dtype: str) -> Any:
    """The :data:`~gridrl.trainer.primitives.service.ModelLoader` of the MLX backend."""
    from gridrl.trainer.primitives.mlx_model import MlxTrainableModel

    def load(base_model: str, lora: Any, seed: int) -> Any:
        return MlxTrainableModel.load(base_model, lora, seed=seed, device=device, dtype=dtype)

    return load


def build_service(settings: ApiSettings, security: Any) -> Any:
    """The :class:`PrimitivesService` of ``settings``: with a fleet when nodes are given (the
    pool started; nodes that come later join it)."""
    from gridrl.models import resolve_model
    from gridrl.trainer.primitives.fleet import FleetRoute
    from gridrl.trainer.primitives.service import PrimitivesService

    fleet = None
    if settings.rollout or settings.master:
        from gridrl.models import model_identity
        from gridrl.trainer.fleet.pool import NodePool

        path = resolve_model(settings.model)
        identity = model_identity(path, model_id=settings.model)
        pool = NodePool(master=settings.master, addresses=settings.rollout,
                        model_identity=identity, security=security,
                        wait_for_nodes_s=settings.wait_for_nodes_s)
        pool.start()
        fleet = FleetRoute(pool, model_path=str(path), identity=identity,
                           deadline_s=settings.sync_deadline_s)
    return PrimitivesService(root=Path(settings.api_dir),
                             load_model=(mlx_loader if settings.backend == "mlx" else
                                         torch_loader)(settings.device, settings.dtype),
                             lora_alpha=settings.lora_alpha, seed=settings.seed, fleet=fleet,
                             max_models=settings.max_models)


def serve(settings: ApiSettings, *, listen: str, metrics_port: int, security: Any,
          ready_file: str | None) -> None:
    """Serve until SIGINT / SIGTERM (see the module docstring).

    Raises:
        OSError: a port cannot be bound.
    """
    import torch

    from gridrl.common.cli import write_ready_file
    from gridrl.common.rpc.server import GrpcServer
    from gridrl.trainer.primitives import grpc_servicer, tinker_facade, tinker_http

    if settings.threads:
        torch.set_num_threads(settings.threads)
    host, port = parse_listen(settings.http_listen, "--http-listen")
    service = build_service(settings, security)
    server = http = None
    try:
        server = GrpcServer(listen, metrics_port=metrics_port, security=security, grace_s=2.0)
        grpc_servicer.add_to(server, service)
        server.start()
        facade = tinker_facade.TinkerFacade(service, base_model=settings.model,
                                            authorized=security.authorized,
                                            session_timeout_s=settings.session_timeout_s)
        tls = security.tls
        http = tinker_http.HttpServer(facade, host, port, tls=(tls.cert, tls.key)
                                      if tls.serves_tls else None).start()
        write_ready_file(ready_file, server.address, server.port, server.metrics_port,
                         tinker_base_url=http.base_url)
        nodes = (f"samples on the rollout nodes ({', '.join(settings.rollout) or settings.master})"
                 if service.fleet else "samples on this trainer (no --rollout / --master)")
        print(f"TrainingService on {server.address}; Tinker API on {http.base_url} "
              f"(TINKER_BASE_URL); {nodes}; files under {settings.api_dir}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(SWEEP_S):  # checkpoints whose TTL passed are deleted
            for uri in facade.checkpoints.sweep():
                log.info("checkpoint %s expired: deleted", uri)
    finally:
        if http is not None:
            http.stop()
        if server is not None:
            server.stop(grace_s=1.0)
        service.close()
