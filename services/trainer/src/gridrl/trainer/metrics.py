"""The trainer's Prometheus metrics (``gridrl_trainer_*``) on the default registry, served by
the trainer's ``/metrics`` endpoint (:func:`gridrl.trainer.server.serve_trainer`).

Step metrics come from :func:`record_step`; per-node metrics (served and synced policy
version, rotation, failures) from the node pool and the adapter sync, so a node that stopped
receiving weights shows up on a dashboard as a flat ``gridrl_trainer_node_adapter_version``
below ``gridrl_trainer_policy_version``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge

STEP = Gauge("gridrl_trainer_step", "Last finished GRPO step.")
LAST_PROGRESS = Gauge("gridrl_trainer_last_progress_timestamp_seconds",
                      "Unix time (s) the last GRPO step finished; before the first step of this "
                      "process, the time its server started (so a stalled start shows too).")
POLICY_VERSION = Gauge("gridrl_trainer_policy_version", "Trainer policy version after the last step.")
REWARD_MEAN = Gauge("gridrl_trainer_reward_mean", "Mean reward over the last step's samples.")
REWARD_STD = Gauge("gridrl_trainer_reward_std", "Std of the reward over the last step's samples.")
EVAL_SCORE = Gauge("gridrl_trainer_eval_score", "Last held-out eval score in [0, 1].")
LOSS = Gauge("gridrl_trainer_loss", "Loss of the last step.")
MISMATCH_KL = Gauge("gridrl_trainer_mismatch_kl",
                    "Trainer-vs-behaviour logprob KL estimate of the last step, nats per token.")
MISMATCH_KL_BOUND = Gauge(
    "gridrl_trainer_mismatch_kl_bound",
    "Mismatch KL a node may reach before it is flagged, at the last step, nats per token: "
    "--mismatch-kl-max, or --mismatch-kl-max-16bit when a node that sampled the step "
    "or the trainer computes in bfloat16/float16.")
STALENESS_MEAN = Gauge("gridrl_trainer_staleness_mean",
                       "Mean staleness (trainer version - sample version) of the last step.")
DROPPED_SAMPLES = Counter("gridrl_trainer_dropped_samples_total",
                          "Samples dropped for staleness beyond --max-staleness.")
ROLLOUT_SECONDS = Gauge("gridrl_trainer_rollout_seconds", "Seconds collecting the last step's rollouts.")
TRAIN_SECONDS = Gauge("gridrl_trainer_train_seconds", "Seconds of the last step's gradient update.")
SYNC_SECONDS = Gauge("gridrl_trainer_sync_seconds",
                     "Seconds pushing the adapter at the last step (0 when it did not sync).")
PHASE_SECONDS = Counter("gridrl_trainer_phase_seconds_total",
                        "Seconds spent in each phase of the run.", ["phase"])
NODES_SYNCED = Gauge("gridrl_trainer_nodes_synced", "Nodes that took the adapter at the last sync.")
NODES_SKIPPED = Gauge("gridrl_trainer_nodes_skipped",
                      "Nodes skipped (unreachable or failed) at the last sync.")
TOKENS_PER_SECOND = Gauge("gridrl_trainer_tokens_per_second",
                          "Completion tokens sampled per second of rollout, last step.")

NODE_IN_ROTATION = Gauge("gridrl_trainer_node_in_rotation",
                         "1 while the node is given groups to sample, else 0.", ["node"])
NODE_ADAPTER_VERSION = Gauge("gridrl_trainer_node_adapter_version",
                             "Policy version the node last reported serving.", ["node"])
NODE_SYNCED_VERSION = Gauge("gridrl_trainer_node_synced_version",
                            "Policy version last pushed to the node successfully.", ["node"])
NODE_GROUP_SECONDS = Gauge("gridrl_trainer_node_group_seconds",
                           "Moving average of a node's Generate call seconds (a group's latency "
                           "there, queueing included), which the pool schedules by; 0 until "
                           "measured.", ["node"])
GENERATE_FAILURES = Counter("gridrl_trainer_generate_failures_total",
                            "Generate calls that failed or timed out, by node and status code.",
                            ["node", "code"])
NODE_FLAGGED = Gauge("gridrl_trainer_node_flagged",
                     "1 while the node is benched for stale or mismatched samples (no groups, "
                     "its samples kept out of the update) until it passes a fresh mismatch "
                     "check, else 0.", ["node"])
EXCLUDED_SAMPLES = Counter("gridrl_trainer_excluded_samples_total",
                           "Samples of flagged nodes kept out of the update, by node.",
                           ["node"])
NODE_CHECKS = Counter("gridrl_trainer_node_checks_total",
                      "Fresh mismatch checks of flagged nodes, by node and result (passed: back "
                      "in rotation; failed: stays benched).", ["node", "result"])
NODE_WAIT_SECONDS = Gauge("gridrl_trainer_node_wait_seconds",
                          "Seconds the run has been waiting for a rollout node (none in "
                          "rotation); 0 when it is not waiting.")
NODE_WAIT_LEFT_SECONDS = Gauge("gridrl_trainer_node_wait_left_seconds",
                               "Seconds left before a run waiting for a rollout node fails "
                               "(--wait-for-nodes-s); 0 when it is not waiting.")
SYNC_FAILURES = Counter("gridrl_trainer_sync_failures_total",
                        "Adapter pushes that failed or missed their deadline, by node.", ["node"])

_GAUGES = {"step": STEP, "policy_version": POLICY_VERSION, "reward_mean": REWARD_MEAN,
           "reward_std": REWARD_STD, "loss": LOSS, "mismatch_kl": MISMATCH_KL,
           "staleness_mean": STALENESS_MEAN, "rollout_s": ROLLOUT_SECONDS,
           "train_s": TRAIN_SECONDS, "sync_s": SYNC_SECONDS, "nodes_synced": NODES_SYNCED,
           "nodes_skipped": NODES_SKIPPED, "tokens_per_s": TOKENS_PER_SECOND}
_PHASES = {"rollout_s": "rollout", "train_s": "train", "sync_s": "sync"}


def record_step(report: Mapping[str, Any]) -> None:
    """Publish one step report (keys: field names of ``gridrl.v1.StepReport``, times in
    seconds). Missing keys leave their gauge unchanged; ``eval_score`` None or absent leaves the
    last eval score; ``dropped_samples`` is added to the running counter.

    Raises:
        ValueError: naming the key, when a value is not a number.
    """
    LAST_PROGRESS.set_to_current_time()
    for key, gauge in _GAUGES.items():
        if report.get(key) is not None:
            gauge.set(_number(report, key))
    if report.get("eval_score") is not None:
        EVAL_SCORE.set(_number(report, "eval_score"))
    if report.get("dropped_samples"):
        DROPPED_SAMPLES.inc(_number(report, "dropped_samples"))
    for key, phase in _PHASES.items():
        if report.get(key):
            PHASE_SECONDS.labels(phase).inc(_number(report, key))


def mark_started() -> None:
    """Start the stalled-trainer clock (``gridrl_trainer_last_progress_timestamp_seconds``):
    called when the trainer's server starts, before the model loads."""
    LAST_PROGRESS.set_to_current_time()


def record_node(address: str, *, in_rotation: bool, adapter_version: int,
                synced_version: int, group_s: float, flagged: bool = False) -> None:
    """Publish a node's rotation and flag, served / synced policy versions and group latency
    (s)."""
    NODE_IN_ROTATION.labels(address).set(1 if in_rotation else 0)
    NODE_FLAGGED.labels(address).set(1 if flagged else 0)
    NODE_ADAPTER_VERSION.labels(address).set(adapter_version)
    NODE_SYNCED_VERSION.labels(address).set(synced_version)
    NODE_GROUP_SECONDS.labels(address).set(group_s)


def record_node_wait(waited_s: float, left_s: float) -> None:
    """Publish a wait for a rollout node: seconds waited and left (both 0: not waiting)."""
    NODE_WAIT_SECONDS.set(waited_s)
    NODE_WAIT_LEFT_SECONDS.set(left_s)


def forget_node(address: str) -> None:
    """Drop the per-node gauges of a node that left the registry."""
    for gauge in (NODE_IN_ROTATION, NODE_ADAPTER_VERSION, NODE_SYNCED_VERSION,
                  NODE_GROUP_SECONDS, NODE_FLAGGED):
        try:
            gauge.remove(address)
        except KeyError:
            pass


def _number(report: Mapping[str, Any], key: str) -> float:
    value = report[key]
    try:
        if isinstance(value, (str, bytes, bool)):
            raise TypeError
        return float(value)  # int, float, numpy and 0-d torch scalars
    except (TypeError, ValueError):
        raise ValueError(f"report.{key}: expected a number, got {value!r}") from None
