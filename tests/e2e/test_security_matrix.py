"""Every RPC of the services x {no credential, a wrong one, node, trainer, read-only}: the
exact status each call gets, through real servers (master, torch rollout node on the tiny
llama, TrainerService, the training primitives' TrainingService) over mutual TLS with a client
certificate and a bearer token.

Denied calls get UNAUTHENTICATED (no or an unknown token) or PERMISSION_DENIED (a known
credential outside its scope); allowed ones get what the handler answers to the small request
sent (OK, or NOT_FOUND / INVALID_ARGUMENT where the request itself is refused). Health and
reflection answer everyone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridrl.common.rpc.channel import dial
from gridrl.common.security.access import METHOD_SCOPES
from gridrl.common.security.policy import Security
from gridrl.common.security.tokens import AuthorizedTokens
from gridrl.master.registry import node_id_for
from gridrl.master.server import Master
from gridrl.v1 import (
    common_pb2,
    primitives_pb2,
    primitives_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    runs_pb2,
    runs_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

OK = grpc.StatusCode.OK
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED
NOT_FOUND = grpc.StatusCode.NOT_FOUND
INVALID = grpc.StatusCode.INVALID_ARGUMENT
CALLERS = (None, "wrong", "node", "trainer", "read")
NODE_ADDRESS = "127.0.0.1:6001"  # what the node credential registers


def _node_info() -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(
        address=NODE_ADDRESS, role=common_pb2.NODE_ROLE_ROLLOUT, backend=common_pb2.BACKEND_TORCH,
        adapter_format=common_pb2.ADAPTER_FORMAT_PEFT, capacity=1,
        base_model=common_pb2.BaseModel(model_id="tiny", architecture="llama", num_layers=2))


# RPC -> (service, how to call it on a channel, the status an allowed caller gets,
#         the callers allowed)
def _calls() -> dict[str, tuple[str, Callable[[grpc.Channel], None], grpc.StatusCode, set]]:
    def registry(ch: grpc.Channel) -> registry_pb2_grpc.RegistryServiceStub:
        return registry_pb2_grpc.RegistryServiceStub(ch)

    def rollout(ch: grpc.Channel) -> rollout_pb2_grpc.RolloutServiceStub:
        return rollout_pb2_grpc.RolloutServiceStub(ch)

    def trainer(ch: grpc.Channel) -> trainer_pb2_grpc.TrainerServiceStub:
        return trainer_pb2_grpc.TrainerServiceStub(ch)

    def first(stream: Iterator) -> None:
        next(iter(stream))
        stream.cancel()

    node, read_scope = {"node"}, {"trainer", "read"}
    return {
        "RegisterNode": ("master", lambda ch: registry(ch).RegisterNode(
            registry_pb2.RegisterNodeRequest(node=_node_info()), timeout=10), OK, node),
        "Heartbeat": ("master", lambda ch: registry(ch).Heartbeat(
            registry_pb2.HeartbeatRequest(node_id=node_id_for(NODE_ADDRESS)), timeout=10),
            OK, node),
        "DeregisterNode": ("master", lambda ch: registry(ch).DeregisterNode(
            registry_pb2.DeregisterNodeRequest(node_id="n-unknown"), timeout=10),
            NOT_FOUND, node),
        "ListNodes": ("master", lambda ch: registry(ch).ListNodes(
            registry_pb2.ListNodesRequest(), timeout=10), OK, read_scope),
        "WatchNodes": ("master", lambda ch: first(registry(ch).WatchNodes(
            registry_pb2.WatchNodesRequest(), timeout=10)), OK, read_scope),
        "Generate": ("rollout", lambda ch: rollout(ch).Generate(rollout_pb2.GenerateRequest(
            prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=1)),
            timeout=60), OK, {"trainer"}),
        "PushAdapter": ("rollout", lambda ch: rollout(ch).PushAdapter(
            iter([rollout_pb2.PushAdapterRequest()]), timeout=30), INVALID, {"trainer"}),
        "ReloadAdapter": ("rollout", lambda ch: rollout(ch).ReloadAdapter(
            rollout_pb2.ReloadAdapterRequest(base_model=True), timeout=30), OK, {"trainer"}),
        "FetchAdapter": ("rollout", lambda ch: rollout(ch).FetchAdapter(
            rollout_pb2.FetchAdapterRequest(), timeout=10), INVALID, {"trainer"}),
        # the relay capability of node credentials; node-1 has no address, so the holder
        # refuses it (tests/rollout/test_relay.py covers the readers a holder accepts)
        "ReadAdapter": ("rollout", lambda ch: list(rollout(ch).ReadAdapter(
            rollout_pb2.ReadAdapterRequest(name="x", version=1), timeout=10)), DENIED, node),
        "GetNodeInfo": ("rollout", lambda ch: rollout(ch).GetNodeInfo(
            rollout_pb2.GetNodeInfoRequest(), timeout=10), OK, read_scope),
        "GetRunStatus": ("trainer", lambda ch: trainer(ch).GetRunStatus(
            trainer_pb2.GetRunStatusRequest(), timeout=10), OK, read_scope),
        "WatchRun": ("trainer", lambda ch: list(trainer(ch).WatchRun(
            trainer_pb2.WatchRunRequest(include_history=True), timeout=10)), OK, read_scope),
        "ReportRun": ("master", lambda ch: runs_pb2_grpc.RunReportServiceStub(ch).ReportRun(
            runs_pb2.ReportRunRequest(run=runs_pb2.RunInfo(run_id="matrix")), timeout=10),
            OK, {"trainer"}),
        **_primitive_calls(),
    }


def _primitive_calls() -> dict[str, tuple[str, Callable[[grpc.Channel], None], grpc.StatusCode,
                                          set]]:
    """TrainingService (gridrl-trainer serve-api): the trainer scope alone; requests on a
    session that does not exist (NOT_FOUND), a session without a base model (INVALID), a
    sample of the base model (OK)."""
    def stub(ch: grpc.Channel) -> primitives_pb2_grpc.TrainingServiceStub:
        return primitives_pb2_grpc.TrainingServiceStub(ch)

    pb, trainer = primitives_pb2, {"trainer"}
    datum = pb.Datum(input_token_ids=[1, 2], target_token_ids=[2, 3])
    adam = pb.AdamParams(learning_rate=1e-3, beta2=0.99, eps=1e-8)
    return {
        "CreateTrainingSession": ("primitives", lambda ch: stub(ch).CreateTrainingSession(
            pb.CreateTrainingSessionRequest(), timeout=30), INVALID, trainer),
        "GetTrainingSession": ("primitives", lambda ch: stub(ch).GetTrainingSession(
            pb.GetTrainingSessionRequest(session_id="none"), timeout=30), NOT_FOUND, trainer),
        "CloseTrainingSession": ("primitives", lambda ch: stub(ch).CloseTrainingSession(
            pb.CloseTrainingSessionRequest(session_id="none"), timeout=30), NOT_FOUND, trainer),
        "Forward": ("primitives", lambda ch: stub(ch).Forward(pb.ForwardRequest(
            session_id="none", data=[datum], loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY),
            timeout=30), NOT_FOUND, trainer),
        "ForwardBackward": ("primitives", lambda ch: stub(ch).ForwardBackward(
            pb.ForwardBackwardRequest(session_id="none", data=[datum],
                                      loss_function=pb.LOSS_FUNCTION_CROSS_ENTROPY),
            timeout=30), NOT_FOUND, trainer),
        "OptimStep": ("primitives", lambda ch: stub(ch).OptimStep(pb.OptimStepRequest(
            session_id="none", adam=adam), timeout=30), NOT_FOUND, trainer),
        "SaveState": ("primitives", lambda ch: stub(ch).SaveState(pb.SaveStateRequest(
            session_id="none", name="a"), timeout=30), NOT_FOUND, trainer),
        "LoadState": ("primitives", lambda ch: stub(ch).LoadState(pb.LoadStateRequest(
            session_id="none", path="tinker://none/weights/a"), timeout=30), NOT_FOUND,
            trainer),
        "SaveWeightsForSampler": ("primitives", lambda ch: stub(ch).SaveWeightsForSampler(
            pb.SaveWeightsForSamplerRequest(session_id="none"), timeout=30), NOT_FOUND,
            trainer),
        "Sample": ("primitives", lambda ch: stub(ch).Sample(pb.SampleRequest(
            base_model=_TINY[0], prompt_token_ids=[1, 2, 3],
            sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=120), OK, trainer),
    }


_TINY: list[str] = []  # the tiny llama's directory, set by the servers fixture


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_llama_dir: Path, pki, creds) -> Iterator[dict[str, str]]:
    """Master, rollout node, TrainerService and TrainingService, each with mutual TLS (the ``server``
    certificate) and the session's authorized tokens."""
    from gridrl.common.rpc.server import GrpcServer
    from gridrl.engine.backends.torch.backend import TorchBackend
    from gridrl.rollout.server import NodeConfig, RolloutNode
    from gridrl.trainer.primitives import grpc_servicer
    from gridrl.trainer.primitives.serve import torch_loader
    from gridrl.trainer.primitives.service import PrimitivesService
    from gridrl.trainer.report.status import RunStatus
    from gridrl.trainer.server import serve_trainer

    security = Security(tls=pki.tls("server"), authorized=AuthorizedTokens(creds.authorized))
    master = Master("127.0.0.1:0", security=security, grace_s=1).start()
    node = RolloutNode(TorchBackend.from_pretrained(tiny_llama_dir), NodeConfig(
        listen="127.0.0.1:0", security=security, grace_s=1,
        adapter_root=tmp_path_factory.mktemp("matrix-adapters"))).start()
    status = RunStatus()
    status.begin("matrix", "/runs/matrix", total_steps=1, model_id="tiny")
    status.finish()
    trainer = serve_trainer(status, "127.0.0.1:0", metrics_port=-1, security=security)
    _TINY[:] = [str(tiny_llama_dir)]
    service = PrimitivesService(root=tmp_path_factory.mktemp("matrix-api"),
                                load_model=torch_loader("cpu", "auto"))
    primitives = GrpcServer("127.0.0.1:0", security=security, grace_s=1)
    grpc_servicer.add_to(primitives, service)
    primitives.start()
    yield {"master": master.address, "rollout": node.address, "trainer": trainer.address,
           "primitives": primitives.address}
    primitives.stop(0)
    service.close()
    trainer.stop(0)
    node.stop(1)
    master.stop(0)


def _status(fn: Callable[[grpc.Channel], None], channel: grpc.Channel) -> grpc.StatusCode:
    try:
        fn(channel)
    except grpc.RpcError as e:
        return e.code()
    return OK


def test_every_rpc_of_the_services_is_in_the_scope_table() -> None:
    """A new RPC must be classified: the table lists exactly the RPCs of the services (an RPC
    missing from it would be refused to everyone)."""
    pool = descriptor_pool.Default()
    rpcs = {f"/gridrl.v1.{service}/{m.name}"
            for service in ("RegistryService", "RolloutService", "TrainerService",
                            "RunReportService", "TrainingService")
            for m in pool.FindServiceByName(f"gridrl.v1.{service}").methods}
    assert set(METHOD_SCOPES) == rpcs
    assert {m.rsplit("/", 1)[1] for m in rpcs} == set(_calls())


def test_every_rpc_by_every_kind_of_caller(servers: dict[str, str], pki, creds) -> None:
    calls = _calls()
    got, want = {}, {}
    for caller in CALLERS:
        channels = {name: dial(address, Security(tls=pki.tls("client"),
                                                 token=creds.tokens[caller] if caller else None))
                    for name, address in servers.items()}
        try:
            for rpc, (service, fn, allowed_code, allowed) in calls.items():
                want[rpc, caller] = (allowed_code if caller in allowed else
                                     DENIED if caller in ("node", "trainer", "read") else UNAUTH)
                got[rpc, caller] = _status(fn, channels[service])
            for name, channel in channels.items():  # health stays open to everyone
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING, (name, caller)
        finally:
            for channel in channels.values():
                channel.close()
    wrong = [f"{rpc} as {caller or 'no credential'}: got {got[rpc, caller].name}, want "
             f"{want[rpc, caller].name}" for rpc, caller in want if got[rpc, caller] != want[rpc, caller]]
    assert not wrong, "\n".join(wrong)
    # the matrix is not vacuous: every kind of answer occurs
    assert {OK, UNAUTH, DENIED, NOT_FOUND, INVALID} <= set(got.values())


def test_refusals_name_what_was_refused(servers: dict[str, str], pki, creds) -> None:
    def error(caller: str | None, rpc: str) -> grpc.RpcError:
        service, fn, _, _ = _calls()[rpc]
        security = Security(tls=pki.tls("client"), token=creds.tokens[caller] if caller else None)
        with dial(servers[service], security) as ch, pytest.raises(grpc.RpcError) as e:
            fn(ch)
        return e.value

    e = error(None, "Generate")
    assert e.code() == UNAUTH and e.details() == (
        "RolloutService/Generate: no credential; send 'authorization: Bearer <token>' "
        "(clients: --auth-token-file)")
    e = error("wrong", "ListNodes")
    assert e.code() == UNAUTH and e.details().startswith(
        "RegistryService/ListNodes: credential not recognised")
    e = error("node", "PushAdapter")
    assert e.code() == DENIED and e.details() == (
        "RolloutService/PushAdapter: credential 'node-1' has scope node; this RPC needs scope "
        "trainer")
    e = error("read", "ReloadAdapter")
    assert e.code() == DENIED and e.details() == (
        "RolloutService/ReloadAdapter: credential 'reader' has scope read; this RPC needs scope "
        "trainer")
    e = error("trainer", "RegisterNode")  # a rollout entry: a trainer lists only itself
    assert e.code() == DENIED and e.details() == (
        "RegistryService/RegisterNode: credential 'trainer-1' has scope trainer; it may "
        "register trainer entries (node.role), not rollout")
