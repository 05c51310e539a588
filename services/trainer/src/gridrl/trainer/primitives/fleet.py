"""The rollout nodes as the primitives use them: one training model's snapshots pushed to the
fleet, and samples routed to the nodes that serve the version asked for.

The fleet serves one base model (the server's ``--model``) and one adapter at a time, so the
first training model on that base model that saves weights for sampling *owns* it: its
snapshots are pushed (:class:`gridrl.trainer.fleet.sync.AdapterSync`, which makes the newest
version the pool's target: a node that does not serve it yet waits out of rotation until it
does) and its samples of the newest version go to the nodes
(:meth:`gridrl.trainer.fleet.pool.NodePool.generate_groups`). Everything else (another model,
an older version, the base model once an adapter was pushed) is sampled on the trainer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from gridrl.engine.contract import SamplingConfig
from gridrl.trainer.primitives.types import SamplingSpec
from gridrl.trainer.rollouts import RolloutSample

log = logging.getLogger(__name__)


def adapter_name(model_id: str) -> str:
    """The adapter name of a training model on the nodes (``[A-Za-z0-9._-]+``)."""
    return model_id.replace(":", "-")


class FleetRoute:
    """Pushes and samples for the model that owns the fleet.

    Args:
        pool: a started :class:`~gridrl.trainer.fleet.pool.NodePool` of nodes serving
            ``model_path``.
        model_path: the fleet's base model, resolved (:func:`gridrl.models.resolve_model`).
        identity: its :class:`gridrl.models.ModelIdentity` (the pushes' manifests; MLX nodes'
            conversion).
        deadline_s: seconds one node's push may take.
    """

    def __init__(self, pool: Any, *, model_path: str, identity: Any,
                 deadline_s: float = 30.0) -> None:
        self.pool = pool
        self.model_path = model_path
        self.identity = identity
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._owner: str | None = None
        self._version = 0
        self._pushed: set[int] = {0}
        self._sync: Any = None

    @property
    def owner(self) -> str | None:
        """The model whose adapters the nodes serve, or None before the first push."""
        with self._lock:
            return self._owner

    def serves(self, model_id: str | None, version: int, model_path: str) -> bool:
        """Whether the nodes serve ``version`` of ``model_id`` (None: the base model)."""
        with self._lock:
            if model_path != self.model_path:
                return False
            if self._owner is None:
                return version == 0
            return model_id == self._owner and version == self._version

    def push(self, model_id: str, model_path: str, version: int,
             files: Mapping[str, bytes]) -> list[str] | None:
        """Push ``version`` of ``model_id`` when it owns the fleet (or claims it now: the
        first model on the fleet's base model). Returns the nodes that serve it now, or None
        when the model does not own the fleet."""
        from gridrl.trainer.fleet.sync import AdapterSync

        with self._lock:
            if model_path != self.model_path or self._owner not in (None, model_id):
                return None
            if self._sync is None:
                self._owner = model_id
                self._sync = AdapterSync(self.pool, name=adapter_name(model_id),
                                         base_model=self.identity, deadline_s=self.deadline_s,
                                         known_versions=lambda: set(self._pushed))
            sync = self._sync
            self._pushed.add(version)
        report = sync.push(version, files)
        with self._lock:
            self._version = version
        if report.skipped:
            log.warning("policy version %d of %s: %d node(s) skipped: %s", version, model_id,
                        len(report.skipped), "; ".join(f"{a}: {why}" for a, why in
                                                      sorted(report.skipped.items())))
        return list(report.synced)

    def sample(self, prompt: list[int], spec: SamplingSpec, seed: int
               ) -> tuple[list[RolloutSample], str]:
        """``spec.n`` samples of ``prompt`` on one node in rotation (Generate with
        ``seed``): the samples and the node's address.

        Raises:
            ValueError, RuntimeError: as :meth:`NodePool.generate_groups`.
        """
        sampling = SamplingConfig(max_tokens=spec.max_tokens, temperature=spec.temperature,
                                  top_p=spec.top_p, top_k=spec.top_k,
                                  stop_token_ids=spec.stop_token_ids)
        groups = self.pool.generate_groups([prompt], sampling, group_size=spec.n, seed=seed)
        return groups[0].samples, groups[0].node

    def close(self) -> None:
        """Stop pushing and close the pool. Idempotent."""
        with self._lock:
            sync, self._sync = self._sync, None
        if sync is not None:
            sync.close()
        self.pool.close()
