"""The master's dashboard: a web page of the fleet and the runs, on an HTTP port of its own
(``gridrl-master serve --dashboard-port``, default 8321, on the host of ``--listen``).

    GET  /                 the page (static/index.html, with the data of its first render;
                           then it polls /api/*)
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

Stack: the services' one HTTP stack (:mod:`gridrl.common.http`: Starlette on uvicorn, mutual
TLS there), the routes in :meth:`Dashboard.app`. Threads: ``dashboard-http`` runs the asyncio
loop (the TLS handshakes included); the routes that read the registry or the runs run in
Starlette's thread pool; ``dashboard-fleet`` turns the registry's changes into event lines.
They read the registry and the runs through their thread-safe methods only.
"""

from __future__ import annotations

import html
import json
import logging
import math
import threading
import time
import urllib.parse
from importlib import resources
from typing import Any

from gridrl.common.http import HttpServer, HttpTls, client_certificate
from gridrl.common.security.policy import Security
from gridrl.master.fleet_view import FleetWatch, fleet_rows
from gridrl.master.registry import Registry
from gridrl.master.run_wire import detail_json, event_json, summary_json
from gridrl.master.runs import Runs
from gridrl.master.sessions import SESSION_TTL_S, Sessions, decide

log = logging.getLogger(__name__)

SESSION_COOKIE = "gridrl_session"
FLUSH_EVERY_S = 5.0  # runs written to the store at most this often
MAX_FORM_BYTES = 4096  # the sign-in form's body at most
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
#: headers of every answer (what the page may load, no caching, no framing, no sniffing)
_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
            "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
            "Content-Security-Policy": _CSP}
_STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
           "style.css": "text/css; charset=utf-8", "login.html": "text/html; charset=utf-8"}
_JSON = "application/json; charset=utf-8"


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


def _json_body(obj: Any) -> bytes:
    try:
        return json.dumps(obj, allow_nan=False).encode()
    except ValueError:  # a NaN or an infinity a node reported (uptime, load): as null
        return json.dumps(_finite(obj), allow_nan=False).encode()


def _canonical(name: bytes) -> bytes:
    """A header's name in its usual spelling (``www-authenticate`` -> ``WWW-Authenticate``):
    names are case-insensitive, but scripts that read them as a plain dict keep working."""
    return b"-".join(b"WWW" if p == b"www" else p.capitalize() for p in name.split(b"-"))


class _SecurityHeaders:
    """ASGI middleware: :data:`_HEADERS` on every answer, errors and 404s included (every
    header name in its usual spelling)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [(_canonical(k), v) for k, v in message.get("headers", [])]
                present = {k.lower() for k, _ in headers}
                headers += [(k.encode(), v.encode()) for k, v in _HEADERS.items()
                            if k.lower().encode() not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


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
        self.tls: HttpTls | None = None
        tls = security.tls
        if tls.serves_tls:
            tls.check("server")
            self.tls = HttpTls(tls.cert, tls.key, tls.ca or None)
            self.tls.context()  # unusable files fail here, not in the serving thread
        self._login_template = _asset("login.html").decode()
        self._index_template = _asset("index.html").decode()
        self._server: HttpServer | None = None
        self._fleet: FleetWatch | None = None
        self._stop = threading.Event()
        self.port = -1

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    @property
    def url(self) -> str:
        """Where to open it (a wildcard host shown as loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"{self.scheme}://{f'[{host}]' if ':' in host else host}:{self.port}/"

    def login_page(self, message: str) -> bytes:
        """The sign-in form, with ``message`` escaped into it."""
        return self._login_template.replace("{{message}}", html.escape(message)).encode()

    def state(self) -> dict[str, Any]:
        """``/api/state``: the fleet rows, the runs, the fleet's last 100 events."""
        now = time.time()
        runs = self.runs.summaries()
        gone = self._fleet.gone() if self._fleet is not None else {}
        return {"time": now, "protected": self.tokens is not None,
                "fleet": fleet_rows(self.registry.list_nodes(), runs, gone, now),
                "runs": [{k: v for k, v in summary_json(r).items() if k != "nodes"}
                         for r in runs],
                "events": [event_json(e) for e in self.runs.fleet_events()[-100:]]}

    def index_page(self) -> bytes:
        """The page, carrying the data of its first render (``/api/state`` and the newest
        run's ``/api/runs/<id>``) as JSON in a ``<meta name="gridrl-initial">`` attribute
        (HTML-escaped: a string from a trainer stays text), so its charts draw without
        waiting for a request."""
        state = self.state()
        run = self.runs.detail(state["runs"][0]["run_id"]) if state["runs"] else None
        initial = _json_body({"state": state,
                              "run": detail_json(run) if run is not None else None}).decode()
        return self._index_template.replace("{{initial}}",
                                            html.escape(initial, quote=True)).encode()

    # ------------------------------------------------------------------ the app

    def caller(self, request: Any) -> tuple[int, str]:
        """Who sends ``request``: ``(200, "")`` when it may read the dashboard, else the
        401/403 status and its message (:func:`gridrl.master.sessions.decide` on the bearer
        token, else the session cookie, and the connection's client certificate)."""
        tokens = self.tokens
        if tokens is None:
            return 200, ""
        header = request.headers.get("authorization")
        cookie = request.cookies.get(SESSION_COOKIE) or None
        credential = None
        if header:
            scheme, _, token = header.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                credential = tokens.lookup(token.strip())
        elif cookie:
            credential = self.sessions.credential(cookie, tokens)
        status, message, _ = decide(tokens, credential, bool(header or cookie),
                                    client_certificate(request))
        return status, message

    def app(self) -> Any:
        """The Starlette app: the routes of the module's docstring behind the credential
        check (every path but the sign-in form and the style sheet; an unknown path too, so
        a caller without a credential learns nothing of which paths exist)."""
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.requests import Request
        from starlette.responses import RedirectResponse, Response
        from starlette.routing import Route

        def send(status: int, body: bytes, content_type: str,
                 headers: dict[str, str] | None = None) -> Response:
            return Response(body, status, headers=headers, media_type=content_type)

        def send_json(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
            return send(status, _json_body(obj), _JSON, headers)

        def refuse(status: int, message: str, path: str) -> Response:
            """401/403 with nothing of the fleet or the runs: JSON for the API, the sign-in
            form (holding only ``message``, escaped) for pages."""
            headers = {"WWW-Authenticate": 'Bearer realm="gridrl"'} if status == 401 else {}
            if path.startswith("/api/"):
                return send_json(status, {"error": message}, headers)
            return send(status, self.login_page(message), _STATIC["login.html"], headers)

        def redirect(location: str, cookie: str | None = None) -> Response:
            response = RedirectResponse(location, 303)
            if cookie is not None:
                response.headers["Set-Cookie"] = cookie
            return response

        def guarded(endpoint: Any) -> Any:
            def handle(request: Request) -> Response:
                status, message = self.caller(request)
                if status != 200:
                    return refuse(status, message, request.url.path)
                return endpoint(request)
            return handle

        def asset(name: str) -> Any:
            return lambda request: send(200, _asset(name), _STATIC[name])

        def run_detail(request: Request) -> Response:
            try:
                since = int(request.query_params.get("since", "0"))
                generation = int(request.query_params.get("gen", "-1"))
            except ValueError:
                return send_json(400, {"error": "since, gen: integers expected"})
            detail = self.runs.detail(request.path_params["run_id"], since, generation)
            if detail is None:
                return send_json(404, {"error": "run_id: no such run"})
            return send_json(200, detail_json(detail))

        def login_form(request: Request) -> Response:
            if self.tokens is None:  # nothing to sign in to
                return redirect("/")
            return send(200, self.login_page(""), _STATIC["login.html"])

        def same_origin(request: Request) -> bool:
            origin = request.headers.get("origin")
            if origin is None or origin == "null":
                return origin is None
            return urllib.parse.urlsplit(origin).netloc == request.headers.get("host")

        def session_cookie(value: str, max_age: int) -> str:
            secure = "; Secure" if self.tls is not None else ""
            return (f"{SESSION_COOKIE}={value}; Path=/; Max-Age={max_age}; HttpOnly; "
                    f"SameSite=Strict{secure}")

        async def form(request: Request) -> str | Response:
            """The posted form's text, or the answer refusing it (too large, cross-site)."""
            too_large = send_json(413, {"error": f"body: at most {MAX_FORM_BYTES} bytes"})
            declared = request.headers.get("content-length") or "0"
            if not declared.isdigit() or int(declared) > MAX_FORM_BYTES:
                return too_large
            body = b""
            async for chunk in request.stream():  # a chunked body is read up to the bound
                body += chunk
                if len(body) > MAX_FORM_BYTES:
                    return too_large
            if not same_origin(request):
                return send_json(403, {"error": "Origin: cross-site request refused"})
            return body.decode(errors="replace")

        async def sign_in(request: Request) -> Response:
            body = await form(request)
            if isinstance(body, Response):
                return body
            tokens = self.tokens
            if tokens is None:
                return redirect("/")
            token = (urllib.parse.parse_qs(body).get("token") or [""])[0].strip()
            credential = tokens.lookup(token) if token else None
            status, message, credential = decide(tokens, credential, bool(token),
                                                 client_certificate(request))
            if credential is None:
                return refuse(status, message, request.url.path)
            session = self.sessions.open(credential)
            log.info("dashboard: %s signed in (credential %s)",
                     request.client.host if request.client else "?", credential.id)
            return redirect("/", session_cookie(session, int(SESSION_TTL_S)))

        async def sign_out(request: Request) -> Response:
            body = await form(request)
            if isinstance(body, Response):
                return body
            cookie = request.cookies.get(SESSION_COOKIE)
            if cookie:
                self.sessions.close(cookie)
            return redirect("/login", session_cookie("", 0))

        def not_found(request: Request, error: Exception) -> Response:
            if request.method in ("GET", "HEAD"):
                status, message = self.caller(request)
                if status != 200:
                    return refuse(status, message, request.url.path)
            if isinstance(error, HTTPException) and error.status_code not in (404, 405):
                return send_json(error.status_code, {"error": str(error.detail)})
            return send_json(404, {"error": "path: not found"})

        index = guarded(lambda request: send(200, self.index_page(), _STATIC["index.html"]))
        routes = [
            Route("/login", login_form, methods=["GET"]),
            Route("/login", sign_in, methods=["POST"]),
            Route("/logout", sign_out, methods=["POST"]),
            Route("/static/style.css", asset("style.css"), methods=["GET"]),
            Route("/", index, methods=["GET"]),
            Route("/index.html", index, methods=["GET"]),
            Route("/static/app.js", guarded(asset("app.js")), methods=["GET"]),
            Route("/api/state", guarded(lambda request: send_json(200, self.state())),
                  methods=["GET"]),
            Route("/api/runs/{run_id:path}", guarded(run_detail), methods=["GET"]),
        ]
        app = Starlette(routes=routes, exception_handlers={HTTPException: not_found})
        return _SecurityHeaders(app)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Dashboard:
        """Bind and serve; start the fleet watch. Returns self.

        Raises:
            OSError: ``dashboard_port: ...`` when the port cannot be bound.
        """
        server = HttpServer(self.app(), self.host, self.requested_port, tls=self.tls,
                            name="dashboard-http", grace_s=2.0)
        try:
            server.start()
        except OSError as e:
            raise OSError(f"dashboard_port: could not bind {self.host}:{self.requested_port}: "
                          f"{e.strerror or e}") from e
        self._server = server
        self.port = server.port
        self._fleet = FleetWatch(self.registry, self.runs)
        self._fleet.start()
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
            self._server.stop()
        if self._fleet is not None:
            self._fleet.stop()
        try:
            self.runs.flush()
        except Exception:
            log.exception("dashboard: writing the runs to the store failed")
