"""Experiment trackers (``--report-to tensorboard,wandb,trackio``): each record the run writes
to ``log.jsonl`` (a step's, the baseline eval's) is sent to TensorBoard, Weights & Biases or
Trackio under the names TRL users already chart (:class:`TrackerSubscriber`, a subscriber of
the run's reporter).

Names follow transformers' ``rewrite_logs`` (``integrations/integration_utils.py``): eval keys
under ``eval/``, everything else under ``train/``; and TRL's ``GRPOTrainer`` metric names where
gridrl computes the same quantity (TRL 1.16 ``grpo_trainer.py``, ``_metrics[mode][...]``):

    reward_mean          -> train/reward              lr             -> train/learning_rate
    reward_std           -> train/reward_std          grad_norm      -> train/grad_norm
    reward_funcs[f]      -> train/rewards/<f>/mean    loss           -> train/loss
    1 - groups_with_signal / groups -> train/frac_reward_zero_std
    sampled tokens / samples        -> train/completions/mean_length
    ref_kl (--kl-beta > 0)  -> train/kl               clip_fraction  -> train/clip_ratio/region_mean
    eval_score           -> eval/reward               eval_s         -> eval/runtime

Every other number of the record keeps its gridrl name (``train/mismatch_kl``,
``train/staleness_mean``, ``train/dropped_samples``, ``train/rollout_s``, ``train/sync_s``,
``train/nodes_synced``, ``train/policy_version``, ``eval/exact``, ``eval/policy_version``...),
each node's figures go under ``train/nodes/<node>/`` (``samples``, ``dropped``,
``staleness_mean``, ``mismatch_kl``: its fresh samples' mismatch KL), the episodes' under
``train/episodes``, ``train/turns_mean``, ``train/model_tokens``, ``train/env_tokens``,
``train/truncated_episodes``, ``train/dropped_episodes/<reason>`` and ``train/env/<counter>``
(``tool_calls``...), the environment's eval figures under ``eval/<name>``
(``eval/first_attempt_success``...), and the x axis is the GRPO
step (``train/global_step`` for W&B and Trackio, the event step for TensorBoard). The baseline
eval is logged at step 0.

Where each writes: TensorBoard event files in ``<run_dir>/tensorboard/``; W&B under
``<run_dir>/wandb/`` (project ``$WANDB_PROJECT``, default ``gridrl``; ``WANDB_MODE=offline`` works
without an account), one W&B run per run directory, continued by ``--resume``; Trackio in its
local database (``$TRACKIO_DIR``; project ``$TRACKIO_PROJECT``, default ``gridrl``). The
packages are optional extras of gridrl-trainer: ``gridrl-trainer[tensorboard]``, ``[wandb]``,
``[trackio]``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from gridrl.common.errors import failed_precondition
from gridrl.trainer.config import TRACKERS, TrainConfig, parse_report_to
from gridrl.trainer.report.events import BaselineEvaluated, RunEvent
from gridrl.trainer.report.records import StepRecord

log = logging.getLogger(__name__)

# gridrl record key -> TRL / transformers name (before the train/ or eval/ prefix)
RENAMES = {
    "reward_mean": "reward",
    "lr": "learning_rate",
    "ref_kl": "kl",
    "clip_fraction": "clip_ratio/region_mean",
    "eval_score": "eval_reward",
    "eval_s": "eval_runtime",
}
# Record keys that are bookkeeping, not metrics.
_SKIP = {"step", "event", "data_position", "updated"}


def extra_requirement(extra: str) -> str:
    """What gridrl-trainer's ``extra`` asks pip for (``"wandb<1,>=0.19"``), read from the
    installed package's metadata so the range is written once, in its pyproject; ``extra``
    itself when the metadata does not say."""
    try:
        requires = importlib.metadata.requires("gridrl-trainer") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    for line in requires:
        spec, _, marker = line.partition(";")
        if marker.strip().replace("'", '"') == f'extra == "{extra}"':
            return spec.strip()
    return extra


def require(names: Sequence[str]) -> None:
    """Check that every tracker's package is importable, without importing it (so a missing
    one fails before the model loads).

    Raises:
        StatusError: FAILED_PRECONDITION ``"--report-to wandb: the wandb package is not
            installed: pip install 'wandb<1,>=0.19' (the gridrl-trainer[wandb] extra)"``.
    """
    for name in parse_report_to(names):
        module = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise failed_precondition(f"--report-to {name}: the {module} package is not "
                                      f"installed: pip install '{extra_requirement(name)}' "
                                      f"(the gridrl-trainer[{name}] extra)")


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def tracker_metrics(record: Mapping[str, Any], groups: int) -> dict[str, float]:
    """The metrics of one ``log.jsonl`` record under the names of the module docstring.

    Args:
        record: a step record (:meth:`StepRecord.to_json`) or the baseline record
            (``{"event": "baseline", "eval_score": ...}``).
        groups: prompts (GRPO groups) per step, for ``train/frac_reward_zero_std``.
    Returns:
        name -> finite float; keys whose value is None, NaN, a string or a flag are left out,
        and so are eval keys of a step without an eval.
    """
    has_eval = record.get("eval_score") is not None
    out: dict[str, float] = {}
    for key, value in record.items():
        v = _number(value)
        if key in _SKIP or v is None or (key.startswith("eval_") and not has_eval):
            continue
        name = RENAMES.get(key, key)
        if key == "loss" and record.get("updated") is False:
            continue  # no sample survived: no update, no loss
        out[f"eval/{name[5:]}" if name.startswith("eval_") else f"train/{name}"] = v
    if has_eval:
        for metric, value in (record.get("eval_metrics") or {}).items():
            if (v := _number(value)) is not None:
                out[f"eval/{metric}"] = v
    if "event" in record:
        return out
    for reason, n in (record.get("dropped_episodes") or {}).items():
        if (v := _number(n)) is not None:
            out[f"train/dropped_episodes/{reason}"] = v
    for event, n in (record.get("env_counts") or {}).items():
        if (v := _number(n)) is not None:
            out[f"train/env/{event}"] = v
    for func, mean in (record.get("reward_funcs") or {}).items():
        if (v := _number(mean)) is not None:
            out[f"train/rewards/{func}/mean"] = v
    if (g := _number(record.get("groups_with_signal"))) is not None and groups > 0:
        out["train/frac_reward_zero_std"] = 1.0 - g / groups
    nodes: Mapping[str, Mapping[str, Any]] = record.get("nodes") or {}
    samples = sum(int(n.get("samples") or 0) for n in nodes.values())
    if samples and (tokens := _number(record.get("sampled_tokens"))) is not None:
        out["train/completions/mean_length"] = tokens / samples
    for node, stats in nodes.items():
        tag = node.replace("/", "_")
        for key, name in (("samples", "samples"), ("dropped", "dropped"),
                          ("staleness_mean", "staleness_mean"),
                          ("fresh_mismatch_kl", "mismatch_kl")):
            if (v := _number(stats.get(key))) is not None:
                out[f"train/nodes/{tag}/{name}"] = v
    if "flagged_nodes" in record:
        out["train/flagged_nodes"] = float(len(record["flagged_nodes"] or {}))
    return out


class Tracker(Protocol):
    """One experiment tracker: ``log`` a step's metrics, ``close`` once at the end."""

    name: str

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` (what transformers'
    ``TensorBoardCallback`` uses) into ``<run_dir>/tensorboard``. A resumed run purges the
    events the killed run wrote after its checkpoint (``purge_step``)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, config: Mapping[str, Any], resumed_at: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=(
            resumed_at + 1 if resumed_at is not None else None))
        if resumed_at is None:
            self._writer.add_text("config", json.dumps(dict(config), indent=2, sort_keys=True))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run in ``<run_dir>/wandb`` named after the run, with the config, and
    ``train/global_step`` as every metric's x axis (as transformers' ``WandbCallback``). Its id
    is kept in ``<run_dir>/wandb/gridrl-run-id`` so ``--resume`` continues the same W&B run."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        import wandb

        root = run_dir / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "gridrl-run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "gridrl",
                               name=run_name, dir=str(run_dir), config=dict(config), id=run_id,
                               resume="allow")
        self._run.define_metric("train/global_step")
        self._run.define_metric("*", step_metric="train/global_step", step_sync=True)
        self.run_id = run_id

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log({**metrics, "train/global_step": step})

    def close(self) -> None:
        self._run.finish()


class TrackioTracker:
    """A Trackio run (local database, ``$TRACKIO_DIR``) named after the run, with the config;
    a resumed run continues it (``resume="allow"``)."""

    name = "trackio"

    def __init__(self, run_name: str, config: Mapping[str, Any]) -> None:
        import trackio

        self._trackio = trackio
        self.project = os.environ.get("TRACKIO_PROJECT") or "gridrl"
        trackio.init(project=self.project, name=run_name, config=dict(config), resume="allow")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._trackio.log({**metrics, "train/global_step": step}, step=step)

    def close(self) -> None:
        self._trackio.finish()


class Trackers:
    """The trackers of a run: each record goes to all of them; one that fails is logged and
    dropped (a tracker must never stop training).

    Args:
        trackers: the open trackers.
        groups: prompts (GRPO groups) per step (see :func:`tracker_metrics`).
    """

    def __init__(self, trackers: Sequence[Tracker], groups: int) -> None:
        self.trackers = list(trackers)
        self.groups = groups

    def log(self, record: Mapping[str, Any]) -> None:
        """Send one ``log.jsonl`` record (a step's, or the baseline's at step 0)."""
        if not self.trackers:
            return
        metrics = tracker_metrics(record, self.groups)
        step = int(record.get("step") or 0)
        for tracker in list(self.trackers):
            try:
                tracker.log(metrics, step)
            except Exception:
                log.exception("--report-to %s: logging step %d failed; no more records go to it",
                              tracker.name, step)
                self.trackers.remove(tracker)

    def close(self) -> None:
        """Flush and close every tracker (each once)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception:
                log.exception("--report-to %s: closing failed", tracker.name)


class TrackerSubscriber:
    """The run's reporter subscriber that sends each ``log.jsonl`` record to the trackers: a
    step's record, and the baseline eval at step 0."""

    def __init__(self, trackers: Trackers) -> None:
        self.trackers = trackers

    def on_step(self, record: StepRecord) -> None:
        self.trackers.log(record.to_json())

    def on_event(self, event: RunEvent) -> None:
        if isinstance(event, BaselineEvaluated):
            self.trackers.log(event.record.to_json())

    def close(self) -> None:
        self.trackers.close()


def open_trackers(cfg: TrainConfig, *, resumed_at: int | None = None) -> Trackers:
    """Start the trackers ``cfg.report_to`` names for the run in ``cfg.run_dir``.

    Args:
        cfg: the run's :class:`~gridrl.trainer.config.TrainConfig` (finalized).
        resumed_at: the step a resumed run continues from (None: a new run).
    Raises:
        StatusError: an unknown tracker, its package missing (see :func:`require`), or
            FAILED_PRECONDITION when one cannot start (``"--report-to wandb: could not start:
            ..."``; those already started are closed).
    """
    names = parse_report_to(cfg.report_to)
    require(names)
    run_dir, run_name = Path(cfg.run_dir), str(cfg.run_name)
    config = cfg.to_dict()  # without the auth token
    opened: list[Tracker] = []
    for name in names:
        try:
            if name == "tensorboard":
                opened.append(TensorBoardTracker(run_dir, config, resumed_at))
            elif name == "wandb":
                opened.append(WandbTracker(run_dir, run_name, config))
            else:
                opened.append(TrackioTracker(run_name, config))
        except Exception as e:  # e.g. W&B online without an account
            Trackers(opened, cfg.prompts_per_step).close()
            raise failed_precondition(f"--report-to {name}: could not start: "
                                      f"{type(e).__name__}: {e}") from e
    return Trackers(opened, cfg.prompts_per_step)
