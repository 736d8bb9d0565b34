"""The platform's degradation level, as admission reads it from Redis.

A load monitor (a later issue) computes the level from queue depth and throughput and writes it
to ``LOAD_LEVEL_KEY`` as a hash ``{level, updated_at_ms}``. Admission reads it on every submit
inside its Lua script; a missing or stale level (older than ``SLUICE_LOAD_LEVEL_MAX_AGE_S``)
counts as NORMAL, so a dead monitor can never leave the platform shedding.

Admission acts on two levels: REJECT_BATCH turns batch submissions away, SHED turns everything
away (503 with Retry-After). The steps below them act later in the pipeline.
"""

from __future__ import annotations

import enum

import redis

from .keys import LOAD_LEVEL_KEY


class LoadLevel(enum.IntEnum):
    NORMAL = 0
    LIGHT_MODEL = 1
    SHORTER_OUTPUT = 2
    CACHED_ANSWERS = 3
    REJECT_BATCH = 4
    SHED = 5


def write_level(client: redis.Redis, level: LoadLevel, ttl_s: float = 60.0) -> None:
    """Publish ``level`` now (what the load monitor does; tests and operators use it too).

    The timestamp comes from the Redis clock, the one the admission script compares it with.
    """
    seconds, micros = client.time()
    client.hset(LOAD_LEVEL_KEY, mapping={"level": int(level), "updated_at_ms": seconds * 1000 + micros // 1000})
    client.pexpire(LOAD_LEVEL_KEY, int(ttl_s * 1000))
