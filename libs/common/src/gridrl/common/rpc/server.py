"""Wiring of a gridrl gRPC server: health, reflection, size limits, metrics, TLS, credentials
and scopes, shutdown.

Every service builds its server with :class:`GrpcServer`:

    server = GrpcServer(listen="127.0.0.1:50051", metrics_port=9401, security=Security(...))
    server.add(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, servicer,
               rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name)
    server.start()          # binds; server.port is the bound port (listen port 0 -> free port)
    server.wait()           # until SIGTERM/SIGINT or server.stop()

On stop, health flips to NOT_SERVING at once, new calls are refused, and calls in flight get
``grace_s`` seconds to finish.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gridrl.common.address import join_address, parse_listen
from gridrl.common.rpc import reflection
from gridrl.common.rpc.channel import MAX_MESSAGE_BYTES, channel_options
from gridrl.common.rpc.interceptor import ServerInterceptor
from gridrl.common.rpc.metrics import start_metrics_server
from gridrl.common.security.policy import Security, check_exposure, exposure_warning

log = logging.getLogger(__name__)

# Clients ping every 30 s by default (channel.Keepalive; a trainer on Wi-Fi may ping every
# second: --keepalive-s) so calls and long streams (WatchNodes, WatchRun) notice dead peers;
# grpc's server default (one ping per 5 min) would answer that with GOAWAY "too_many_pings" and
# drop the stream. Accept pings every second or slower.
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]
# Never share a port: with SO_REUSEPORT (grpc's default on Linux) a second node started on the
# same port binds silently and the kernel splits the calls between the two processes.
NO_REUSEPORT = [("grpc.so_reuseport", 0)]



def freeze_long_lived() -> None:
    """Move every object alive now out of the garbage collector's generations (``gc.freeze``).

    A service's entry point calls it once it has loaded what lives as long as the process (a
    model, tokenizer, modules: ~430k objects for SmolLM2): otherwise every full collection walks
    them, a ~200 ms pause in the middle of an adapter push or a decode step on a 2-core CPU.
    Not for library code or tests: frozen objects that later form garbage cycles are never
    collected.
    """
    gc.collect()
    gc.freeze()


class GrpcServer:
    """A gRPC server with health, reflection, metrics, TLS, credentials and graceful shutdown.

    Args:
        listen: ``host:port`` to bind; port 0 picks a free port (read it back from ``.port``).
        metrics_port: Prometheus ``/metrics`` port, on the host ``listen`` binds (HTTPS with
            the server's certificate when it serves TLS, requiring a client certificate under
            mutual TLS); 0 picks a free one, negative disables.
        security: TLS files (a certificate: TLS; and a CA: mutual TLS) and the authorized
            tokens every call but health/reflection must carry (None: no TLS, no credentials).
        max_workers: threads serving calls; streams hold one each for their duration.
        max_message_bytes: explicit send/receive message size limit.
        max_receive_bytes: a lower limit on what the server receives (None: as sent): a
            service whose requests are small (the master, the TrainerService) keeps an
            unauthenticated caller from making it buffer 64 MiB messages (the credential is
            checked after gRPC has read the request).
        grace_s: seconds calls in flight get to finish on stop.

    Raises:
        StatusError: INVALID_ARGUMENT ``listen: ...`` for a malformed address.
        ExposedError: ``listen`` is not loopback and ``security`` lacks TLS or credentials
            without ``insecure`` (:func:`gridrl.common.security.policy.check_exposure`).
        TlsError: unreadable or malformed TLS files.
    """

    def __init__(self, listen: str, metrics_port: int = -1, security: Security | None = None,
                 max_workers: int = 32, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 grace_s: float = 10.0, max_receive_bytes: int | None = None) -> None:
        self._host, self._requested_port = parse_listen(listen)
        self.security = security or Security()
        check_exposure(self._host, self.security)
        self._credentials = (self.security.tls.server_credentials()
                             if self.security.tls.serves_tls else None)
        self._metrics_port_requested = metrics_port
        self.grace_s = grace_s
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
            interceptors=[ServerInterceptor(self.security.authorized)],
            options=[*channel_options(max_message_bytes, max_receive_bytes),
                     *SERVER_KEEPALIVE_OPTIONS, *NO_REUSEPORT],
            maximum_concurrent_rpcs=max_workers * 4,
        )
        self._health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._service_names: list[str] = []
        self._on_stop: list[Callable[[], None]] = []
        self._on_stopping: list[Callable[[], None]] = []
        self._stopped = threading.Event()
        self._stop_done = threading.Event()  # set once stop() ran every callback
        self.port = 0
        self.metrics_port = -1

    def add(self, add_fn: Callable[[Any, grpc.Server], None], servicer: Any, service_name: str) -> None:
        """Register ``servicer`` with its generated ``add_*_to_server`` and full service name."""
        add_fn(servicer, self._server)
        self._service_names.append(service_name)

    def on_stopping(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` as soon as :meth:`stop` begins: new calls are already refused but
        calls in flight are not yet drained. End long-lived streams (watches) here, or the stop
        waits ``grace_s`` for them."""
        self._on_stopping.append(callback)

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after the server stopped (close engines, deregister, flush)."""
        self._on_stop.append(callback)

    @property
    def address(self) -> str:
        """``host:port`` of the bound socket (0.0.0.0 / :: shown as 127.0.0.1 / ::1)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(self._host, self._host)
        return join_address(host, self.port)

    def start(self) -> GrpcServer:
        """Bind, start /metrics, start serving, mark every service SERVING. Returns self.

        Raises:
            OSError: ``listen: ...`` or ``metrics_port: ...`` when the port cannot be bound
                (taken: servers never share a port, see :data:`NO_REUSEPORT`).
        """
        target = join_address(self._host, self._requested_port)
        try:
            self.port = (self._server.add_secure_port(target, self._credentials)
                         if self._credentials is not None
                         else self._server.add_insecure_port(target))
        except RuntimeError:  # grpcio >= 1.60 raises where older versions returned 0
            self.port = 0
        if self.port == 0:
            raise OSError(f"listen: could not bind {target} (in use, or not an address of "
                          "this machine)")
        # /metrics binds the gRPC listen host: a loopback service is not scraped from afar.
        tls = self.security.tls
        metrics_host = self._host.strip("[]") or "0.0.0.0"
        try:
            self.metrics_port = start_metrics_server(self._metrics_port_requested,
                                                     host=metrics_host,
                                                     tls=tls if tls.serves_tls else None)
        except OSError as e:
            self._server.stop(None)
            raise OSError(f"metrics_port: could not bind {metrics_host}:"
                          f"{self._metrics_port_requested}: {e.strerror or e}") from e
        names = [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable(names, self._server)
        self._server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        for name in self._service_names:
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s (%s; %s; %s)", ", ".join(self._service_names), self.address,
                 "mutual TLS" if tls.mutual else "TLS" if tls.serves_tls else "plaintext",
                 f"{len(self.security.authorized.credentials)} authorized credential(s)"
                 if self.security.authorized else "no credentials checked",
                 f"metrics port {self.metrics_port}" if self.metrics_port >= 0 else "metrics off")
        exposed = exposure_warning(self._host, self.security)
        if exposed:
            log.warning("listening on %s: %s", join_address(self._host or "0.0.0.0", self.port),
                        exposed)
        return self

    def set_serving(self, serving: bool) -> None:
        """Health of the server and each of its services: SERVING, or NOT_SERVING while the
        process cannot do its job though it answers (e.g. a node whose credential the master
        refuses). No effect once :meth:`stop` began (health stays NOT_SERVING)."""
        if self._stopped.is_set():
            return
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self._service_names):
            self._health.set(name, status)

    def stop(self, grace_s: float | None = None) -> None:
        """Flip health to NOT_SERVING, refuse new calls, let calls in flight finish within
        ``grace_s`` (default: the constructor's), then run the on-stop callbacks. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            self._health.enter_graceful_shutdown()
            drained = self._server.stop(self.grace_s if grace_s is None else grace_s)
            for callback in self._on_stopping:
                try:
                    callback()
                except Exception:  # shutdown must go on
                    log.exception("on-stopping callback failed")
            drained.wait()
            for callback in self._on_stop:
                try:
                    callback()
                except Exception:  # shutdown must go on
                    log.exception("on-stop callback failed")
        finally:
            self._stop_done.set()

    def wait(self) -> None:
        """Block until SIGTERM/SIGINT (main thread only) or :meth:`stop`, then stop gracefully."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: threading.Thread(target=self.stop, daemon=True).start())
        while not self._stopped.wait(0.5):
            pass
        # stop() may run in the signal's thread: return only once its callbacks are done,
        # or the process would exit in the middle of them.
        self._stop_done.wait()
        self._server.wait_for_termination()
