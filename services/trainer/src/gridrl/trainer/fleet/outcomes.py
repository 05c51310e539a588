"""How the fleet's calls to a node end, as types: a Generate that gave no group
(:class:`GenerateFailure`) and an adapter push (:class:`PushResult`).

Callers branch on the kind (``failure.kind is FailureKind.REJECTED``,
``result.status is PushStatus.SUPERSEDED``), never on a message; the ``label`` and ``reason``
strings are for logs, records and metrics only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc


class FailureKind(enum.Enum):
    """Why a Generate call gave no group (the value is the label logs and the
    ``gridrl_trainer_generate_failures_total{code}`` metric use for kinds without a status)."""

    REJECTED = "INVALID_ARGUMENT"  # the node refused the request: the prompt's fault
    RPC_ERROR = "RPC_ERROR"  # any other gRPC status (UNAVAILABLE, DEADLINE_EXCEEDED...)
    MALFORMED_RESPONSE = "MALFORMED_RESPONSE"  # wrong number of samples, another prompt...
    NODE_LEFT = "NODE_LEFT"  # the node left the pool before the call
    LOST_ADAPTER = "LOST_ADAPTER"  # its samples show it lost the adapter it was pushed


@dataclass(frozen=True)
class GenerateFailure:
    """A Generate call on a node that gave no group.

    Attributes:
        kind: why (:class:`FailureKind`).
        detail: what the node or the check said.
        status: the call's gRPC status (REJECTED and RPC_ERROR), else None.
    """

    kind: FailureKind
    detail: str
    status: grpc.StatusCode | None = None

    @classmethod
    def of_rpc(cls, code: grpc.StatusCode, detail: str) -> GenerateFailure:
        """The failure of a call that ended with gRPC status ``code``."""
        kind = (FailureKind.REJECTED if code == grpc.StatusCode.INVALID_ARGUMENT
                else FailureKind.RPC_ERROR)
        return cls(kind, detail, code)

    @property
    def label(self) -> str:
        """The status code's name, else the kind's (``"UNAVAILABLE"``, ``"NODE_LEFT"``)."""
        return self.status.name if self.status is not None else self.kind.value

    @property
    def nodes_fault(self) -> bool:
        """Whether the failure counts against the node (a rejected request does not, nor a
        node that lost its adapter: it is caught up, not benched)."""
        return self.kind not in (FailureKind.REJECTED, FailureKind.LOST_ADAPTER)


class PushStatus(enum.Enum):
    """How a push of the adapter to one node ended."""

    SYNCED = "synced"  # the node serves the pushed version
    FAILED = "failed"  # the call failed or the node answered wrong: it is benched
    SUPERSEDED = "superseded"  # a newer version is pushed to it instead (not a failure)
    NOT_PUSHED = "not pushed"  # nothing to push, or the node left the pool (not a failure)


@dataclass(frozen=True)
class PushResult:
    """One node's push (:meth:`gridrl.trainer.fleet.sync.AdapterSync.repush` and the pushes
    of a sync).

    Attributes:
        status: how it ended.
        reason: why it did not sync, in words ("" when it did).
        sent_bytes: adapter bytes the trainer itself streamed to the node (0 when a peer
            relayed it: :mod:`gridrl.trainer.fleet.sync`).
        relayed: the node fetched it from a peer (relay fan-out).
    """

    status: PushStatus
    reason: str = ""
    sent_bytes: int = 0
    relayed: bool = False

    @property
    def synced(self) -> bool:
        return self.status is PushStatus.SYNCED


SYNCED = PushResult(PushStatus.SYNCED)
