"""The node pool's Prometheus metrics (per node: rotation, flag, served and synced policy
version, group latency; Generate and push failures; fresh checks of flagged nodes; the wait for
a node) on the default registry, served by the trainer's ``/metrics`` endpoint
(:func:`gridrl.trainer.server.serve_trainer`) beside the step metrics
(:mod:`gridrl.trainer.report.metrics`). A node that stopped receiving weights shows up on a
dashboard as a flat ``gridrl_trainer_node_adapter_version`` below
``gridrl_trainer_policy_version``.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

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
REDISPATCHED = Counter("gridrl_trainer_groups_redispatched_total",
                       "Groups started again on another node while their call ran: its node "
                       "left rotation (reason 'node gone': the call is abandoned) or the group "
                       "ran --hedge-after times its node's latency (reason 'hedge': a backup "
                       "copy, first answer wins).", ["node", "reason"])
NODE_FLAGGED = Gauge("gridrl_trainer_node_flagged",
                     "1 while the node is benched for stale or mismatched samples (no groups, "
                     "its samples kept out of the update) until it passes a fresh mismatch "
                     "check, else 0.", ["node"])
NODE_CHECKS = Counter("gridrl_trainer_node_checks_total",
                      "Fresh mismatch checks of flagged nodes, by node and result (passed: back "
                      "in rotation; failed: stays benched).", ["node", "result"])
NODE_WAIT_SECONDS = Gauge("gridrl_trainer_node_wait_seconds",
                          "Seconds the run has been waiting for a rollout node (none in "
                          "rotation); 0 when it is not waiting.")
NODE_WAIT_LEFT_SECONDS = Gauge("gridrl_trainer_node_wait_left_seconds",
                               "Seconds left before a run waiting for a rollout node fails "
                               "(--outage-wait-s; --start-wait-s before step 1); 0 when it "
                               "is not waiting.")
SYNC_FAILURES = Counter("gridrl_trainer_sync_failures_total",
                        "Adapter pushes that failed or missed their deadline, by node.", ["node"])


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
