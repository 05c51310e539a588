"""Minting and revoking credentials (``gridrl-auth mint`` / ``revoke``): a new token file
and its line in an authorized-tokens file, written together or not at all."""

from __future__ import annotations

import os
from pathlib import Path

from gridrl.common.address import parse_address
from gridrl.common.security.tokens import (
    AuthError,
    Credential,
    _check_credential,
    new_token,
    parse_authorized_tokens,
    token_digest,
)

_HEADER = ("# gridrl authorized tokens: one credential a line (see `gridrl-auth --help`).\n"
           "# sha256 of the token, scope (node | trainer | read), id, [address a node "
           "credential may register]\n")


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
        raise AuthError("--id", f"{credential_id!r} is already in {authorized_path} (revoke it "
                        "first to replace its token)")
    if address is not None:
        wanted = parse_address(address)
        holder = next((c for c in existing if c.address is not None
                       and parse_address(c.address) == wanted), None)
        if holder is not None:  # the master reserves an address for the credential bound first
            raise AuthError("--address", f"{address} is already bound to credential "
                            f"{holder.id!r}, and a node may register it only with that one "
                            f"(revoke {holder.id!r} first to move the address)")
    token = new_token()
    credential = Credential(credential_id, scope, token_digest(token), address, cert)
    try:
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as e:
        raise AuthError("--out", f"{token_path} exists; not overwriting a token") from e
    except OSError as e:
        raise AuthError("--out", f"cannot create {token_path}: {e.strerror or e}") from e
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
        raise AuthError("--authorized-tokens", f"{authorized_path} does not exist")
    existing = _read_existing(authorized_path)
    gone = [c for c in existing if c.id == credential_id]
    if not gone:
        raise AuthError("ID", f"no credential {credential_id!r} in {authorized_path}")
    _write_authorized(authorized_path, [c for c in existing if c.id != credential_id])
    return gone[0]


def _read_existing(path: Path) -> list[Credential]:
    if not path.exists():
        return []
    try:
        return parse_authorized_tokens(path.read_text(), str(path))
    except OSError as e:
        raise AuthError("--authorized-tokens", f"cannot read {path}: {e.strerror or e}") from e


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
