"""The pool's channels: one per node, dialled on first use, shared by every caller (Generate
calls, pushes, catch-ups); a replaced channel is closed once the calls leased on it end.
"""

from __future__ import annotations

import threading

import grpc

from gridrl.common.rpc.channel import Keepalive, dial
from gridrl.common.security.policy import Security


class Channels:
    """One channel per node, dialled on first use and shared by every caller. A replaced
    (retired) channel is closed once the Generate calls leased on it have ended."""

    def __init__(self, security: Security | None, keepalive: Keepalive | None = None) -> None:
        self._security = security
        self._keepalive = keepalive
        self._lock = threading.Lock()
        self._current: dict[str, grpc.Channel] = {}
        self._leases: dict[int, int] = {}  # id(channel) -> calls in flight on it
        self._retired: dict[int, grpc.Channel] = {}

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._current.get(address)
            if channel is None:
                channel = self._current[address] = dial(address, self._security,
                                                                keepalive=self._keepalive)
            return channel

    def lease(self, address: str) -> grpc.Channel:
        """The node's channel, counted busy until :meth:`release`."""
        channel = self.get(address)
        with self._lock:
            self._leases[id(channel)] = self._leases.get(id(channel), 0) + 1
        return channel

    def release(self, channel: grpc.Channel) -> None:
        with self._lock:
            left = self._leases.get(id(channel), 1) - 1
            if left:
                self._leases[id(channel)] = left
                return
            self._leases.pop(id(channel), None)
            close = self._retired.pop(id(channel), None)
        if close is not None:
            close.close()

    def retire(self, address: str) -> None:
        """Replace the node's channel (the next call dials a fresh one, skipping gRPC's
        reconnect backoff); the old one closes once its calls have ended."""
        with self._lock:
            channel = self._current.pop(address, None)
            if channel is None:
                return
            if self._leases.get(id(channel)):
                self._retired[id(channel)] = channel
                return
        channel.close()

    def close(self, address: str | None = None) -> None:
        """Close the channels of ``address`` (every node's when None), in use or not."""
        with self._lock:
            if address is None:
                channels = [*self._current.values(), *self._retired.values()]
                self._current.clear()
                self._retired.clear()
            else:
                channel = self._current.pop(address, None)
                channels = [channel] if channel is not None else []
        for channel in channels:
            channel.close()
