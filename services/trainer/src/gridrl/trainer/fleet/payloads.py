"""One policy version of the run's adapter in each format its nodes take: the peft files as
pushed, converted once per version for MLX nodes (``gridrl.adapters.convert_files``), each with
its manifest; and, for relay fan-out, the manifest with every sha256 and the relay plan, hashed
once per version and format. :class:`~gridrl.trainer.fleet.sync.AdapterSync` sends them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from gridrl.adapters import AdapterManifest, build_manifest, convert_files
from gridrl.common import transport
from gridrl.models import ModelIdentity
from gridrl.v1 import rollout_pb2


@dataclass
class AdapterVersion:
    """One version of the adapter, with its files in each format converted so far."""

    version: int
    payloads: dict[str, tuple[AdapterManifest, Mapping[str, bytes]]]  # format -> its push
    # format -> (manifest with every sha256, relay plan without readers): relay fan-out
    relays: dict[str, tuple[AdapterManifest, rollout_pb2.RelayPlan]] = field(
        default_factory=dict)


class Payloads:
    """Builds each :class:`AdapterVersion`'s files, manifests and relay plans, once per version
    and format; thread-safe (one lock: a conversion or hashing runs once however many pushes
    ask for it).

    Args:
        name: the adapter's name (the run name).
        base_model: the trainer's base model (the manifests' ``base_model``; its
            ``num_layers`` drives the MLX conversion).
        piece_bytes: relay piece size in bytes.
    """

    def __init__(self, *, name: str, base_model: ModelIdentity, piece_bytes: int) -> None:
        self.name = name
        self.base_model = base_model
        self.piece_bytes = piece_bytes
        self._lock = threading.Lock()

    def relay_plan(self, adapter: AdapterVersion, fmt: str,
                   readers: list[str]) -> rollout_pb2.RelayPlan:
        """The relay plan of ``adapter`` in ``fmt`` with ``readers``, hashing its files once
        per version and format (the manifest with digests is kept for the fetches)."""
        with self._lock:
            if fmt not in adapter.relays:
                files = adapter.payloads[fmt][1]
                hashed = build_manifest(files, name=self.name, version=adapter.version,
                                        base_model=self.base_model, hash_files=True)
                adapter.relays[fmt] = (hashed, transport.relay_plan(
                    hashed, files, piece_bytes=self.piece_bytes))
            plan = rollout_pb2.RelayPlan()
            plan.CopyFrom(adapter.relays[fmt][1])
        plan.readers[:] = readers
        return plan

    def manifest(self, files: Mapping[str, bytes], version: int) -> AdapterManifest:
        """The manifest of the adapter's ``files`` at ``version`` (no digests)."""
        return build_manifest(files, name=self.name, version=version,
                              base_model=self.base_model, hash_files=False)

    def payload(self, adapter: AdapterVersion, fmt: str
                ) -> tuple[AdapterManifest, Mapping[str, bytes]]:
        """The (manifest, files) of ``adapter`` in ``fmt``, converting once per version."""
        with self._lock:
            if fmt not in adapter.payloads:
                if fmt != "mlx":
                    raise ValueError(f"adapter_format {fmt!r} is not peft or mlx")
                _, peft_files = adapter.payloads["peft"]
                mlx_files = convert_files(peft_files, "mlx", self.base_model.num_layers)
                adapter.payloads["mlx"] = (self.manifest(mlx_files, adapter.version), mlx_files)
            return adapter.payloads[fmt]
