"""host:port addresses."""

from __future__ import annotations

import errno
import socket

from gridrl.common.errors import invalid_argument


def parse_address(address: str, field: str = "address") -> tuple[str, int]:
    """Split ``"host:port"`` (IPv6 as ``"[::1]:50051"``) into ``(host, port)``.

    Raises:
        StatusError: INVALID_ARGUMENT naming ``field`` when empty, without a port, or with a
            port outside 1..65535 (0 is accepted only by servers binding, see ``allow_zero``).
    """
    return _parse(address, field, allow_zero=False)


def parse_listen(address: str, field: str = "listen") -> tuple[str, int]:
    """Like :func:`parse_address` but port 0 (pick a free port) is allowed."""
    return _parse(address, field, allow_zero=True)


def _parse(address: str, field: str, allow_zero: bool) -> tuple[str, int]:
    if not address:
        raise invalid_argument(field, "is required (host:port)")
    scheme, sep, rest = address.partition("://")
    if sep:  # a URL: gRPC addresses have no scheme (http:// made grpc read a domain name)
        bare = rest.split("/", 1)[0] or "host:port"
        raise invalid_argument(field, f"{address!r} is not host:port: drop the {scheme}:// "
                                      f"(give {bare})")
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise invalid_argument(field, f"{address!r} is not [ipv6]:port")
        port_s = rest[1:]
    else:
        host, sep, port_s = address.rpartition(":")
        if not sep:  # a bare host: grpc would dial its default port 443
            raise invalid_argument(field, f"{address!r} is not host:port: the port is missing "
                                          f"(give {address}:PORT)")
        if not host:
            raise invalid_argument(field, f"{address!r} is not host:port")
        if ":" in host:
            raise invalid_argument(field, f"{address!r}: write IPv6 hosts as [addr]:port")
    if not port_s.isdigit():
        raise invalid_argument(field, f"{address!r}: port {port_s!r} is not a number")
    port = int(port_s)
    if not (0 if allow_zero else 1) <= port <= 65535:
        raise invalid_argument(field, f"{address!r}: port {port} is out of range")
    return host, port


def canonical_address(address: str) -> str:
    """One spelling of a node's address, for comparing who holds it: the host lowercased and
    without a trailing dot (DNS names are case-insensitive; ``host.`` is ``host``), the port
    as a plain number (``050051`` is ``50051``). ``"Mac-Mini.lan.:050051"`` ->
    ``"mac-mini.lan:50051"``.

    Raises:
        StatusError: INVALID_ARGUMENT as :func:`parse_address`.
    """
    host, port = parse_address(address)
    return join_address(host.lower().rstrip(".") or host, port)


def join_address(host: str, port: int) -> str:
    """Inverse of :func:`parse_address`; brackets IPv6 hosts."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def port_in_use(host: str, port: int) -> bool:
    """Whether ``port`` on ``host`` (a bindable address of this machine) is taken: a test bind
    fails with EADDRINUSE. Port 0 (any free port) and negative ports (off) are never in use;
    other bind errors (not an address of this machine) are left to the server's own bind."""
    if port <= 0:
        return False
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # as servers bind: a port in TIME_WAIT after a previous run is free to them
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False
