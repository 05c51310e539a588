"""The services' one HTTP stack (gridrl.common.http) over real sockets: plain HTTP, HTTPS, mutual
TLS with the client's certificate visible to the route, and a stop that frees the port."""

from __future__ import annotations

import http.client
import socket
import ssl

import pytest
from cryptography import x509

from gridrl.common.http import HttpServer, HttpTls, client_certificate


def echo_app():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    def who(request):
        pem = client_certificate(request)
        if pem is None:
            return PlainTextResponse("anonymous")
        cert = x509.load_pem_x509_certificate(pem)
        return PlainTextResponse(cert.subject.rfc4514_string())

    return Starlette(routes=[Route("/who", who)])


def get(port: int, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    conn = (http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
            if context else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
    try:
        conn.request("GET", "/who")
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def test_plain_http_serves_without_a_client_certificate_and_stops():
    server = HttpServer(echo_app(), "127.0.0.1", 0, name="test-http", grace_s=1).start()
    assert server.port > 0 and server.scheme == "http"
    assert get(server.port) == (200, "anonymous")
    assert server.stop() is True
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
    assert server.stop() is True  # idempotent


def test_mutual_tls_hands_the_client_certificate_to_the_route(pki):
    tls = HttpTls(pki.crt("server"), pki.key("server"), pki.ca)
    server = HttpServer(echo_app(), "127.0.0.1", 0, tls=tls, name="test-https",
                        grace_s=1).start()
    try:
        with_cert = ssl.create_default_context(cafile=pki.ca)
        with_cert.load_cert_chain(pki.crt("client"), pki.key("client"))
        status, subject = get(server.port, with_cert)
        assert status == 200 and "client.test" in subject, subject
        # no client certificate: the handshake fails, no HTTP answer at all
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            get(server.port, ssl.create_default_context(cafile=pki.ca))
        # a certificate from a CA the server does not trust: refused as well
        rogue = ssl.create_default_context(cafile=pki.ca)
        rogue.load_cert_chain(pki.crt("rogue"), pki.key("rogue"))
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            get(server.port, rogue)
    finally:
        assert server.stop() is True


def test_https_without_a_ca_asks_no_client_certificate(pki):
    server = HttpServer(echo_app(), "127.0.0.1", 0, tls=HttpTls(pki.crt("server"),
                                                                 pki.key("server")),
                        name="test-https", grace_s=1).start()
    try:
        assert server.scheme == "https"
        assert get(server.port, ssl.create_default_context(cafile=pki.ca)) == (200, "anonymous")
    finally:
        server.stop()


def test_a_port_in_use_is_an_os_error():
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(OSError):
            HttpServer(echo_app(), "127.0.0.1", taken.getsockname()[1]).start()
    finally:
        taken.close()
