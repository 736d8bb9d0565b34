"""API key authentication: `Authorization: Bearer <key>` → the key's tenant.

Every call that reads or changes anything authenticates against Postgres (``authenticate``): an
unknown or revoked key gets 401, a key of a disabled tenant 403. One path may use what this
process saw a moment ago instead: refusing a submit (``web/api.py``), above all with the 503 the
global gate would answer anyway (``RequestService.refuse_early``). ``RecentKeys`` remembers, for
``SLUICE_AUTH_CACHE_S``, the tenants of keys that authenticated here; such a refusal then costs no
database round trip, which matters when a spike makes refusals the commonest answer.

Revoking a key or disabling a tenant bumps a counter in Redis once it commits
(``sluice.keys.AUTH_EPOCH_KEY``). A remembered key carries the value this process knew before
the lookup that found it, and a refusal from memory first reads the counter (one GET): if it
moved, Postgres is asked again (``RecentKeys.confirm``), so a revoked key gets its 401 at once.
Only if that bump failed (Redis away while revoking) may it get refusals for the rest of the
window. It never gets a request accepted: accepting always asks Postgres.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict

import redis
from flask import request

from models import Tenant, tenant_for_key
from models.session import Database
from sluice.keys import AUTH_EPOCH_KEY

from .errors import Forbidden, Unauthorized

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
    """The tenant of the request's API key (loaded once: admission reads its limits), 401 for an
    unknown or revoked key, 403 when its tenant is disabled.

    Always asks Postgres; ``recent``, when given, learns the answer.
    """
    key = bearer_key()
    # Read before the lookup: a revocation that commits after the lookup bumps the epoch past it.
    epoch = recent.epoch if recent is not None else None
    with db.session() as session:
        tenant = tenant_for_key(session, key)
    if tenant is None:
        raise Unauthorized("Invalid or revoked API key.", headers=_CHALLENGE)
    if tenant.disabled_at is not None:
        raise Forbidden("This API key's tenant is disabled; the platform's operator can enable it again.",
                        code="tenant_disabled")
    if recent is not None:
        recent.remember(key, tenant, epoch)
    return tenant


class RecentKeys:
    """Tenants of keys that authenticated in this process within the last ``ttl_s`` seconds.

    Bounded: the least recently remembered keys are dropped past ``max_entries``. Keys are held
    by their SHA-256, never in clear. ``ttl_s`` 0 turns it off.
    """

    def __init__(self, ttl_s: float, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, tuple[float, Tenant, str | None]] = OrderedDict()
        self._lock = threading.Lock()
        # The revocation epoch this process read last (None: never read, or never bumped).
        self.epoch: str | None = None

    def remember(self, key: str, tenant: Tenant, epoch: str | None) -> None:
        """``epoch``: ``self.epoch`` as it was before the lookup that found ``tenant``."""
        if self.ttl_s <= 0:
            return
        digest = _digest(key)
        with self._lock:
            self._entries[digest] = (time.monotonic() + self.ttl_s, tenant, epoch)
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

    def confirm(self, key: str, client: redis.Redis) -> bool:
        """Whether no key was revoked and no tenant disabled since ``key`` was remembered: one GET.

        False drops the entry (also when Redis does not answer); the caller then authenticates afresh.
        """
        digest = _digest(key)
        try:
            epoch = client.get(AUTH_EPOCH_KEY)
        except redis.RedisError:
            with self._lock:
                self._entries.pop(digest, None)
            return False
        with self._lock:
            self.epoch = epoch
            entry = self._entries.get(digest)
            if entry is not None and entry[2] == epoch:
                return True
            self._entries.pop(digest, None)
            return False


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
