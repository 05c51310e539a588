"""The bookkeeping of the pool's batches: what a batch waits for (:class:`NodeWait`, shown
by the console and ``GetRunStatus``), one batch's requests, calls in flight and results
(:class:`Batch`), and a Generate call the batch can cancel while it runs (:class:`Call`).
Owned by the thread running the batch (:meth:`gridrl.trainer.fleet.pool.NodePool.sample_turns`);
no locks but the call's own.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from gridrl.trainer.envs.episode import TurnRequest
from gridrl.trainer.fleet import scheduling
from gridrl.trainer.rollouts import RolloutSample
from gridrl.v1 import common_pb2

__all__ = ["Batch", "Call", "NodeWait"]


@dataclass(frozen=True)
class NodeWait:
    """The run waits for rollout nodes: a batch for one in rotation (none is), or the start
    for ``--min-nodes`` of them.

    Attributes:
        waited_s: seconds waited so far.
        left_s: seconds left before the wait fails (``wait_for_nodes_s`` or ``node_wait_s``
            minus waited).
        waiting_for: every known node and why it is out of rotation (and the master's
            connection), e.g. ``"127.0.0.1:5001 (benched: 3 consecutive Generate failures,
            last UNAVAILABLE: ...)"``.
        starting: the start's wait (:meth:`NodePool.wait_for_nodes`), not a batch's.
        in_rotation: nodes in rotation now (the start's wait).
        needed: nodes the start waits for (``--min-nodes``).
        gave_up: the wait ended without the nodes it waited for (its time ran out; the run
            fails): the last report of a failed wait (a wait that got its nodes ends with
            None).
    """

    waited_s: float
    left_s: float
    waiting_for: str
    starting: bool = False
    in_rotation: int = 0
    needed: int = 1
    gave_up: bool = False


@dataclass
class Batch:
    """The bookkeeping of one ``generate_groups`` / ``sample_turns`` call (owned by its
    calling thread): one Generate per request, ``results[i]`` its samples or, for a pinned
    request that cannot be served, the exception that failed it."""

    requests: list[TurnRequest]
    sampling: common_pb2.SamplingParams  # n, max_tokens and seed set per request
    results: list[list[RolloutSample] | BaseException | None] = field(default_factory=list)
    tried: list[list[str]] = field(default_factory=list)  # nodes each request failed on
    rejected: list[dict[str, str]] = field(default_factory=list)  # INVALID_ARGUMENT per node
    pending: deque[int] = field(default_factory=deque)
    in_flight: dict[futures.Future, tuple[int, str]] = field(default_factory=dict)
    calls: dict[futures.Future, Call] = field(default_factory=dict)
    started: dict[futures.Future, float] = field(default_factory=dict)  # clock seconds
    abandoned: set[futures.Future] = field(default_factory=set)  # cancelled; answers ignored
    hedges: dict[int, str] = field(default_factory=dict)  # pending backup -> node to avoid
    hedged: set[int] = field(default_factory=set)  # groups given a backup copy

    def __post_init__(self) -> None:
        self.results = [None] * len(self.requests)
        self.tried = [[] for _ in self.requests]
        self.rejected = [{} for _ in self.requests]
        self.pending = deque(range(len(self.requests)))

    def group(self, i: int) -> scheduling.PendingGroup:
        r = self.requests[i]
        return scheduling.PendingGroup(i, len(r.prompt_ids), tuple(self.tried[i]),
                                       self.rejected[i], n=r.n, max_tokens=r.max_tokens,
                                       pinned=r.node)

    def fail(self, i: int, problem: str) -> None:
        """A pinned request that can never be served: its result is the error."""
        self.results[i] = RuntimeError(problem)
        self.pending.remove(i)

    def live_copies(self, i: int) -> list[futures.Future]:
        """Calls of request ``i`` in flight and not abandoned."""
        return [f for f, (j, _) in self.in_flight.items() if j == i and f not in self.abandoned]

    def abandon(self, future: futures.Future) -> None:
        """Cancel a call; its answer, should one still come, is ignored."""
        self.abandoned.add(future)
        future.cancel()
        self.calls[future].cancel()


class Call:
    """A Generate call that the batch's thread can cancel while a ``rollout`` thread
    waits on it (before the RPC starts, or while it runs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rpc: grpc.Future | None = None
        self.cancelled = False

    def attach(self, rpc: grpc.Future) -> None:
        with self._lock:
            self._rpc = rpc
            cancelled = self.cancelled
        if cancelled:
            rpc.cancel()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            rpc = self._rpc
        if rpc is not None:
            rpc.cancel()
