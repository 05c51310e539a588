"""A received adapter (pushed or fetched) checked against the node's base model and converted to
its backend's format: the header check before any byte arrives (:func:`check_header`), then,
once the files are in, the format they really are, what their tensors say about the base
model, and the conversion (:func:`check_and_convert`). No I/O and no node state: the adapter
manager (:mod:`.adapter_manager`) stores and swaps what comes out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gridrl.adapters import (
    AdapterError,
    AdapterManifest,
    build_manifest,
    check_fits,
    convert_files,
    detect_format,
)
from gridrl.common.errors import failed_precondition, invalid_argument
from gridrl.common.transport import ReceivedAdapter
from gridrl.models import ModelIdentity
from gridrl.v1 import common_pb2


def check_header(manifest: common_pb2.AdapterManifest, identity: ModelIdentity) -> None:
    """Refuse, before any byte arrives, a push made for another base model.

    Raises:
        StatusError: INVALID_ARGUMENT (a name starting with '.'), FAILED_PRECONDITION (made
            for another base model than ``identity``).
    """
    if manifest.name.startswith("."):
        raise invalid_argument("header.manifest.name", f"{manifest.name!r} must not start "
                                                       "with '.'")
    try:
        check_fits(AdapterManifest.from_proto(manifest), identity)
    except AdapterError as e:
        raise failed_precondition(f"header.manifest.base_model: {e}") from e


@dataclass(frozen=True)
class ReadyAdapter:
    """A received adapter's files, checked and in the backend's format.

    Attributes:
        name: the adapter's name (the run).
        version: its policy version.
        pushed_format: the format it arrived in (``peft``, ``mlx``).
        converted: True when ``files`` were converted from ``pushed_format``.
        files: relative path -> bytes, in the backend's format.
        meta: what the store records beside the files (name, version, format, pushed format,
            converted, the manifest as a dict).
        verify_s: seconds spent verifying (the receiver's part included).
        convert_s: seconds spent converting (0 when not converted).
    """

    name: str
    version: int
    pushed_format: str
    converted: bool
    files: dict[str, bytes]
    meta: dict
    verify_s: float
    convert_s: float


def check_and_convert(received: ReceivedAdapter, identity: ModelIdentity,
                      adapter_format: str) -> ReadyAdapter:
    """Check ``received``'s files against the manifest's format and the base model
    ``identity``, and convert them to ``adapter_format`` when they are another.

    Raises:
        StatusError: INVALID_ARGUMENT (files that are not the declared format or do not parse,
            an adapter that cannot be converted), FAILED_PRECONDITION (tensors that do not fit
            the base model).
    """
    manifest = AdapterManifest.from_proto(received.manifest)
    name, version = manifest.name, manifest.version
    pushed_format = manifest.format
    t = time.perf_counter()
    files = received.files
    try:
        found = detect_format(files)
    except AdapterError as e:
        raise invalid_argument("header.manifest.files", str(e)) from e
    if found != pushed_format:
        raise invalid_argument("header.manifest.format",
                               f"says {pushed_format} but the files are a {found} adapter")
    try:  # what the tensors say: unreadable files are the caller's error ...
        described = build_manifest(files, infer_local=False, hash_files=False)
    except AdapterError as e:
        raise invalid_argument("adapter", str(e)) from e
    try:  # ... a well-formed adapter for another model is a precondition failure
        check_fits(described, identity)
    except AdapterError as e:
        raise failed_precondition(f"adapter: {e}") from e
    verify_s = received.verify_s + time.perf_counter() - t
    t = time.perf_counter()
    converted = pushed_format != adapter_format
    if converted:
        try:
            files = convert_files(files, adapter_format, num_layers=identity.num_layers)
        except AdapterError as e:
            raise invalid_argument("adapter", f"cannot convert {pushed_format} to "
                                              f"{adapter_format}: {e}") from e
    convert_s = time.perf_counter() - t if converted else 0.0
    meta = {"name": name, "version": version, "format": adapter_format,
            "pushed_format": pushed_format, "converted": converted,
            "manifest": manifest.to_dict()}
    return ReadyAdapter(name=name, version=version, pushed_format=pushed_format,
                        converted=converted, files=files, meta=meta, verify_s=verify_s,
                        convert_s=convert_s)
