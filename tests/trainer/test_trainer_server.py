"""TrainerService over real channels (GetRunStatus, WatchRun with history and live reports)
and the trainer's Prometheus endpoint."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from waiting import wait_for

from gridrl.common.rpc.channel import dial
from gridrl.trainer.report import metrics
from gridrl.trainer.report.records import StepRecord
from gridrl.trainer.report.status import RunStatus
from gridrl.trainer.server import serve_trainer
from gridrl.v1 import trainer_pb2, trainer_pb2_grpc


def step_report(step: int, **over) -> dict:
    report = {"step": step, "policy_version": step, "reward_mean": 0.1 * step, "reward_std": 0.2,
              "loss": -0.05 * step, "eval_score": None, "eval_policy_version": 0,
              "mismatch_kl": 0.001, "staleness_mean": 0.5, "dropped_samples": 1,
              "rollout_s": 2.0, "train_s": 1.0, "sync_s": 0.25, "nodes_synced": 3,
              "nodes_skipped": 1, "tokens_per_s": 850.0, "elapsed_s": 3.5 * step}
    report.update(over)
    return report


def step_proto(step: int, **over) -> trainer_pb2.StepReport:
    """:func:`step_report` as the ``gridrl.v1.StepReport`` a run appends (``time``: now)."""
    msg = trainer_pb2.StepReport(**{k: v for k, v in step_report(step, **over).items()
                                    if v is not None})
    msg.time.GetCurrentTime()
    return msg


@pytest.fixture
def served(creds):
    status = RunStatus()
    server = serve_trainer(status, "127.0.0.1:0", metrics_port=0,
                           security=creds.security(None, authorized=True))
    channel = dial(server.address, creds.tokens["read"])
    yield status, server, trainer_pb2_grpc.TrainerServiceStub(channel)
    channel.close()
    server.stop(0)


def test_get_run_status_through_the_lifecycle(served) -> None:
    status, _server, stub = served
    status.begin("run-1", "/runs/run-1", total_steps=10, model_id="tiny")
    got = stub.GetRunStatus(trainer_pb2.GetRunStatusRequest(), timeout=5)
    assert (got.run_name, got.run_dir, got.total_steps, got.model_id) == (
        "run-1", "/runs/run-1", 10, "tiny")
    assert got.state == trainer_pb2.RUN_STATE_STARTING and got.step == 0
    assert not got.HasField("baseline_eval")

    status.set_baseline(0.125)
    status.append(step_proto(1))
    status.append(step_proto(2, eval_score=0.5, eval_policy_version=2))
    got = stub.GetRunStatus(trainer_pb2.GetRunStatusRequest(), timeout=5)
    assert got.state == trainer_pb2.RUN_STATE_RUNNING
    assert (got.step, got.policy_version, got.baseline_eval) == (2, 2, 0.125)
    last = got.last_report
    assert last.HasField("eval_score") and last.eval_score == 0.5 and last.eval_policy_version == 2
    assert (last.nodes_synced, last.nodes_skipped, last.dropped_samples) == (3, 1, 1)
    assert last.sync_s == 0.25 and last.tokens_per_s == 850.0
    assert abs(last.time.ToNanoseconds() / 1e9 - time.time()) < 60

    status.fail("CUDA out of memory")
    got = stub.GetRunStatus(trainer_pb2.GetRunStatusRequest(), timeout=5)
    assert got.state == trainer_pb2.RUN_STATE_FAILED and got.error == "CUDA out of memory"


def test_a_run_stopped_on_request_is_stopped_not_failed(served) -> None:
    """SIGTERM's clean stop is its own state (systemd counts it a success), and a watcher's
    stream ends with it."""
    status, _server, stub = served
    status.begin("run-1", "/runs/run-1", total_steps=10, model_id="tiny")
    status.append(step_proto(1))
    status.stop("stopped after step 1 of 10 (SIGTERM); continue with: gridrl-trainer run "
                "--resume /runs/run-1")
    got = stub.GetRunStatus(trainer_pb2.GetRunStatusRequest(), timeout=5)
    assert got.state == trainer_pb2.RUN_STATE_STOPPED and "--resume /runs/run-1" in got.error
    watched = list(stub.WatchRun(trainer_pb2.WatchRunRequest(include_history=True), timeout=5))
    assert [r.report.step for r in watched] == [1]


def test_watch_run_history_then_live_until_finished(served) -> None:
    status, _server, stub = served
    status.begin("run-1", "/runs/run-1", total_steps=4, model_id="tiny")
    status.append(step_proto(1))
    status.append(step_proto(2))
    # A live-only watch starts at the report count it reads when its handler starts.
    subscribed = threading.Event()
    history_length = status.history_length

    def history_length_read() -> int:
        n = history_length()
        subscribed.set()
        return n

    status.history_length = history_length_read
    with_history = stub.WatchRun(trainer_pb2.WatchRunRequest(include_history=True), timeout=10)
    live_only = stub.WatchRun(trainer_pb2.WatchRunRequest(), timeout=10)
    got_history, got_live = [], []
    readers = [threading.Thread(target=lambda: got_history.extend(r.report.step for r in with_history)),
               threading.Thread(target=lambda: got_live.extend(r.report.step for r in live_only))]
    for t in readers:
        t.start()
    wait_for(lambda: got_history == [1, 2], 5, "the history")
    assert subscribed.wait(5), "the live-only WatchRun never started"
    status.append(step_proto(3))
    status.append(step_proto(4))
    status.finish()
    for t in readers:
        t.join(5)
        assert not t.is_alive(), "WatchRun did not end when the run finished"
    assert got_history == [1, 2, 3, 4]
    assert got_live == [3, 4]
    # A watch on a finished run replays the history and ends.
    steps = [r.report.step for r in stub.WatchRun(
        trainer_pb2.WatchRunRequest(include_history=True), timeout=5)]
    assert steps == [1, 2, 3, 4]


def test_server_stop_ends_watch_streams(served) -> None:
    status, server, stub = served
    status.begin("run-1", "/runs/run-1", total_steps=4, model_id="tiny")
    waiting = threading.Event()
    wait_reports = status.wait_reports

    def wait_reports_entered(*args, **kwargs):
        waiting.set()
        return wait_reports(*args, **kwargs)

    status.wait_reports = wait_reports_entered
    stream = stub.WatchRun(trainer_pb2.WatchRunRequest(), timeout=30)
    result = []

    def read() -> None:
        try:
            result.extend(r.report.step for r in stream)
            result.append("ended")
        except grpc.RpcError as e:
            result.append(e.code().name)

    reader = threading.Thread(target=read)
    reader.start()
    assert waiting.wait(10), "WatchRun never started waiting for reports"
    start = time.monotonic()
    server.stop(grace_s=5)
    reader.join(8)
    assert not reader.is_alive() and time.monotonic() - start < 2.5  # poll is 5 s
    assert result in (["ended"], ["CANCELLED"], ["UNAVAILABLE"])


def _samples(body: str) -> dict[str, float]:
    """``name{labels}`` -> value of the trainer's samples in a Prometheus text exposition (the
    value is after the line's last space: a label value may hold spaces)."""
    return {key: float(value) for key, value in (line.rsplit(" ", 1) for line in body.splitlines()
                                                 if line.startswith("gridrl_trainer_"))}


def test_metrics_endpoint_shows_step_metrics(served) -> None:
    _status, server, _stub = served
    before = metrics.DROPPED_SAMPLES._value.get()
    metrics.record_step(StepRecord.from_json(step_report(7, eval_score=0.75, dropped_samples=4)))
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=5).read().decode()
    values = _samples(body)
    assert values["gridrl_trainer_step"] == 7
    assert values["gridrl_trainer_policy_version"] == 7
    assert values["gridrl_trainer_reward_mean"] == pytest.approx(0.7)
    assert values["gridrl_trainer_eval_score"] == 0.75
    assert values["gridrl_trainer_loss"] == pytest.approx(-0.35)
    assert values["gridrl_trainer_mismatch_kl"] == 0.001
    assert values["gridrl_trainer_staleness_mean"] == 0.5
    assert values["gridrl_trainer_dropped_samples_total"] == before + 4
    assert values["gridrl_trainer_rollout_seconds"] == 2.0
    assert values["gridrl_trainer_train_seconds"] == 1.0
    assert values["gridrl_trainer_sync_seconds"] == 0.25
    assert values["gridrl_trainer_nodes_synced"] == 3
    assert values["gridrl_trainer_nodes_skipped"] == 1
    assert values["gridrl_trainer_tokens_per_second"] == 850.0
    assert 'gridrl_trainer_phase_seconds_total{phase="rollout"}' in values
    # the step's episodes, reward functions and the environment's eval figures
    counters = ('gridrl_trainer_episodes_total', 'gridrl_trainer_truncated_episodes_total',
                'gridrl_trainer_episode_tokens_total{source="model"}',
                'gridrl_trainer_episode_tokens_total{source="environment"}',
                'gridrl_trainer_dropped_episodes_total{reason="sampler"}',
                'gridrl_trainer_environment_events_total{event="tool_calls"}')
    before = {k: values.get(k, 0.0) for k in counters}
    metrics.record_step(StepRecord.from_json(step_report(
        8, eval_score=0.5, episodes=16, turns_mean=1.5, model_tokens=300, env_tokens=120,
        truncated_episodes=2, dropped_episodes={"sampler": 3}, env_counts={"tool_calls": 5},
        reward_funcs={"retry:attempt": 0.25, "none": None},
        eval_metrics={"first_attempt_success": 0.125})))
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=5).read().decode()
    values = _samples(body)
    assert {k: values[k] - before[k] for k in counters} == dict(zip(
        counters, (16, 2, 300, 120, 3, 5), strict=True))
    assert values["gridrl_trainer_episode_turns_mean"] == 1.5
    assert values['gridrl_trainer_reward_function_mean{function="retry:attempt"}'] == 0.25
    assert 'gridrl_trainer_reward_function_mean{function="none"}' not in values
    assert values['gridrl_trainer_eval_metric{metric="first_attempt_success"}'] == 0.125
    with pytest.raises(ValueError, match=r"^report\.loss"):
        metrics.record_step(StepRecord.from_json({**step_report(8), "loss": "nan-ish"}))


def test_metrics_endpoint_shows_importance_weights(served) -> None:
    """--is-correction: the step record's is_* keys go to Prometheus beside the report."""
    _status, server, _stub = served
    metrics.record_step(StepRecord.from_json({**step_report(8), "is_weight_mean": 1.25,
                                              "is_weight_max": 3.5, "is_limited_fraction": 0.125}))
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=5).read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines()
              if line.startswith("gridrl_trainer_is_")}
    assert values == {"gridrl_trainer_is_weight_mean": 1.25, "gridrl_trainer_is_weight_max": 3.5,
                      "gridrl_trainer_is_limited_fraction": 0.125}
