"""The master's dashboard: a web page of the fleet and the runs, on an HTTP port of its own
(``gridrl-master serve --dashboard-port``, default 8321, on the host of ``--listen``).

    GET  /                 the page (static/index.html; the data comes from /api/*)
    GET  /static/<file>    its script and style (no data; style.css is served to anyone)
    GET  /api/state        the fleet (one row per node and trainer), the runs, fleet events
    GET  /api/runs/<id>    one run: steps, evals, events, node view (?since=STEP&gen=G: only
                           the points after STEP, unless the run's points were merged since G)
    GET  /login            the sign-in form; POST /login (form field ``token``) signs in
    POST /logout           signs out

Security is the gRPC side's (:class:`gridrl.common.security.Security`): the same TLS files
(HTTPS; a client certificate the CA signed under mutual TLS), the same credentials, and the
same rule that a master beyond loopback must have TLS and credentials (or ``--insecure``).
With credentials, every path but ``/login`` and ``/static/style.css`` needs one whose scope
grants ``read`` (read, trainer), presented either as ``Authorization: Bearer <token>``
(scripts, curl) or by a session cookie that signing in with the token sets (browsers:
``HttpOnly``, ``SameSite=Strict``, ``Secure`` over TLS; the server keeps only its sha256 and
re-checks the credential at every request, so revoking it ends its sessions). Anything else is
401 (no or an unknown credential) or 403 (a scope without ``read``), with a body that holds
no data. Sign-in and sign-out refuse a cross-site ``Origin``. The page never inserts a string
it received as HTML (``textContent`` only) and is served with a Content-Security-Policy that
allows only its own script.

Who may see what (the credentials, the sign-in sessions) is :mod:`gridrl.master.sessions`; the
fleet's rows and the ``dashboard-fleet`` thread are :mod:`gridrl.master.fleet_view`; this module
serves them over HTTP.

Threads: one ``dashboard-http`` thread accepts, one thread per connection serves it (the
handshake included), and ``dashboard-fleet`` turns the registry's changes into event lines.
They read the registry and the runs through their thread-safe methods only.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import ssl
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from gridrl.common.security.policy import Security
from gridrl.master.fleet_view import FleetWatch, fleet_rows
from gridrl.master.registry import (
    Registry,
)
from gridrl.master.runs import Runs
from gridrl.master.sessions import SESSION_TTL_S, Sessions, decide

log = logging.getLogger(__name__)

SESSION_COOKIE = "gridrl_session"
FLUSH_EVERY_S = 5.0  # runs written to the store at most this often
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
_PUBLIC = frozenset({"/login", "/static/style.css"})
_STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
           "style.css": "text/css; charset=utf-8", "login.html": "text/html; charset=utf-8"}


def _asset(name: str) -> bytes:
    return resources.files("gridrl.master").joinpath("static", name).read_bytes()


def _finite(obj: Any) -> Any:
    """``obj`` with every float that JSON cannot carry replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # as port_in_use checks: a port in TIME_WAIT is free

    def __init__(self, address: tuple[str, int], dashboard: Dashboard) -> None:
        self.dashboard = dashboard
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("dashboard: connection from %s ended with an error", client_address,
                  exc_info=True)

    def get_request(self):
        sock, peer = super().get_request()
        sock.settimeout(15.0)
        context = self.dashboard.ssl_context
        if context is not None:  # the handshake runs in the connection's thread
            sock = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, peer


class _Handler(BaseHTTPRequestHandler):
    server_version = "gridrl-master"
    sys_version = ""

    def version_string(self) -> str:
        return self.server_version
    protocol_version = "HTTP/1.1"

    @property
    def dash(self) -> Dashboard:
        return self.server.dashboard  # type: ignore[attr-defined]

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            try:
                self.request.do_handshake()
            except (ssl.SSLError, OSError) as e:
                log.debug("dashboard: TLS handshake with %s failed: %s", self.client_address, e)
                self.request.close()
                raise ConnectionAbortedError from e
        super().setup()

    def handle(self) -> None:
        try:
            super().handle()
        except (ConnectionError, TimeoutError, ssl.SSLError):
            pass

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("dashboard %s: " + format, self.client_address[0], *args)

    # ------------------------------------------------------------------ replies

    def _send(self, status: int, body: bytes, content_type: str,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in {"Content-Type": content_type, "Content-Length": str(len(body)),
                            "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                            "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
                            "Content-Security-Policy": _CSP, **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        try:
            body = json.dumps(obj, allow_nan=False)
        except ValueError:  # a NaN or an infinity a node reported (uptime, load): as null
            body = json.dumps(_finite(obj), allow_nan=False)
        self._send(status, body.encode(), "application/json; charset=utf-8", headers)

    def _refuse(self, status: int, message: str, path: str) -> None:
        """401/403 with nothing of the fleet or the runs: JSON for the API, the sign-in form
        (holding only ``message``, escaped) for pages."""
        headers = {"WWW-Authenticate": 'Bearer realm="gridrl"'} if status == 401 else {}
        if path.startswith("/api/"):
            self._json(status, {"error": message}, headers)
        else:
            self._send(status, self.dash.login_page(message), _STATIC["login.html"], headers)

    def _redirect(self, location: str, headers: dict[str, str] | None = None) -> None:
        self._send(303, b"", "text/plain", {"Location": location, **(headers or {})})

    # --------------------------------------------------------------- identity

    def _peer_pem(self) -> bytes | None:
        if not isinstance(self.request, ssl.SSLSocket):
            return None
        der = self.request.getpeercert(binary_form=True)
        return ssl.DER_cert_to_PEM_cert(der).encode() if der else None

    def _cookie(self) -> str | None:
        for part in (self.headers.get("Cookie") or "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == SESSION_COOKIE and value:
                return value
        return None

    def _caller(self) -> tuple[int, str]:
        tokens = self.dash.tokens
        if tokens is None:
            return 200, ""
        header = self.headers.get("Authorization")
        cookie = self._cookie()
        credential = None
        if header:
            scheme, _, token = header.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                credential = tokens.lookup(token.strip())
        elif cookie:
            credential = self.dash.sessions.credential(cookie, tokens)
        status, message, _ = decide(tokens, credential, bool(header or cookie), self._peer_pem())
        return status, message

    def _same_origin(self) -> bool:
        origin = self.headers.get("Origin")
        if origin is None or origin == "null":
            return origin is None
        return urllib.parse.urlsplit(origin).netloc == self.headers.get("Host")

    # ----------------------------------------------------------------- routes

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        path = url.path
        if path == "/login":
            if self.dash.tokens is None:  # nothing to sign in to
                return self._redirect("/")
            return self._send(200, self.dash.login_page(""), _STATIC["login.html"])
        if path == "/static/style.css":
            return self._send(200, _asset("style.css"), _STATIC["style.css"])
        status, message = self._caller()
        if status != 200:
            return self._refuse(status, message, path)
        if path in ("/", "/index.html"):
            return self._send(200, _asset("index.html"), _STATIC["index.html"])
        if path == "/static/app.js":
            return self._send(200, _asset("app.js"), _STATIC["app.js"])
        if path == "/api/state":
            return self._json(200, self.dash.state())
        if path.startswith("/api/runs/"):
            query = urllib.parse.parse_qs(url.query)
            try:
                since = int(query.get("since", ["0"])[0])
                generation = int(query.get("gen", ["-1"])[0])
            except ValueError:
                return self._json(400, {"error": "since, gen: integers expected"})
            run_id = urllib.parse.unquote(path.removeprefix("/api/runs/"))
            detail = self.dash.runs.detail(run_id, since, generation)
            if detail is None:
                return self._json(404, {"error": "run_id: no such run"})
            return self._json(200, detail)
        return self._json(404, {"error": "path: not found"})

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        if length > 4096:
            return self._json(413, {"error": "body: at most 4096 bytes"})
        body = self.rfile.read(length).decode(errors="replace") if length else ""
        if path not in ("/login", "/logout"):
            return self._json(404, {"error": "path: not found"})
        if not self._same_origin():
            return self._json(403, {"error": "Origin: cross-site request refused"})
        cookie = self._cookie()
        secure = "; Secure" if self.dash.ssl_context is not None else ""
        if path == "/logout":
            if cookie:
                self.dash.sessions.close(cookie)
            return self._redirect("/login", {"Set-Cookie": f"{SESSION_COOKIE}=; Path=/; "
                                                           f"Max-Age=0; HttpOnly; "
                                                           f"SameSite=Strict{secure}"})
        tokens = self.dash.tokens
        if tokens is None:
            return self._redirect("/")
        token = (urllib.parse.parse_qs(body).get("token") or [""])[0].strip()
        credential = tokens.lookup(token) if token else None
        status, message, credential = decide(tokens, credential, bool(token), self._peer_pem())
        if credential is None:
            return self._refuse(status, message, path)
        session = self.dash.sessions.open(credential)
        log.info("dashboard: %s signed in (credential %s)", self.client_address[0],
                 credential.id)
        return self._redirect("/", {"Set-Cookie": f"{SESSION_COOKIE}={session}; Path=/; "
                                                  f"Max-Age={int(SESSION_TTL_S)}; HttpOnly; "
                                                  f"SameSite=Strict{secure}"})


class Dashboard:
    """The dashboard's HTTP server, its fleet watch and the periodic flush of the runs.

    Args:
        registry: the master's registry (read: list_nodes; watched: subscribe).
        runs: the runs the trainers report.
        host: the address to bind (the gRPC ``--listen`` host).
        port: the port (0: any free one; read ``.port`` after :meth:`start`).
        security: the master's (TLS files, authorized tokens); its exposure rule was applied
            to ``host`` already by the gRPC server.

    Raises:
        TlsError: unusable TLS files.
    """

    def __init__(self, registry: Registry, runs: Runs, host: str, port: int,
                 security: Security) -> None:
        self.registry = registry
        self.runs = runs
        self.host = host.strip("[]") or "0.0.0.0"
        self.requested_port = port
        self.tokens = security.authorized
        self.sessions = Sessions()
        self.ssl_context: ssl.SSLContext | None = None
        tls = security.tls
        if tls.serves_tls:
            tls.check("server")
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(tls.cert, tls.key)
            if tls.ca:
                context.load_verify_locations(cafile=tls.ca)
                context.verify_mode = ssl.CERT_REQUIRED
            self.ssl_context = context
        self._login_template = _asset("login.html").decode()
        self._server: _Server | None = None
        self._fleet: FleetWatch | None = None
        self._stop = threading.Event()
        self.port = -1

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context is not None else "http"

    @property
    def url(self) -> str:
        """Where to open it (a wildcard host shown as loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"{self.scheme}://{f'[{host}]' if ':' in host else host}:{self.port}/"

    def login_page(self, message: str) -> bytes:
        """The sign-in form, with ``message`` escaped into it."""
        import html

        return self._login_template.replace("{{message}}", html.escape(message)).encode()

    def state(self) -> dict[str, Any]:
        """``/api/state``: the fleet rows, the runs, the fleet's last 100 events."""
        now = time.time()
        runs = self.runs.summaries()
        gone = self._fleet.gone() if self._fleet is not None else {}
        return {"time": now, "protected": self.tokens is not None,
                "fleet": fleet_rows(self.registry.list_nodes(), runs, gone, now),
                "runs": [{k: v for k, v in r.items() if k != "nodes"} for r in runs],
                "events": self.runs.fleet_events()[-100:]}

    def start(self) -> Dashboard:
        """Bind and serve; start the fleet watch. Returns self.

        Raises:
            OSError: ``dashboard_port: ...`` when the port cannot be bound.
        """
        try:
            self._server = _Server((self.host, self.requested_port), self)
        except OSError as e:
            raise OSError(f"dashboard_port: could not bind {self.host}:{self.requested_port}: "
                          f"{e.strerror or e}") from e
        self.port = int(self._server.server_address[1])
        self._fleet = FleetWatch(self.registry, self.runs)
        self._fleet.start()
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                         name="dashboard-http", daemon=True).start()
        threading.Thread(target=self._flush, name="dashboard-flush", daemon=True).start()
        log.info("dashboard on %s (%s)", self.url,
                 "read credentials required" if self.tokens else "no credentials checked")
        return self

    def _flush(self) -> None:
        while not self._stop.wait(FLUSH_EVERY_S):
            try:
                self.runs.flush()
            except Exception:
                log.exception("dashboard: writing the runs to the store failed")

    def stop(self) -> None:
        """Stop serving, the fleet watch and the flush (the runs are flushed once more)."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._fleet is not None:
            self._fleet.stop()
        try:
            self.runs.flush()
        except Exception:
            log.exception("dashboard: writing the runs to the store failed")
