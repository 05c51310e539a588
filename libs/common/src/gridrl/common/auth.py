"""Optional shared-token authentication: the one auth mechanism of all three services.

When a server is started with a token (``--auth-token`` / ``GRIDRL_AUTH_TOKEN``), every call
except health checks and reflection must carry the metadata ``authorization: Bearer <token>``,
or it fails with UNAUTHENTICATED. Clients attach it with :func:`call_metadata` or by dialing
through :func:`gridrl.common.channel.dial`, which adds it to every call.
"""

from __future__ import annotations

import hmac

import grpc

AUTH_HEADER = "authorization"
# Methods that stay open so load balancers, systemd probes and grpcurl work without a token.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata to attach to a call; empty when ``token`` is empty."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


def check_token(expected: str | None, method: str, metadata: tuple | list | None) -> str | None:
    """Return None when the call may proceed, else the reason it is UNAUTHENTICATED."""
    if not expected or method.startswith(OPEN_PREFIXES):
        return None
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token, expected):
                return None
            return "authorization: bearer token does not match"
    return "authorization: missing 'authorization: Bearer <token>' metadata"


class _TokenAuthPlugin(grpc.AuthMetadataPlugin):
    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(self, context, callback) -> None:
        callback(call_metadata(self._token), None)


class TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Client interceptor adding the bearer token to every call on an insecure channel."""

    def __init__(self, token: str) -> None:
        self._md = call_metadata(token)

    def _details(self, details):
        md = list(details.metadata or ()) + list(self._md)
        return details._replace(metadata=md) if hasattr(details, "_replace") else _Details(
            details.method, details.timeout, md, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression
