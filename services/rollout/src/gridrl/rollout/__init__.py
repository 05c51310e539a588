"""gridrl rollout node: samples completions with their behaviour logprobs and takes new LoRA
adapters over gRPC. Read top-down: ``cli.py`` -> ``server.py`` (RolloutService, node wiring,
registration) -> ``engine.py`` (bounded queue, batching, adapter swaps between batches) ->
``validation.py`` (Generate requests -> jobs) and ``adapter_manager.py`` / ``adapter_store.py``
(push, reload, adapters on disk). The models themselves (torch, mlx backends, the sampling
contract, the per-sequence random streams) are the :mod:`gridrl.engine` library."""
