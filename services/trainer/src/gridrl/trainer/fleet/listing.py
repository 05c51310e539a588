"""The trainer's entry in the master's registry (``gridrl-master nodes --role trainer``).

    registrar = register_trainer(master, server.address, status, model_id, security)
    ...
    registrar.stop()    # deregisters

A trainer given ``--master`` registers its TrainerService address with role TRAINER and
heartbeats like a node (:class:`gridrl.common.registration.NodeRegistrar`), carrying the run's
adapter (run name, policy version): an operator finds every trainer of the cluster, and its
``gridrl-trainer status --address``, in one listing. Rollout nodes' watchers never see it (they
watch role ROLLOUT). In a secured cluster the trainer's own credential lists it: the master
lets a trainer-scope credential register, heartbeat and deregister only a trainer-role entry
it holds. It is best effort: a master that refuses it is logged once, at INFO, and the run goes
on unlisted.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
from typing import Any

from gridrl.common.registration import NodeRegistrar
from gridrl.common.sequence import ReportSequence
from gridrl.v1 import common_pb2


def register_trainer(master: str, address: str, status: Any, model_id: str,
                     security: Any = None) -> NodeRegistrar:
    """Start registering the trainer serving at ``address`` with ``master``; returns the
    started registrar (stop it to deregister).

    Args:
        master: host:port of the master.
        address: the TrainerService's dialable host:port.
        status: the run's :class:`~gridrl.trainer.report.status.RunStatus` (run name, policy
            version).
        model_id: the base model (``--model``).
        security: the trainer's TLS files and token for the master.
    """
    started = time.monotonic()
    try:
        version = importlib.metadata.version("gridrl-trainer")
    except importlib.metadata.PackageNotFoundError:
        version = ""

    reports = ReportSequence()  # heartbeats with a sequence refresh the listed uptime

    def info() -> common_pb2.NodeInfo:
        sequence = reports.next()
        snap = status.snapshot()
        return common_pb2.NodeInfo(
            address=address, role=common_pb2.NODE_ROLE_TRAINER,
            base_model=common_pb2.BaseModel(model_id=model_id),
            adapter=common_pb2.AdapterRef(name=snap.run_name,
                                          version=snap.policy_version),
            uptime_s=time.monotonic() - started, software_version=version, sequence=sequence)

    registrar = NodeRegistrar(master, info, security=security, failure_level=logging.INFO)
    registrar.start()
    return registrar
