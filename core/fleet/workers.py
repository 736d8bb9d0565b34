"""The workers that serve right now, as their heartbeats in Redis say.

A worker writes a heartbeat only once its engine is warm (``workers/bootstrap.py``); the load
monitor, the job feeder and /readyz read them here.
"""

from __future__ import annotations

import json
import time

from core.rediskeys import WORKER_PREFIX

# A worker is alive while its last heartbeat is at most this many heartbeat intervals old; what it
# wrote for admission (its capacity entry) counts for as long.
HEARTBEAT_PATIENCE = 2.5


def live_workers(redis, heartbeat_s: float) -> list[dict]:
    """Warm workers whose last heartbeat is recent: a silent one leaves capacity at once,
    before its heartbeat key expires."""
    return [w for w in warm_workers(redis) if w.get("heartbeat_age_s", 0) <= HEARTBEAT_PATIENCE * heartbeat_s]


def warm_workers(redis) -> list[dict]:
    """Heartbeats of live workers. A worker writes one only after its engine warmed up."""
    keys = sorted(redis.scan_iter(match=WORKER_PREFIX + "*", count=200))
    now = time.time()
    workers = []
    for raw in redis.mget(keys) if keys else []:
        if raw:
            beat = json.loads(raw)
            beat["heartbeat_age_s"] = round(now - beat.pop("at", now), 3)
            workers.append(beat)
    return workers
