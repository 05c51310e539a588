"""The services' one HTTP stack: a Starlette (ASGI) app on uvicorn (h11), on a thread of its own
with its own asyncio loop. The master's dashboard, the node's OpenAI-compatible endpoint and
the trainer's Tinker routes serve through it (extra ``gridrl-common[http]``).

    server = HttpServer(app, "127.0.0.1", 0, tls=HttpTls(cert, key, ca), name="dashboard-http")
    server.start()      # bound and accepting; server.port is the bound port
    server.stop()       # stop accepting, give requests in flight grace_s, close

TLS: a certificate and key make it HTTPS (TLS 1.2 at least); a CA as well requires a client
certificate the CA signed (mutual TLS: a client without one fails the handshake, no HTTP answer).
An endpoint reads the client certificate of its request's connection with
:func:`client_certificate` (a credential bound to a certificate is checked against it).

Only this module imports uvicorn; starlette is imported by the apps themselves.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

#: the request-state key under which a connection's TLS client certificate (PEM bytes) travels
CLIENT_CERT_STATE = "gridrl_client_cert_pem"


@dataclass(frozen=True)
class HttpTls:
    """PEM files of an HTTPS server.

    Attributes:
        cert, key: the server's certificate chain and key.
        ca: the CA whose signature a client certificate needs (None: no client certificate
            asked for).
    """

    cert: str
    key: str
    ca: str | None = None

    def context(self) -> ssl.SSLContext:
        """The server-side context these files make (TLS 1.2 at least; with a CA, a client
        certificate is required).

        Raises:
            OSError, ssl.SSLError: unreadable or mismatched files.
        """
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        if self.ca:
            context.load_verify_locations(cafile=self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


def client_certificate(request: Any) -> bytes | None:
    """The PEM of the TLS client certificate of the connection ``request`` (a Starlette
    ``Request``) came on; None over plain HTTP or when the client presented none."""
    return request.scope.get("state", {}).get(CLIENT_CERT_STATE)


_PROTOCOL: Any = None


def _protocol_class() -> Any:
    """uvicorn's h11 protocol, with each connection's client certificate put in the state
    every request of the connection starts with (uvicorn's scope carries none)."""
    global _PROTOCOL
    if _PROTOCOL is None:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        class _ClientCertH11Protocol(H11Protocol):
            def connection_made(self, transport: Any) -> None:
                super().connection_made(transport)
                ssl_object = transport.get_extra_info("ssl_object")
                der = ssl_object.getpeercert(binary_form=True) if ssl_object else None
                if der:
                    self.app_state = {**self.app_state,
                                      CLIENT_CERT_STATE: ssl.DER_cert_to_PEM_cert(der).encode()}

        _PROTOCOL = _ClientCertH11Protocol
    return _PROTOCOL


class HttpServer:
    """An ASGI app on uvicorn, on a thread of its own.

    Args:
        app: the ASGI app (a Starlette instance).
        host: the address to bind (``""``: every IPv4 address; brackets around IPv6 allowed).
        port: the port (0: any free one; :attr:`port` holds the bound one after :meth:`start`).
        tls: the HTTPS files (None: plain HTTP).
        name: the thread's name (and the server's, in messages).
        grace_s: seconds requests in flight get to finish on :meth:`stop`.
    """

    def __init__(self, app: Any, host: str, port: int, *, tls: HttpTls | None = None,
                 name: str = "http", grace_s: float = 5.0) -> None:
        self.app = app
        self.host = host.strip("[]") or "0.0.0.0"
        self.port = port
        self.tls = tls
        self.name = name
        self.grace_s = grace_s
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def display_host(self) -> str:
        """The host to connect to (a wildcard shown as loopback), bracketed when IPv6."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"[{host}]" if ":" in host else host

    def start(self) -> HttpServer:
        """Bind and serve; returns once it accepts connections.

        Raises:
            OSError: the address cannot be bound.
            RuntimeError: the server did not start within 30 s (the log says why).
        """
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family)
        self.port = sock.getsockname()[1]
        kwargs: dict[str, Any] = {}
        if self.tls:
            kwargs = {"ssl_certfile": self.tls.cert, "ssl_keyfile": self.tls.key,
                      "ssl_cert_reqs": ssl.CERT_NONE}
            if self.tls.ca:
                kwargs |= {"ssl_ca_certs": self.tls.ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off",
                                http=_protocol_class(), loop="asyncio", server_header=False,
                                timeout_graceful_shutdown=self.grace_s, **kwargs)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=self.name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                sock.close()
                raise RuntimeError(f"{self.name} on {self.display_host}:{self.port} did not "
                                   "start")
            time.sleep(0.01)
        return self

    def begin_stop(self) -> None:
        """Stop accepting and start the graceful shutdown, without waiting (then wake what
        requests in flight wait on, and :meth:`stop`)."""
        if self._server is not None:
            self._server.should_exit = True

    def stop(self, extra_s: float = 0.0) -> bool:
        """Stop accepting, give requests in flight ``grace_s`` to finish, then close; waits
        ``grace_s + extra_s + 5`` seconds at most. Idempotent.

        Returns:
            False when the serving thread was still running at the end of the wait.
        """
        if self._server is None or self._thread is None:
            return True
        self.begin_stop()
        self._thread.join(self.grace_s + extra_s + 5)
        stopped = not self._thread.is_alive()
        self._server = None
        return stopped
