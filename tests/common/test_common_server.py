"""GrpcServer wiring: health, reflection, auth, StatusError mapping, metrics, shutdown."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridrl.common.address import parse_address
from gridrl.common.errors import Kind, StatusError, invalid_argument
from gridrl.common.rpc.channel import dial
from gridrl.common.rpc.server import GrpcServer
from gridrl.common.security.policy import Security
from gridrl.v1 import trainer_pb2, trainer_pb2_grpc

SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name


class _Trainer(trainer_pb2_grpc.TrainerServiceServicer):
    def GetRunStatus(self, request, context):
        raise invalid_argument("run_name", "no such run")

    def WatchRun(self, request, context):
        for step in (1, 2, 3):
            yield trainer_pb2.WatchRunResponse(report=trainer_pb2.StepReport(step=step))


@pytest.fixture
def server(creds):
    srv = GrpcServer("127.0.0.1:0", metrics_port=0, security=creds.security(None, authorized=True),
                     grace_s=1)
    srv.add(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, _Trainer(), SERVICE)
    srv.start()
    yield srv
    srv.stop(0)


def test_status_error_auth_and_metrics(server: GrpcServer, creds) -> None:
    assert server.port > 0
    # Health stays open without a token.
    health = health_pb2_grpc.HealthStub(dial(server.address))
    resp = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    # No token -> UNAUTHENTICATED.
    stub = trainer_pb2_grpc.TrainerServiceStub(dial(server.address))
    with pytest.raises(grpc.RpcError) as e:
        stub.GetRunStatus(trainer_pb2.GetRunStatusRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # With a read credential, the StatusError becomes INVALID_ARGUMENT naming the field.
    stub = trainer_pb2_grpc.TrainerServiceStub(dial(server.address, creds.tokens["read"]))
    with pytest.raises(grpc.RpcError) as e:
        stub.GetRunStatus(trainer_pb2.GetRunStatusRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "run_name: no such run"
    steps = [r.report.step for r in stub.WatchRun(trainer_pb2.WatchRunRequest(), timeout=5)]
    assert steps == [1, 2, 3]
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    assert ('gridrl_rpc_requests_total{code="INVALID_ARGUMENT",method="GetRunStatus",'
            'service="gridrl.v1.TrainerService"}') in body
    assert 'code="UNAUTHENTICATED",method="GetRunStatus"' in body
    assert 'code="OK",method="WatchRun"' in body


def _listening_hosts(port: int) -> set[str]:
    """Local IPv4 addresses with a socket listening on ``port`` (from /proc/net/tcp)."""
    hosts = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            hosts.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return hosts


def test_metrics_bind_the_listen_host(server: GrpcServer) -> None:
    """A service listening on loopback serves /metrics on loopback too, not on every
    interface; one listening on 0.0.0.0 serves both on every interface."""
    assert _listening_hosts(server.metrics_port) == {"127.0.0.1"}
    wide = GrpcServer("0.0.0.0:0", metrics_port=0, security=Security(insecure=True),
                      grace_s=0).start()
    try:
        assert _listening_hosts(wide.metrics_port) == {"0.0.0.0"}
    finally:
        wide.stop(0)


def test_stop_flips_health(server: GrpcServer) -> None:
    """On stop a health watcher (a load balancer, systemd's probe) sees NOT_SERVING before the
    server goes away, for the whole server and for each service; then new calls are refused."""
    health = health_pb2_grpc.HealthStub(dial(server.address))
    watches = {name: health.Watch(health_pb2.HealthCheckRequest(service=name), timeout=30)
               for name in ("", SERVICE)}
    for stream in watches.values():
        assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
    stopper = threading.Thread(target=server.stop, args=(2.0,))
    stopper.start()
    try:
        for stream in watches.values():
            assert next(stream).status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        stopper.join()
    with pytest.raises(grpc.RpcError):
        health.Check(health_pb2.HealthCheckRequest(), timeout=2)


@pytest.mark.parametrize("bad", ["", "nohost", "host:", "host:99999", ":80", "::1:80"])
def test_parse_address_rejects(bad: str) -> None:
    with pytest.raises(StatusError) as e:
        parse_address(bad, field="node.address")
    assert e.value.kind is Kind.INVALID_ARGUMENT
    assert e.value.message.startswith("node.address: ")


def test_parse_address_accepts() -> None:
    assert parse_address("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_address("[::1]:50051") == ("::1", 50051)
    assert parse_address("node-a.local:1") == ("node-a.local", 1)



def test_a_client_leaving_a_request_stream_is_a_cancellation_not_an_error(server: GrpcServer,
                                                                          caplog) -> None:
    """A client that cancels as soon as it has its answer, while the server may still be
    reading its request stream (what a reflection probe did), ends the call CANCELLED or OK
    in the metrics, never UNKNOWN with an "unhandled error" traceback in the log."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def reflection_calls() -> dict[str, float]:
        """ServerReflectionInfo calls by status code so far (the counters are the process's:
        other tests' servers in this process count there too)."""
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        return {line.split('code="')[1].split('"')[0]: float(line.split()[-1])
                for line in urllib.request.urlopen(url).read().decode().splitlines()
                if line.startswith("gridrl_rpc_requests_total{")
                and "ServerReflectionInfo" in line}

    before = reflection_calls()
    stub = reflection_pb2_grpc.ServerReflectionStub(dial(server.address))
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    for _ in range(40):
        call = stub.ServerReflectionInfo(iter([request]), timeout=30)
        assert next(call).HasField("list_services_response")
        call.cancel()
    server.stop(2.0)  # every call has ended and been counted
    codes = {k: v - before.get(k, 0.0) for k, v in reflection_calls().items()}
    codes = {k: v for k, v in codes.items() if v}
    assert set(codes) <= {"OK", "CANCELLED"} and sum(codes.values()) == 40, codes
    assert "unhandled error" not in caplog.text
