"""Fixtures of the master tests: in-process masters with short liveness timers, and stubs."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from master_helpers import EXPIRE_S, HEARTBEAT_S, UNHEALTHY_S

from gridrl.common.rpc.channel import dial
from gridrl.master.config import Liveness
from gridrl.master.server import Master
from gridrl.v1 import registry_pb2_grpc


@pytest.fixture
def make_master() -> Iterator[Callable[..., Master]]:
    """``make_master(store_path=None, listen="127.0.0.1:0", **kw)``: a started in-process
    master with 0.2 s heartbeats, unhealthy after 0.6 s, expired after 1.2 s; stopped at
    teardown."""
    started: list[Master] = []

    def make(store_path: str | None = None, listen: str = "127.0.0.1:0", **kw) -> Master:
        kw.setdefault("liveness", Liveness(HEARTBEAT_S, UNHEALTHY_S, EXPIRE_S))
        kw.setdefault("grace_s", 2.0)
        master = Master(listen, store_path=store_path, **kw).start()
        started.append(master)
        return master

    yield make
    for master in reversed(started):
        master.stop(0)


@pytest.fixture
def stub_for() -> Iterator[Callable[[Master], registry_pb2_grpc.RegistryServiceStub]]:
    """``stub_for(master)``: a RegistryService stub on a fresh channel (closed at teardown)."""
    channels = []

    def make(master: Master, security=None):
        channel = dial(master.address, security)
        channels.append(channel)
        return registry_pb2_grpc.RegistryServiceStub(channel)

    yield make
    for channel in channels:
        channel.close()
