"""Inference backends. Each implements :class:`gridrl.rollout.backends.base.Backend`."""
