"""One active copy of a loop that must run once per platform (the load monitor, the job feeder).

Each copy tries to take or renew a Redis lease every round; the holder works, the others stand
by, and one of them takes over within a lease when the holder dies or loses Redis.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import redis

log = logging.getLogger(__name__)

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0
"""


class Lease:
    def __init__(self, client: redis.Redis, key: str, ttl_s: float) -> None:
        self.key = key
        self.ttl_ms = int(ttl_s * 1000)
        self.identity = uuid.uuid4().hex
        self._renew = client.register_script(_RENEW)

    def hold(self) -> bool:
        """Take or keep the lease; False while another copy holds it."""
        return bool(self._renew(keys=[self.key], args=[self.identity, self.ttl_ms]))


def run_leading(name: str, lease: Lease, work: Callable[[], object], interval_s: float, stop: threading.Event,
                clock: Callable[[], float] = time.monotonic,
                on_change: Callable[[bool], None] = lambda leading: None) -> None:
    """Call ``work()`` every ``interval_s`` while this copy holds ``lease``, until ``stop``.

    Survives any error of Redis, Postgres or ``work`` itself (logged): a loop like this must
    outlive the outages it is there to ride out."""
    leading = False
    while not stop.is_set():
        began = clock()
        try:
            now_leading = lease.hold()
            if now_leading != leading:
                log.info("%s %s", name, "leading" if now_leading else "standing by")
                leading = now_leading
                on_change(leading)
            if leading:
                work()
        except Exception:
            log.warning("%s round failed", name, exc_info=True)
        stop.wait(max(0.0, interval_s - (clock() - began)))
