"""The rollout nodes as the trainer sees them.

- ``pool.py``: ``NodePool``, the RPC layer (channels in ``channels.py``, Generate calls, probes,
  the master's watch ``watch.py``, waits for a node) and the run's ``RolloutSource``;
- ``membership.py``: who is in the pool and in rotation, a pure state machine fed events; it
  owns each node's state (``nodes.py``) and the trainer's flags on nodes;
- ``scheduling.py``: which node samples which group (pure);
- ``sync.py``: adapter pushes (``PushAdapter``), catch-ups of late nodes;
- ``monitor.py`` and ``probation.py``: flagging nodes whose samples are stale or mismatched,
  and their way back;
- ``outcomes.py`` (how calls end, typed), ``wire.py`` (protobuf in, domain types out; enum
  words), ``backoff.py``, ``metrics.py`` (the per-node Prometheus gauges), ``listing.py``
  (the trainer's own registry entry).

Imports ``grpo`` (admission's per-node counts, readmission), never ``report`` or ``run``.
"""
