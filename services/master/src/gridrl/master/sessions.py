"""The dashboard's credentials: who may see the page (decide: a presented token's credential and
scope -> allowed, 401 or 403) and the browsers signed in with a token (Sessions: a cookie's
sha256 -> its credential, bounded and expiring; the credential is re-checked at every request)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from gridrl.common.security.access import GRANTS, Decision, check_bound_certificate
from gridrl.common.security.tokens import READ, AuthorizedTokens, Credential

SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 1000


@dataclass
class _Session:
    credential_id: str
    digest: str  # the credential's token digest: a new token under the same id ends it
    expires: float


class Sessions:
    """Signed-in browsers: sha256 of each session cookie -> the credential it stands for.
    At most :data:`MAX_SESSIONS` (the oldest goes first), each for :data:`SESSION_TTL_S`."""

    def __init__(self, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._clock = clock

    @staticmethod
    def _key(cookie: str) -> str:
        return hashlib.sha256(cookie.encode()).hexdigest()

    def open(self, credential: Credential) -> str:
        """A new session cookie value for ``credential``."""
        cookie = secrets.token_urlsafe(32)
        with self._lock:
            self._sessions[self._key(cookie)] = _Session(credential.id, credential.digest,
                                                         self._clock() + SESSION_TTL_S)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return cookie

    def close(self, cookie: str) -> None:
        with self._lock:
            self._sessions.pop(self._key(cookie), None)

    def credential(self, cookie: str, tokens: AuthorizedTokens) -> Credential | None:
        """The credential of a live session, if it is still in force with the same token."""
        with self._lock:
            session = self._sessions.get(self._key(cookie))
            if session is not None and session.expires < self._clock():
                del self._sessions[self._key(cookie)]
                session = None
        if session is None:
            return None
        return next((c for c in tokens.credentials if c.id == session.credential_id
                     and hmac.compare_digest(c.digest, session.digest)), None)


def decide(tokens: AuthorizedTokens | None, credential: Credential | None, presented: bool,
           peer_pem: bytes | None) -> tuple[int, str, Credential | None]:
    """HTTP status of a request to a protected path: 200 with the credential, 401 without a
    (known) one, 403 for a scope that does not grant ``read``. ``presented``: the request
    carried a token or cookie at all (for the message); ``peer_pem``: the client certificate
    of the connection (a credential bound to one needs it)."""
    if tokens is None:
        return 200, "", None
    if credential is None:
        return 401, ("credential not recognised (revoked, mistyped, expired session, or minted "
                     "for another cluster)" if presented else
                     "sign in with a read credential (or send 'Authorization: Bearer <token>')"), None
    checked = check_bound_certificate(Decision(credential=credential), "dashboard", peer_pem)
    if checked.code is not None:
        return 401, checked.message, None
    if READ not in GRANTS[credential.scope]:
        return 403, (f"credential {credential.id!r} has scope {credential.scope}; the dashboard "
                     "needs scope read (or trainer)"), None
    return 200, "", credential
