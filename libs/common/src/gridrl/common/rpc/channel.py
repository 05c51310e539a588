"""Client channels with the project's message-size limits, TLS and bearer token (sent by
:class:`TokenInterceptor` on plaintext channels)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from gridrl.common.address import parse_address
from gridrl.common.errors import StatusError
from gridrl.common.security.policy import Security, is_loopback
from gridrl.common.security.tokens import AUTH_HEADER

log = logging.getLogger(__name__)

# 64 MiB: a Generate response with large n fits; adapters are streamed in chunks anyway.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# What a server whose requests are small (registry entries, run-status queries) accepts.
SMALL_REQUEST_BYTES = 4 * 1024 * 1024
# What a rollout node accepts: one prompt (Generate) or one adapter chunk (PushAdapter streams
# 1 MiB chunks, gridrl.common.transport.CHUNK_SIZE), with room for other clients' chunk sizes;
# the node's OpenAI-compatible endpoint has the same bound on a request body.
NODE_REQUEST_BYTES = 16 * 1024 * 1024
_warned_plaintext: set[str] = set()


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 keepalive of a channel: a ping every ``time_s`` seconds (with or without calls
    in flight), the connection closed when one is not answered in ``timeout_s``. A peer whose
    packets vanish (a cut Wi-Fi link, a closed laptop lid: no RST) is noticed after about
    ``time_s + timeout_s`` seconds, and every call on the connection fails UNAVAILABLE; without
    keepalive only the call's deadline would end it. Servers accept pings as often as every
    second (``gridrl.common.rpc.server.SERVER_KEEPALIVE_OPTIONS``)."""

    time_s: float = 30.0
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.time_s < 1:
            raise ValueError(f"keepalive_s: must be >= 1 (servers refuse faster pings), got "
                             f"{self.time_s}")
        if self.timeout_s <= 0:
            raise ValueError(f"keepalive_timeout_s: must be > 0, got {self.timeout_s}")


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES,
                    max_receive_bytes: int | None = None,
                    keepalive: Keepalive | None = None) -> list[tuple[str, int]]:
    """Options shared by clients and servers: explicit size limits (``max_receive_bytes``: a
    lower limit on what is received, None: ``max_message_bytes``) and keepalive
    (:class:`Keepalive`; None: its defaults)."""
    keepalive = keepalive or Keepalive()
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length",
         max_message_bytes if max_receive_bytes is None else max_receive_bytes),
        ("grpc.keepalive_time_ms", int(keepalive.time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive.timeout_s * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def dial(address: str, security: Security | str | None = None,
         max_message_bytes: int = MAX_MESSAGE_BYTES,
         keepalive: Keepalive | None = None) -> grpc.Channel:
    """A channel to ``address`` (host:port): TLS when ``security.tls`` has a CA (mutual TLS
    when it also has a certificate), sending ``security.token`` on every call. A bare string is
    a token over plaintext (tests, loopback tools). ``keepalive``: how soon a silent peer is
    noticed (:class:`Keepalive`; None: its defaults).

    The channel is lazy: nothing connects until the first call. A token sent over plaintext
    to a non-loopback address is logged once as a warning (anyone on the path can read it).

    Raises:
        TlsError: unreadable or malformed TLS files (naming the flag).
    """
    if isinstance(security, str):
        security = Security(token=security)
    security = security or Security()
    options = channel_options(max_message_bytes, keepalive=keepalive)
    if security.tls.dials_tls:
        credentials = security.tls.channel_credentials()
        if security.token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(security.token))
        return grpc.secure_channel(address, credentials, options=options)
    channel = grpc.insecure_channel(address, options=options)
    if security.token:
        try:
            host = parse_address(address)[0]
        except StatusError:  # a malformed address fails at the first call, with its own error
            host = address
        if not is_loopback(host) and address not in _warned_plaintext:
            _warned_plaintext.add(address)
            log.warning("sending a token to %s without TLS: anyone on the network path can "
                        "read it (give --tls-ca)", address)
        channel = grpc.intercept_channel(channel, TokenInterceptor(security.token))
    return channel


def connection_hint(code: str, details: str, security: Security | str | None) -> str:
    """`` (hint)`` for an UNAVAILABLE call that looks like a TLS mismatch, else ``""``:
    a plaintext client cannot talk to a TLS server (nor the other way round), a TLS client
    must trust the server's CA and dial a host its certificate names, and a mutual-TLS server
    closes connections from clients without a certificate its CA signed."""
    if code != "UNAVAILABLE":
        return ""
    text = details.lower()
    tls = getattr(security, "tls", None)
    if tls is None or not tls.dials_tls:
        return (" (is the server up? if it serves TLS, give --tls-ca, and --tls-cert/--tls-key "
                "for mutual TLS)")
    if "wrong_version_number" in text:
        return " (the server does not serve TLS: drop --tls-ca, or start it with --tls-cert)"
    if "hostname verification" in text:
        return " (the server's certificate does not name the host dialed; dial a name it lists)"
    if "certificate_verify_failed" in text or "handshake failed" in text:
        return " (the server's certificate did not verify: --tls-ca must be the CA that signed it)"
    if "socket closed" in text or "connection reset" in text:
        return (" (the server closed the connection: is it up? a mutual-TLS server refuses "
                "clients without a --tls-cert/--tls-key its CA signed)")
    return " (is the server up?)"


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata to attach to a call; empty when ``token`` is empty."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


class TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Client interceptor adding the bearer token to every call on a plaintext channel (grpc
    sends call credentials only over TLS; TLS channels use ``access_token_call_credentials``)."""

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
