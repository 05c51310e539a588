"""Helpers shared by the master tests (imported as ``master_helpers``)."""

from __future__ import annotations

from gridrl.v1 import common_pb2

# Short timers so liveness tests take about a second (seconds).
HEARTBEAT_S, UNHEALTHY_S, EXPIRE_S = 0.2, 0.6, 1.2


def node_info(address: str, role: int = common_pb2.NODE_ROLE_ROLLOUT,
              backend: int = common_pb2.BACKEND_TORCH, model: str = "tiny",
              adapter: tuple[str, int] = ("", 0)) -> common_pb2.NodeInfo:
    """A NodeInfo as a rollout node (by default) would send it."""
    return common_pb2.NodeInfo(address=address, role=role, backend=backend,
                               base_model=common_pb2.BaseModel(model_id=model),
                               adapter=common_pb2.AdapterRef(name=adapter[0], version=adapter[1]),
                               capacity=8, device="cpu", dtype="float32")
