"""Which node credential holds which address: a node credential registers, heartbeats and
deregisters only the addresses it holds.

Pure domain code (no gRPC): handlers pass the caller's credential
(:func:`gridrl.common.security.access.caller`) and a test of whether a credential id is still in force.

Rules:

* A credential minted with an address (``gridrl-auth mint --address``) may register only that
  address, and while it is in force no other credential may register that address, even
  first (a node credential minted without an address cannot squat a bound node's address).
* Addresses are compared in one spelling (:func:`gridrl.common.address.canonical_address`:
  host case, a trailing dot and leading zeros of the port do not make another address).
* The first credential to register an address holds it for good: the claim outlives the node
  going down, expiring or deregistering, and the master restarting (it is kept in the store),
  so no other credential can take the address over while its node is away.
* A claim lapses when its credential is revoked (no longer in the authorized tokens): the next
  credential to register the address holds it from then on.
* A master without credentials records and checks no claim.

Claims are kept by address in its canonical spelling; Heartbeat and DeregisterNode, which
carry only the node id, are checked against the address the registry holds for that id.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gridrl.common.address import canonical_address
from gridrl.common.errors import Kind, StatusError
from gridrl.common.security.tokens import Credential
from gridrl.master.registry import node_id_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    """``credential_id`` holds ``address`` (node ``node_id``)."""

    node_id: str
    address: str
    credential_id: str


class ClaimStore(Protocol):
    """Persistence of claims (see :class:`gridrl.master.store.SqliteStore`)."""

    def load_claims(self) -> list[Claim]: ...

    def put_claim(self, claim: Claim) -> None: ...


class Claims:
    """The claims of a master, in memory and written through to ``store``.

    Args:
        active: whether a credential id is in force (not revoked).
        store: where claims persist (None: memory only).
        reserved: the id of the credential in force that was minted for an address (its
            canonical spelling), or None; such an address is that credential's alone.

    Thread-safe (one lock).
    """

    def __init__(self, active: Callable[[str], bool], store: ClaimStore | None = None,
                 reserved: Callable[[str], str | None] | None = None) -> None:
        self._active = active
        self._store = store
        self._reserved = reserved or (lambda address: None)
        self._lock = threading.Lock()
        self._claims: dict[str, Claim] = {}
        for c in store.load_claims() if store is not None else ():
            self._claims.setdefault(claim_key(c.address), c)

    def holder(self, address: str) -> str | None:
        """Id of the credential holding ``address`` (any spelling; None: unclaimed, or its
        holder was revoked)."""
        with self._lock:
            claim = self._claims.get(claim_key(address))
        return claim.credential_id if claim and self._active(claim.credential_id) else None

    def register(self, address: str, credential: Credential) -> None:
        """Let ``credential`` register ``address``, claiming it when unclaimed.

        Raises:
            StatusError: PERMISSION_DENIED ``node.address: ...`` when the credential is bound to
                another address, or another credential in force holds this one.
        """
        key = claim_key(address)
        if credential.address is not None and claim_key(credential.address) != key:
            raise StatusError(Kind.PERMISSION_DENIED,
                              f"node.address: credential {credential.id!r} may register only "
                              f"{credential.address}, not {address}")
        owner = self._reserved(key)
        if owner is not None and owner != credential.id:
            raise StatusError(Kind.PERMISSION_DENIED,
                              f"node.address: {address} is reserved for credential {owner!r} "
                              f"(minted for it); credential {credential.id!r} may not "
                              "register it")
        with self._lock:
            claim = self._claims.get(key)
            if claim is not None and claim.credential_id == credential.id:
                return
            if claim is not None and self._active(claim.credential_id):
                raise StatusError(Kind.PERMISSION_DENIED,
                                  f"node.address: {address} is held by credential "
                                  f"{claim.credential_id!r}; credential {credential.id!r} may "
                                  "not register it")
            claim = Claim(node_id_for(key), key, credential.id)
            self._claims[key] = claim
            if self._store is not None:
                try:
                    self._store.put_claim(claim)
                except Exception:  # the claim holds in memory; a restart would lose it
                    log.exception("could not store the claim of %s by %r", address,
                                  credential.id)
        log.info("credential %r holds %s", credential.id, address)

    def check(self, node_id: str, address: str, credential: Credential, action: str) -> None:
        """Let ``credential`` ``action`` (heartbeat, deregister) node ``node_id``, registered
        at ``address``.

        Raises:
            StatusError: PERMISSION_DENIED ``node_id: ...`` when another credential in force
                holds its address.
        """
        with self._lock:
            claim = self._claims.get(claim_key(address))
        if claim is None or claim.credential_id == credential.id \
                or not self._active(claim.credential_id):
            return
        raise StatusError(Kind.PERMISSION_DENIED,
                          f"node_id: {node_id} ({claim.address}) is held by credential "
                          f"{claim.credential_id!r}; credential {credential.id!r} may not "
                          f"{action} it")


def claim_key(address: str) -> str:
    """The spelling claims are kept under (:func:`canonical_address`; an address that does
    not parse, from an old store, as it is)."""
    try:
        return canonical_address(address)
    except StatusError:
        return address
