"""Server reflection that also serves the ``.proto`` comments, so ``grpcurl describe`` shows
each RPC's and field's documentation.

grpcio-reflection answers from the process's descriptor pool, and the generated ``*_pb2``
modules register their files without source info (protoc's Python generator drops comments).
``gridrl/v1/descriptors.binpb``, generated beside them by ``scripts/gen_protos.sh`` from the
same ``protos/`` (``--include_source_info``; the freshness check covers it), holds the same
files with their comments: this servicer answers file requests as grpcio-reflection does, then
adds the ``source_code_info`` (the comments and their locations) of every gridrl file to the
descriptor it serves. Nothing else changes (clients see the same fields, names and JSON
names as before); files it has no copy of (health, reflection, well-known types) are served
as they were.
"""

from __future__ import annotations

import functools
import importlib.resources
import logging
from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

log = logging.getLogger(__name__)


@functools.cache
def documented_files() -> dict[str, descriptor_pb2.SourceCodeInfo]:
    """File name (``gridrl/v1/rollout.proto``) -> its ``SourceCodeInfo`` (comments), from the
    packaged descriptor set; empty (with a warning) if it is missing."""
    try:
        raw = importlib.resources.files("gridrl.v1").joinpath("descriptors.binpb").read_bytes()
    except (FileNotFoundError, ModuleNotFoundError) as e:
        log.warning("reflection without proto comments: %s", e)
        return {}
    files = descriptor_pb2.FileDescriptorSet.FromString(raw).file
    return {f.name: f.source_code_info for f in files}


class DocumentedReflectionServicer(reflection.ReflectionServicer):
    """``grpc.reflection.v1alpha.ServerReflection`` for ``service_names``, gridrl's files with
    their comments (see the module docstring)."""

    def __init__(self, service_names: Iterable[str]) -> None:
        super().__init__(service_names)
        self._documented = documented_files()

    def _documented_response(self, response: Any) -> Any:
        if response.HasField("file_descriptor_response"):
            protos = response.file_descriptor_response.file_descriptor_proto
            for i, raw in enumerate(protos):
                file = descriptor_pb2.FileDescriptorProto.FromString(raw)
                if file.name in self._documented:
                    file.source_code_info.CopyFrom(self._documented[file.name])
                    protos[i] = file.SerializeToString()
        return response

    def _file_by_filename(self, request: Any, filename: str) -> Any:
        return self._documented_response(super()._file_by_filename(request, filename))

    def _file_containing_symbol(self, request: Any, fully_qualified_name: str) -> Any:
        return self._documented_response(
            super()._file_containing_symbol(request, fully_qualified_name))

    def _file_containing_extension(self, request: Any, containing_type: str,
                                   extension_number: int) -> Any:
        return self._documented_response(
            super()._file_containing_extension(request, containing_type, extension_number))


def enable(service_names: Iterable[str], server: grpc.Server) -> None:
    """Add reflection for ``service_names`` (plus itself) to ``server``."""
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        DocumentedReflectionServicer([*service_names]), server)


SERVICE_NAME = reflection.SERVICE_NAME
__all__ = ["SERVICE_NAME", "DocumentedReflectionServicer", "documented_files", "enable"]
