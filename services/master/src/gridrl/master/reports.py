"""RunReportService over gRPC: trainers report their runs to the master's dashboard
(:mod:`gridrl.master.runs` holds them, :mod:`gridrl.master.dashboard` shows them)."""

from __future__ import annotations

import grpc

from gridrl.common.security.access import caller
from gridrl.master.runs import Runs, validate_report
from gridrl.v1 import runs_pb2, runs_pb2_grpc

SERVICE_NAME = runs_pb2.DESCRIPTOR.services_by_name["RunReportService"].full_name


class RunReportServicer(runs_pb2_grpc.RunReportServiceServicer):
    """gRPC face of :class:`Runs`. Handlers raise ``StatusError``; the shared server
    interceptor turns it into the status the client sees."""

    def __init__(self, runs: Runs) -> None:
        self._runs = runs

    def ReportRun(self, request: runs_pb2.ReportRunRequest,
                  context: grpc.ServicerContext) -> runs_pb2.ReportRunResponse:
        """Add the run's steps and events, replace its info and node view; returns the last
        step the master holds for it.

        Raises:
            StatusError: INVALID_ARGUMENT naming the field (``run.run_id``, a string over its
                bound, too many items, steps out of order, an unknown or master-recorded event
                kind); PERMISSION_DENIED ``run.run_id`` when another credential reported the
                run first (the trainer scope is required: :data:`gridrl.common.security.access.METHOD_SCOPES`).
        """
        validate_report(request)
        credential = caller()
        last = self._runs.report(request, credential.id if credential is not None else None)
        return runs_pb2.ReportRunResponse(last_step=last)
