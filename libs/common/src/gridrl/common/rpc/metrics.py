"""The one Prometheus setup: RPC counters/histograms shared by every service, and /metrics.

Service-specific metrics (tokens sampled, nodes registered, reward...) are declared in each
service's own ``metrics.py`` on the same default registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram, start_http_server

if TYPE_CHECKING:
    from gridrl.common.security.tls import TlsFiles

RPC_REQUESTS = Counter(
    "gridrl_rpc_requests_total",
    "gRPC calls handled, by service, method and final status code.",
    ["service", "method", "code"],
)
RPC_DURATION = Histogram(
    "gridrl_rpc_duration_seconds",
    "Wall-clock seconds from the start of a call to its end (streams: the whole stream).",
    ["service", "method"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)


def split_method(full_method: str) -> tuple[str, str]:
    """``"/gridrl.v1.RolloutService/Generate"`` -> ``("gridrl.v1.RolloutService", "Generate")``."""
    _, service, method = full_method.split("/", 2)
    return service, method


def start_metrics_server(port: int, host: str = "0.0.0.0", tls: TlsFiles | None = None) -> int:
    """Serve the default registry on ``http://host:port/metrics``; port 0 picks a free one.

    With ``tls`` (a certificate and key) it serves ``https://`` with that certificate; when
    ``tls`` also has a CA, a scraper must present a client certificate the CA signed (as every
    gRPC client must under mutual TLS). Returns the bound port. A negative port disables the
    endpoint and returns -1.
    """
    if port < 0:
        return -1
    kwargs = {}
    if tls is not None:
        kwargs = {"certfile": tls.cert, "keyfile": tls.key, "client_cafile": tls.ca,
                  "client_auth_required": bool(tls.ca)}
    server, _thread = start_http_server(port, addr=host, **kwargs)
    return int(server.server_port)
