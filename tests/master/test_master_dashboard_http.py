"""The dashboard on the shared HTTP stack (gridrl.common.http: Starlette on uvicorn) keeps the
old server's edges: every answer carries the security headers (404s and errors too), the
sign-in form's body is bounded (declared or chunked), POST to an unknown path is 404, a bad
query is 400, and HEAD answers without a body."""

from __future__ import annotations

import http.client
import socket

import pytest

from gridrl.master.dashboard import MAX_FORM_BYTES
from gridrl.master.server import Master


@pytest.fixture
def dashboard_port():
    master = Master("127.0.0.1:0", dashboard_port=0).start()
    yield master.dashboard_port
    master.stop(0)


def call(port: int, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_every_answer_carries_the_security_headers(dashboard_port):
    for method, path, status in (("GET", "/", 200), ("GET", "/api/state", 200),
                                 ("GET", "/nothing", 404), ("POST", "/nothing", 404),
                                 ("GET", "/api/runs/nope", 404),
                                 ("GET", "/api/runs/x?since=a", 400)):
        got, headers, body = call(dashboard_port, method, path)
        assert got == status, (method, path, got, body)
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        assert headers["X-Frame-Options"] == "DENY" and headers["Cache-Control"] == "no-store"
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Referrer-Policy"] == "no-referrer"
    assert call(dashboard_port, "GET", "/nothing")[2] == b'{"error": "path: not found"}'
    status, headers, body = call(dashboard_port, "HEAD", "/api/state")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_the_sign_in_body_is_bounded_declared_or_chunked(dashboard_port):
    big = b"token=" + b"x" * MAX_FORM_BYTES
    status, _, body = call(dashboard_port, "POST", "/login", big,
                           {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 413 and b"at most 4096 bytes" in body
    # chunked, no Content-Length: read up to the bound, then refused
    with socket.create_connection(("127.0.0.1", dashboard_port), timeout=10) as sock:
        chunk = b"x" * 1024
        sock.sendall(b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n"
                     + b"".join(b"400\r\n" + chunk + b"\r\n" for _ in range(6)) + b"0\r\n\r\n")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
