"""Which gridrl service answers at an address, asked through gRPC server reflection.

    names = list_services("127.0.0.1:50051")   # ["gridrl.v1.RolloutService", ...] or None
    check_service("127.0.0.1:50051", REGISTRY, "--master")  # StatusError: a rollout node...

Every gridrl server serves reflection without credentials (``gridrl.common.rpc.server``), so a
client can tell, before it starts its real work, that the address it was given is another
gridrl service (the trainer's ``--master`` pointed at a node, a client's ``--address`` at the
master) and say so in one line, where the real call would only get ``UNIMPLEMENTED: Method not
found!``. An address where nothing answers, or where reflection is not served, is not judged:
the caller waits or retries as it would anyway.
"""

from __future__ import annotations

import dataclasses

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gridrl.common.errors import failed_precondition

REGISTRY = "gridrl.v1.RegistryService"
ROLLOUT = "gridrl.v1.RolloutService"
TRAINER = "gridrl.v1.TrainerService"

# What each gridrl service is, in the words of a one-line error.
SERVICES = {
    REGISTRY: "the master (gridrl-master serve)",
    ROLLOUT: "a rollout node (gridrl-rollout serve)",
    TRAINER: "a trainer (gridrl-trainer run)",
}


def list_services(address: str, security: object | None = None,
                  timeout_s: float = 3.0) -> list[str] | None:
    """The full service names the server at ``address`` lists through reflection
    (``ServerReflectionInfo``, ``list_services``), or None when it cannot be asked: nothing
    answers within ``timeout_s`` seconds, the server serves no reflection, TLS does not match.

    Args:
        address: host:port (already validated).
        security: a :class:`gridrl.common.security.policy.Security` for TLS, or None. Its bearer
            token is never sent: reflection needs none, and whatever answers at
            ``address`` (a port taken before a server starts, a mistyped address) is not
            known to be ours.
    """

    from gridrl.common.rpc.channel import dial

    if getattr(security, "token", None) is not None:
        security = dataclasses.replace(security, token=None)  # type: ignore[type-var]
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    names = None
    try:
        with dial(address, security) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            # Read the stream to its end (the server ends it after our one request): leaving
            # the loop early would cancel the call under the server's feet.
            for response in stub.ServerReflectionInfo(iter([request]), timeout=timeout_s):
                if names is None and response.HasField("list_services_response"):
                    names = [s.name for s in response.list_services_response.service]
    except grpc.RpcError:
        return names
    return names


def describe(names: list[str]) -> str:
    """What a list of service names is, in words: ``a rollout node (gridrl-rollout serve)``,
    or the gridrl-unknown names themselves."""
    known = [SERVICES[n] for n in names if n in SERVICES]
    if known:
        return " and ".join(known)
    shown = [n for n in names if not n.startswith("grpc.")]
    return f"a gRPC server of {', '.join(shown)}" if shown else "a gRPC server of no known service"


def service_mismatch(address: str, expected: str, names: list[str] | None) -> str | None:
    """``"<address> is <what is there>, not <expected>"`` when ``names`` (from
    :func:`list_services`) lack ``expected``; None when it is there or nothing could be asked."""
    if names is None or expected in names:
        return None
    return f"{address} is {describe(names)}, not {SERVICES.get(expected, expected)}"


def check_service(address: str, expected: str, flag: str, security: object | None = None,
                  timeout_s: float = 3.0) -> None:
    """Refuse an ``address`` where another service answers.

    Raises:
        StatusError: FAILED_PRECONDITION ``"<flag>: <address> is a rollout node (gridrl-rollout
            serve), not the master (gridrl-master serve)"``. Nothing is raised when ``expected``
            is served, or when nothing could be asked (see :func:`list_services`).
    """
    problem = service_mismatch(address, expected, list_services(address, security, timeout_s))
    if problem:
        raise failed_precondition(problem, field=flag)
