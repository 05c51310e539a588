"""Credentials and scopes: who may call which RPC of the three services.

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

* ``node`` — RegisterNode, Heartbeat, DeregisterNode, for its own address only: a credential
  minted with an address may register only that address, and the master refuses a node
  credential re-registering, heartbeating or deregistering an address another (unrevoked)
  credential registered (:mod:`gridrl.master.claims`).
* ``trainer`` — Generate, PushAdapter, ReloadAdapter, and everything ``read`` can do (watch
  the registry, read node info and run status); RegisterNode, Heartbeat and DeregisterNode
  only for its own trainer entry (the master refuses a trainer credential any other role,
  and any entry it did not register; a node credential lists only rollout nodes).
* ``read`` — ListNodes, WatchNodes, GetNodeInfo, GetRunStatus, WatchRun.

No or an unknown credential: UNAUTHENTICATED. A known credential whose scope does not cover the
RPC: PERMISSION_DENIED naming the credential, its scope, the RPC and the scope it needs.
Tokens are compared in constant time (``hmac.compare_digest`` against every entry).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from gridrl.common.address import parse_address
from gridrl.common.errors import StatusError

log = logging.getLogger(__name__)

AUTH_HEADER = "authorization"
TOKEN_PREFIX = "gridrl_"
DIGEST_PREFIX = "sha256:"
# Methods that stay open so load balancers, systemd probes and grpcurl work without a token.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")

NODE, TRAINER, READ = "node", "trainer", "read"
SCOPES = (NODE, TRAINER, READ)
# What a credential of each scope may call: the scopes its RPCs may require.
GRANTS: dict[str, frozenset[str]] = {
    NODE: frozenset({NODE}),
    TRAINER: frozenset({TRAINER, READ, NODE}),  # NODE: its own entry (role trainer) only
    READ: frozenset({READ}),
}
# Every RPC of the three services and the scope it requires. An RPC missing here is refused to
# every credential (a new RPC must be classified; tests/e2e/test_security_matrix.py checks it).
METHOD_SCOPES: dict[str, str] = {
    "/gridrl.v1.RegistryService/RegisterNode": NODE,
    "/gridrl.v1.RegistryService/Heartbeat": NODE,
    "/gridrl.v1.RegistryService/DeregisterNode": NODE,
    "/gridrl.v1.RegistryService/ListNodes": READ,
    "/gridrl.v1.RegistryService/WatchNodes": READ,
    "/gridrl.v1.RolloutService/Generate": TRAINER,
    "/gridrl.v1.RolloutService/PushAdapter": TRAINER,
    "/gridrl.v1.RolloutService/ReloadAdapter": TRAINER,
    "/gridrl.v1.RolloutService/GetNodeInfo": READ,
    "/gridrl.v1.TrainerService/GetRunStatus": READ,
    "/gridrl.v1.TrainerService/WatchRun": READ,
}

CERT_FIELD = "cert="  # an authorized-tokens line's certificate binding: cert=sha256:<hex>
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----\s*(.+?)\s*-----END CERTIFICATE-----",
                       re.S)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{16,512}")
_MISSING = (-1, -1, -1)  # file stamp of a file that cannot be stat'ed
_HEADER = ("# gridrl authorized tokens: one credential a line (see `gridrl-auth --help`).\n"
           "# sha256 of the token, scope (node | trainer | read), id, [address a node "
           "credential may register]\n")


class AuthError(ValueError):
    """A token file, an authorized-tokens file or a mint request is unusable. The message
    starts with the flag or field at fault."""


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

    def may_call(self, method: str) -> bool:
        """Whether the scope covers ``method`` (``/package.Service/Method``)."""
        return METHOD_SCOPES.get(method) in GRANTS[self.scope]


def cert_fingerprint(pem: bytes | str) -> str:
    """``"sha256:" + hex(sha256(DER))`` of the first certificate in ``pem`` (a PEM file's
    text, or a chain: the leaf comes first), the binding an authorized-tokens line stores.

    Raises:
        ValueError: ``pem`` holds no PEM certificate.
    """
    import base64

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
        raise AuthError(f"{flag}: cannot read {path}: {e.strerror or e}") from e
    except ValueError as e:  # binascii.Error is a ValueError
        raise AuthError(f"{flag}: {path}: {e}") from e


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
        raise AuthError(f"{flag}: cannot read {path}: {getattr(e, 'strerror', None) or e}") \
            from e
    token = text.strip()
    if not token:
        raise AuthError(f"{flag}: {path} is empty")
    return check_token(token, f"{flag}: {path}", mode)


def check_token(token: str, where: str, mode: int | None = None) -> str:
    """``token`` when it looks like a bearer token (16-512 url-safe characters, no spaces).

    Raises:
        AuthError: ``<where>: ...`` otherwise.
    """
    if not _TOKEN.fullmatch(token):
        raise AuthError(f"{where}: not a token (one line of 16-512 url-safe characters, no "
                        "spaces)")
    if mode is not None and mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s is readable by other users; chmod 600 it", where)
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
            raise AuthError(f"{where}: expected 'sha256:<hex> SCOPE ID [ADDRESS] "
                            f"[cert=sha256:<hex>]', got {len(fields)} fields")
        digest, scope, cid = fields[:3]
        address = rest[0] if rest else None
        cert = binding[0].removeprefix(CERT_FIELD) if binding else None
        if not _DIGEST.fullmatch(digest):
            raise AuthError(f"{where}: {digest[:20]!r} is not sha256:<64 lowercase hex digits>")
        _check_credential(scope, cid, address, where, cert)
        if cid in ids:
            raise AuthError(f"{where}: id {cid!r} appears twice")
        if digest in digests:
            raise AuthError(f"{where}: the same token appears twice")
        ids.add(cid)
        digests.add(digest)
        credentials.append(Credential(cid, scope, digest, address, cert))
    return credentials


def _check_credential(scope: str, cid: str, address: str | None, where: str | None,
                      cert: str | None = None) -> None:
    """Raise AuthError prefixed with ``where`` (a file line), or with the flag at fault."""
    if cert is not None and not _DIGEST.fullmatch(cert):
        raise AuthError(f"{where or '--cert'}: {CERT_FIELD}{cert[:20]!r} is not "
                        f"{CERT_FIELD}sha256:<64 lowercase hex digits>")
    if scope not in SCOPES:
        raise AuthError(f"{where or '--scope'}: scope {scope!r} is not one of "
                        f"{', '.join(SCOPES)}")
    if not _ID.fullmatch(cid):
        raise AuthError(f"{where or '--id'}: id {cid!r} must match [A-Za-z0-9][A-Za-z0-9._-]* "
                        "(at most 64)")
    if address is not None:
        if scope != NODE:
            raise AuthError(f"{where or '--address'}: only node credentials are bound to an "
                            "address")
        try:
            parse_address(address, "address")
        except StatusError as e:
            raise AuthError(f"{where or '--address'}: {e.message}") from e


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
            raise AuthError(f"--authorized-tokens: cannot read {self.path}: "
                            f"{e.strerror or e}") from e
        except AuthError as e:
            raise AuthError(f"--authorized-tokens: {e}") from e
        if not self._credentials:
            raise AuthError(f"--authorized-tokens: {self.path} lists no credential (mint one "
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


# ---------------------------------------------------------------------- the server check


@dataclass(frozen=True)
class Decision:
    """What the server does with a call: ``code`` None lets it through as ``credential``
    (None when the method is open or the server runs without credentials)."""

    code: grpc.StatusCode | None = None
    message: str = ""
    credential: Credential | None = None


def authorize(tokens: AuthorizedTokens | None, method: str,
              metadata: Sequence[tuple[str, str | bytes]] | None) -> Decision:
    """Decide a call to ``method`` (``/package.Service/Method``) carrying ``metadata``.

    Open methods (health, reflection) and servers without ``tokens`` let every call through.
    Otherwise: no or an unknown token -> UNAUTHENTICATED; a credential whose scope does not
    cover the method, or a method no scope covers -> PERMISSION_DENIED. Messages name what was
    refused.
    """
    if tokens is None or method.startswith(OPEN_PREFIXES):
        return Decision()
    name = method.removeprefix("/gridrl.v1.")
    header = next((v for k, v in metadata or () if k == AUTH_HEADER), None)
    if header is None:
        return Decision(grpc.StatusCode.UNAUTHENTICATED,
                        f"{name}: no credential; send 'authorization: Bearer <token>' "
                        "(clients: --auth-token-file)")
    if isinstance(header, bytes):
        header = header.decode(errors="replace")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return Decision(grpc.StatusCode.UNAUTHENTICATED,
                        f"{name}: authorization metadata must be 'Bearer <token>'")
    credential = tokens.lookup(token.strip())
    if credential is None:
        return Decision(grpc.StatusCode.UNAUTHENTICATED,
                        f"{name}: credential not recognised (not in this server's authorized "
                        "tokens: revoked, mistyped, or minted for another cluster)")
    needed = METHOD_SCOPES.get(method)
    if needed is None:
        return Decision(grpc.StatusCode.PERMISSION_DENIED,
                        f"{name}: no scope may call this RPC", credential)
    if needed not in GRANTS[credential.scope]:
        return Decision(grpc.StatusCode.PERMISSION_DENIED,
                        f"{name}: credential {credential.id!r} has scope {credential.scope}; "
                        f"this RPC needs scope {needed}", credential)
    return Decision(credential=credential)


def check_bound_certificate(decision: Decision, method: str, peer_pem: bytes | None
                            ) -> Decision:
    """``decision`` unless its credential is bound to a client certificate (``cert=``) that
    the connection did not present: then UNAUTHENTICATED, naming the credential.

    Args:
        decision: :func:`authorize`'s answer for the call.
        method: ``/package.Service/Method``.
        peer_pem: the client's certificate as the TLS layer verified it (grpc's auth context
            ``x509_pem_cert``); None on plaintext or without a client certificate.
    """
    credential = decision.credential
    if decision.code is not None or credential is None or credential.cert is None:
        return decision
    name = method.removeprefix("/gridrl.v1.")
    if not peer_pem:
        return Decision(grpc.StatusCode.UNAUTHENTICATED,
                        f"{name}: credential {credential.id!r} is bound to a client certificate "
                        "and this connection presented none (mutual TLS with --tls-cert/"
                        "--tls-key)")
    try:
        presented = cert_fingerprint(peer_pem)
    except ValueError:
        presented = None
    if presented is None or not hmac.compare_digest(presented, credential.cert):
        return Decision(grpc.StatusCode.UNAUTHENTICATED,
                        f"{name}: credential {credential.id!r} is bound to another client "
                        "certificate than the one this connection presented")
    return decision


_CALLER: contextvars.ContextVar[Credential | None] = contextvars.ContextVar("gridrl_caller",
                                                                           default=None)


def caller() -> Credential | None:
    """The credential of the call being served on this thread (None: open method or a server
    without credentials). Handlers use it for checks finer than scopes (a node's own
    address)."""
    return _CALLER.get()


@contextmanager
def calling_as(credential: Credential | None) -> Iterator[None]:
    """Make :func:`caller` return ``credential`` inside the block (the server interceptor)."""
    reset = _CALLER.set(credential)
    try:
        yield
    finally:
        try:
            _CALLER.reset(reset)
        except ValueError:  # a stream closed from another thread's context
            pass


# ------------------------------------------------------------------------------ client side


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata to attach to a call; empty when ``token`` is empty."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


class TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Client interceptor adding the bearer token to every call on a plaintext channel (grpc
    sends call credentials only over TLS; TLS channels use ``access_token_call_credentials``)."""

    def __init__(self, token: str) -> None:
        self._md = call_metadata(token)

    def _details(self, details):
        md = list(details.metadata or ()) + list(self._md)
        return details._replace(metadata=md) if hasattr(details, "_replace") else _Details(
            details.method, details.timeout, md, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


# ---------------------------------------------------------------------- minting, revoking


def mint(authorized_path: str | os.PathLike, token_path: str | os.PathLike, scope: str,
         credential_id: str, address: str | None = None, cert: str | None = None
         ) -> Credential:
    """Write a new token to ``token_path`` (mode 0600; never overwritten) and append its
    credential to ``authorized_path`` (created when missing). Either both happen or neither.
    ``cert`` (``sha256:<hex>``, :func:`cert_fingerprint`) binds it to a client certificate.

    Raises:
        AuthError: naming the field: bad scope, id, address or cert; an id already in the
            file; an address another credential is bound to; ``token_path`` already existing;
            a malformed authorized-tokens file.
    """
    authorized_path = Path(authorized_path)
    _check_credential(scope, credential_id, address, None, cert)
    existing = _read_existing(authorized_path)
    if any(c.id == credential_id for c in existing):
        raise AuthError(f"--id: {credential_id!r} is already in {authorized_path} (revoke it "
                        "first to replace its token)")
    if address is not None:
        wanted = parse_address(address)
        holder = next((c for c in existing if c.address is not None
                       and parse_address(c.address) == wanted), None)
        if holder is not None:  # the master reserves an address for the credential bound first
            raise AuthError(f"--address: {address} is already bound to credential "
                            f"{holder.id!r}, and a node may register it only with that one "
                            f"(revoke {holder.id!r} first to move the address)")
    token = new_token()
    credential = Credential(credential_id, scope, token_digest(token), address, cert)
    try:
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as e:
        raise AuthError(f"--out: {token_path} exists; not overwriting a token") from e
    except OSError as e:
        raise AuthError(f"--out: cannot create {token_path}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        _write_authorized(authorized_path, [*existing, credential])
    except BaseException:
        os.unlink(token_path)
        raise
    return credential


def revoke(authorized_path: str | os.PathLike, credential_id: str) -> Credential:
    """Remove the credential ``credential_id`` from ``authorized_path`` (atomic rewrite; the
    servers reading the file refuse its token from their next call on).

    Raises:
        AuthError: the file is missing or malformed, or has no such id.
    """
    authorized_path = Path(authorized_path)
    if not authorized_path.exists():
        raise AuthError(f"--authorized-tokens: {authorized_path} does not exist")
    existing = _read_existing(authorized_path)
    gone = [c for c in existing if c.id == credential_id]
    if not gone:
        raise AuthError(f"ID: no credential {credential_id!r} in {authorized_path}")
    _write_authorized(authorized_path, [c for c in existing if c.id != credential_id])
    return gone[0]


def _read_existing(path: Path) -> list[Credential]:
    if not path.exists():
        return []
    try:
        return parse_authorized_tokens(path.read_text(), str(path))
    except OSError as e:
        raise AuthError(f"--authorized-tokens: cannot read {path}: {e.strerror or e}") from e


def _write_authorized(path: Path, credentials: list[Credential]) -> None:
    """Rewrite the file atomically (temporary file + rename), keeping its comments."""
    lines = _HEADER
    if path.exists():
        kept = [raw for raw in path.read_text().splitlines()
                if raw.strip().startswith("#") or not raw.strip()]
        lines = "\n".join(kept) + "\n" if kept else _HEADER
    lines += "".join(c.line() + "\n" for c in credentials)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(lines)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
