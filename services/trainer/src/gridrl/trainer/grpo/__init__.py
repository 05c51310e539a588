"""The GRPO maths that needs no tensor framework (numpy, no threads, no RPC).

- ``admission.py``: which samples of a step enter the update (lineage, staleness, flagged
  nodes) and the per-node counts the monitor judges; a flagged node's readmission rule;
- ``advantages.py``: group-relative advantages, aggregation weights, the LR schedule factor,
  the mismatch KL;
- ``batch.py``: a step's ``StepBatch`` from its rollouts (admission, rewards, advantages ->
  the ``TrainSequence`` s the backend trains on, ``sequences.py``).

Imports no other trainer package but ``rollouts``; the backends import it.
"""
