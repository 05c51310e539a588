"""The MLX backend on mlx-lm: decoding, LoRA adapters beside the base weights, sampling."""
