"""The adapter manifest: what an adapter is, what base model it fits, and its files' digests.

One type, :class:`AdapterManifest`, converted straight to and from the protobuf message
``gridrl.v1.AdapterManifest`` (:meth:`AdapterManifest.to_proto`, :meth:`AdapterManifest.from_proto`)
for the wire, and to and from a JSON dict (:meth:`AdapterManifest.to_dict`, ``format`` "peft" /
"mlx") for files on disk (a node's stored pushes, ``gridrl-adapters manifest --json``).
:meth:`AdapterManifest.from_dict` also reads older JSON forms: the enum name
(``ADAPTER_FORMAT_PEFT``) or number as ``format``, ``MessageToDict`` output (camelCase or not,
64-bit ints as strings).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gridrl.adapters.adapter import Format
from gridrl.adapters.base_model import local_identity
from gridrl.adapters.convert import read_adapter
from gridrl.adapters.errors import AdapterError
from gridrl.adapters.io import check_relpath, read_dir
from gridrl.adapters.wire import (
    adapter_format_from_json,
    adapter_format_from_proto,
    adapter_format_to_proto,
    base_model_from_proto,
    base_model_to_proto,
)
from gridrl.models import ModelIdentity
from gridrl.v1 import common_pb2


@dataclass
class AdapterFile:
    """One file: '/'-separated relative ``path``, ``size_bytes``, lower-case hex ``sha256``."""

    path: str
    size_bytes: int
    sha256: str

    @classmethod
    def of(cls, path: str, data: bytes) -> AdapterFile:
        return cls(path, len(data), hashlib.sha256(data).hexdigest())


@dataclass
class AdapterManifest:
    """Self-description of an adapter (proto ``gridrl.v1.AdapterManifest``).

    Attributes:
        name: adapter name; version: policy version (0: unset).
        format: "peft" or "mlx".
        base_model: the base model it was trained on (zero fields: unknown).
        rank: LoRA rank r (the config's when modules differ).
        scale: effective scale of B @ A: peft ``lora_alpha / r`` (``/ sqrt(r)`` under rsLoRA),
            mlx ``scale`` (the config's when modules differ).
        target_modules: module paths inside a block ("self_attn.q_proj"), sorted; LoRA
            modules outside the blocks appear with their full path.
        layers: adapted block indices, ascending.
        files: every file, sorted by path (the streaming order).
    """

    name: str = ""
    version: int = 0
    format: Format | Literal[""] = ""
    base_model: ModelIdentity = field(default_factory=ModelIdentity)
    rank: int = 0
    scale: float = 0.0
    target_modules: list[str] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)
    files: list[AdapterFile] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The schema of the brief: ``format`` "peft"/"mlx", ints as ints."""
        return {
            "name": self.name, "version": self.version, "format": self.format,
            "base_model": self.base_model.to_dict(), "rank": self.rank, "scale": self.scale,
            "target_modules": list(self.target_modules), "layers": list(self.layers),
            "files": [{"path": f.path, "size_bytes": f.size_bytes, "sha256": f.sha256}
                      for f in self.files],
        }

    def to_proto(self) -> common_pb2.AdapterManifest:
        """The ``gridrl.v1.AdapterManifest`` message (format by enum name; an unknown format is
        ``ADAPTER_FORMAT_UNSPECIFIED``, which a node refuses)."""
        return common_pb2.AdapterManifest(
            name=self.name, version=self.version, format=adapter_format_to_proto(self.format),
            base_model=base_model_to_proto(self.base_model), rank=self.rank, scale=self.scale,
            target_modules=self.target_modules, layers=self.layers,
            files=[common_pb2.AdapterFile(path=f.path, size_bytes=f.size_bytes, sha256=f.sha256)
                   for f in self.files])

    @classmethod
    def from_proto(cls, message: common_pb2.AdapterManifest) -> AdapterManifest:
        """Inverse of :meth:`to_proto` (format ``""`` when unspecified)."""
        return cls(
            name=message.name, version=message.version,
            format=adapter_format_from_proto(message.format),
            base_model=base_model_from_proto(message.base_model), rank=message.rank,
            scale=message.scale, target_modules=list(message.target_modules),
            layers=list(message.layers),
            files=[AdapterFile(f.path, f.size_bytes, f.sha256) for f in message.files])

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AdapterManifest:
        """Inverse of :meth:`to_dict`; also reads the older JSON forms (module docstring).
        Missing fields take their zero value.

        Raises:
            AdapterError: an unknown format or a malformed field.
        """
        def get(key: str, default: Any = None) -> Any:
            camel = key.split("_")[0] + "".join(w.title() for w in key.split("_")[1:])
            return d.get(key, d.get(camel, default))

        raw = get("format", "")
        try:  # the word, or older files' and MessageToDict's enum names and numbers
            fmt = adapter_format_from_json(raw)
        except ValueError:
            raise AdapterError(f"manifest.format: {raw!r} is not peft or mlx") from None
        try:
            files = [AdapterFile(str(f["path"]), int(f.get("size_bytes", f.get("sizeBytes", 0))),
                                 str(f.get("sha256", ""))) for f in get("files", [])]
            return cls(
                name=str(get("name", "")), version=int(get("version", 0)),
                format=fmt, base_model=ModelIdentity.from_any(get("base_model")),
                rank=int(get("rank", 0)), scale=float(get("scale", 0.0)),
                target_modules=[str(t) for t in get("target_modules", [])],
                layers=[int(i) for i in get("layers", [])], files=files,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise AdapterError(f"manifest: malformed field: {e!r}") from e


def _infer_base(adapter, infer_local: bool) -> ModelIdentity:
    base = ModelIdentity(model_id=adapter.base_model_path)
    local = local_identity(adapter.base_model_path) if infer_local else None
    if local is not None:
        base = local
    num_layers = base.num_layers
    if not num_layers:
        layers = adapter.layers()
        if layers and adapter.format == "mlx" and (adapter.mlx_num_layers or 0) > 0:
            num_layers = layers[-1] + 1  # mlx-lm adapts the last N blocks
        elif layers and adapter.all_layers and layers == list(range(len(layers))):
            num_layers = len(layers)
    return dataclasses.replace(base, hidden_size=base.hidden_size or adapter.hidden_size(),
                               num_layers=num_layers)


def build_manifest(files: Mapping[str, bytes] | Path | str, *, name: str = "", version: int = 0,
                   base_model: Mapping[str, Any] | Any | None = None,
                   infer_local: bool = True, hash_files: bool = True) -> AdapterManifest:
    """The manifest of an adapter (file name -> bytes, or a directory).

    ``base_model`` (a :class:`gridrl.models.ModelIdentity`, or a dict of its fields)
    wins field by field; fields it leaves zero are inferred: the local
    ``base_model_name_or_path/config.json`` (mlx: ``model``) when ``infer_local`` and it exists,
    the hidden size from tensor shapes, the block count where the config implies it (mlx-lm
    adapts the last N blocks, so its last adapted block is the model's last).
    ``hash_files=False`` leaves each file's sha256 empty (sizes only): for checks that only
    read the model fields, and for a push that sends the digests after the bytes
    (``gridrl.common.transport.push_requests`` hashes while it streams).

    Raises:
        AdapterError: not a readable peft / mlx adapter, or an unsafe file path.
    """
    if isinstance(files, (str, Path)):
        files = read_dir(files)
    for path in files:
        check_relpath(path)
    with ThreadPoolExecutor(1) as pool:
        # hashlib releases the GIL: the digests are computed while the tensors are parsed.
        hashed = pool.submit(lambda: [AdapterFile.of(p, files[p]) for p in sorted(files)]) \
            if hash_files else None
        adapter = read_adapter(files)
        listed = hashed.result() if hashed is not None else [
            AdapterFile(p, len(files[p]), "") for p in sorted(files)]
    base = _infer_base(adapter, infer_local)
    if base_model is not None:
        base = base.known(**ModelIdentity.from_any(base_model).to_dict())
    rank = adapter.uniform_rank()
    scale = adapter.uniform_scale()
    return AdapterManifest(
        name=name, version=version, format=adapter.format, base_model=base,
        rank=rank if rank is not None else adapter.rank,
        scale=scale if scale is not None else adapter.scale,
        target_modules=adapter.target_modules(), layers=adapter.layers(),
        files=listed,
    )


def verify_files(manifest: AdapterManifest, files: Mapping[str, bytes]) -> None:
    """Check that ``files`` are exactly the manifest's: same paths, sizes and sha256.

    Raises:
        AdapterError: naming the first file missing, unexpected, or with a wrong size or
            digest (``"adapter_model.safetensors: sha256 ab12... does not match the manifest's
            cd34..."``).
    """
    listed = {f.path: f for f in manifest.files}
    for path in sorted(listed):
        if path not in files:
            raise AdapterError(f"{path}: missing (listed in the manifest)")
    for path in sorted(files):
        if path not in listed:
            raise AdapterError(f"{path}: unexpected file (not in the manifest)")
        data, want = files[path], listed[path]
        if len(data) != want.size_bytes:
            raise AdapterError(f"{path}: {len(data)} bytes, the manifest says {want.size_bytes}")
        digest = hashlib.sha256(data).hexdigest()
        if digest != want.sha256.lower():
            raise AdapterError(f"{path}: sha256 {digest} does not match the manifest's "
                               f"{want.sha256}")


def check_fits(manifest_or_files: AdapterManifest | Mapping[str, bytes] | Path | str,
               base_model: Mapping[str, Any] | Any) -> None:
    """Refuse an adapter made for another base model, before loading it.

    Files (or a directory) are judged by what their tensors and config say, never by a local
    base-model directory; a manifest by its fields. A field unknown on either side (zero or
    empty) is not compared.

    Raises:
        AdapterError: ``"adapter does not fit the base model: hidden_size: adapter 64, base
            model 576; ..."`` naming each mismatch: architecture, hidden_size, num_layers,
            layers (a block index beyond the base model's), vocab_size, and
            weights_fingerprint (``"weights_fingerprint: adapter trained on 'wfp1:...'
            (model_id), base model 'wfp1:...' (model_id): another checkpoint of this
            architecture"``).
    """
    if isinstance(manifest_or_files, AdapterManifest):
        manifest = manifest_or_files
    else:
        manifest = build_manifest(manifest_or_files, infer_local=False, hash_files=False)
    base = ModelIdentity.from_any(base_model)
    have = manifest.base_model
    problems = [
        f"{key}: adapter {getattr(have, key)!r}, base model {getattr(base, key)!r}"
        for key in ("architecture", "hidden_size", "num_layers", "vocab_size")
        if getattr(have, key) and getattr(base, key) and getattr(have, key) != getattr(base, key)
    ]
    if have.weights_fingerprint and base.weights_fingerprint and \
            have.weights_fingerprint != base.weights_fingerprint:
        problems.append(f"weights_fingerprint: adapter trained on {have.weights_fingerprint!r} "
                        f"({have.model_id or 'model id unknown'}), base model "
                        f"{base.weights_fingerprint!r} ({base.model_id or 'model id unknown'}): "
                        "another checkpoint of this architecture")
    if base.num_layers and manifest.layers and manifest.layers[-1] >= base.num_layers:
        problems.append(f"layers: adapter adapts block {manifest.layers[-1]}, base model has "
                        f"{base.num_layers} blocks")
    if problems:
        raise AdapterError("adapter does not fit the base model: " + "; ".join(problems))
