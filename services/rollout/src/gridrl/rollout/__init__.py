"""gridrl rollout node: samples completions with their behaviour logprobs and takes new LoRA
adapters over gRPC. Read top-down: ``cli.py`` -> ``server.py`` -> ``engine.py`` (batching,
adapter swaps) -> ``backends/`` (torch, mlx) -> ``sampling`` semantics in ``backends/base.py``."""
