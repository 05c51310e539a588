"""The master's run model (:mod:`gridrl.master.run_model`) on its wires, in one place: from the
``ReportRun`` protos a trainer sends (``*_from_proto``, :func:`step_point`, :func:`eval_point`),
to the JSON the dashboard serves (``*_json``: ``/api/state``, ``/api/runs/<id>``, the page's
first render), and to and from the JSON rows of the store (:func:`run_json`,
:func:`run_from_json`).

JSON shapes (what ``static/app.js`` reads; the store holds the same): a point is a flat object
of its fields (``nodes``: address -> samples); an event's ``kind`` and the info's ``state`` are
words (:func:`gridrl.v1.enums.enum_word`: ``"node_joined"``, ``"running"``) beside
``state_value``; floats JSON cannot carry (NaN, infinities) are null.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gridrl.master.run_model import (
    EVAL_POINTS,
    STEP_POINTS,
    EvalExample,
    EvalExamples,
    EvalPoint,
    Message,
    NodeView,
    Run,
    RunDetail,
    RunEvent,
    RunInfo,
    RunSummary,
    StepPoint,
)
from gridrl.v1 import runs_pb2, trainer_pb2
from gridrl.v1.enums import enum_value, enum_word


def _num(x: float | None) -> float | None:
    """A float JSON can carry (NaN and infinities become None)."""
    return x if x is not None and math.isfinite(x) else None


def _seconds(message: Any, name: str) -> float | None:
    """A Timestamp field as wall-clock seconds; None when not set."""
    return getattr(message, name).ToNanoseconds() / 1e9 if message.HasField(name) else None


def _optional(message: Any, name: str) -> float | None:
    """An optional float field; None when not set (or not a finite number)."""
    return _num(getattr(message, name)) if message.HasField(name) else None


def _known(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``d`` that are fields of ``cls`` (a row of an older or newer master)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


# ------------------------------------------------------------------- from the protos


def info_from_proto(run: runs_pb2.RunInfo) -> RunInfo:
    """The run's info as the trainer reported it."""
    return RunInfo(run_id=run.run_id, run_name=run.run_name,
                   trainer_address=run.trainer_address, state=run.state, error=run.error,
                   total_steps=run.total_steps, model_id=run.model_id, task=run.task,
                   baseline_eval=_optional(run, "baseline_eval"),
                   baseline_eval_stderr=_optional(run, "baseline_eval_stderr"),
                   baseline_eval_exact=_optional(run, "baseline_eval_exact"),
                   eval_scorer=run.eval_scorer, importance_weighting=run.importance_weighting,
                   started_at=_seconds(run, "started_at"))


def step_point(step: runs_pb2.RunStep) -> StepPoint:
    """A step as a point standing for one step (a measure the step lacks: None)."""
    r = step.report
    iw = step.importance_weights if step.HasField("importance_weights") else None
    return StepPoint(
        step=r.step, first_step=r.step, steps=1, policy_version=r.policy_version,
        reward_mean=_num(r.reward_mean), reward_std=_num(r.reward_std), loss=_num(r.loss),
        mismatch_kl=_num(r.mismatch_kl), staleness_mean=_num(r.staleness_mean),
        rollout_s=_num(r.rollout_s), update_s=_num(r.train_s), sync_s=_num(r.sync_s),
        eval_s=_num(step.eval_s), dropped=r.dropped_samples, excluded=step.excluded_samples,
        lr=_optional(step, "lr"), reward_min=_optional(step, "reward_min"),
        reward_max=_optional(step, "reward_max"), tokens_per_s=_num(r.tokens_per_s),
        elapsed_s=_num(r.elapsed_s), time=_seconds(r, "time"),
        is_mean=_num(iw.mean) if iw else None, is_max=_num(iw.max) if iw else None,
        is_limited=_num(iw.limited_fraction) if iw else None,
        nodes={n.address: n.samples for n in step.nodes})


def eval_point(step: runs_pb2.RunStep) -> EvalPoint | None:
    """The step's eval as a point standing for one eval, or None (the step did not eval)."""
    r = step.report
    if not r.HasField("eval_score"):
        return None
    exact = (_optional(step, "eval_exact") if step.HasField("eval_exact")
             else _optional(r, "eval_exact"))
    return EvalPoint(step=r.step, first_step=r.step, steps=1,
                     policy_version=r.eval_policy_version, score=_num(r.eval_score),
                     stderr=_optional(step, "eval_stderr"), exact=exact)


def event_from_proto(event: runs_pb2.RunEvent, now: float) -> RunEvent:
    """A trainer's event (``now``: its time when it sent none)."""
    time = _seconds(event, "time")
    return RunEvent(kind=event.kind, time=now if time is None else time, step=event.step,
                    node=event.node, duration_s=_num(event.duration_s), ok=event.ok,
                    message=event.message)


def node_from_proto(node: runs_pb2.RunNode) -> NodeView:
    """The trainer's view of one node."""
    return NodeView(address=node.address, in_rotation=node.in_rotation,
                    out_of_rotation=node.out_of_rotation, flagged=node.flagged,
                    benched=node.benched, readmitted=node.readmitted,
                    policy_version=node.policy_version, staleness=node.staleness,
                    mismatch_kl=_optional(node, "mismatch_kl"),
                    mismatch_kl_bound=_num(node.mismatch_kl_bound),
                    tokens_per_s=_num(node.tokens_per_s), in_flight=node.in_flight,
                    last_step=node.last_step)


def examples_from_proto(step: runs_pb2.RunStep) -> EvalExamples | None:
    """An evaluating step's eval examples; None when the step carries none."""
    if not step.eval_examples:
        return None
    return EvalExamples(
        step=step.report.step, policy_version=step.report.eval_policy_version,
        examples=tuple(EvalExample(prompt=e.prompt, score=_num(e.score), turns=e.turns,
                                   dropped=e.dropped, error=e.error,
                                   transcript=tuple(Message(m.role, m.content)
                                                    for m in e.transcript))
                       for e in step.eval_examples))


# ------------------------------------------------------------------------ to JSON


def info_json(info: RunInfo) -> dict[str, Any]:
    """``{"run_id", ..., "state": word, "state_value": number, ...}``."""
    out = dataclasses.asdict(info)
    out["state"] = enum_word(trainer_pb2.RunState, info.state, None)
    out["state_value"] = int(info.state)
    return out


def point_json(point: StepPoint | EvalPoint) -> dict[str, Any]:
    """A point as a flat object of its fields."""
    out = {f.name: getattr(point, f.name) for f in dataclasses.fields(point)}
    if isinstance(point, StepPoint):
        out["nodes"] = dict(point.nodes)
    return out


def event_json(event: RunEvent) -> dict[str, Any]:
    """An event line (``kind``: its word, e.g. ``"push"``)."""
    return {"kind": enum_word(runs_pb2.RunEventKind, event.kind, None), "time": event.time,
            "step": event.step, "node": event.node, "duration_s": event.duration_s,
            "ok": event.ok, "message": event.message}


def node_json(node: NodeView) -> dict[str, Any]:
    """The trainer's view of one node as an object of its fields."""
    return dataclasses.asdict(node)


def examples_json(examples: EvalExamples) -> dict[str, Any]:
    """``{"step", "policy_version", "examples": [{"prompt", "score", "turns", "dropped",
    "error", "transcript": [{"role", "content"}...]}...]}``."""
    out = dataclasses.asdict(examples)
    for example in out["examples"]:
        example["transcript"] = list(example["transcript"])
    out["examples"] = list(out["examples"])
    return out


def summary_json(summary: RunSummary) -> dict[str, Any]:
    """A run in the page's run list: its info with ``last_step``, ``policy_version``,
    ``report_age_s`` and ``nodes`` beside."""
    return {**info_json(summary.info), "last_step": summary.last_step,
            "policy_version": summary.policy_version, "report_age_s": summary.report_age_s,
            "nodes": [node_json(n) for n in summary.nodes]}


def detail_json(detail: RunDetail) -> dict[str, Any]:
    """``/api/runs/<id>``: ``{"info": {..., "last_step", "report_age_s"}, "generation",
    "full", "steps", "evals", "events", "nodes", "eval_examples"}``."""
    return {"info": {**info_json(detail.info), "last_step": detail.last_step,
                     "report_age_s": detail.report_age_s},
            "generation": detail.generation, "full": detail.full,
            "steps": [point_json(p) for p in detail.steps],
            "evals": [point_json(p) for p in detail.evals],
            "events": [event_json(e) for e in detail.events],
            "nodes": [node_json(n) for n in detail.nodes],
            "eval_examples": (examples_json(detail.eval_examples)
                              if detail.eval_examples is not None else None)}


# ------------------------------------------------------------------------ the store


def run_json(run: Run) -> dict[str, Any]:
    """Everything a run holds, for the store (:func:`run_from_json` reads it back)."""
    return {"run_id": run.run_id, "owner": run.owner, "info": info_json(run.info),
            "steps": [point_json(p) for p in run.steps.points],
            "evals": [point_json(p) for p in run.evals.points],
            "events": [event_json(e) for e in run.events],
            "nodes": {a: node_json(n) for a, n in run.nodes.items()},
            "examples": examples_json(run.examples) if run.examples is not None else {},
            "reported_at": run.reported_at}


def run_from_json(d: dict[str, Any]) -> Run:
    """A run as :func:`run_json` wrote it (fields this build does not know are ignored, those
    it lacks take their defaults).

    Raises:
        KeyError, TypeError, ValueError: a row that is not a run.
    """
    info = dict(d["info"])
    info["state"] = info.get("state_value", 0)
    run = Run(d["run_id"], d.get("owner"), info=RunInfo(**_known(RunInfo, info)),
              nodes={a: NodeView(**_known(NodeView, n)) for a, n in d.get("nodes", {}).items()},
              examples=_examples_from_json(d.get("examples")),
              reported_at=d.get("reported_at", 0.0), dirty=False)
    run.steps.points = [StepPoint(**_known(StepPoint, p))
                        for p in list(d.get("steps", []))[-STEP_POINTS:]]
    run.evals.points = [EvalPoint(**_known(EvalPoint, p))
                        for p in list(d.get("evals", []))[-EVAL_POINTS:]]
    run.events.extend(RunEvent(**{**_known(RunEvent, e),
                                  "kind": enum_value(runs_pb2.RunEventKind, e["kind"], 0)})
                      for e in d.get("events", []))
    return run


def _examples_from_json(d: dict[str, Any] | None) -> EvalExamples | None:
    if not d:
        return None
    return EvalExamples(
        step=d["step"], policy_version=d["policy_version"],
        examples=tuple(EvalExample(**{**_known(EvalExample, e), "transcript": tuple(
            Message(m["role"], m["content"]) for m in e.get("transcript", ()))})
            for e in d["examples"]))
