"""What a process proves and checks on the network, as one object every server and channel
takes, and the rule that keeps servers off the network until they are protected.

    security = Security(tls=TlsFiles(cert, key, ca), authorized=AuthorizedTokens(path),
                        token=read_token_file(path))
    GrpcServer(listen, security=security)     # TLS / mTLS, accepts the authorized tokens
    dial(address, security)                   # TLS / mTLS, sends the token

The command-line flags that build it are in :mod:`gridrl.common.cli` (``server_options``,
``client_security_options``).

Safe default: a server may listen on a loopback address as it likes, but one listening on any
other address (``0.0.0.0``, a LAN address, a host name) must serve TLS *and* check credentials,
or be started with ``--insecure`` (:func:`check_exposure`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from gridrl.common.security.tls import TlsFiles
from gridrl.common.security.tokens import AuthorizedTokens


class ExposedError(ValueError):
    """A server would listen beyond loopback without TLS and credentials (the message says
    what to add)."""


@dataclass(frozen=True)
class Security:
    """A process's TLS identity, the credentials its server accepts and the token it sends.

    Attributes:
        tls: certificate, key and CA files (:class:`gridrl.common.security.tls.TlsFiles`).
        authorized: the credentials a server accepts (None: it checks none; allowed on
            loopback, or with ``insecure``).
        token: the bearer token a client sends (None: none).
        insecure: let a server listen beyond loopback without TLS and credentials.
    """

    tls: TlsFiles = field(default_factory=TlsFiles)
    authorized: AuthorizedTokens | None = None
    token: str | None = None
    insecure: bool = False

    def __repr__(self) -> str:  # never print the token
        return (f"Security(tls={self.tls!r}, authorized="
                f"{self.authorized.path if self.authorized else None}, "
                f"token={'<set>' if self.token else None}, insecure={self.insecure})")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IPs (``127.0.0.0/8``, ``::1``); brackets allowed."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, security: Security | None) -> str | None:
    """What is unprotected about a server that ``--insecure`` let listen beyond loopback
    (None: loopback, or TLS and credentials both there): said as a WARNING at start, naming the
    real bind address (the server's ``address`` shows a wildcard host as loopback)."""
    security = security or Security()
    if is_loopback(host):
        return None
    tls, tokens = security.tls.serves_tls, security.authorized is not None
    if tls and tokens:
        return None
    if tokens:
        return ("reachable from other machines without TLS (--insecure): the bearer tokens "
                "cross the network in cleartext, readable and replayable by anyone on it")
    if tls and security.tls.mutual:
        return ("reachable from other machines without credentials (--insecure): any client "
                "whose certificate the CA signed may call every RPC")
    if tls:
        return ("reachable from other machines without credentials or client certificates "
                "(--insecure): anyone on the network may call every RPC over TLS")
    return ("reachable from other machines with no TLS and no credentials (--insecure): anyone "
            "on the network may call every RPC (push adapters, rewrite the registry)")


def check_exposure(host: str, security: Security | None, listen_flag: str = "--listen") -> None:
    """Refuse to serve on a non-loopback ``host`` without TLS and credentials.

    Raises:
        ExposedError: when ``host`` is not loopback, ``security`` lacks a TLS certificate or
            authorized tokens, and ``insecure`` is not set; the message names the flags to add.
    """
    security = security or Security()
    if is_loopback(host) or security.insecure:
        return
    missing = []
    if not security.tls.serves_tls:
        missing.append("TLS (--tls-cert and --tls-key; --tls-ca for mutual TLS)")
    if security.authorized is None:
        missing.append("credentials (--authorized-tokens)")
    if not missing:
        return
    raise ExposedError(
        f"{listen_flag}: {host or '0.0.0.0'} is reachable from other machines but the server "
        f"has no {' and no '.join(missing)}: anyone on the network could call it (push "
        "adapters, rewrite the registry). Add them (README: Running across machines safely), "
        "listen on 127.0.0.1, or pass --insecure to run unprotected anyway.")
