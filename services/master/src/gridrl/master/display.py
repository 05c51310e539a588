"""Rendering of registry records for ``gridrl-master nodes``: a rich table or JSON."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from google.protobuf.json_format import MessageToDict

from gridrl.v1 import common_pb2, registry_pb2
from gridrl.v1.enums import enum_word

COLUMNS = ("ADDRESS", "ROLE", "BACKEND", "MODEL", "ADAPTER", "STATUS", "LAST SEEN")


def adapter_label(adapter: common_pb2.AdapterRef) -> str:
    """``"name@v3"``; ``"base"`` for version 0 with no name."""
    if not adapter.name and not adapter.version:
        return "base"
    return f"{adapter.name or '?'}@v{adapter.version}"


def last_seen_label(record: registry_pb2.NodeRecord, now: float) -> str:
    """``"2025-01-02T03:04:05Z (1.2s ago)"`` from the record's wall-clock ``last_seen``."""
    seen = record.last_seen.ToNanoseconds() / 1e9
    stamp = dt.datetime.fromtimestamp(seen, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"{stamp} ({max(0.0, now - seen):.1f}s ago)"


def node_row(record: registry_pb2.NodeRecord, now: float) -> tuple[str, ...]:
    """The table cells of one record, in :data:`COLUMNS` order."""
    info = record.info
    return (info.address, enum_word(common_pb2.NodeRole, info.role, None),
            enum_word(common_pb2.Backend, info.backend, None) if info.backend else "-",
            info.base_model.model_id or "-", adapter_label(info.adapter),
            enum_word(common_pb2.NodeStatus, record.status, None), last_seen_label(record, now))


def nodes_table(records: list[registry_pb2.NodeRecord], now: float | None = None):
    """A ``rich.table.Table`` of ``records`` (one row each, in the given order); ``now`` is
    the wall-clock time (seconds) ages are measured against, default ``time.time()``."""
    from rich import box
    from rich.table import Table

    now = time.time() if now is None else now
    # Whitespace-separated columns: readable, and awk/grep-friendly.
    table = Table(box=box.SIMPLE_HEAD, caption=f"{len(records)} node(s)",
                  caption_justify="left")
    for name in COLUMNS:
        table.add_column(name, no_wrap=True)
    for record in records:
        table.add_row(*node_row(record, now))
    return table


def nodes_json(records: list[registry_pb2.NodeRecord]) -> dict[str, Any]:
    """``{"nodes": [...]}``: each record as proto3 JSON with proto field names and every field
    (zeros included), enums by name."""
    return {"nodes": [MessageToDict(r, preserving_proto_field_name=True,
                                    always_print_fields_with_no_presence=True)
                      for r in records]}
