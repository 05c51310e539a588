"""Checks on what nodes and clients send the master. Every failure is INVALID_ARGUMENT naming
the field (``gridrl.common.errors.invalid_argument``)."""

from __future__ import annotations

import ipaddress
import math
import re

from gridrl.common.address import parse_address
from gridrl.common.errors import invalid_argument
from gridrl.v1 import common_pb2, registry_pb2

# Hosts a server binds to but nobody can dial.
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*"})
# A DNS name (RFC 1123 labels; '_' tolerated, as container hostnames carry it).
_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)"
                       r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")
# Statuses a node may announce in a heartbeat (UNHEALTHY is the master's verdict, not the node's).
_REPORTABLE_STATUSES = frozenset({common_pb2.NODE_STATUS_UNSPECIFIED, common_pb2.NODE_STATUS_HEALTHY,
                                  common_pb2.NODE_STATUS_DRAINING})


def _check_enum(enum_type, value: int, field: str, required: bool) -> None:
    if value not in enum_type.values():
        raise invalid_argument(field, f"unknown value {value}")
    if required and value == 0:
        names = ", ".join(n for n, v in enum_type.items() if v != 0)
        raise invalid_argument(field, f"is required (one of {names})")


def validate_register(request: registry_pb2.RegisterNodeRequest) -> None:
    """Check a RegisterNode request: ``node`` present, ``node.address`` a dialable host:port
    (an IP address or a host name, not a wildcard),
    ``node.role`` set and known, ``node.backend`` known and set for rollout nodes,
    ``node.adapter_format`` known.

    Raises:
        StatusError: INVALID_ARGUMENT whose message starts with the offending field.
    """
    if not request.HasField("node"):
        raise invalid_argument("node", "is required")
    node = request.node
    host, _port = parse_address(node.address, field="node.address")
    if host in _WILDCARD_HOSTS:
        raise invalid_argument("node.address", f"{node.address!r} is a wildcard; advertise an "
                                               "address other processes can dial")
    if not _dialable_host(host, bracketed=node.address.startswith("[")):
        raise invalid_argument("node.address", f"{node.address!r}: host {host!r} is neither an "
                                               "IP address nor a host name")
    _check_enum(common_pb2.NodeRole, node.role, "node.role", required=True)
    _check_enum(common_pb2.Backend, node.backend, "node.backend",
                required=node.role == common_pb2.NODE_ROLE_ROLLOUT)
    _check_enum(common_pb2.AdapterFormat, node.adapter_format, "node.adapter_format",
                required=False)


def _dialable_host(host: str, bracketed: bool) -> bool:
    """An IPv6 literal (inside brackets), or an IPv4 address or DNS name (outside)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return not bracketed and _HOSTNAME.fullmatch(host) is not None
    return bracketed == (ip.version == 6)


def validate_node_id(node_id: str) -> None:
    """Raises StatusError INVALID_ARGUMENT ``node_id: is required`` when empty."""
    if not node_id:
        raise invalid_argument("node_id", "is required (the id RegisterNode returned)")


def validate_heartbeat(request: registry_pb2.HeartbeatRequest) -> None:
    """Check a Heartbeat: ``node_id`` set, ``load`` finite in [0, 1], ``status`` unset, HEALTHY
    or DRAINING.

    Raises:
        StatusError: INVALID_ARGUMENT naming the field.
    """
    validate_node_id(request.node_id)
    if not (math.isfinite(request.load) and 0.0 <= request.load <= 1.0):
        raise invalid_argument("load", f"must be in [0, 1], got {request.load}")
    _check_enum(common_pb2.NodeStatus, request.status, "status", required=False)
    if request.status not in _REPORTABLE_STATUSES:
        raise invalid_argument("status", "a node may report only HEALTHY or DRAINING")


def validate_filter(role: int, backend: int, status: int = 0) -> None:
    """Check the enum filters of ListNodes / WatchNodes (0 = no filter).

    Raises:
        StatusError: INVALID_ARGUMENT naming ``role``, ``backend`` or ``status``.
    """
    _check_enum(common_pb2.NodeRole, role, "role", required=False)
    _check_enum(common_pb2.Backend, backend, "backend", required=False)
    _check_enum(common_pb2.NodeStatus, status, "status", required=False)
