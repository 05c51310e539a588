"""The MLX trainer backend (``--backend mlx``; Apple Silicon, or a Linux CPU through mlx[cpu]).

``backend.py`` (``MlxTrainerBackend``: mlx-lm's LoRA layers on the engine's MLX model, the GRPO
step, AdamW, adapter and checkpoint files) over ``losses.py`` (the torch backend's per-token
formulas on mx arrays). One process: no data parallelism.
"""
