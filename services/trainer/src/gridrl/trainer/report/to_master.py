"""The run, reported to the master's dashboard (``RunReportService.ReportRun``).

    reporter = MasterReporter(master, security, run=lambda: RunInfo(...), nodes=...)
    reporter.on_step(record)          # each StepRecord, from the loop (never blocks)
    reporter.on_event(event)          # a run event (a checkpoint becomes an event line)
    reporter.line(EventLine(...))     # any other event line
    reporter.close()                  # sends what is left (at most a few seconds), stops

A subscriber of the run's reporter (:class:`gridrl.trainer.report.reporter.RunSubscriber`;
:mod:`gridrl.trainer.run.dashboard` wires it): ``on_step`` and ``on_event`` only queue (bounded: the
oldest step or event is dropped past :data:`MAX_PENDING`, counted and said once), and the
``master-report`` thread sends them with the run's info and its view of the nodes at most every
:data:`SEND_EVERY_S` (sooner when something is queued), with the trainer's own credential. A
master that is down, slow or refusing never slows or stops the run: sends time out after
:data:`TIMEOUT_S`, failures back off up to 10 s and are logged once per outage, and a master
that does not know the RPC (an older one) or refuses the credential is left alone for the rest
of the run.

From each step record it derives the event lines the dashboard shows: the push (duration,
how many nodes took it, why others did not), the eval (score ± standard error), nodes newly
flagged (why) and nodes no longer flagged (readmitted). The node view (``nodes``) is the
trainer's pool as it is at each send (in rotation or why not, flagged, benched, the served
policy version) with the last step's per-node staleness, mismatch KL and tokens/s.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gridrl.common.rpc import channel as rpc_channel
from gridrl.common.security.policy import Security
from gridrl.trainer.report.events import Checkpointed, LearningWarning, NoUpdate, RunEvent
from gridrl.trainer.report.records import StepRecord
from gridrl.trainer.report.status import step_report
from gridrl.v1 import runs_pb2, runs_pb2_grpc, trainer_pb2
from gridrl.v1.enums import enum_value, enum_word

log = logging.getLogger(__name__)

MAX_PENDING = 1000  # steps, and events, queued while the master does not answer
SEND_EVERY_S = 2.0  # a report at least this often (the page shows how fresh it is)
LINGER_S = 0.2  # after something is queued, wait this long for more before sending
TIMEOUT_S = 5.0
MAX_BACKOFF_S = 10.0
# Codes after which the master will not take reports from this run (an older master, a
# credential without the trainer scope, a run id another credential holds).
_GIVE_UP = frozenset({grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED,
                      grpc.StatusCode.UNAUTHENTICATED})
_BAD_STATES = frozenset({trainer_pb2.RUN_STATE_FAILED, trainer_pb2.RUN_STATE_STOPPED})


@dataclass(frozen=True)
class EventLine:
    """One event line of the run on the dashboard.

    Attributes:
        kind: ``node_flagged``, ``node_readmitted``, ``push``, ``checkpoint``, ``eval`` or
            ``state`` (``gridrl.v1.RunEventKind`` without its prefix, lower case).
        message: the event in words.
        step: the step it belongs to (0: before step 1).
        node: the node concerned, host:port ("" for none).
        duration_s: seconds it took (0: not timed).
        ok: it went as it should.
        time: POSIX seconds when it happened.
    """

    kind: str
    message: str
    step: int = 0
    node: str = ""
    duration_s: float = 0.0
    ok: bool = True
    time: float = field(default_factory=time.time)

    def to_proto(self) -> runs_pb2.RunEvent:
        event = runs_pb2.RunEvent(kind=enum_value(runs_pb2.RunEventKind, self.kind),
                                  step=self.step, node=self.node, duration_s=self.duration_s,
                                  ok=self.ok, message=self.message[:4096])
        event.time.FromNanoseconds(int(self.time * 1e9))
        return event


def run_id_for(run_dir: str | Path) -> str:
    """The run's id on the dashboard: the same for every start of one run directory on one
    machine (``--resume`` continues it), distinct for two runs: ``r`` + 16 hex digits of the
    sha256 of the host name and the directory's absolute path."""
    key = f"{socket.gethostname()}:{Path(run_dir).resolve()}"
    return "r" + hashlib.sha256(key.encode()).hexdigest()[:16]


#: the bounds of ``runs.proto``'s EvalExample (what the master accepts)
MAX_EXAMPLES, MAX_MESSAGES, MAX_TEXT, MAX_ROLE = 8, 64, 16_384, 256


def _clip(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters (a cut one ends with ``…``)."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def eval_example_message(example: dict[str, Any]) -> runs_pb2.EvalExample:
    """An eval example (:func:`gridrl.trainer.evaluation.eval_example`) as an ``EvalExample``,
    within its bounds: strings cut to 16,384 characters, the transcript to its first 63
    messages and its last (the reply the score is of)."""
    transcript = list(example.get("transcript") or [])
    if len(transcript) > MAX_MESSAGES:
        transcript = transcript[:MAX_MESSAGES - 1] + transcript[-1:]
    return runs_pb2.EvalExample(
        prompt=_clip(str(example.get("prompt", "")), MAX_TEXT),
        transcript=[runs_pb2.TranscriptMessage(role=_clip(str(m.get("role", "")), MAX_ROLE),
                                               content=_clip(str(m.get("content", "")),
                                                             MAX_TEXT))
                    for m in transcript],
        score=float(example.get("score") or 0.0), turns=int(example.get("turns") or 0),
        dropped=_clip(str(example.get("dropped") or ""), MAX_ROLE),
        error=_clip(str(example.get("error") or ""), MAX_TEXT))


def step_message(record: StepRecord) -> runs_pb2.RunStep:
    """A step record as a ``RunStep`` (the StepReport and what the dashboard adds)."""
    step = runs_pb2.RunStep(report=step_report(record),
                            eval_s=record.eval_s or 0.0,
                            excluded_samples=sum(record.excluded_samples.values()))
    if record.eval_stderr is not None:
        step.eval_stderr = record.eval_stderr
    if record.eval_score is not None and record.eval_exact is not None:
        step.eval_exact = record.eval_exact
    if record.lr is not None:
        step.lr = record.lr
    if record.reward_min is not None and record.reward_max is not None:
        step.reward_min, step.reward_max = record.reward_min, record.reward_max
    if record.is_weight_mean is not None:
        step.importance_weights.mean = record.is_weight_mean
        step.importance_weights.max = record.is_weight_max or 0.0
        step.importance_weights.limited_fraction = record.is_limited_fraction or 0.0
    if record.eval_score is not None:
        step.eval_examples.extend(eval_example_message(e)
                                  for e in (record.eval_examples or [])[:MAX_EXAMPLES])
    for address, node in sorted(record.nodes.items()):
        share = step.nodes.add(address=address, samples=node.samples, dropped=node.dropped,
                               tokens_per_s=node.tokens_per_s or 0.0)
        if node.staleness_mean is not None:
            share.staleness_mean = node.staleness_mean
        if node.fresh_mismatch_kl is not None:
            share.mismatch_kl = node.fresh_mismatch_kl
    return step


def step_events(record: StepRecord, flagged_before: dict[str, str]) -> list[EventLine]:
    """The event lines a step record implies: its push, its eval, nodes newly flagged and
    nodes no longer flagged (``flagged_before``: the previous record's flagged nodes)."""
    out = []
    s = record.step
    if record.synced_nodes is not None:
        n_all = record.nodes_synced + record.nodes_skipped
        problems = [f"{a}: {why}" for a, why in sorted((record.skipped_nodes or {}).items())]
        if record.lagging_nodes:
            problems.append("lagging: " + ", ".join(record.lagging_nodes))
        out.append(EventLine("push", f"policy version {record.policy_version} to "
                            f"{record.nodes_synced}/{n_all} node(s)"
                            + (" — " + "; ".join(problems) if problems else ""),
                            step=s, duration_s=record.sync_s, ok=not problems))
    if record.eval_score is not None:
        out.append(EventLine("eval", f"{record.eval_score:.3f} ± {record.eval_stderr or 0:.3f} "
                            f"at policy version {record.eval_policy_version}"
                            + (f" ({record.eval_n} prompts)" if record.eval_n else ""),
                            step=s, duration_s=record.eval_s or 0.0))
    for node, why in sorted(record.flagged_nodes.items()):
        if node not in flagged_before:
            out.append(EventLine("node_flagged", why, step=s, node=node, ok=False))
    for node in sorted(set(flagged_before) - set(record.flagged_nodes)):
        out.append(EventLine("node_readmitted", "passed a fresh mismatch check on the current "
                            "policy version; takes groups again", step=s, node=node))
    return out


class MasterReporter:
    """Sends the run's steps, events and node view to the master (see the module docstring).

    Args:
        master: host:port of the master.
        security: the trainer's TLS files and token (a ``trainer``-scope credential).
        run: the run's info now (state, name, totals), as a ``gridrl.v1.RunInfo``; called on
            the reporter's thread before each send.
        nodes: the trainer's view of its rollout nodes now, as ``gridrl.v1.RunNode`` s, given
            each node's share of the last step it drew for (None: no pool, e.g. --rollout
            local); called before each send.
        dial: ``dial(master, security) -> grpc.Channel`` (tests may pass their own).
    """

    def __init__(self, master: str, security: Security | None,
                 run: Callable[[], runs_pb2.RunInfo],
                 nodes: Callable[[dict[str, NodeStats]], list[runs_pb2.RunNode]] | None = None,
                 dial: Callable[..., grpc.Channel] | None = None) -> None:
        if dial is None:
            dial = rpc_channel.dial
        self._channel = dial(master, security)
        self._stub = runs_pb2_grpc.RunReportServiceStub(self._channel)
        self._master = master
        self._run = run
        self._nodes = nodes
        self._cond = threading.Condition()
        self._steps: deque[runs_pb2.RunStep] = deque()
        self._events: deque[runs_pb2.RunEvent] = deque()
        self._node_stats: dict[str, NodeStats] = {}
        self._flagged: dict[str, str] = {}
        self._readmitted: dict[str, str] = {}  # node -> when it was readmitted
        self._state = -1  # the run state last sent (a change is an event line)
        self._dropped = 0
        self._closing = False
        self._given_up = False
        self._last_nodes: list[runs_pb2.RunNode] | None = None
        self.sent_steps = 0  # steps the master acknowledged (tests, the log)
        self._thread = threading.Thread(target=self._loop, name="master-report", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ subscriber

    def on_step(self, record: StepRecord) -> None:
        """Queue a finished step and the events it implies. Never blocks, never raises."""
        try:
            step = step_message(record)
            events = step_events(record, self._flagged)
        except Exception:  # a report must never stop training
            log.exception("dashboard report of step %d failed", record.step)
            return
        self._flagged = dict(record.flagged_nodes)
        with self._cond:
            for event in events:
                if event.kind == "node_readmitted":
                    self._readmitted[event.node] = f"at step {event.step}: {event.message}"
            for address, node in record.nodes.items():
                self._node_stats[address] = NodeStats(record.step, node.staleness_mean,
                                                      node.fresh_mismatch_kl,
                                                      node.tokens_per_s)
            self._queue(self._steps, [step])
            self._queue(self._events, [e.to_proto() for e in events])

    def on_event(self, event: RunEvent) -> None:
        """Queue the event line a run event implies (a checkpoint written; a warning that
        nothing can be learned; a step whose every episode was dropped). Never blocks, never
        raises."""
        if isinstance(event, Checkpointed):
            self.line(EventLine("checkpoint", f"{event.path.name} written", step=event.step,
                                duration_s=event.seconds))
        elif isinstance(event, LearningWarning):
            self.line(EventLine("state", f"nothing can be learned? {event.message}",
                                step=event.step, ok=False))
        elif isinstance(event, NoUpdate) and event.why:
            self.line(EventLine("state", f"{event.why}; no update", step=event.step, ok=False))

    def line(self, event: EventLine) -> None:
        """Queue an event line. Never blocks, never raises."""
        try:
            message = event.to_proto()
        except Exception:
            log.exception("dashboard event %r failed", event)
            return
        with self._cond:
            self._queue(self._events, [message])

    def close(self, timeout_s: float = 3.0) -> None:
        """Send what is queued and the run's final state (within ``timeout_s``), then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._channel.close()

    def _queue(self, queue: deque, items: list) -> None:
        """Append under ``_cond``, dropping the oldest past MAX_PENDING."""
        queue.extend(items)
        while len(queue) > MAX_PENDING:
            queue.popleft()
            self._dropped += 1
            if self._dropped == 1:
                log.warning("the master has not taken the dashboard reports for a while: "
                            "dropping the oldest (the run goes on)")
        self._cond.notify_all()

    def _closed(self) -> bool:
        return self._closing

    def _queued(self) -> bool:
        return self._closing or bool(self._steps or self._events)

    @property
    def node_stats(self) -> dict[str, NodeStats]:
        with self._cond:
            return dict(self._node_stats)

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        backoff = 0.0
        failing = False
        while True:
            with self._cond:
                if not self._closing:
                    # while failing, wait out the backoff; else send as soon as a step comes
                    ready = self._closed if backoff else self._queued
                    self._cond.wait_for(ready, backoff or SEND_EVERY_S)
                closing = self._closing
            if not closing and not backoff:
                time.sleep(LINGER_S)  # let a step's events arrive with it
            if self._given_up:
                return
            try:
                self._send(final=closing)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code in _GIVE_UP:
                    log.warning("the master at %s does not take dashboard reports (%s: %s); "
                                "the run goes on without them", self._master,
                                code.name, e.details() if hasattr(e, "details") else e)
                    self._given_up = True
                    return
                if not failing:
                    log.info("dashboard report to the master at %s failed (%s); retrying, the "
                             "run goes on", self._master, code.name if code else e)
                failing = True
                backoff = min(MAX_BACKOFF_S, max(1.0, backoff * 2))
                if closing:
                    return
                continue
            except Exception:
                log.exception("dashboard report failed")
                backoff = MAX_BACKOFF_S
                if closing:
                    return
                continue
            if failing:
                log.info("dashboard reports reach the master at %s again", self._master)
            failing, backoff = False, 0.0
            if closing:
                return

    def _send(self, final: bool) -> None:
        """One ReportRun with up to MAX_PENDING steps and events; removes what was sent."""
        run = self._run()
        if run.state != self._state:
            state = enum_word(trainer_pb2.RunState, run.state, None)
            self.line(EventLine("state", state + (f": {run.error}" if run.error else ""),
                                ok=run.state not in _BAD_STATES))
        with self._cond:
            steps = list(self._steps)[:MAX_PENDING]
            events = list(self._events)[:MAX_PENDING]
            readmitted = dict(self._readmitted)
        request = runs_pb2.ReportRunRequest(run=run, steps=steps, events=events)
        nodes = self._nodes(self.node_stats) if self._nodes is not None else []
        for node in nodes:
            node.readmitted = readmitted.get(node.address, "")[:4096]
        if nodes == self._last_nodes:
            request.nodes_unchanged = True
        else:
            request.nodes.extend(nodes[:MAX_PENDING])
        self._stub.ReportRun(request, timeout=min(TIMEOUT_S, 2.0) if final else TIMEOUT_S)
        self._last_nodes = nodes
        self._state = run.state
        self.sent_steps += len(steps)
        with self._cond:
            for _ in steps:
                self._steps.popleft()
            for _ in events:
                self._events.popleft()


@dataclass(frozen=True)
class NodeStats:
    """A node's share of the last step it drew groups for (the node view's numbers)."""

    step: int
    staleness_mean: float | None
    mismatch_kl: float | None
    tokens_per_s: float | None
