"""A private CA and certificates for a gridrl cluster (``gridrl-auth ca`` / ``gridrl-auth cert``).

Every certificate is for one machine (or process): ECDSA P-256, its host names and IPs as
subject alternative names, usable both as a server certificate and as a client certificate
(extended key usages serverAuth and clientAuth), so one pair serves a node's gRPC port and
authenticates it to the master. Any other PEM certificates work as well (an existing PKI, the
openssl recipe in the README).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

CA_DAYS = 3650
CERT_DAYS = 825


class CertError(ValueError):
    """The CA files are missing or unreadable, or an output file already exists."""


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600 (never overwrite)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as e:
        raise CertError(f"{path} exists; not overwriting it") from e
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _check_free(*paths: Path) -> None:
    for path in paths:
        if path.exists():
            raise CertError(f"{path} exists; not overwriting it")


def make_ca(directory: str | os.PathLike, name: str = "gridrl CA") -> tuple[Path, Path]:
    """Write ``ca.crt`` (0644) and ``ca.key`` (0600) into ``directory`` (created): a
    self-signed CA valid for :data:`CA_DAYS` days that may sign only end-entity certificates.

    Returns:
        (certificate path, key path).
    Raises:
        CertError: either file exists already.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    crt, key_path = directory / "ca.crt", directory / "ca.key"
    _check_free(crt, key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    _write_private(key_path, _key_pem(key))
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return crt, key_path


def make_cert(directory: str | os.PathLike, name: str, hosts: list[str]) -> tuple[Path, Path]:
    """Write ``<name>.crt`` (0644) and ``<name>.key`` (0600) into ``directory``, signed by the
    ``ca.crt`` / ``ca.key`` there, for ``hosts`` (DNS names and IP addresses; the first is
    also the common name), valid :data:`CERT_DAYS` days, for serverAuth and clientAuth.

    Returns:
        (certificate path, key path).
    Raises:
        CertError: no CA in ``directory``, no host, a bad name, or an output file exists.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise CertError(f"NAME: {name!r} must be a plain file name")
    if not hosts:
        raise CertError("--host: give at least one host name or IP the certificate is for")
    crt, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    _check_free(crt, key_path)
    try:
        ca_cert = x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes())
        ca_key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    except (OSError, ValueError) as e:
        raise CertError(f"--dir: no usable ca.crt/ca.key in {directory} ({e}); make one with "
                        "`gridrl-auth ca`") from e
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=True, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write_private(key_path, _key_pem(key))
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return crt, key_path


@dataclass(frozen=True)
class LocalIdentity:
    """What :func:`local_identities` made for one process: its certificate and key (for
    localhost and 127.0.0.1), the CA, its token file (None: it calls nobody), and the
    authorized-tokens file every server of the set reads."""

    cert: Path
    key: Path
    ca: Path
    token: Path | None
    authorized: Path

    def client_flags(self) -> list[str]:
        """``--tls-*`` (mutual TLS) and ``--auth-token-file`` for a client command."""
        token = ["--auth-token-file", str(self.token)] if self.token else []
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca",
                str(self.ca), *token]

    def server_flags(self) -> list[str]:
        """:meth:`client_flags` plus ``--authorized-tokens`` for a ``serve``/``run`` command."""
        return [*self.client_flags(), "--authorized-tokens", str(self.authorized)]


def local_identities(directory: str | os.PathLike,
                     scopes: dict[str, str | None]) -> dict[str, LocalIdentity]:
    """A CA, a certificate per name of ``scopes`` (for localhost and 127.0.0.1) and a token of
    the given scope per name (None: no token), each token bound to its name's certificate,
    all in ``directory``: what a set of processes on one machine needs to run with mutual TLS
    and scoped credentials (``make demo``'s ``--secure``, the benchmarks, tests).

    Raises:
        CertError, AuthError: ``directory`` already holds one of the files.
    """
    from gridrl.common.security.minting import mint
    from gridrl.common.security.tokens import certificate_file_fingerprint

    directory = Path(directory)
    ca, _ = make_ca(directory)
    authorized = directory / "authorized_tokens"
    out = {}
    for name, scope in scopes.items():
        cert, key = make_cert(directory, name, ["localhost", "127.0.0.1"])
        token = None
        if scope is not None:
            token = directory / f"{name}.token"
            mint(authorized, token, scope, name, cert=certificate_file_fingerprint(cert))
        out[name] = LocalIdentity(cert, key, ca, token, authorized)
    return out
