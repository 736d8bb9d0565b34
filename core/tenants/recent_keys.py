"""Keys that authenticated in this process a moment ago, for refusing without a database read.

Only a refusal may use them (``web/auth.py`` explains the revocation epoch that keeps a revoked
key from being refused as someone else's); accepting always asks Postgres.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict

import redis

from core.rediskeys import AUTH_EPOCH_KEY
from models import Tenant


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
