"""The local floor: admission that keeps working while Redis does not answer.

Each web process keeps in-process token buckets and fixed rules that read no remote state:

* batch submissions are turned away (503 with Retry-After): they can wait, interactive users can't;
* realtime submissions are admitted within this process's own budget
  (``SLUICE_LOCAL_FLOOR_TOKENS_PER_MINUTE``) and, per tenant, within the tenant's own tokens and
  requests per minute, counted by this process alone;
* the per-request gate applies unchanged. The concurrency cap is not enforced: that count lives
  in Redis, and requests admitted here are not in it;
* a class the shared promise refused a moment ago because its queue would make a request late
  stays closed here until the Retry-After that refusal gave (``close``): a Redis blip in an
  overload must not reopen the door the promise had just shut (in a burst of 36 questions with
  30 refused, one slow Redis call let 6 in on the floor, and all 6 expired).

:class:`RedisBreaker` decides when to try Redis again. After a failure one request probes it after
a backoff (0.5 s doubling to 10 s, jittered); every other request stays on the floor without
waiting for a timeout. The first successful call closes the breaker: shared limits are back.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from core.admission.limiter import Quota, Verdict
from core.tenants.tiers import Limits

BATCH_RETRY_AFTER_MS = 5000
CLOSED_MAX_MS = 30_000  # the longest a class stays closed on the floor after the promise refused it
MAX_TENANTS = 10_000  # per-tenant buckets kept per process (least recently used dropped: full again)


def _now_ms() -> float:
    return time.monotonic() * 1000


class TokenBucket:
    """The arithmetic of ``admit.lua`` in process: ``cap`` per minute, refilled continuously.

    Like the script, a refill is only computed on read and stored only when the level changes, so
    the same sequence of calls gives bit-identical levels here and in Redis.
    """

    def __init__(self, cap: int, now_ms: float) -> None:
        self.cap = cap
        self.level = float(cap)
        self.t = now_ms

    def level_at(self, now_ms: float) -> tuple[float, float]:
        level, t = self.level, self.t
        if now_ms > t:
            level = level + (now_ms - t) * self.cap / 60000
            t = now_ms
        return min(level, self.cap), t

    def take(self, cost: float, now_ms: float) -> None:
        level, self.t = self.level_at(now_ms)
        self.level = level - cost

    def give(self, amount: float, now_ms: float) -> None:
        level, self.t = self.level_at(now_ms)
        self.level = min(self.cap, level + amount)

    def wait_ms(self, need: float, now_ms: float) -> int:
        """How long until the bucket holds ``need``, as its refill will compute it then: the
        division's answer can leave that refill a float's hair short, and waiting as told must be
        enough (admit.lua's wait_ms, the same arithmetic)."""
        level = self.level_at(now_ms)[0]
        if level >= need:
            return 0
        wait = math.ceil((need - level) * 60000 / self.cap)
        while self.level_at(now_ms + wait)[0] < need:
            wait += 1
        return wait

    def quota(self, now_ms: float) -> Quota:
        level = self.level_at(now_ms)[0]
        return Quota(self.cap, max(0, math.floor(level)), max(0, math.ceil((self.cap - level) * 60000 / self.cap)))


class RedisBreaker:
    """Open after a Redis failure; lets one probe through per backoff period until one succeeds."""

    def __init__(self, base_s: float = 0.5, max_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._base_s, self._max_s, self._clock = base_s, max_s, clock
        self._failures = 0
        self._retry_at = 0.0
        self._probing = False
        self._lock = threading.Lock()

    @property
    def healthy(self) -> bool:
        return self._failures == 0

    def allow(self) -> bool:
        """May this caller use Redis now? While open: only the one probe, once the backoff passed."""
        if self._failures == 0:
            return True
        with self._lock:
            if self._failures == 0:
                return True
            if self._probing or self._clock() < self._retry_at:
                return False
            self._probing = True
            return True

    def succeeded(self) -> None:
        if self._failures or self._probing:
            with self._lock:
                self._failures, self._probing = 0, False

    def failed(self) -> None:
        with self._lock:
            # Concurrent requests that fail together open the breaker once, not once each.
            if self._failures == 0 or self._probing:
                self._failures += 1
                delay = min(self._max_s, self._base_s * 2 ** (self._failures - 1))
                self._retry_at = self._clock() + delay * random.uniform(0.8, 1.2)
            self._probing = False


class LocalFloor:
    def __init__(self, tokens_per_minute: int, clock: Callable[[], float] = _now_ms) -> None:
        self._clock = clock
        self._process = TokenBucket(tokens_per_minute, clock())
        self._tenants: OrderedDict[str, tuple[TokenBucket, TokenBucket]] = OrderedDict()
        # Class ("<priority>:<model>") → until when (clock ms) the promise's last refusal keeps it
        # closed here; as many entries as classes.
        self._closed: dict[str, float] = {}
        self._lock = threading.Lock()

    def close(self, klass: str, for_ms: int) -> None:
        """The shared promise refused a request of ``klass``: its queue would make it late for
        ``for_ms`` more (the refusal's Retry-After). Requests of that class meet the same answer
        here until then (at most CLOSED_MAX_MS)."""
        with self._lock:
            until = self._clock() + min(max(0, for_ms), CLOSED_MAX_MS)
            self._closed[klass] = max(self._closed.get(klass, 0.0), until)

    def admit(self, tenant_id: str, limits: Limits, cost: int, priority: str, *, too_large: bool,
              klass: str = "") -> Verdict:
        """The floor's gates in the shared order: global → tenant → per request."""
        with self._lock:
            now = self._clock()
            tokens, requests = self._buckets(tenant_id, limits, now)
            gate, reason, retry = "", "", 0
            closed_until = self._closed.get(klass, 0.0) if klass else 0.0
            if priority == "batch":
                gate, reason, retry = "global", "local_floor_batch", BATCH_RETRY_AFTER_MS
            elif closed_until > now:
                gate, reason, retry = "global", "local_floor_deadline", math.ceil(closed_until - now)
            elif self._process.level_at(now)[0] < min(cost, self._process.cap):
                gate, reason = "global", "local_floor_tokens"
                retry = self._process.wait_ms(min(cost, self._process.cap), now)
            elif tokens.level_at(now)[0] < min(cost, tokens.cap):
                gate, reason, retry = "tenant", "tokens_per_minute", tokens.wait_ms(min(cost, tokens.cap), now)
            elif requests.level_at(now)[0] < 1:
                gate, reason, retry = "tenant", "requests_per_minute", requests.wait_ms(1, now)
            elif too_large:
                gate, reason = "request", "too_large"
            if not gate:
                for bucket, amount in ((self._process, cost), (tokens, cost), (requests, 1)):
                    bucket.take(amount, now)
            return Verdict(gate, reason, retry, tokens.quota(now), requests.quota(now), 0)

    def peek(self, tenant_id: str, limits: Limits) -> Verdict:
        with self._lock:
            now = self._clock()
            tokens, requests = self._buckets(tenant_id, limits, now)
            return Verdict("", "", 0, tokens.quota(now), requests.quota(now), 0)

    def refund(self, tenant_id: str, tokens: int) -> None:
        """Give back a floor admission whose row was never written."""
        with self._lock:
            now = self._clock()
            self._process.give(tokens, now)
            if tenant_id in self._tenants:
                self._tenants[tenant_id][0].give(tokens, now)

    def _buckets(self, tenant_id: str, limits: Limits, now: float) -> tuple[TokenBucket, TokenBucket]:
        pair = self._tenants.get(tenant_id)
        if pair is None or (pair[0].cap, pair[1].cap) != (limits.tokens_per_minute, limits.requests_per_minute):
            pair = (TokenBucket(limits.tokens_per_minute, now), TokenBucket(limits.requests_per_minute, now))
            self._tenants[tenant_id] = pair
        self._tenants.move_to_end(tenant_id)
        while len(self._tenants) > MAX_TENANTS:
            self._tenants.popitem(last=False)
        return pair
