"""API key authentication: `Authorization: Bearer <key>` → the key's tenant.

Every call that reads or changes anything authenticates against Postgres (``authenticate``), so
a revoked key stops working at once. One path may use what this process saw a moment ago
instead: refusing a submit that the global gate would refuse anyway (``web/service.py``,
``RequestService.refuse_early``). ``RecentKeys`` remembers, for ``SLUICE_AUTH_CACHE_S``, the
tenants of keys that authenticated here; such a refusal then costs no database round trip, which
matters when a spike makes refusals the commonest answer. A key revoked within that window may
get a 503 instead of a 401 for the rest of it; it never gets a request accepted.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict

from flask import request

from models import Tenant, tenant_for_key
from models.session import Database

from .errors import Unauthorized

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="sluice"'}


def bearer_key() -> str:
    """The request's API key, or 401 when the header is missing or malformed."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if not header:
        raise Unauthorized("Missing API key: send `Authorization: Bearer <key>`.",
                           code="missing_api_key", headers=_CHALLENGE)
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("Malformed Authorization header: use `Authorization: Bearer <key>`.",
                           headers=_CHALLENGE)
    return key.strip()


def authenticate(db: Database, recent: RecentKeys | None = None) -> Tenant:
    """The tenant of the request's API key (loaded once: admission reads its limits), or 401.

    Always asks Postgres; ``recent``, when given, learns the answer.
    """
    key = bearer_key()
    with db.session() as session:
        tenant = tenant_for_key(session, key)
    if tenant is None:
        raise Unauthorized("Invalid or revoked API key.", headers=_CHALLENGE)
    if recent is not None:
        recent.remember(key, tenant)
    return tenant


class RecentKeys:
    """Tenants of keys that authenticated in this process within the last ``ttl_s`` seconds.

    Bounded: the least recently remembered keys are dropped past ``max_entries``. Keys are held
    by their SHA-256, never in clear. ``ttl_s`` 0 turns it off.
    """

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, tuple[float, Tenant]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, key: str, tenant: Tenant) -> None:
        if self.ttl_s <= 0:
            return
        digest = _digest(key)
        with self._lock:
            self._entries[digest] = (time.monotonic() + self.ttl_s, tenant)
            self._entries.move_to_end(digest)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def tenant(self, key: str) -> Tenant | None:
        """The tenant this key authenticated as a moment ago, or None (unknown or too old)."""
        if self.ttl_s <= 0:
            return None
        digest = _digest(key)
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return None
            if entry[0] < time.monotonic():
                del self._entries[digest]
                return None
            return entry[1]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
