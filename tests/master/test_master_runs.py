"""The master's record of runs (gridrl.master.runs): bounded whatever a run's length, merged
points that keep what they stand for, resumed runs, ownership, eviction, the store, and the
checks on what trainers send. Pure: no server, a fake clock."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest

from gridrl.common.errors import Kind, StatusError
from gridrl.master import runs as runs_mod
from gridrl.master.run_model import EVAL_POINTS, STEP_POINTS, EvalPoint, Series, merge
from gridrl.master.run_wire import detail_json
from gridrl.master.runs import Runs, validate_report
from gridrl.master.store import SqliteStore
from gridrl.v1 import runs_pb2, trainer_pb2


def step(n: int, eval_every: int = 0, reward: float | None = None) -> runs_pb2.RunStep:
    s = runs_pb2.RunStep(report=trainer_pb2.StepReport(
        step=n, policy_version=n, reward_mean=n / 10 if reward is None else reward,
        reward_std=0.1, rollout_s=1.0, train_s=2.0, dropped_samples=1), eval_s=0.5,
        excluded_samples=2, lr=1e-3)
    if eval_every and n % eval_every == 0:
        s.report.eval_score = 0.5
        s.report.eval_policy_version = n
        s.eval_stderr = 0.04
    s.nodes.add(address="a:1", samples=8)
    return s


def report(run_id: str = "r1", steps=(), events=(), state=trainer_pb2.RUN_STATE_RUNNING,
           **info) -> runs_pb2.ReportRunRequest:
    return runs_pb2.ReportRunRequest(
        run=runs_pb2.RunInfo(run_id=run_id, run_name=info.pop("run_name", "run"), state=state,
                             total_steps=100, **info),
        steps=list(steps), events=list(events))


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_run_of_100k_steps_stays_within_its_bound_and_covers_every_step():
    runs = Runs(clock=Clock())
    total = 100_000
    for start in range(1, total + 1, 1000):  # reports of 1,000 steps, as a trainer sends
        runs.report(report(steps=[step(n, eval_every=10) for n in range(start, start + 1000)]),
                    None)
    detail = runs.detail("r1")
    steps, evals = detail.steps, detail.evals
    assert len(steps) <= STEP_POINTS and len(evals) <= EVAL_POINTS
    # every step is in exactly one point, in order, the newest ones one point each
    assert steps[0].first_step == 1 and steps[-1].step == total
    assert sum(p.steps for p in steps) == total
    for a, b in itertools.pairwise(steps):
        assert b.first_step == a.step + 1
    assert all(p.steps == 1 for p in steps[-STEP_POINTS // 4:])
    assert sum(p.steps for p in evals) == total // 10
    # merged points keep what they stand for: counts summed, means weighted
    assert sum(p.dropped for p in steps) == total
    assert sum(p.excluded for p in steps) == 2 * total
    mean_reward = sum(p.reward_mean * p.steps for p in steps) / total
    assert math.isclose(mean_reward, (total + 1) / 20, rel_tol=1e-9)
    assert sum(p.nodes["a:1"] for p in steps) == 8 * total
    assert all(p.rollout_s == 1.0 and p.lr == 1e-3 for p in steps)
    # the whole record is small: well under a megabyte of JSON
    assert len(json.dumps(detail_json(detail))) < 1_000_000


def test_merge_combines_two_points_as_their_mean():
    a = EvalPoint(step=1, first_step=1, steps=1, policy_version=1, score=0.2, stderr=0.03)
    b = EvalPoint(step=3, first_step=2, steps=2, policy_version=3, score=0.5, stderr=0.06)
    m = merge(a, b)
    assert (m.first_step, m.step, m.steps, m.policy_version) == (1, 3, 3, 3)
    assert math.isclose(m.score, (0.2 + 2 * 0.5) / 3, rel_tol=1e-12)
    # the standard error of the weighted mean of independent estimates
    assert math.isclose(m.stderr, math.sqrt(0.03 ** 2 + (2 * 0.06) ** 2) / 3, rel_tol=1e-12)
    # a field one side did not measure takes the other's value
    assert merge(replace(a, exact=None), replace(b, exact=0.1)).exact == 0.1


def test_series_generation_tells_readers_to_read_everything_again():
    series = Series(8)
    for n in range(1, 9):
        series.add(EvalPoint(step=n, first_step=n, steps=1, score=float(n)))
    assert series.generation == 0 and len(series.points) == 8
    series.add(EvalPoint(step=9, first_step=9, steps=1, score=9.0))
    assert series.generation == 1 and len(series.points) == 7
    assert [p.step for p in series.points] == [2, 4, 5, 6, 7, 8, 9]
    assert series.since(7) == series.points[-2:]


def test_incremental_reads_and_a_resumed_run():
    runs = Runs(clock=Clock())
    runs.report(report(steps=[step(n, eval_every=2) for n in range(1, 7)]), None)
    first = runs.detail("r1")
    assert first.full and [p.step for p in first.steps] == [1, 2, 3, 4, 5, 6]
    again = runs.detail("r1", since=6, generation=first.generation)
    assert not again.full and again.steps == [] and again.evals == []
    # resumed from the checkpoint of step 4: steps 5 and 6 run again
    last = runs.report(report(steps=[step(5, reward=0.9), step(6, reward=0.9)]), None)
    assert last == 6
    after = runs.detail("r1", since=6, generation=first.generation)
    assert after.full, "points were dropped: the reader must read them all again"
    assert [p.step for p in after.steps] == [1, 2, 3, 4, 5, 6]
    assert [p.reward_mean for p in after.steps[-2:]] == [0.9, 0.9]
    assert [p.step for p in after.evals] == [2, 4]  # step 6's eval was re-run without one


def test_the_exact_match_rate_and_the_scorer_travel_with_the_evals():
    """Beside each eval's score, the share of its replies with full marks (the dashboard shows
    both), merged like the score; the run says what scored its evals."""
    runs = Runs(clock=Clock())
    steps = [step(n, eval_every=2) for n in range(1, 5)]
    for s, exact in zip(steps[1::2], (0.25, 0.5), strict=True):
        s.eval_exact = exact
    runs.report(report(steps=steps, baseline_eval=0.1, baseline_eval_exact=0.0,
                       eval_scorer="reward upper (upper_reward.py)"), None)
    detail = runs.detail("r1")
    assert [(p.step, p.score, p.exact) for p in detail.evals] == [
        (2, 0.5, 0.25), (4, 0.5, 0.5)]
    assert detail.info.baseline_eval_exact == 0.0
    assert detail.info.eval_scorer == "reward upper (upper_reward.py)"
    assert merge(*detail.evals).exact == pytest.approx(0.375)
    no_exact = step(6, eval_every=2)  # a trainer that sends none: the point says so
    runs.report(report(steps=[no_exact]), None)
    assert runs.detail("r1").evals[-1].exact is None


def test_another_credential_may_not_report_a_run_it_did_not_start():
    runs = Runs(clock=Clock())
    runs.report(report(steps=[step(1)]), "trainer-1")
    with pytest.raises(StatusError) as e:
        runs.report(report(steps=[step(2)]), "trainer-2")
    assert e.value.kind is Kind.PERMISSION_DENIED
    assert "run.run_id" in e.value.message and "trainer-1" in e.value.message
    assert runs.report(report(steps=[step(2)]), "trainer-1") == 2
    assert runs.report(report("r2", steps=[step(1)]), "trainer-2") == 1
    assert {r.info.run_id for r in runs.summaries()} == {"r1", "r2"}


def test_the_oldest_finished_run_goes_first_past_the_limit(monkeypatch):
    monkeypatch.setattr(runs_mod, "MAX_RUNS", 3)
    clock = Clock()
    runs = Runs(clock=clock)
    for i, state in enumerate((trainer_pb2.RUN_STATE_RUNNING, trainer_pb2.RUN_STATE_FINISHED,
                               trainer_pb2.RUN_STATE_FINISHED)):
        clock.t += 1
        runs.report(report(f"r{i}", state=state), None)
    clock.t += 1
    runs.report(report("r3"), None)
    # r0 is the oldest but still running: the oldest finished one (r1) went
    assert {r.info.run_id for r in runs.summaries()} == {"r0", "r2", "r3"}


def test_runs_persist_in_the_store(tmp_path):
    store = SqliteStore(tmp_path / "m.sqlite")
    runs = Runs(store=store, clock=Clock())
    runs.report(report(steps=[step(n, eval_every=2) for n in range(1, 5)],
                       events=[runs_pb2.RunEvent(kind=runs_pb2.RUN_EVENT_KIND_CHECKPOINT,
                                                 step=4, message="step-000004 written")],
                       state=trainer_pb2.RUN_STATE_FINISHED), "trainer-1")
    runs.flush()
    store.close()
    restarted = Runs(store=SqliteStore(tmp_path / "m.sqlite"), clock=Clock())
    detail = restarted.detail("r1")
    assert [p.step for p in detail.steps] == [1, 2, 3, 4]
    assert [p.step for p in detail.evals] == [2, 4]
    assert detail.info.state == trainer_pb2.RUN_STATE_FINISHED
    assert [e.message for e in detail.events] == ["step-000004 written"]
    with pytest.raises(StatusError):  # the owner is remembered too
        restarted.report(report(steps=[step(5)]), "trainer-2")


def test_fleet_events_join_the_runs_that_were_running():
    clock = Clock()
    runs = Runs(clock=clock)
    runs.fleet_event(runs_pb2.RUN_EVENT_KIND_NODE_JOINED, "old:1", "long before")
    clock.t += 3600
    info = runs_pb2.RunInfo()
    info.started_at.FromSeconds(int(clock.t))
    runs.fleet_event(runs_pb2.RUN_EVENT_KIND_NODE_JOINED, "a:1", "rollout a:1 joined")
    runs.report(runs_pb2.ReportRunRequest(run=runs_pb2.RunInfo(
        run_id="r1", started_at=info.started_at)), None)
    clock.t += 5
    runs.fleet_event(runs_pb2.RUN_EVENT_KIND_NODE_EXPIRED, "a:1", "rollout a:1 expired")
    events = runs.detail("r1").events
    assert [(e.kind, e.ok) for e in events] == [
        (runs_pb2.RUN_EVENT_KIND_NODE_JOINED, True), (runs_pb2.RUN_EVENT_KIND_NODE_EXPIRED, False)]


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r.ClearField("run"), "run"),
    (lambda r: setattr(r.run, "run_id", ""), "run.run_id"),
    (lambda r: setattr(r.run, "run_id", "a/b"), "run.run_id"),
    (lambda r: setattr(r.run, "run_name", "x" * 257), "run.run_name"),
    (lambda r: setattr(r.run, "eval_scorer", "x" * 257), "run.eval_scorer"),
    (lambda r: setattr(r.run, "error", "x" * 4097), "run.error"),
    (lambda r: setattr(r.run, "state", 99), "run.state"),
    (lambda r: r.steps.extend([step(3), step(2)]), "steps[1].report.step"),
    (lambda r: r.steps.extend([step(0)]), "steps[0].report.step"),
    (lambda r: r.steps.extend(step(n) for n in range(1, 1002)), "steps"),
    (lambda r: r.events.add(kind=0), "events[0].kind"),
    (lambda r: r.events.add(kind=runs_pb2.RUN_EVENT_KIND_NODE_JOINED), "events[0].kind"),
    (lambda r: r.events.add(kind=runs_pb2.RUN_EVENT_KIND_PUSH, message="x" * 4097),
     "events[0].message"),
    (lambda r: r.nodes.add(address="a:1", flagged="x" * 4097), "nodes[0].flagged"),
])
def test_bad_reports_are_refused_naming_the_field(mutate, field):
    request = report()
    mutate(request)
    with pytest.raises(StatusError) as e:
        validate_report(request)
    assert e.value.kind is Kind.INVALID_ARGUMENT
    assert e.value.message.startswith(f"{field}:"), e.value.message


def test_a_stored_row_of_another_build_still_reads(tmp_path):
    """A row without the fields a later build added (a step point without its reward range)
    and with one this build does not know reads back: the missing ones unmeasured, the
    unknown one ignored; enum words become values again."""
    row = {"run_id": "r1", "owner": None, "reported_at": 5.0,
           "info": {"run_id": "r1", "run_name": "old", "state": "finished", "state_value": 3,
                    "total_steps": 2, "from_the_future": 1},
           "steps": [{"step": 1, "first_step": 1, "steps": 1, "policy_version": 1,
                      "reward_mean": 0.5, "nodes": {"a:1": 8}, "from_the_future": 1}],
           "evals": [], "events": [{"kind": "checkpoint", "time": 4.0, "step": 1,
                                     "node": "", "duration_s": 0.5, "ok": True,
                                     "message": "written"}],
           "nodes": {}, "examples": {}}
    store = SqliteStore(tmp_path / "m.sqlite")
    store.put_runs([("r1", json.dumps(row))])
    detail = Runs(store=store, clock=Clock()).detail("r1")
    assert detail.info.state == trainer_pb2.RUN_STATE_FINISHED and detail.info.run_name == "old"
    (point,) = detail.steps
    assert (point.reward_mean, point.reward_min, point.nodes) == (0.5, None, {"a:1": 8})
    assert [(e.kind, e.message) for e in detail.events] == [
        (runs_pb2.RUN_EVENT_KIND_CHECKPOINT, "written")]
    assert detail_json(detail)["info"]["state"] == "finished"
