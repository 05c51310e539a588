"""Prometheus metrics of a rollout node (default registry, served by ``gridrl.common``).

RPC counts by method and status code, and RPC durations, come from the shared server
interceptor (``gridrl_rpc_requests_total``, ``gridrl_rpc_duration_seconds``); these are the
node's own. Times are seconds, sizes bytes.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

COMPLETION_TOKENS = Counter(
    "gridrl_rollout_completion_tokens_total", "Tokens sampled (every sample of every request).")
PROMPT_TOKENS = Counter(
    "gridrl_rollout_prompt_tokens_total", "Prompt tokens of finished Generate requests.")
SAMPLES = Counter(
    "gridrl_rollout_samples_total", "Samples returned, by finish reason.", ["finish_reason"])
REJECTED = Counter(
    "gridrl_rollout_rejected_requests_total",
    "Generate requests refused with RESOURCE_EXHAUSTED because the queue was full.")
REQUEST_DURATION = Histogram(
    "gridrl_rollout_request_duration_seconds",
    "Seconds from a Generate request's arrival to its last sample (queueing included).",
    buckets=_LATENCY)
TIME_TO_FIRST_TOKEN = Histogram(
    "gridrl_rollout_time_to_first_token_seconds",
    "Seconds from a Generate request's arrival to its first sampled token.", buckets=_LATENCY)
QUEUE_WAIT = Histogram(
    "gridrl_rollout_queue_wait_seconds",
    "Seconds a Generate request waited before its first batch started.", buckets=_LATENCY)
BATCH_SIZE = Histogram(
    "gridrl_rollout_batch_size", "Sequences decoded together in one batch.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
BATCH_DURATION = Histogram(
    "gridrl_rollout_batch_duration_seconds", "Seconds of one batch (prefill and decode).",
    buckets=_LATENCY)
BATCHES = Counter("gridrl_rollout_batches_total", "Batches decoded.")
BATCHES_INTERRUPTED = Counter(
    "gridrl_rollout_batches_interrupted_total",
    "Batches stopped between two decode steps for an adapter push or reload; their requests "
    "were decoded again on the new adapter.")
QUEUE_DEPTH = Gauge("gridrl_rollout_queue_depth", "Generate requests waiting for a batch slot.")
ACTIVE_SEQUENCES = Gauge(
    "gridrl_rollout_active_sequences", "Sequences in the batch being decoded now.")
ADAPTER_VERSION = Gauge(
    "gridrl_rollout_adapter_version", "Policy (adapter) version serving now; 0 = base model.")
PUSH_BYTES = Counter("gridrl_rollout_push_bytes_total", "Adapter bytes received by PushAdapter.")
PUSH_DURATION = Histogram(
    "gridrl_rollout_push_duration_seconds",
    "Seconds of each phase of a successful PushAdapter (receive, verify, convert, apply) and "
    "of the whole push (total).", ["phase"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
PUSHES_EXPIRED = Counter(
    "gridrl_rollout_adapter_apply_expired_total",
    "Pushes and reloads refused with DEADLINE_EXCEEDED because they could not be applied "
    "before their caller's deadline (nothing changed; they are never applied later).")
ADAPTER_APPLY_DURATION = Histogram(
    "gridrl_rollout_adapter_apply_seconds",
    "Seconds to load an adapter next to the serving one and swap (push or reload).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
