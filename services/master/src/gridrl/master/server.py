"""RegistryService over gRPC, and the wiring of a master process (server, store, sweeper).

    master = Master(listen="127.0.0.1:50050", metrics_port=9400, store_path="/var/lib/m.sqlite")
    master.start()   # binds; master.address / master.port
    master.wait()    # until SIGTERM/SIGINT or master.stop()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
from google.protobuf.duration_pb2 import Duration

from gridrl.common.errors import Kind, StatusError
from gridrl.common.rpc.channel import SMALL_REQUEST_BYTES
from gridrl.common.rpc.server import GrpcServer
from gridrl.common.security.access import caller
from gridrl.common.security.policy import Security
from gridrl.common.security.tokens import NODE, TRAINER, AuthorizedTokens, Credential
from gridrl.master import metrics
from gridrl.master.claims import Claims, claim_key
from gridrl.master.config import Liveness
from gridrl.master.registry import Registry
from gridrl.master.reports import SERVICE_NAME as REPORT_SERVICE_NAME
from gridrl.master.reports import RunReportServicer
from gridrl.master.runs import Runs
from gridrl.master.store import NO_STORE, SqliteStore
from gridrl.master.subscriptions import NodeFilter
from gridrl.master.validate import (
    validate_filter,
    validate_heartbeat,
    validate_node_id,
    validate_register,
)
from gridrl.v1 import common_pb2, registry_pb2, registry_pb2_grpc, runs_pb2_grpc
from gridrl.v1.enums import enum_word

log = logging.getLogger(__name__)

SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name
# Each WatchNodes stream holds a server thread; half the threads stay for unary calls so
# heartbeats are never starved by watchers.
MAX_WORKERS = 64
MAX_WATCHERS = MAX_WORKERS // 2


def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    """gRPC face of a :class:`Registry`. Handlers raise ``StatusError``; the shared server
    interceptor turns it into the status the client sees."""

    def __init__(self, registry: Registry, claims: Claims | None = None) -> None:
        self._registry = registry
        self._claims = claims

    def RegisterNode(self, request: registry_pb2.RegisterNodeRequest,
                     context: grpc.ServicerContext) -> registry_pb2.RegisterNodeResponse:
        """Add the node or replace the record at its address; returns its id and the heartbeat
        interval (seconds, as a Duration).

        Raises:
            StatusError: INVALID_ARGUMENT naming ``node``, ``node.address`` (missing, not
                host:port, a wildcard host), ``node.role`` (unset or unknown),
                ``node.backend`` (unknown, or unset on a rollout node) or
                ``node.adapter_format`` (unknown); PERMISSION_DENIED ``node.address`` when
                the caller's credential is bound to another address or another credential
                holds this one (:mod:`gridrl.master.claims`); PERMISSION_DENIED naming the
                credential, its scope and ``node.role`` when the scope does not list that role
                (a node credential lists rollout nodes, a trainer credential its trainer).
        """
        validate_register(request)
        credential = caller()
        if credential is not None:
            _check_role(credential, request.node.role)
        if credential is not None and self._claims is not None:
            self._claims.register(request.node.address, credential)
        record, existed = self._registry.register(request.node)
        metrics.REGISTRATIONS.labels(enum_word(common_pb2.NodeRole, record.info.role, None),
                                     str(existed).lower()).inc()
        log.info("%s %s as %s (%s)", "re-registered" if existed else "registered",
                 record.info.address, record.node_id,
                 enum_word(common_pb2.NodeRole, record.info.role, None))
        return registry_pb2.RegisterNodeResponse(
            node_id=record.node_id,
            heartbeat_interval=_duration(self._registry.heartbeat_interval_s))

    def Heartbeat(self, request: registry_pb2.HeartbeatRequest,
                  context: grpc.ServicerContext) -> registry_pb2.HeartbeatResponse:
        """Keep the node alive; record its adapter, queue depth, load and DRAINING status.

        Raises:
            StatusError: INVALID_ARGUMENT naming ``node_id`` (empty), ``load`` (outside
                [0, 1]) or ``status`` (UNHEALTHY or unknown); NOT_FOUND for an unknown
                ``node_id`` (the node must register again); PERMISSION_DENIED ``node_id``
                when another credential holds the node's address.
        """
        validate_heartbeat(request)
        self._check_holder(request.node_id, "heartbeat")
        self._registry.heartbeat(request.node_id, request.adapter, request.queue_depth,
                                 request.load, request.status, sequence=request.sequence,
                                 uptime_s=request.uptime_s,
                                 stored_adapters=request.stored_adapters,
                                 resident_adapters=request.resident_adapters,
                                 run_shares=request.run_shares)
        metrics.HEARTBEATS.inc()
        return registry_pb2.HeartbeatResponse(
            heartbeat_interval=_duration(self._registry.heartbeat_interval_s))

    def ListNodes(self, request: registry_pb2.ListNodesRequest,
                  context: grpc.ServicerContext) -> registry_pb2.ListNodesResponse:
        """Nodes matching every set filter (role, backend, model_id, status), by address.

        Raises:
            StatusError: INVALID_ARGUMENT naming ``role``, ``backend`` or ``status`` for an
                unknown enum value.
        """
        validate_filter(request.role, request.backend, request.status)
        nodes = self._registry.list_nodes(NodeFilter(request.role, request.backend,
                                                     request.model_id, request.status))
        return registry_pb2.ListNodesResponse(nodes=nodes)

    def WatchNodes(self, request: registry_pb2.WatchNodesRequest, context: grpc.ServicerContext):
        """Stream SNAPSHOT events for the matching nodes, SNAPSHOT_END, then JOINED / CHANGED /
        REMOVED as they happen, with strictly increasing sequence numbers. Ends (OK) when
        the master stops; the client cancelling ends it at once.

        Raises:
            StatusError: INVALID_ARGUMENT naming ``role`` or ``backend``; RESOURCE_EXHAUSTED
                past the watcher limit or when the client falls 10,000 events behind;
                UNAVAILABLE while the master shuts down.
        """
        validate_filter(request.role, request.backend)
        sub = self._registry.subscribe(NodeFilter(request.role, request.backend,
                                                  request.model_id))
        if not context.add_callback(sub.close):  # the call already ended
            sub.close()
        metrics.WATCHERS.inc()
        try:
            while True:
                event = sub.get()
                if event is None:
                    return
                response = registry_pb2.WatchNodesResponse(type=event.type,
                                                           sequence=event.sequence)
                if event.node is not None:
                    response.node.CopyFrom(event.node)
                yield response
        finally:
            sub.close()
            metrics.WATCHERS.dec()

    def DeregisterNode(self, request: registry_pb2.DeregisterNodeRequest,
                       context: grpc.ServicerContext) -> registry_pb2.DeregisterNodeResponse:
        """Remove the node (clean shutdown).

        Raises:
            StatusError: INVALID_ARGUMENT for an empty ``node_id``; NOT_FOUND for an unknown
                one; PERMISSION_DENIED when another credential holds the node's address.
        """
        validate_node_id(request.node_id)
        self._check_holder(request.node_id, "deregister")
        record = self._registry.deregister(request.node_id)
        metrics.DEREGISTRATIONS.inc()
        log.info("deregistered %s (%s)", record.info.address, record.node_id)
        return registry_pb2.DeregisterNodeResponse()

    def _check_holder(self, node_id: str, action: str) -> None:
        credential = caller()
        if credential is None or self._claims is None:
            return
        try:
            address = self._registry.get(node_id).info.address
        except StatusError:  # unknown: NOT_FOUND from the registry, unless the scope forbids
            # an entry the master expired (its trainer was cut off for a while) is its
            # holder's to register again: NOT_FOUND, which tells it to
            address = self._registry.expired_address(node_id)
        if credential.scope == TRAINER and (
                address is None or self._claims.holder(address) != credential.id):
            raise StatusError(Kind.PERMISSION_DENIED,
                              f"node_id: credential {credential.id!r} (scope trainer) may "
                              f"{action} only the trainer entry it registered")
        if address is not None:
            self._claims.check(node_id, address, credential, action)


# The node roles a credential of each scope may list (RegisterNode's ``node.role``).
ROLES_BY_SCOPE = {NODE: (common_pb2.NODE_ROLE_ROLLOUT,), TRAINER: (common_pb2.NODE_ROLE_TRAINER,)}


def _check_role(credential: Credential, role: int) -> None:
    if role not in ROLES_BY_SCOPE.get(credential.scope, ()):
        allowed = [enum_word(common_pb2.NodeRole, r, None)
                   for r in ROLES_BY_SCOPE.get(credential.scope, ())]
        raise StatusError(Kind.PERMISSION_DENIED,
                          f"RegistryService/RegisterNode: credential {credential.id!r} has "
                          f"scope {credential.scope}; it may register "
                          f"{' or '.join(allowed) or 'no'} entries (node.role), not "
                          f"{enum_word(common_pb2.NodeRole, role, None)}")


def _reserved_by(tokens: AuthorizedTokens) -> Callable[[str], str | None]:
    """For :class:`Claims`: the credential in force minted for an address, read from the
    authorized tokens as they are now (revocations and new mints count at once)."""
    def reserved(address: str) -> str | None:
        for c in tokens.credentials:
            if c.address is not None and claim_key(c.address) == address:
                return c.id
        return None
    return reserved


class Sweeper:
    """Background thread running :meth:`Registry.sweep` every ``interval_s`` seconds and
    counting what it marked unhealthy or expired."""

    def __init__(self, registry: Registry, interval_s: float) -> None:
        self._registry = registry
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-sweeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop and join the thread (within one sweep)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                result = self._registry.sweep()
            except Exception:  # the sweeper must survive anything
                log.exception("registry sweep failed")
                continue
            metrics.UNHEALTHY_TRANSITIONS.inc(len(result.unhealthy))
            metrics.EXPIRATIONS.inc(len(result.expired))


class Master:
    """A master process: registry + optional sqlite store + sweeper + gRPC server.

    Args:
        listen: host:port to serve on (port 0: any free port; read ``.port`` after start).
        metrics_port: Prometheus port (0: any free port, negative: off).
        security: TLS files and authorized tokens (:class:`gridrl.common.security.policy.Security`;
            None: plaintext, no credentials, loopback only). With credentials, node
            credentials hold the addresses they register (:mod:`gridrl.master.claims`).
        store_path: sqlite file for the records and claims; None, "" or ":memory:" for no
            persistence.
        liveness: heartbeat interval and the silences that make a node unhealthy, then
            removed (:class:`gridrl.master.config.Liveness`).
        grace_s: seconds unary calls in flight get to finish on stop (watch streams end at once).
        dashboard_port: the dashboard's HTTP port on the ``listen`` host
            (:mod:`gridrl.master.dashboard`; 0: any free port, negative: off).

    Raises:
        StatusError: INVALID_ARGUMENT for non-increasing durations. OSError / sqlite3.Error:
            unusable store path.
        ExposedError, TlsError: see :class:`gridrl.common.rpc.server.GrpcServer`.
    """

    def __init__(self, listen: str = "127.0.0.1:50050", metrics_port: int = -1,
                 security: Security | None = None, store_path: str | None = None,
                 liveness: Liveness = Liveness(), grace_s: float = 5.0,
                 dashboard_port: int = -1) -> None:
        self.store = None if store_path in (None, *NO_STORE) else SqliteStore(store_path)
        try:
            self.registry = Registry(liveness, store=self.store, max_watchers=MAX_WATCHERS)
            self.server = GrpcServer(listen, metrics_port=metrics_port, security=security,
                                     max_workers=MAX_WORKERS, grace_s=grace_s,
                                     max_receive_bytes=SMALL_REQUEST_BYTES)
            tokens = self.server.security.authorized
            self.claims = (Claims(tokens.active, self.store, reserved=_reserved_by(tokens))
                           if tokens is not None else None)
        except Exception:
            if self.store is not None:
                self.store.close()
            raise
        self.server.add(registry_pb2_grpc.add_RegistryServiceServicer_to_server,
                        RegistryServicer(self.registry, self.claims), SERVICE_NAME)
        self.runs = Runs(store=self.store)
        self.server.add(runs_pb2_grpc.add_RunReportServiceServicer_to_server,
                        RunReportServicer(self.runs), REPORT_SERVICE_NAME)
        self.dashboard = None
        if dashboard_port >= 0:
            from gridrl.common.address import parse_listen
            from gridrl.master.dashboard import Dashboard

            self.dashboard = Dashboard(self.registry, self.runs, parse_listen(listen)[0],
                                       dashboard_port, self.server.security)
            self.server.on_stopping(self.dashboard.stop)
        self.server.on_stopping(self.registry.close_watchers)
        self.server.on_stop(self._shutdown)
        self._sweeper = Sweeper(self.registry, liveness.sweep_every_s)

    @property
    def address(self) -> str:
        """host:port clients dial (after :meth:`start`)."""
        return self.server.address

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def metrics_port(self) -> int:
        return self.server.metrics_port

    @property
    def dashboard_port(self) -> int:
        """The dashboard's bound port (-1: off)."""
        return self.dashboard.port if self.dashboard is not None else -1

    def start(self) -> Master:
        """Bind and serve, start the sweeper and the node-count metrics. Returns self."""
        self.server.start()
        if self.dashboard is not None:
            try:
                self.dashboard.start()
            except OSError:
                self.stop(grace_s=0)
                raise
        metrics.track(self.registry)
        self._sweeper.start()
        return self

    def stop(self, grace_s: float | None = None) -> None:
        """End watch streams, let unary calls finish within ``grace_s``, flush and close the
        store. Idempotent."""
        self.server.stop(grace_s)

    def wait(self) -> None:
        """Block until SIGTERM/SIGINT or :meth:`stop`, then stop gracefully."""
        self.server.wait()

    def _shutdown(self) -> None:
        self._sweeper.stop()
        metrics.untrack(self.registry)
        self.registry.close()
        if self.store is not None:
            self.store.close()
        log.info("master stopped")
