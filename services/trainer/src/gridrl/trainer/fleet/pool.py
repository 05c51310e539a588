"""The pool of rollout nodes over gRPC: sampling over the nodes in rotation.

    pool = NodePool(master="master:50050", addresses=[], model_identity=identity)
    pool.start()                       # follows WatchNodes; probes static addresses
    pool.wait_for_nodes(1, timeout_s=60)
    results = pool.sample_turns(requests, SamplingConfig(max_tokens=128))

:class:`NodePool` is a :class:`~gridrl.trainer.fleet.nodeset.NodeSet` (which nodes there are and
which are in rotation: the master's watch, probes, pushes, flags, waits for a node) that
sends work to them: each batch of requests is dispatched by
:mod:`gridrl.trainer.fleet.scheduling` (which node in rotation samples which group), retried
away from failing nodes, re-dispatched or hedged by :mod:`gridrl.trainer.fleet.hedging`, and its
answers turned into samples by :mod:`gridrl.trainer.fleet.wire`.

Threads and what they own (the node set's own: :mod:`~gridrl.trainer.fleet.nodeset`):

- the caller of :meth:`NodePool.sample_turns` (the loop or its prefetch thread) runs the
  batch: it asks the scheduler, starts calls on the ``rollout`` executor and collects them;
- ``rollout-*`` executor threads make one Generate call each (no pool state touched).

Locks: the node set's lock, held only while the scheduler runs over the in-memory table or an
outcome is applied, never during an RPC.

When no node is in rotation (every node dead, restarting, benched or waiting for the current
adapter), a batch waits for one up to ``wait_for_nodes_s`` seconds, telling ``on_wait`` (the
trainer's console and ``GetRunStatus``) and the ``gridrl_trainer_node_wait_*`` metrics what it
waits for and how long is left; a node that comes back gets the current adapter before any
group (membership's *syncing*), then the batch goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc

from gridrl.common.rpc.channel import Keepalive
from gridrl.common.security.policy import Security
from gridrl.engine.contract import SamplingConfig
from gridrl.models import ModelIdentity
from gridrl.trainer.envs.episode import TurnRequest
from gridrl.trainer.fleet import hedging, metrics, scheduling
from gridrl.trainer.fleet.batch import Batch, Call, NodeWait
from gridrl.trainer.fleet.membership import MAX_PROBE_BACKOFF_S, ORPHAN_GRACE_S
from gridrl.trainer.fleet.nodes import NodeState
from gridrl.trainer.fleet.nodeset import WAIT_REPORT_S, NodeSet
from gridrl.trainer.fleet.outcomes import FailureKind, GenerateFailure
from gridrl.trainer.fleet.wire import samples_of
from gridrl.trainer.rollouts import Group, RolloutSample, group_seed
from gridrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

__all__ = ["MAX_PROBE_BACKOFF_S", "ORPHAN_GRACE_S", "NodePool", "NodeState",
           "NodeWait"]

log = logging.getLogger(__name__)

# Seconds the batch loop sleeps between looks at the pool while groups are in flight.
_POLL_S = 0.1


class NodePool(NodeSet):
    """Rollout nodes from the master and/or static addresses; a turn sampler
    (:class:`~gridrl.trainer.envs.source.TurnSampler`).

    Args:
        master: host:port of the master to follow, or None.
        addresses: static rollout node addresses (host:port).
        model_identity: the trainer's base model (nodes of another are excluded).
        security: TLS files and token for the nodes and the master
            (:class:`gridrl.common.security.policy.Security`), if any.
        request_timeout_s: deadline of one Generate call, seconds.
        max_consecutive_failures: failed Generate calls in a row that bench a node.
        probe_interval_s: seconds between GetNodeInfo probes of unreachable or benched nodes.
        max_workers: threads issuing Generate calls (bounds groups in flight over all nodes).
        wait_for_nodes_s: seconds a batch waits when no node is in rotation before it fails
            (0: it fails at once).
        on_wait: called with a :class:`NodeWait` about every half second while a batch waits
            for a node, and with None when the wait ends (a node is back, or the batch
            fails); from the batch's thread, so it must return quickly.
        clock: monotonic seconds of the events the pool feeds its membership and scheduler
            (when a call started, a push answered, a probe was sent; tests advance a fake
            one); waits and latencies are measured in real time.
        hedge: when a slow group gets a backup copy on another node
            (:class:`~gridrl.trainer.fleet.hedging.HedgePolicy`; default: never). Groups on a
            node that leaves rotation (unhealthy, benched, gone) are re-dispatched at once
            whatever this says.
        keepalive: HTTP/2 keepalive of the pool's channels (None: the project's default,
            :class:`gridrl.common.rpc.channel.Keepalive`): a call to a node whose link
            vanished fails after about ``time_s + timeout_s``.

    Raises:
        ValueError: naming the argument, when neither a master nor addresses are given, a
            model_identity key is missing, or a number is out of range.
    """

    def __init__(self, *, master: str | None, addresses: Sequence[str],
                 model_identity: ModelIdentity, security: Security | None = None,
                 request_timeout_s: float = 120.0, max_consecutive_failures: int = 3,
                 probe_interval_s: float = 5.0, max_workers: int = 64,
                 wait_for_nodes_s: float = 0.0,
                 on_wait: Callable[[NodeWait | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 hedge: hedging.HedgePolicy | None = None,
                 keepalive: Keepalive | None = None) -> None:
        if wait_for_nodes_s < 0:
            raise ValueError(f"wait_for_nodes_s: must be >= 0, got {wait_for_nodes_s}")
        super().__init__(master=master, addresses=addresses, model_identity=model_identity,
                         security=security, request_timeout_s=request_timeout_s,
                         max_consecutive_failures=max_consecutive_failures,
                         probe_interval_s=probe_interval_s, on_wait=on_wait, clock=clock,
                         keepalive=keepalive)
        self.wait_for_nodes_s = wait_for_nodes_s
        #: this run's weight in each node's fair share between runs (GenerateRequest.share_weight)
        self.share_weight = 1.0
        self.hedge = hedge or hedging.HedgePolicy()
        self._tick = 0
        self._executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="rollout")

    def close(self) -> None:
        """Stop discovery and probing, cancel calls in flight, close channels. Idempotent."""
        super().close()
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ rollouts

    def generate_groups(self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                        group_size: int, seed: int = 0) -> list[Group]:
        """Sample one group of ``group_size`` completions per prompt over the nodes in rotation
        (prompts in, samples out: Tinker's ``sample`` on the fleet; a run's steps go through
        :meth:`sample_turns` from an :class:`~gridrl.trainer.envs.source.EpisodeSource`).

        Group ``i`` is one ``Generate(prompt_token_ids=prompts[i], sampling.n=group_size,
        sampling.seed=group_seed(seed, i))`` on one node (:meth:`sample_turns` with one
        unpinned request per prompt); see :meth:`sample_turns` for placement, retries and the
        wait for nodes.

        Returns:
            one :class:`Group` per prompt, in the order of ``prompts``.
        Raises:
            ValueError, RuntimeError: as :meth:`sample_turns`.
        """
        requests = [TurnRequest(tuple(p), group_seed(seed, i), group_size, sampling.max_tokens,
                                group=i) for i, p in enumerate(prompts)]
        results = self.sample_turns(requests, sampling)
        groups = []
        for i, (p, samples) in enumerate(zip(prompts, results, strict=True)):
            assert isinstance(samples, list)  # unpinned requests never fail alone
            groups.append(Group(prompt_index=i, prompt_ids=list(p), samples=samples,
                                node=samples[0].node if samples else "",
                                seconds=samples[0].seconds if samples else 0.0))
        return groups

    def sample_turns(self, requests: Sequence[TurnRequest], sampling: SamplingConfig
                     ) -> list[list[RolloutSample] | BaseException]:
        """Sample every request over the nodes in rotation (an episode runner's
        :data:`~gridrl.trainer.envs.episode.Sampler`) under ``sampling`` (temperature, top-p,
        top-k, stop ids; each request's own ``max_tokens`` replaces ``sampling.max_tokens``).

        Request ``i`` is one ``Generate(prompt_token_ids, sampling.n=n,
        sampling.max_tokens=max_tokens, sampling.seed=seed, keep_cache)`` on one node; the
        requests run concurrently, placed by :func:`gridrl.trainer.fleet.scheduling.schedule`
        (earliest expected finish). A request that names its episode's ``node`` (a later turn)
        goes to that node only: it holds the episode's keys and values (``keep_cache``) and
        its policy version. If that node is out of rotation (dead, benched, restarted and
        syncing), rejects the request or fails it, the request's result is the exception (its
        episode is dropped and counted; it is never continued on another node). Any other
        request that fails is retried on a node it has not failed on if one is in rotation,
        on the same node only when no other is; one whose samples show its node lost the
        adapter it was pushed (it restarted) is sampled again after the node is caught up.
        When no node is in rotation the batch waits up to ``wait_for_nodes_s`` for one (see
        the module docstring).

        Returns:
            per request, its ``n`` samples (each with the request's seconds), or for a pinned
            request the exception that failed it.
        Raises:
            ValueError: naming the argument when a request's n / max_tokens < 1, or when every
                node in rotation rejected an unpinned prompt as INVALID_ARGUMENT (message from
                the node) or the prompt exceeds every node's bounds.
            RuntimeError: when no node came into rotation within ``wait_for_nodes_s``
                (every node dead, benched, unhealthy or excluded), naming each node and why;
                or when an unpinned request failed ``max_consecutive_failures`` times per
                usable node while nodes remained in rotation.
        """
        for r in requests:
            if r.n < 1:
                raise ValueError(f"group_size: must be >= 1, got {r.n}")
            if r.max_tokens < 1:
                raise ValueError(f"max_tokens: must be >= 1, got {r.max_tokens}")
        if self._closed.is_set():
            raise RuntimeError("the node pool is closed")
        params = common_pb2.SamplingParams(temperature=sampling.temperature,
                                           top_p=sampling.top_p, top_k=sampling.top_k,
                                           stop_token_ids=list(sampling.stop_token_ids))
        batch = Batch(list(requests), params)
        try:
            self._run_batch(batch)
        finally:  # on an error or once done, every call still in flight is cancelled
            for future in batch.in_flight:
                if future not in batch.abandoned:
                    batch.abandon(future)
        return [r for r in batch.results if r is not None]

    def check_group(self, address: str, prompt: Sequence[int], sampling: SamplingConfig, *,
                    group_size: int, seed: int = 0) -> Group:
        """Sample one group of ``group_size`` on ``address`` under ``sampling`` whatever its
        rotation (a flagged node's fresh check); nothing is recorded about the node.

        Raises:
            KeyError: ``address`` is not a known node.
            grpc.RpcError: the call failed.
            ValueError: the answer is malformed (wrong number of samples...).
        """
        request = rollout_pb2.GenerateRequest(
            prompt_token_ids=list(prompt), request_id="check",
            sampling=common_pb2.SamplingParams(
                n=group_size, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                top_p=sampling.top_p, top_k=sampling.top_k,
                stop_token_ids=list(sampling.stop_token_ids), seed=group_seed(seed, 0)),
            **self._own_adapter())
        response, _, seconds = self._call_generate(address, request)
        samples = samples_of(response, list(prompt), group_size, address, seconds)
        return Group(prompt_index=0, prompt_ids=list(prompt), samples=samples, node=address,
                     seconds=seconds)

    def _run_batch(self, batch: Batch) -> None:
        """The loop of :meth:`sample_turns` (fills ``batch.results``)."""
        pending, in_flight = batch.pending, batch.in_flight
        while pending or in_flight:
            self._start_groups(batch)
            if pending and not in_flight:
                self._wait_for_a_node(batch)
                continue
            done, _ = futures.wait(in_flight, timeout=_POLL_S,
                                   return_when=futures.FIRST_COMPLETED)
            for future in done:
                i, address = in_flight.pop(future)
                batch.calls.pop(future, None)
                batch.started.pop(future, None)
                if future in batch.abandoned:  # a late answer of an abandoned call
                    batch.abandoned.discard(future)
                    log.info("ignored the late end of an abandoned call for group %d on %s",
                             i, address)
                    continue
                if batch.results[i] is not None:  # another copy answered first
                    continue
                request = batch.requests[i]
                outcome = self._finish(future, address, i, list(request.prompt_ids), request.n)
                if isinstance(outcome, list):
                    batch.results[i] = outcome
                    for other in batch.live_copies(i):  # the hedge's loser
                        batch.abandon(other)
                    if i in batch.pending:  # a backup not started yet
                        batch.pending.remove(i)
                        batch.hedges.pop(i, None)
                    continue
                if batch.live_copies(i):
                    continue  # another copy of the group runs
                if i in batch.pending:  # its backup, not started yet, is now its only copy:
                    batch.hedges.pop(i, None)  # any node may take it
                    continue
                if request.node:  # the episode's node failed it: the episode ends here
                    batch.results[i] = RuntimeError(
                        f"request {i} on its episode's node {address}: {outcome.label}: "
                        f"{outcome.detail}")
                    continue
                if outcome.kind is FailureKind.REJECTED:
                    batch.rejected[i][address] = outcome.detail
                elif outcome.nodes_fault:  # the node's fault, not the prompt's
                    batch.tried[i].append(address)
                    with self._lock:
                        limit = self.max_consecutive_failures * max(1, self._members.usable())
                        live = len(self._members.in_rotation())
                    if len(batch.tried[i]) >= limit and live:
                        raise RuntimeError(
                            f"prompt {i}: Generate failed {len(batch.tried[i])} times on "
                            f"{', '.join(sorted(set(batch.tried[i])))}; last ({address}): "
                            f"{outcome.label}: {outcome.detail}")
                pending.appendleft(i)
            self._rebalance(batch)

    def _rebalance(self, batch: Batch) -> None:
        """Abandon the calls on nodes that left rotation (their groups are queued again at
        once) and queue backups of slow groups (:func:`gridrl.trainer.fleet.hedging.moves`)."""
        attempts = [hedging.Attempt(f, i, a, batch.started.get(f, 0.0))
                    for f, (i, a) in batch.in_flight.items()
                    if f not in batch.abandoned and not batch.requests[i].node]
        if not attempts:
            return
        with self._lock:
            now = self._clock()
            gone = {a.address: why for a in attempts if (why := self._gone(a.address))}
            group_s = {a.address: s.group_s for a in attempts
                       if (s := self._members.state(a.address)) is not None}
            free = {c.address for c in self._members.candidates()
                    if c.in_flight < max(1, c.capacity)}
        moves = hedging.moves(attempts, now=now, gone=gone, group_s=group_s,
                              policy=self.hedge,
                              elsewhere=lambda address: bool(free - {address}))
        for move in moves:
            a = move.attempt
            if move.kind is hedging.MoveKind.REDISPATCH:
                requeue = hedging.needs_queue(move, attempts, gone)
                batch.abandon(a.key)
                log.warning("group %d re-dispatched: %s", a.index, move.reason)
                metrics.REDISPATCHED.labels(a.address, "node gone").inc()
                if requeue and a.index not in batch.pending:
                    batch.tried[a.index].append(a.address)
                    batch.pending.appendleft(a.index)
            elif a.index not in batch.hedged and a.index not in batch.pending:
                batch.hedged.add(a.index)
                batch.hedges[a.index] = a.address
                batch.pending.append(a.index)
                log.warning("group %d hedged: %s", a.index, move.reason)
                metrics.REDISPATCHED.labels(a.address, "hedge").inc()

    def _gone(self, address: str) -> str:
        """Why a call on ``address`` cannot be answered any more ("" when it may). Lock
        held."""
        s = self._members.state(address)
        if s is None:
            return "left the pool"
        if s.excluded:
            return f"is excluded: {s.excluded}"
        if s.benched:
            return f"is benched: {s.benched}"
        if not s.healthy:
            return f"is unhealthy ({s.last_error or 'the master says so'})"
        return ""

    def _start_groups(self, batch: Batch) -> None:
        """Fail the pinned requests whose node can no longer serve them, ask the scheduler
        for this round's assignments and start their calls."""
        if not batch.pending:
            return
        groups = [batch.group(i) for i in batch.pending]
        with self._lock:
            now = self._clock()
            live = self._members.candidates()
            stranded = {g.index: problem for g in groups if (problem := scheduling.stranded(
                live, g, group_size=g.n, max_tokens=g.max_tokens))}
            plan = scheduling.schedule(live, [g for g in groups if g.index not in stranded],
                                       group_size=1, max_tokens=1, now=now, tick=self._tick)
            # a backup goes elsewhere or not at all
            plan = [a for a in plan if batch.hedges.get(a.index) != a.address]
            self._tick += len(plan)
            for a in plan:
                self._members.assign(a.address, now)
        for i, problem in stranded.items():
            log.warning("episode request dropped: %s", problem)
            batch.fail(i, problem)
        for a in plan:
            batch.pending.remove(a.index)
            batch.hedges.pop(a.index, None)
            r = batch.requests[a.index]
            request = rollout_pb2.GenerateRequest(
                prompt_token_ids=list(r.prompt_ids),
                request_id=f"group-{r.group}-request-{a.index}-try-{len(batch.tried[a.index])}",
                sampling=batch.sampling, keep_cache=r.keep_cache,
                share_weight=self.share_weight, **self._own_adapter())
            request.sampling.n, request.sampling.max_tokens = r.n, r.max_tokens
            request.sampling.seed = r.seed
            call = Call()
            future = self._executor.submit(self._call_generate, a.address, request, call)
            future.add_done_callback(functools.partial(self._call_done, a.address))
            batch.in_flight[future] = (a.index, a.address)
            batch.calls[future] = call
            batch.started[future] = now

    def _own_adapter(self) -> dict[str, Any]:
        """The GenerateRequest fields that make a node decode with this run's policy: the
        adapter its calls name once it has pushed one (several runs share the nodes: each
        decodes with its own, issue 46); before, the base model (its version 0), whatever
        adapter of another run serves there."""
        target = self._members.target
        return {"adapter_name": target.name} if target.version > 0 else {"base_model": True}

    def _wait_for_a_node(self, batch: Batch) -> None:
        """Nothing of the batch could start and none of it is in flight: wait for a node
        busy with another batch's calls, raise when the first pending group can never be
        served by the nodes in rotation, or wait up to ``wait_for_nodes_s`` for a node to
        come into rotation (reporting to ``on_wait``)."""
        first = batch.group(batch.pending[0])
        with self._lock:
            if self._members.busy() or first.pinned:  # busy with calls of another batch, or
                # the pinned request's node changed since this round was planned (the next
                # round starts it or fails it)
                self._changed.wait(_POLL_S)
                return
            live = self._members.candidates()
            problem = scheduling.unservable(live, first, group_size=first.n,
                                            max_tokens=first.max_tokens)
            if problem:
                raise ValueError(problem)
            if live:  # a node came back since this round was planned
                return
        self._wait_for_rotation(first.index)

    def _wait_for_rotation(self, index: int) -> None:
        """Wait up to ``wait_for_nodes_s`` for a node in rotation (group ``index`` waits).

        Raises:
            RuntimeError: none came, naming every node and why it is out.
        """
        started = time.monotonic()
        deadline = started + self.wait_for_nodes_s
        last: NodeWait | None = None  # the wait's last report (None: not reported)
        gave_up = False
        try:
            while True:
                with self._lock:
                    if self._members.in_rotation() or self._closed.is_set():
                        break
                    now = time.monotonic()
                    left = deadline - now
                    describe = self._describe()
                    if left <= 0:
                        gave_up = True
                        waited = (f" after waiting {now - started:.1f}s (--outage-wait-s)"
                                  if self.wait_for_nodes_s else "")
                        raise RuntimeError(f"no rollout node can serve prompt {index} "
                                           f"(0 in rotation){waited}: {describe}")
                    if last is None:
                        log.warning("no rollout node in rotation; waiting up to %.0fs for one: "
                                    "%s", self.wait_for_nodes_s, describe)
                    last = NodeWait(now - started, left, describe)
                    self._report_wait(last)
                    self._changed.wait(min(left, WAIT_REPORT_S))
            if last is not None:
                log.info("a rollout node is in rotation again after %.1fs",
                         time.monotonic() - started)
        finally:
            if last is not None:
                self._report_wait(dataclasses.replace(
                    last, waited_s=time.monotonic() - started, left_s=0.0, gave_up=True)
                    if gave_up else None)

    def _call_generate(self, address: str, request: rollout_pb2.GenerateRequest,
                       call: Call | None = None):
        channel = self.channel(address, lease=True)
        try:
            started, t0 = self._clock(), time.monotonic()
            rpc = rollout_pb2_grpc.RolloutServiceStub(channel).Generate.future(
                request, timeout=self.request_timeout_s)
            if call is not None:
                call.attach(rpc)
            response = rpc.result()
            return response, started, time.monotonic() - t0
        finally:
            self._channels.release(channel)

    def _call_done(self, address: str, _future: futures.Future) -> None:
        """A Generate call ended (answered, failed or cancelled before it started): free its
        slot on the node."""
        self._apply(lambda: self._members.call_done(address))

    def _finish(self, future: futures.Future, address: str, index: int, prompt: list[int],
                group_size: int) -> list[RolloutSample] | GenerateFailure:
        """Turn a finished Generate into its samples, or record the node's failure."""
        try:
            response, started, seconds = future.result()
            samples = samples_of(response, prompt, group_size, address, seconds)
        except grpc.RpcError as e:
            failure = GenerateFailure.of_rpc(e.code(), e.details() or "")
        except (grpc.FutureCancelledError, futures.CancelledError):
            failure = GenerateFailure.of_rpc(grpc.StatusCode.CANCELLED, "cancelled")
        except ValueError as e:
            failure = GenerateFailure(FailureKind.MALFORMED_RESPONSE, str(e))
        except KeyError:
            failure = GenerateFailure(FailureKind.NODE_LEFT,
                                      "the node left the pool before the call")
        else:
            served = max(s.policy_version for s in samples)
            name = response.samples[0].adapter_name if response.samples else ""
            usable = self._apply(lambda: self._members.generate_succeeded(
                address, name, served, started, seconds))
            if usable:
                return samples
            log.warning("node %s sampled prompt %d with policy version %d, older than it was "
                        "pushed: group discarded, sampled again", address, index, served)
            return GenerateFailure(FailureKind.LOST_ADAPTER,
                                   f"sampled with policy version {served}")
        metrics.GENERATE_FAILURES.labels(address, failure.label).inc()
        if failure.kind is FailureKind.REJECTED:
            log.warning("node %s rejected prompt %d: %s", address, index, failure.detail)
        self._apply(lambda: self._members.generate_failed(address, failure, self._clock()))
        return failure
