"""Client channels with the project's message-size limits and optional bearer token."""

from __future__ import annotations

import grpc

from gridrl.common.auth import TokenInterceptor

# 64 MiB: a Generate response with large n fits; adapters are streamed in chunks anyway.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options shared by clients and servers: explicit size limits and keepalive."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def dial(address: str, auth_token: str | None = None,
         max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Channel:
    """An insecure channel to ``address`` (host:port) that sends ``auth_token`` on every call.

    The channel is lazy: nothing connects until the first call.
    """
    channel = grpc.insecure_channel(address, options=channel_options(max_message_bytes))
    if auth_token:
        channel = grpc.intercept_channel(channel, TokenInterceptor(auth_token))
    return channel
