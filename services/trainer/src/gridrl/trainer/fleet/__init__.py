"""The rollout nodes as the trainer sees them.

- ``nodeset.py``: ``NodeSet``, which nodes there are and which are in rotation: the feed of
  ``membership.py`` (the master's watch ``watch.py``, probes, pushes, flags; channels in
  ``channels.py``) and the waits for a node;
- ``pool.py``: ``NodePool``, a ``NodeSet`` that samples on its nodes (the run's turn sampler):
  Generate calls dispatched by ``scheduling.py``, retried, re-dispatched or hedged
  (``hedging.py``), their bookkeeping in ``batch.py``;
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
