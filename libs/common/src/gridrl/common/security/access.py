"""Scopes: who may call which RPC of the three services, decided per call.

  minted with an address may register only that address, and the master refuses a node
  credential re-registering, heartbeating or deregistering an address another (unrevoked)
  credential registered (:mod:`gridrl.master.claims`).
* ``trainer`` — Generate, PushAdapter, ReloadAdapter, and everything ``read`` can do (watch
  the registry, read node info and run status); RegisterNode, Heartbeat and DeregisterNode
  only for its own trainer entry (the master refuses a trainer credential any other role,
  and any entry it did not register; a node credential lists only rollout nodes).
* ``read`` — ListNodes, WatchNodes, GetNodeInfo, GetRunStatus, WatchRun, and the master's
  dashboard (its HTTP port: :mod:`gridrl.master.dashboard`).

* ``relay`` — not a credential's scope but what a ``node`` credential may do besides
  registering: ReadAdapter, a peer reading an adapter version from the node that holds it
  (relay fan-out). The holder also checks that the credential was minted with an address and
  that the trainer listed that address among the version's readers
  (:func:`relay_reader_refusal`), so a node forwards only to the nodes the master lists.

``trainer`` alone may also call ReportRun (a run's steps and events for the master's
dashboard) and the TrainingService primitives (``gridrl-trainer serve-api``, whose
Tinker-compatible HTTP facade takes the same credential as its API key).

No or an unknown credential: UNAUTHENTICATED. A known credential whose scope does not cover the
RPC: PERMISSION_DENIED naming the credential, its scope, the RPC and the scope it needs.
Tokens are compared in constant time (``hmac.compare_digest`` against every entry).
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from gridrl.common.address import canonical_address
from gridrl.common.errors import Kind
from gridrl.common.security.tokens import (
    AUTH_HEADER,
    NODE,
    READ,
    TRAINER,
    AuthorizedTokens,
    Credential,
    cert_fingerprint,
)

# Methods that stay open so load balancers, systemd probes and grpcurl work without a token.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")

# The capability of ReadAdapter (relay fan-out between nodes): granted to node credentials only.
RELAY = "relay"

# What a credential of each scope may call: the scopes its RPCs may require.
GRANTS: dict[str, frozenset[str]] = {
    NODE: frozenset({NODE, RELAY}),
    TRAINER: frozenset({TRAINER, READ, NODE}),  # NODE: its own entry (role trainer) only
    READ: frozenset({READ}),
}
# Every RPC of the three services and the scope it requires. An RPC missing here is refused to
# every credential (a new RPC must be classified; tests/e2e/test_security_matrix.py checks it).
METHOD_SCOPES: dict[str, str] = {
    "/gridrl.v1.RegistryService/RegisterNode": NODE,
    "/gridrl.v1.RegistryService/Heartbeat": NODE,
    "/gridrl.v1.RegistryService/DeregisterNode": NODE,
    "/gridrl.v1.RegistryService/ListNodes": READ,
    "/gridrl.v1.RegistryService/WatchNodes": READ,
    "/gridrl.v1.RolloutService/Generate": TRAINER,
    "/gridrl.v1.RolloutService/PushAdapter": TRAINER,
    "/gridrl.v1.RolloutService/ReloadAdapter": TRAINER,
    "/gridrl.v1.RolloutService/GetNodeInfo": READ,
    "/gridrl.v1.RolloutService/FetchAdapter": TRAINER,
    "/gridrl.v1.RolloutService/ReadAdapter": RELAY,
    "/gridrl.v1.TrainerService/GetRunStatus": READ,
    "/gridrl.v1.TrainerService/WatchRun": READ,
    "/gridrl.v1.RunReportService/ReportRun": TRAINER,
    # the training primitives (gridrl-trainer serve-api): train and sample on the trainer
    **{f"/gridrl.v1.TrainingService/{rpc}": TRAINER for rpc in (
        "CreateTrainingSession", "GetTrainingSession", "CloseTrainingSession", "Forward",
        "ForwardBackward", "OptimStep", "SaveState", "LoadState", "SaveWeightsForSampler",
        "Sample")},
}



@dataclass(frozen=True)
class Decision:
    """What the server does with a call: ``code`` None lets it through as ``credential``
    (None when the method is open or the server runs without credentials)."""

    code: Kind | None = None
    message: str = ""
    credential: Credential | None = None


def authorize(tokens: AuthorizedTokens | None, method: str,
              metadata: Sequence[tuple[str, str | bytes]] | None) -> Decision:
    """Decide a call to ``method`` (``/package.Service/Method``) carrying ``metadata``.

    Open methods (health, reflection) and servers without ``tokens`` let every call through.
    Otherwise: no or an unknown token -> UNAUTHENTICATED; a credential whose scope does not
    cover the method, or a method no scope covers -> PERMISSION_DENIED. Messages name what was
    refused.
    """
    if tokens is None or method.startswith(OPEN_PREFIXES):
        return Decision()
    name = method.removeprefix("/gridrl.v1.")
    header = next((v for k, v in metadata or () if k == AUTH_HEADER), None)
    if header is None:
        return Decision(Kind.UNAUTHENTICATED,
                        f"{name}: no credential; send 'authorization: Bearer <token>' "
                        "(clients: --auth-token-file)")
    if isinstance(header, bytes):
        header = header.decode(errors="replace")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return Decision(Kind.UNAUTHENTICATED,
                        f"{name}: authorization metadata must be 'Bearer <token>'")
    credential = tokens.lookup(token.strip())
    if credential is None:
        return Decision(Kind.UNAUTHENTICATED,
                        f"{name}: credential not recognised (not in this server's authorized "
                        "tokens: revoked, mistyped, or minted for another cluster)")
    needed = METHOD_SCOPES.get(method)
    if needed is None:
        return Decision(Kind.PERMISSION_DENIED,
                        f"{name}: no scope may call this RPC", credential)
    if needed not in GRANTS[credential.scope]:
        return Decision(Kind.PERMISSION_DENIED,
                        f"{name}: credential {credential.id!r} has scope {credential.scope}; "
                        f"this RPC needs scope {needed}", credential)
    return Decision(credential=credential)


def check_bound_certificate(decision: Decision, method: str, peer_pem: bytes | None
                            ) -> Decision:
    """``decision`` unless its credential is bound to a client certificate (``cert=``) that
    the connection did not present: then UNAUTHENTICATED, naming the credential.

    Args:
        decision: :func:`authorize`'s answer for the call.
        method: ``/package.Service/Method``.
        peer_pem: the client's certificate as the TLS layer verified it (grpc's auth context
            ``x509_pem_cert``); None on plaintext or without a client certificate.
    """
    credential = decision.credential
    if decision.code is not None or credential is None or credential.cert is None:
        return decision
    name = method.removeprefix("/gridrl.v1.")
    if not peer_pem:
        return Decision(Kind.UNAUTHENTICATED,
                        f"{name}: credential {credential.id!r} is bound to a client certificate "
                        "and this connection presented none (mutual TLS with --tls-cert/"
                        "--tls-key)")
    try:
        presented = cert_fingerprint(peer_pem)
    except ValueError:
        presented = None
    if presented is None or not hmac.compare_digest(presented, credential.cert):
        return Decision(Kind.UNAUTHENTICATED,
                        f"{name}: credential {credential.id!r} is bound to another client "
                        "certificate than the one this connection presented")
    return decision


def relay_reader_refusal(credential: Credential | None, readers: Sequence[str]) -> str | None:
    """Why a ReadAdapter caller may not read a version whose readers are ``readers``
    (host:port, as the trainer listed them from the master), None when it may.

    A server without credentials (loopback tests, ``--insecure``) lets every caller read.
    Otherwise the caller's credential must be bound to an address (``gridrl-auth mint
    --address``) that is one of ``readers``; spellings of one address are that address
    (:func:`gridrl.common.address.canonical_address`).
    """
    if credential is None:
        return None
    if not credential.address:
        return (f"credential {credential.id!r} has no address (mint it with --address): a node "
                "relays adapters only to the nodes the trainer lists, by address")
    mine = _canonical(credential.address)
    if not any(_canonical(r) == mine for r in readers):
        return (f"credential {credential.id!r} is for {credential.address}, which is not among "
                "the nodes the trainer listed as this version's readers")
    return None


def _canonical(address: str) -> str:
    try:
        return canonical_address(address)
    except Exception:  # not host:port: compared as written
        return address


_CALLER: contextvars.ContextVar[Credential | None] = contextvars.ContextVar("gridrl_caller",
                                                                           default=None)


def caller() -> Credential | None:
    """The credential of the call being served on this thread (None: open method or a server
    without credentials). Handlers use it for checks finer than scopes (a node's own
    address)."""
    return _CALLER.get()


@contextmanager
def calling_as(credential: Credential | None) -> Iterator[None]:
    """Make :func:`caller` return ``credential`` inside the block (the server interceptor)."""
    reset = _CALLER.set(credential)
    try:
        yield
    finally:
        try:
            _CALLER.reset(reset)
        except ValueError:  # a stream closed from another thread's context
            pass

