"""Credentials: token files, authorized-tokens files and certificate fingerprints.

Credentials are bearer tokens read from files, never from a command-line value (``ps`` and
shell history would show it).

A **token file** (clients: ``--auth-token-file`` / ``GRIDRL_AUTH_TOKEN_FILE``; a container may
set ``GRIDRL_AUTH_TOKEN`` instead) holds one token: ``gridrl_`` followed by 43 url-safe
characters (256 random bits). Clients send it on every call as the metadata
``authorization: Bearer <token>``.

An **authorized-tokens file** (servers: ``--authorized-tokens`` / ``GRIDRL_AUTHORIZED_TOKENS``)
lists the credentials a server accepts, one a line, like ssh's ``authorized_keys`` but holding
only the sha256 of each token (the file is not a secret; the same file may go to every
machine)::

    # sha256 of the token                  scope    id          address (node scope only)
    sha256:4c1f0e...(64 hex digits)...e9     node     mac-mini    mac-mini.lan:50051
    sha256:90ab33...17                       trainer  trainer     cert=sha256:5d0c...a1
    sha256:77d2a0...c0                       read     grafana

``gridrl-auth mint`` writes a new token file and appends its line; ``gridrl-auth revoke ID``
removes a credential. Servers re-read the file when it changes, so a revocation takes effect
at the next call.

A credential with ``cert=sha256:<hex>`` is **bound to a client certificate** (the sha256 of
its DER encoding, as RFC 8705's ``x5t#S256``): a server accepts its token only on a mutual-TLS
connection whose client presented that certificate, so whoever sees the token (a rollout node
sees the trainer's on every call) cannot use it without the certificate's private key.
Anything else is UNAUTHENTICATED. Renewing the certificate means minting a new credential.

Scopes (:data:`METHOD_SCOPES` is the whole table; health and reflection stay open):


Which scope may call which RPC: :mod:`gridrl.common.security.access`; minting and revoking:
:mod:`gridrl.common.security.minting`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from gridrl.common.address import parse_address
from gridrl.common.errors import StatusError

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
TOKEN_PREFIX = "gridrl_"
DIGEST_PREFIX = "sha256:"

NODE, TRAINER, READ = "node", "trainer", "read"
SCOPES = (NODE, TRAINER, READ)

CERT_FIELD = "cert="  # an authorized-tokens line's certificate binding: cert=sha256:<hex>
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----\s*(.+?)\s*-----END CERTIFICATE-----",
                       re.S)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{16,512}")
_MISSING = (-1, -1, -1)  # file stamp of a file that cannot be stat'ed


class AuthError(ValueError):
    """A token file, an authorized-tokens file or a mint request is unusable. The message is
    ``"<field>: <problem>"``.

    Attributes:
        field: the flag, variable or file line at fault (``"--auth-token-file"``,
            ``"GRIDRL_AUTH_TOKEN"``, ``"/etc/gridrl/tokens:3"``); problem: the message without it.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


@dataclass(frozen=True)
class Credential:
    """One line of an authorized-tokens file.

    Attributes:
        id: who holds it (``[A-Za-z0-9][A-Za-z0-9._-]*``, unique in the file).
        scope: ``node``, ``trainer`` or ``read``.
        digest: ``sha256:<64 hex>`` of the token.
        address: node scope: the only host:port it may register (None: any address no other
            credential holds).
        cert: ``sha256:<64 hex>`` of the only client certificate (DER) its token is accepted
            with (None: any connection).
    """

    id: str
    scope: str
    digest: str
    address: str | None = None
    cert: str | None = None

    def line(self) -> str:
        """The credential as a line of the file (no newline)."""
        return " ".join(x for x in (self.digest, self.scope, self.id, self.address,
                                    self.cert and CERT_FIELD + self.cert) if x)


def cert_fingerprint(pem: bytes | str) -> str:
    """``"sha256:" + hex(sha256(DER))`` of the first certificate in ``pem`` (a PEM file's
    text, or a chain: the leaf comes first), the binding an authorized-tokens line stores.

    Raises:
        ValueError: ``pem`` holds no PEM certificate.
    """
    found = _PEM_CERT.search(pem.encode() if isinstance(pem, str) else pem)
    if found is None:
        raise ValueError("no PEM certificate (-----BEGIN CERTIFICATE-----)")
    der = base64.b64decode(b"".join(found.group(1).split()), validate=True)
    return DIGEST_PREFIX + hashlib.sha256(der).hexdigest()


def certificate_file_fingerprint(path: str | os.PathLike, flag: str = "--cert") -> str:
    """:func:`cert_fingerprint` of the certificate file ``path``.

    Raises:
        AuthError: ``<flag>: ...`` when the file cannot be read or holds no PEM certificate.
    """
    try:
        return cert_fingerprint(Path(path).read_bytes())
    except OSError as e:
        raise AuthError(flag, f"cannot read {path}: {e.strerror or e}") from e
    except ValueError as e:  # binascii.Error is a ValueError
        raise AuthError(flag, f"{path}: {e}") from e


def token_digest(token: str) -> str:
    """``"sha256:" + hex(sha256(token))``: what an authorized-tokens file stores."""
    return DIGEST_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random token: ``gridrl_`` + 43 url-safe characters (256 bits)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


# ------------------------------------------------------------------------------ token files


def read_token_file(path: str | os.PathLike, flag: str = "--auth-token-file") -> str:
    """The token in ``path`` (surrounding whitespace stripped). Warns when the file is readable
    by group or others.

    Raises:
        AuthError: ``<flag>: ...`` when the file is missing, unreadable, empty or holds more
            than one token.
    """
    try:
        text = Path(path).read_text()
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise AuthError(flag, f"cannot read {path}: {getattr(e, 'strerror', None) or e}") \
            from e
    token = text.strip()
    if not token:
        raise AuthError(flag, f"{path} is empty")
    return check_token(token, flag, mode, path)


def check_token(token: str, where: str, mode: int | None = None,
                path: str | os.PathLike | None = None) -> str:
    """``token`` when it looks like a bearer token (16-512 url-safe characters, no spaces);
    ``where`` the flag or variable it came from, ``path`` the file it was read from.

    Raises:
        AuthError: ``<where>: [<path>: ]...`` otherwise.
    """
    source = f"{path}: " if path is not None else ""
    if not _TOKEN.fullmatch(token):
        raise AuthError(where, f"{source}not a token (one line of 16-512 url-safe characters, "
                               "no spaces)")
    if mode is not None and mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s is readable by other users; chmod 600 it",
                    where if path is None else f"{where}: {path}")
    return token


# --------------------------------------------------------------------- authorized tokens


def parse_authorized_tokens(text: str, source: str) -> list[Credential]:
    """Parse an authorized-tokens file (format in the module docstring).

    Raises:
        AuthError: ``<source>:<line>: ...`` for a malformed line, an unknown scope, a bad id or
            address, an address on a non-node credential, or a duplicate id or digest.
    """
    credentials: list[Credential] = []
    ids: set[str] = set()
    digests: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        fields = line.split()
        binding = [f for f in fields[3:] if f.startswith(CERT_FIELD)]
        rest = [f for f in fields[3:] if not f.startswith(CERT_FIELD)]
        if len(fields) < 3 or len(binding) > 1 or len(rest) > 1:
            raise AuthError(where, f"expected 'sha256:<hex> SCOPE ID [ADDRESS] "
                                   f"[cert=sha256:<hex>]', got {len(fields)} fields")
        digest, scope, cid = fields[:3]
        address = rest[0] if rest else None
        cert = binding[0].removeprefix(CERT_FIELD) if binding else None
        if not _DIGEST.fullmatch(digest):
            raise AuthError(where, f"{digest[:20]!r} is not sha256:<64 lowercase hex digits>")
        _check_credential(scope, cid, address, where, cert)
        if cid in ids:
            raise AuthError(where, f"id {cid!r} appears twice")
        if digest in digests:
            raise AuthError(where, "the same token appears twice")
        ids.add(cid)
        digests.add(digest)
        credentials.append(Credential(cid, scope, digest, address, cert))
    return credentials


def _check_credential(scope: str, cid: str, address: str | None, where: str | None,
                      cert: str | None = None) -> None:
    """Raise AuthError prefixed with ``where`` (a file line), or with the flag at fault."""
    if cert is not None and not _DIGEST.fullmatch(cert):
        raise AuthError(where or "--cert", f"{CERT_FIELD}{cert[:20]!r} is not "
                        f"{CERT_FIELD}sha256:<64 lowercase hex digits>")
    if scope not in SCOPES:
        raise AuthError(where or "--scope", f"scope {scope!r} is not one of "
                        f"{', '.join(SCOPES)}")
    if not _ID.fullmatch(cid):
        raise AuthError(where or "--id", f"id {cid!r} must match [A-Za-z0-9][A-Za-z0-9._-]* "
                        "(at most 64)")
    if address is not None:
        if scope != NODE:
            raise AuthError(where or "--address", "only node credentials are bound to an "
                            "address")
        try:
            parse_address(address, "address")
        except StatusError as e:
            raise AuthError(where or "--address", e.message) from e


class AuthorizedTokens:
    """The credentials in an authorized-tokens file, re-read when the file changes.

    Args:
        path: the file (see the module docstring for its format).

    Raises:
        AuthError: ``--authorized-tokens: ...`` when the file is missing, unreadable, malformed
            or lists no credential at all.

    A later edit that leaves the file unreadable or malformed is logged as an error and the
    credentials read last stay in force (a half-typed edit must not lock every node out).
    Thread-safe.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._credentials: tuple[Credential, ...] = ()
        self._bad_stamp: tuple[int, int, int] | None = None
        try:
            self._load(self._file_stamp())
        except OSError as e:
            raise AuthError("--authorized-tokens", f"cannot read {self.path}: "
                            f"{e.strerror or e}") from e
        except AuthError as e:
            raise AuthError("--authorized-tokens", str(e)) from e
        if not self._credentials:
            raise AuthError("--authorized-tokens", f"{self.path} lists no credential (mint one "
                            "with `gridrl-auth mint`)")
        mode = os.stat(self.path).st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            log.warning("--authorized-tokens: %s is writable by %s (mode %o): whoever can "
                        "write it can add a credential; chmod go-w %s", self.path,
                        "group and others" if mode & stat.S_IWGRP and mode & stat.S_IWOTH
                        else "others" if mode & stat.S_IWOTH else "its group",
                        stat.S_IMODE(mode), self.path)

    def _file_stamp(self) -> tuple[int, int, int]:
        st = os.stat(self.path)
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _load(self, stamp: tuple[int, int, int]) -> None:
        credentials = parse_authorized_tokens(self.path.read_text(), str(self.path))
        self._credentials = tuple(credentials)
        self._stamp = stamp

    def _refresh(self) -> None:
        try:
            stamp = self._file_stamp()
        except OSError as e:
            self._failed(_MISSING, e)
            return
        if stamp in (self._stamp, self._bad_stamp):
            return
        try:
            self._load(stamp)
        except (OSError, AuthError, UnicodeDecodeError) as e:
            self._failed(stamp, e)
            return
        self._bad_stamp = None
        log.info("re-read %s: %d credential(s)", self.path, len(self._credentials))

    def _failed(self, stamp: tuple[int, int, int], error: Exception) -> None:
        if stamp != self._bad_stamp:  # once per bad version of the file
            log.error("authorized tokens %s unusable (%s); keeping the %d credential(s) read "
                      "before", self.path, error, len(self._credentials))
        self._bad_stamp = stamp

    @property
    def credentials(self) -> tuple[Credential, ...]:
        """The credentials now in force."""
        with self._lock:
            self._refresh()
            return self._credentials

    def lookup(self, token: str) -> Credential | None:
        """The credential whose digest is the token's, or None. Compares against every entry
        with ``hmac.compare_digest`` (no early exit)."""
        digest = token_digest(token).encode()
        found = None
        for credential in self.credentials:
            if hmac.compare_digest(credential.digest.encode(), digest):
                found = credential
        return found

    def active(self, credential_id: str) -> bool:
        """Whether a credential with this id is in force (not revoked)."""
        return any(c.id == credential_id for c in self.credentials)

