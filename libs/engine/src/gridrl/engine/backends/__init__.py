"""Inference backends. Each implements :class:`gridrl.engine.contract.Backend`."""
