"""Redis key names shared by the web tier and the workers, and the Redis client factory."""

from __future__ import annotations

import redis

CANCEL_PREFIX = "sluice:cancel:"
# Request id → why: a request whose own code held its worker's event loop until the watchdog ended
# the worker (workers/runtime.py); the sweep fails it instead of requeueing it into the next one.
STALLED_PREFIX = "sluice:stalled:"
WORKER_PREFIX = "sluice:worker:"
NODE_PREFIX = "sluice:node:"
CONVERSATION_PREFIX = "sluice:conv:"
# Hash request id → worker id: messages a worker has taken off a queue but not yet claimed.
# A worker killed in that gap leaves its messages in the broker's unacked set, which Redis
# only restores after the visibility timeout; this lets the sweep restore them at once.
RESERVED_KEY = "sluice:reserved"
# Hash worker id → {"node", "queues"}: workers a peak reservation told to stop reading batch
# queues (workers/reservations.py), so whoever leads the monitor next can resume them.
PAUSED_KEY = "sluice:reserve:paused"
# Set (with a TTL) by the sweep that last read every queued message looking for lost ones.
LOST_CHECK_KEY = "sluice:sweep:lost_check"
# The broker epoch the sweep's last complete pass over older epochs saw (core/broker/queues.py).
EPOCH_SEEN_KEY = "sluice:sweep:epoch_seen"
# Hash {at, took_ms}: when the sweep last finished, shown by /readyz.
SWEEP_LAST_KEY = "sluice:sweep:last"
# Hash {at, paused, in_flight, capacity, fed, advanced}: what the job feeder last did
# (core/jobs/feeder.py), shown on every job (core/jobs/service.py).
FEEDER_STATE_KEY = "sluice:feeder:state"


def cancel_key(request_id: str) -> str:
    """Set by the web tier when a running request is cancelled; polled by its worker."""
    return CANCEL_PREFIX + request_id


def raise_cancel_flag(client: redis.Redis, request_id: str, time_limit_s: float) -> None:
    """Ask whichever worker runs ``request_id`` to abort it; the flag outlives any run of it."""
    client.set(cancel_key(request_id), "1", ex=int(time_limit_s) + 600)


def stalled_key(request_id: str) -> str:
    return STALLED_PREFIX + request_id


def worker_key(worker_id: str) -> str:
    """A worker's heartbeat (its engine stats as JSON), expiring when the worker goes silent."""
    return WORKER_PREFIX + worker_id


def node_key(node: str) -> str:
    """Which live worker process answers to a Celery node name (same TTL as its heartbeat)."""
    return NODE_PREFIX + node


def conversation_key(tenant_id: str, conversation_id: str) -> str:
    """The node that served a conversation's last turn, so the next turn reuses its prefix cache."""
    return f"{CONVERSATION_PREFIX}{tenant_id}:{conversation_id}"


# Admission (core/admission/limiter.py). A missing bucket is a full one, so idle tenants cost nothing.
LOAD_LEVEL_KEY = "sluice:load:level"  # hash {level, updated_at_ms}, written by the load monitor
PLATFORM_BUCKET_KEY = "sluice:limit:platform"
TENANT_LIMIT_PREFIX = "sluice:limit:tenant:"
INFLIGHT_SUFFIX = ":inflight"


def tenant_bucket_key(tenant_id: str) -> str:
    """A tenant's token and request buckets (one hash)."""
    return TENANT_LIMIT_PREFIX + tenant_id


def webhook_actions_key(tenant_id: str) -> str:
    """A tenant's webhook redeliveries and rotations in the current minute (a counter)."""
    return TENANT_LIMIT_PREFIX + tenant_id + ":webhook_actions"


def uploads_key(tenant_id: str) -> str:
    """A tenant's POST /v1/files calls in the current minute (a counter, core/openai/file_quotas.py)."""
    return TENANT_LIMIT_PREFIX + tenant_id + ":uploads"


def count_in_window(client: redis.Redis, key: str, window_s: int) -> tuple[int, int]:
    """Count one more call in ``key``'s fixed window, which starts with its first call: (calls in
    the window so far, this one included; seconds until it ends). The counter and its expiry are
    set in one transaction, so a counter never outlives its window. Raises ``redis.RedisError``."""
    pipe = client.pipeline(transaction=True)
    pipe.set(key, 0, ex=window_s, nx=True)
    pipe.incr(key)
    pipe.ttl(key)
    _, count, ttl = pipe.execute()
    return int(count), int(ttl)


def inflight_key(tenant_id: str) -> str:
    """Sorted set of a tenant's admitted, unfinished request ids, scored by admission time (ms)."""
    return TENANT_LIMIT_PREFIX + tenant_id + INFLIGHT_SUFFIX


def eviction_policy(client: redis.Redis) -> str | None:
    """Redis's ``maxmemory-policy`` (from INFO, which servers that disable CONFIG still answer),
    or None when it cannot be read. Anything but ``noeviction`` may drop queued messages, limits
    and cancel flags under memory pressure."""
    try:
        return client.info("memory").get("maxmemory_policy")
    except redis.RedisError:
        return None


def redis_client(url: str, timeout_s: float = 2.0) -> redis.Redis:
    # Bounded timeouts: a hung Redis must not hang a web request or a worker thread.
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                health_check_interval=30, decode_responses=True)


# Counter INCR'd after every API key revocation and tenant disable commits. A web process that
# answers a submit from keys it authenticated a moment ago (web/auth.py RecentKeys) first checks
# that it has not moved since, so a revoked key gets its 401 at once.
AUTH_EPOCH_KEY = "sluice:auth:epoch"


def bump_auth_epoch(client: redis.Redis) -> bool:
    """Tell web processes to stop answering from the keys they remember. Call it after the
    revocation or disable commits: bumped before, a lookup in between would remember the key
    anew. False when Redis did not answer; they then forget it within SLUICE_AUTH_CACHE_S."""
    try:
        client.incr(AUTH_EPOCH_KEY)
    except redis.RedisError:
        return False
    return True


# Requests whose polling client declared `abandon_after_s`: member "<request id> <tenant id>",
# score the epoch second by which the next poll must come (web/waits.py; the sweep cancels the
# overdue).
ABANDON_KEY = "sluice:abandon"
