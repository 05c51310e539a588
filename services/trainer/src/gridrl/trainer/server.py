"""TrainerService over gRPC: a read-only view of the run in :class:`RunStatus`.

    server = serve_trainer(status, listen="127.0.0.1:50052", metrics_port=9402)
    ...                      # the run's StatusSubscriber appends each step's StepReport
    server.stop()

``GetRunStatus`` answers the run's state and its last step's report (the loop emits one
``StepRecord`` a step; :class:`~gridrl.trainer.report.status.StatusSubscriber` turns it into a
``StepReport`` in :class:`RunStatus`). ``WatchRun`` streams step reports as
they finish (the history first when asked) and ends when the run finishes or fails, when the
client goes away, or when the server stops. The Prometheus endpoint (``gridrl_trainer_*`` from
:mod:`gridrl.trainer.report.metrics` and :mod:`gridrl.trainer.fleet.metrics`,
``gridrl_rpc_*``) is served on ``metrics_port``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc

from gridrl.common.rpc.channel import SMALL_REQUEST_BYTES
from gridrl.common.rpc.server import GrpcServer
from gridrl.common.security.policy import Security
from gridrl.trainer.report import metrics
from gridrl.trainer.report.status import RunStatus
from gridrl.v1 import trainer_pb2, trainer_pb2_grpc

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
# Seconds between checks that a WatchRun client is still there (a safety net: the client
# leaving and the server stopping wake the stream at once).
_WATCH_POLL_S = 5.0


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """gRPC face of a :class:`RunStatus`."""

    def __init__(self, status: RunStatus) -> None:
        self._status = status
        self._stopping = threading.Event()

    def GetRunStatus(self, request: trainer_pb2.GetRunStatusRequest,
                     context: grpc.ServicerContext) -> trainer_pb2.GetRunStatusResponse:
        """The run's name, directory, state, step, policy version, last report, baseline."""
        return self._status.snapshot()

    def WatchRun(self, request: trainer_pb2.WatchRunRequest,
                 context: grpc.ServicerContext) -> Iterator[trainer_pb2.WatchRunResponse]:
        """Step reports as they finish; with ``include_history``, every earlier one first.
        Ends (OK) after the last report of a finished or failed run, or when the server stops."""
        context.add_callback(self._status.wake)
        index = 0 if request.include_history else self._status.history_length()

        def cancelled() -> bool:
            return self._stopping.is_set() or not context.is_active()

        while not cancelled():
            reports, done = self._status.wait_reports(index, _WATCH_POLL_S, cancelled)
            for report in reports:
                yield trainer_pb2.WatchRunResponse(report=report)
            index += len(reports)
            if done:
                return

    def stop(self) -> None:
        """End every WatchRun stream (server stopping)."""
        self._stopping.set()
        self._status.wake()


def serve_trainer(status: RunStatus, listen: str, metrics_port: int,
                  security: Security | None = None) -> GrpcServer:
    """Start TrainerService on ``listen`` (host:port, port 0: any free port) with Prometheus
    ``/metrics`` on ``metrics_port`` (0: any free port, negative: off), with ``security``'s TLS
    files and authorized tokens (see :class:`gridrl.common.rpc.server.GrpcServer`).

    Returns:
        the started server; ``.address`` / ``.port`` / ``.metrics_port`` are bound.
    Raises:
        StatusError: INVALID_ARGUMENT ``listen: ...`` for a malformed address.
        OSError: when the port cannot be bound.
        ExposedError, TlsError: see :class:`gridrl.common.rpc.server.GrpcServer`.
    """
    metrics.mark_started()  # the trainer's gauges exist (step 0) from the first scrape
    servicer = TrainerServicer(status)
    server = GrpcServer(listen, metrics_port=metrics_port, security=security, grace_s=5.0,
                        max_receive_bytes=SMALL_REQUEST_BYTES)
    server.add(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, servicer, SERVICE_NAME)
    server.on_stopping(servicer.stop)
    return server.start()
