"""The run's live state, shared by the run (writer, through :class:`StatusSubscriber`) and
TrainerService (readers).

    status = RunStatus()
    status.begin("run-1", "/runs/run-1", total_steps=200, model_id="smollm2-135m-instruct")
    status.set_baseline(0.12)
    status.append(step_report(record))   # each step (StatusSubscriber.on_step)
    status.finish()            # or status.fail("CUDA out of memory")

Reports are ``gridrl.v1.StepReport`` messages: :func:`step_report` converts a step's
:class:`~gridrl.trainer.report.records.StepRecord` (the one conversion to this wire message).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gridrl.trainer.fleet.pool import NodeWait
from gridrl.trainer.report.events import (
    BaselineEvaluated,
    EvalProgressed,
    History,
    NodeWaitChanged,
    RunEvent,
    RunFailed,
    RunFinished,
    RunStarted,
    RunStopped,
)
from gridrl.trainer.report.records import StepRecord
from gridrl.v1 import trainer_pb2


def step_report(record: StepRecord) -> trainer_pb2.StepReport:
    """The ``gridrl.v1.StepReport`` of a step's record (same field names; ``eval_score`` unset
    without an eval; ``time``: now)."""
    msg = trainer_pb2.StepReport(
        step=record.step, policy_version=record.policy_version,
        reward_mean=record.reward_mean, reward_std=record.reward_std, loss=record.loss,
        eval_policy_version=record.eval_policy_version, mismatch_kl=record.mismatch_kl,
        staleness_mean=record.staleness_mean, dropped_samples=record.dropped_samples,
        rollout_s=record.rollout_s, train_s=record.train_s, sync_s=record.sync_s,
        nodes_synced=record.nodes_synced, nodes_skipped=record.nodes_skipped,
        tokens_per_s=record.tokens_per_s, elapsed_s=record.elapsed_s)
    if record.eval_score is not None:
        msg.eval_score = record.eval_score
        if record.eval_exact is not None:
            msg.eval_exact = record.eval_exact
    msg.time.FromNanoseconds(time.time_ns())
    return msg


class RunStatus:
    """Thread-safe state of one training run: lifecycle, baseline, and every step report.

    Readers (:meth:`snapshot`, :meth:`wait_reports`) never block the writer for long.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._run_name = ""
        self._run_dir = ""
        self._model_id = ""
        self._total_steps = 0
        self._state = trainer_pb2.RUN_STATE_STARTING
        self._baseline: float | None = None
        self._error = ""
        self._history: list[trainer_pb2.StepReport] = []
        self._node_wait: trainer_pb2.NodeWait | None = None
        self._eval_progress: trainer_pb2.EvalProgress | None = None
        self._baseline_exact: float | None = None
        self._eval_scorer = ""

    def begin(self, run_name: str, run_dir: str, total_steps: int, model_id: str) -> None:
        """Start a run (state STARTING: loading the model, measuring the baseline)."""
        with self._cond:
            self._run_name, self._run_dir, self._model_id = run_name, run_dir, model_id
            self._total_steps = int(total_steps)
            self._state = trainer_pb2.RUN_STATE_STARTING
            self._baseline = None
            self._baseline_exact = None
            self._eval_progress = None
            self._error = ""
            self._history = []
            self._cond.notify_all()

    def set_baseline(self, score: float, exact: float | None = None, scorer: str = "") -> None:
        """Record the base model's eval score (in [0, 1]) measured before training, the
        fraction of its completions with full marks and what scored it (when known)."""
        with self._cond:
            self._baseline = float(score)
            if exact is not None:
                self._baseline_exact = float(exact)
            if scorer:
                self._eval_scorer = scorer[:256]

    def set_eval_progress(self, step: int, done: int = 0, total: int = 0,
                          elapsed_s: float = 0.0, expected_s: float | None = None,
                          running: bool = True) -> None:
        """A held-out eval at ``step`` (0: the baseline) has decoded ``done`` of ``total``
        prompts in ``elapsed_s`` seconds, the whole expected to take ``expected_s``;
        ``running`` False: no eval runs now."""
        with self._cond:
            if not running:
                self._eval_progress = None
                return
            self._eval_progress = trainer_pb2.EvalProgress(step=step, done=done, total=total,
                                                           elapsed_s=elapsed_s)
            if expected_s is not None:
                self._eval_progress.expected_s = expected_s

    def append(self, msg: trainer_pb2.StepReport) -> None:
        """Append one step's report, set state RUNNING and wake WatchRun subscribers. Does not
        touch Prometheus (see :class:`~gridrl.trainer.report.metrics.PrometheusSubscriber`)."""
        with self._cond:
            self._history.append(msg)
            if self._state == trainer_pb2.RUN_STATE_STARTING:
                self._state = trainer_pb2.RUN_STATE_RUNNING
            self._cond.notify_all()

    def set_node_wait(self, waiting_for: str | None, waited_s: float = 0.0,
                      left_s: float = 0.0) -> None:
        """The run waits for a rollout node (``waiting_for``: every node and why it is out),
        ``waited_s`` so far, ``left_s`` before it fails; None: it no longer waits."""
        with self._cond:
            self._node_wait = None if waiting_for is None else trainer_pb2.NodeWait(
                waiting_for=waiting_for, waited_s=waited_s, left_s=left_s)

    def finish(self) -> None:
        """Mark the run FINISHED (all steps done); ends WatchRun streams."""
        with self._cond:
            self._state = trainer_pb2.RUN_STATE_FINISHED
            self._cond.notify_all()

    def fail(self, error: str) -> None:
        """Mark the run FAILED with ``error``; ends WatchRun streams."""
        self._end(trainer_pb2.RUN_STATE_FAILED, error)

    def stop(self, message: str) -> None:
        """Mark the run STOPPED on request before its last step (``message``: where it stopped
        and how to resume, shown in ``error``); ends WatchRun streams."""
        self._end(trainer_pb2.RUN_STATE_STOPPED, message)

    def _end(self, state: int, error: str) -> None:
        with self._cond:
            self._state = state
            self._error = error
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        """True once the run finished, failed or was stopped."""
        with self._cond:
            return self._done()

    def snapshot(self) -> trainer_pb2.GetRunStatusResponse:
        """The run as ``GetRunStatusResponse``."""
        with self._cond:
            msg = trainer_pb2.GetRunStatusResponse(
                run_name=self._run_name, run_dir=self._run_dir, state=self._state,
                total_steps=self._total_steps, model_id=self._model_id, error=self._error)
            if self._history:
                last = self._history[-1]
                msg.step = last.step
                msg.policy_version = last.policy_version
                msg.last_report.CopyFrom(last)
            if self._baseline is not None:
                msg.baseline_eval = self._baseline
            if self._baseline_exact is not None:
                msg.baseline_eval_exact = self._baseline_exact
            msg.eval_scorer = self._eval_scorer
            if self._eval_progress is not None:
                msg.eval_progress.CopyFrom(self._eval_progress)
            if self._node_wait is not None:
                msg.node_wait.CopyFrom(self._node_wait)
            return msg

    def history_length(self) -> int:
        """Number of reports so far."""
        with self._cond:
            return len(self._history)

    def wait_reports(self, start: int, timeout_s: float,
                     cancelled: Callable[[], bool] = lambda: False,
                     ) -> tuple[list[trainer_pb2.StepReport], bool]:
        """Reports from index ``start`` on, waiting up to ``timeout_s`` seconds for one, or
        until ``cancelled()`` is true after a :meth:`wake`.

        Returns:
            (reports, done): the new reports (possibly none after the timeout) and whether the
            run has finished, failed or stopped (no report will follow those returned).
        """
        with self._cond:
            self._cond.wait_for(
                lambda: len(self._history) > start or self._done() or cancelled(), timeout_s)
            return list(self._history[start:]), self._done()

    def wake(self) -> None:
        """Wake every :meth:`wait_reports` caller (a server stopping, a client leaving)."""
        with self._cond:
            self._cond.notify_all()

    def _done(self) -> bool:
        return self._state in (trainer_pb2.RUN_STATE_FINISHED, trainer_pb2.RUN_STATE_FAILED,
                               trainer_pb2.RUN_STATE_STOPPED)


class StatusSubscriber:
    """The run's reporter subscriber that keeps a :class:`RunStatus` (``GetRunStatus``,
    ``WatchRun``) current: the lifecycle events, each step's report, a resumed run's earlier
    steps (not published to Prometheus again), the baseline, an eval in progress and the wait for
    nodes."""

    def __init__(self, status: RunStatus) -> None:
        self.status = status

    def on_step(self, record: StepRecord) -> None:
        self.status.append(step_report(record))

    def on_event(self, event: RunEvent) -> None:
        match event:
            case RunStarted():
                self.status.begin(event.run_name, event.run_dir, event.total_steps, event.model)
            case History():
                for record in event.records:
                    self.status.append(step_report(record))
                if event.baseline_score is not None:
                    b = event.baseline
                    self.status.set_baseline(event.baseline_score,
                                             b.eval_exact if b is not None else None,
                                             b.eval_scorer if b is not None else "")
            case BaselineEvaluated(record=b):
                self.status.set_baseline(b.eval_score, b.eval_exact, b.eval_scorer)
            case EvalProgressed(progress=None):
                self.status.set_eval_progress(event.step, running=False)
            case EvalProgressed(progress=p) if p is not None:
                self.status.set_eval_progress(event.step, p.done, p.total, p.elapsed_s,
                                              p.expected_s)
            case NodeWaitChanged(wait=None) | NodeWaitChanged(wait=NodeWait(gave_up=True)):
                self.status.set_node_wait(None)
            case NodeWaitChanged(wait=wait) if wait is not None:
                self.status.set_node_wait(wait.waiting_for, wait.waited_s, wait.left_s)
            case RunStopped():
                self.status.stop(event.message)
            case RunFinished():
                self.status.finish()
            case RunFailed():
                self.status.fail(event.error)

    def close(self) -> None:
        pass
