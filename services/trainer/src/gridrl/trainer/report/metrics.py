"""The trainer's step metrics (``gridrl_trainer_*``) on the default registry, served by the
trainer's ``/metrics`` endpoint (:func:`gridrl.trainer.server.serve_trainer`): each step's
record, published by the :class:`PrometheusSubscriber` (:func:`record_step`). The node pool's
per-node metrics are :mod:`gridrl.trainer.fleet.metrics`.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge

from gridrl.trainer.report.events import RunEvent
from gridrl.trainer.report.records import StepRecord

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
PEAK_RSS_BYTES = Gauge("gridrl_trainer_peak_rss_bytes",
                       "Peak resident memory of the trainer process during the last update "
                       "(bounded by --memory-mb).")
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
IS_WEIGHT_MEAN = Gauge("gridrl_trainer_is_weight_mean",
                       "Mean importance ratio pi_trainer / pi_behaviour of the last step's tokens "
                       "or sequences (--is-level), before truncation or masking; set only with "
                       "--is-correction tis|mis.")
IS_WEIGHT_MAX = Gauge("gridrl_trainer_is_weight_max",
                      "Largest importance ratio of the last step (--is-correction tis|mis).")
IS_LIMITED_FRACTION = Gauge("gridrl_trainer_is_limited_fraction",
                            "Fraction of the last step's tokens or sequences whose importance "
                            "ratio exceeded --is-cap (truncated by tis, masked by mis).")

EXCLUDED_SAMPLES = Counter("gridrl_trainer_excluded_samples_total",
                           "Samples of flagged nodes kept out of the update, by node.",
                           ["node"])
# episodes (every task runs as episodes; a single-turn one has one model turn each)
EPISODES = Counter("gridrl_trainer_episodes_total",
                   "Episodes run for the steps, dropped ones included.")
EPISODE_TURNS_MEAN = Gauge("gridrl_trainer_episode_turns_mean",
                           "Model turns per episode at the last step.")
EPISODE_TOKENS = Counter("gridrl_trainer_episode_tokens_total",
                         "Episode tokens after the prompt, by source: model (sampled, trained "
                         "on) or environment (its turns' chat-template tokens, no gradient).",
                         ["source"])
TRUNCATED_EPISODES = Counter("gridrl_trainer_truncated_episodes_total",
                             "Episodes cut by --max-turns or --max-episode-tokens.")
DROPPED_EPISODES = Counter("gridrl_trainer_dropped_episodes_total",
                           "Episodes not trained on, by reason: env_error (the environment "
                           "raised), template (no token-exact chat-template delta), sampler "
                           "(a turn's request failed, e.g. its node died), mixed_version, "
                           "mixed_node.", ["reason"])
ENVIRONMENT_EVENTS = Counter("gridrl_trainer_environment_events_total",
                             "The environment's counters summed over episodes, by event "
                             "(tool_calls, tool_errors, tool_timeouts...).", ["event"])
REWARD_FUNCTION_MEAN = Gauge("gridrl_trainer_reward_function_mean",
                             "Mean of each reward function over the last step's admitted "
                             "samples (before weighting).", ["function"])
EVAL_METRIC = Gauge("gridrl_trainer_eval_metric",
                    "The environment's own figures of the last held-out eval (e.g. "
                    "first_attempt_success, second_attempt_success, turns_mean).", ["metric"])



def record_step(record: StepRecord) -> None:
    """Publish one step's record: a gauge per ``gridrl.v1.StepReport`` number (times in
    seconds), the importance-weight gauges after a corrected update, the eval score when the
    step had an eval (else the last one stays), the mismatch bound when the step's nodes were
    judged; ``dropped_samples``, the flagged nodes' excluded samples, the phases' seconds and
    the episodes' figures (episodes, tokens by source, truncations, drops by reason, the
    environment's counters) are added to their counters; each reward function's mean and the
    eval's environment figures are gauges labelled by name.

    Raises:
        ValueError: naming the field, when a value is not a number.
    """
    LAST_PROGRESS.set_to_current_time()
    gauges = ((STEP, "step", record.step), (POLICY_VERSION, "policy_version",
                                            record.policy_version),
              (REWARD_MEAN, "reward_mean", record.reward_mean),
              (REWARD_STD, "reward_std", record.reward_std), (LOSS, "loss", record.loss),
              (MISMATCH_KL, "mismatch_kl", record.mismatch_kl),
              (STALENESS_MEAN, "staleness_mean", record.staleness_mean),
              (ROLLOUT_SECONDS, "rollout_s", record.rollout_s),
              (TRAIN_SECONDS, "train_s", record.train_s), (SYNC_SECONDS, "sync_s", record.sync_s),
              (NODES_SYNCED, "nodes_synced", record.nodes_synced),
              (NODES_SKIPPED, "nodes_skipped", record.nodes_skipped),
              (TOKENS_PER_SECOND, "tokens_per_s", record.tokens_per_s),
              (IS_WEIGHT_MEAN, "is_weight_mean", record.is_weight_mean),
              (IS_WEIGHT_MAX, "is_weight_max", record.is_weight_max),
              (IS_LIMITED_FRACTION, "is_limited_fraction", record.is_limited_fraction),
              (EVAL_SCORE, "eval_score", record.eval_score),
              (PEAK_RSS_BYTES, "peak_rss_mb",
               None if record.peak_rss_mb is None else record.peak_rss_mb * (1 << 20)),
              (MISMATCH_KL_BOUND, "mismatch_kl_bound", record.mismatch_kl_bound))
    for gauge, name, value in gauges:
        if value is not None:
            gauge.set(_number(name, value))
    if record.dropped_samples:
        DROPPED_SAMPLES.inc(_number("dropped_samples", record.dropped_samples))
    for phase, seconds in (("rollout", record.rollout_s), ("train", record.train_s),
                           ("sync", record.sync_s)):
        if seconds:
            PHASE_SECONDS.labels(phase).inc(_number(f"{phase}_s", seconds))
    for node, n in record.excluded_samples.items():
        EXCLUDED_SAMPLES.labels(node).inc(n)
    EPISODES.inc(_number("episodes", record.episodes))
    EPISODE_TURNS_MEAN.set(_number("turns_mean", record.turns_mean))
    EPISODE_TOKENS.labels("model").inc(_number("model_tokens", record.model_tokens))
    EPISODE_TOKENS.labels("environment").inc(_number("env_tokens", record.env_tokens))
    TRUNCATED_EPISODES.inc(_number("truncated_episodes", record.truncated_episodes))
    for reason, n in record.dropped_episodes.items():
        DROPPED_EPISODES.labels(reason).inc(_number(f"dropped_episodes.{reason}", n))
    for event, n in record.env_counts.items():
        ENVIRONMENT_EVENTS.labels(event).inc(_number(f"env_counts.{event}", n))
    for name, mean in (record.reward_funcs or {}).items():
        if mean is not None:
            REWARD_FUNCTION_MEAN.labels(name).set(_number(f"reward_funcs.{name}", mean))
    for name, value in (record.eval_metrics or {}).items():
        EVAL_METRIC.labels(name).set(_number(f"eval_metrics.{name}", value))


def mark_started() -> None:
    """Start the stalled-trainer clock (``gridrl_trainer_last_progress_timestamp_seconds``):
    called when the trainer's server starts, before the model loads."""
    LAST_PROGRESS.set_to_current_time()


class PrometheusSubscriber:
    """The run's reporter subscriber that publishes each step (:func:`record_step`); a resumed
    run's earlier steps are not published again."""

    def on_step(self, record: StepRecord) -> None:
        record_step(record)

    def on_event(self, event: RunEvent) -> None:
        pass

    def close(self) -> None:
        pass


def _number(name: str, value: Any) -> float:
    try:
        if isinstance(value, (str, bytes, bool)):
            raise TypeError
        return float(value)  # int, float, numpy and 0-d torch scalars
    except (TypeError, ValueError):
        raise ValueError(f"report.{name}: expected a number, got {value!r}") from None
