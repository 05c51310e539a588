"""TLS and mutual TLS for every server and channel: ``--tls-cert``, ``--tls-key``, ``--tls-ca``.

A process has one TLS identity: the certificate and key it serves with (servers) and presents
(clients, for mutual TLS), and the CA it checks its peers against:

* a server with ``--tls-cert``/``--tls-key`` serves TLS; given ``--tls-ca`` too it requires
  every client to present a certificate that CA signed (mutual TLS);
* a client with ``--tls-ca`` speaks TLS and verifies the server's certificate against that CA
  (and that it names the host dialed); with ``--tls-cert``/``--tls-key`` it also presents its
  own certificate. A rollout node uses the same files as a client of the master.

Files are PEM; keys unencrypted (protect them with file permissions). They are read and checked
(pair matching, parseable CA) once, at start: replacing a certificate needs a restart.
``gridrl-auth ca`` and ``gridrl-auth cert`` make a CA and certificates (:mod:`gridrl.common.security.certs`).
"""

from __future__ import annotations

import logging
import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


class TlsError(ValueError):
    """A TLS file is missing, unreadable, not PEM, or a key does not match its certificate.
    The message is ``"<flag>: <problem>"``.

    Attributes:
        flag: the flag at fault (``"--tls-key"``); problem: the message without it.
    """

    def __init__(self, flag: str, problem: str) -> None:
        super().__init__(f"{flag}: {problem}")
        self.flag, self.problem = flag, problem


@dataclass(frozen=True)
class TlsFiles:
    """Paths of a process's TLS identity and trusted CA (any may be None).

    Attributes:
        cert: PEM certificate (chain) served or presented.
        key: PEM private key of ``cert``.
        ca: PEM CA certificate(s): servers require client certificates it signed (mutual TLS);
            clients verify servers against it.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @property
    def serves_tls(self) -> bool:
        """A server with these files serves TLS (certificate and key given)."""
        return bool(self.cert and self.key)

    @property
    def mutual(self) -> bool:
        """A server with these files requires client certificates."""
        return self.serves_tls and bool(self.ca)

    @property
    def dials_tls(self) -> bool:
        """A client with these files speaks TLS (a CA to verify the server is given)."""
        return bool(self.ca)

    def check(self, role: str) -> TlsFiles:
        """Check the files now (readable, PEM, key matching certificate) for ``role``
        ``"server"`` or ``"client"``. Returns self.

        Raises:
            TlsError: naming the flag: a certificate without its key or the other way round;
                a server given ``--tls-ca`` but no certificate; a client given a certificate
                but no ``--tls-ca``; an unreadable or malformed file; a key that does not
                match the certificate or is encrypted.
        """
        if bool(self.cert) != bool(self.key):
            raise (TlsError("--tls-key", "required with --tls-cert") if self.cert else
                   TlsError("--tls-cert", "required with --tls-key"))
        if role == "server" and self.ca and not self.cert:
            raise TlsError("--tls-cert", "a server given --tls-ca (mutual TLS) needs its own "
                                         "--tls-cert and --tls-key")
        if role == "client" and self.cert and not self.ca:
            raise TlsError("--tls-ca", "required with --tls-cert: the CA that signed the "
                                       "server's certificate")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if self.cert:
            _read(self.cert, "--tls-cert", b"-----BEGIN CERTIFICATE-----", "a PEM certificate")
            _read(self.key, "--tls-key", b"PRIVATE KEY-----", "a PEM private key")
            _warn_if_shared(self.key)
            try:
                context.load_cert_chain(self.cert, self.key, password=_no_password)
            except (ssl.SSLError, OSError, TypeError) as e:
                reason = getattr(e, "reason", None) or str(e)
                if reason == "KEY_VALUES_MISMATCH":
                    raise TlsError("--tls-key", f"{self.key} is not the key of {self.cert}") from e
                raise TlsError("--tls-key", f"cannot use {self.key} with {self.cert} "
                                            f"({reason}; keys must be unencrypted PEM)") from e
        if self.ca:
            _read(self.ca, "--tls-ca", b"-----BEGIN CERTIFICATE-----", "a PEM CA certificate")
            try:
                context.load_verify_locations(cafile=self.ca)
            except (ssl.SSLError, OSError) as e:
                raise TlsError("--tls-ca", f"{self.ca} is not a PEM CA certificate "
                                           f"({getattr(e, 'reason', None) or e})") from e
        return self

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``add_secure_port``: this certificate, and with a CA, required
        client certificates signed by it.

        Raises:
            TlsError: as :meth:`check`, or when no certificate is given.
        """
        self.check("server")
        if not self.serves_tls:
            raise TlsError("--tls-cert", "a TLS server needs --tls-cert and --tls-key")
        ca = _read(self.ca, "--tls-ca") if self.ca else None
        return grpc.ssl_server_credentials(
            [(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))],
            root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for ``secure_channel``: verify the server against the CA; present this
        certificate when given (mutual TLS).

        Raises:
            TlsError: as :meth:`check`.
        """
        self.check("client")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "--tls-ca") if self.ca else None,
            private_key=_read(self.key, "--tls-key") if self.key else None,
            certificate_chain=_read(self.cert, "--tls-cert") if self.cert else None)


def _read(path: str | None, flag: str, marker: bytes | None = None, what: str = "") -> bytes:
    try:
        data = Path(path or "").read_bytes()
    except OSError as e:
        raise TlsError(flag, f"cannot read {path}: {e.strerror or e}") from e
    if marker is not None and marker not in data:
        raise TlsError(flag, f"{path} is not {what}")
    return data


def _no_password() -> bytes:
    raise TlsError("--tls-key", "the key is encrypted; gridrl needs an unencrypted key "
                                "(protect it with file permissions)")


def _warn_if_shared(key: str | None) -> None:
    try:
        mode = os.stat(key or "").st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("--tls-key: %s is readable by other users; chmod 600 it", key)
