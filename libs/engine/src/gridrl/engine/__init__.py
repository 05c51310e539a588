"""gridrl's inference engine library, shared by the rollout node and the trainer.

- :mod:`gridrl.engine.contract`: the sampling contract (``SamplingConfig``,
  ``SequenceRequest``, ``SequenceResult``) and the ``Backend`` every framework implements;
- :mod:`gridrl.engine.rng`: per-sequence counter-based random streams and the one seed
  derivation (request seed + index -> sequence seed) used by nodes and trainer alike;
- :mod:`gridrl.engine.backends`: the torch backend (lean llama forward, fused CPU kernels, KV
  cache, adapter strategies) and the MLX backend (mlx-lm).

It knows nothing of gRPC: queuing, batching across requests and adapter transport belong to the
rollout service (``gridrl.rollout``), training to the trainer (``gridrl.trainer``).
"""
