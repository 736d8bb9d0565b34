"""The workers that serve right now, as their heartbeats in Redis say.

A worker writes a heartbeat only once its engine is warm (``workers/bootstrap.py``); the load
monitor, the job feeder and /readyz read them here.
"""

from __future__ import annotations

import json
import time

from core.rediskeys import WORKER_PREFIX

# Sequences an engine runs past the limit its governor fills, for a realtime request of a tenant
# that holds fewer of its seats than the tenants in it hold on average (none, say, beside a flooder
# that fills them): a quiet tenant's question starts at once instead of waiting for the next seat
# to come free (``workers/governor.py``; the fair line gives it that seat's turn, not the seat).
# Each worker is provisioned for them: its pool has this many threads more than its batch size,
# and a vLLM engine this many sequences more than SLUICE_VLLM_MAX_NUM_SEQS. One sequence more
# costs every sequence a little pace, and only while such a request runs.
NEWCOMER_SEATS = 1
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
