"""The sweep: gets every accepted request moving again after a crash anywhere.

Beat runs it every few seconds on the maintenance queue. Each rule is a conditional update
on rows locked with SKIP LOCKED, so overlapping sweeps never act on one row twice.

1. Unpublished: `queued`, never published, older than the publish grace (the web process
   died or the broker refused between commit and publish) → publish.
2. Orphaned: `running` on a worker whose heartbeat expired (SIGKILL, OOM, lost host) →
   back to `queued` and republished, or `failed` with `worker_lost` once it used all its
   attempts, or `cancelled` if the client had asked for that.
3. Reserved but unclaimed: messages a dead worker had taken off a queue but not yet claimed
   (recorded in Redis on receipt) → republish the row if it is still `queued`.
4. Stranded conversation turns: `queued` on the direct queue of a worker that is gone →
   moved to the model's shared queue (they only lose their prefix cache hit).
5. Expired: `queued` past its deadline → `expired` now, not when a worker finally dequeues it.
6. Cancel flags: `running` with a cancel request → make sure the flag is in Redis (it may
   have been lost with a Redis restart, or never written).

Then admission housekeeping: release the token reservation and concurrency slot of every request
that ended without its own release (the terminal paths above, a worker killed between its final
write and the release, a Redis blip), and delete idempotency keys past their window.
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import NamedTuple

import redis
from celery import Celery
from sqlalchemy import func, or_, select, update

from models import InferenceRequest, Status, utcnow
from models.session import Database
from sluice.keys import RESERVED_KEY, node_key, raise_cancel_flag, worker_key
from sluice.limiter import limiter_for, reconcile_in_flight
from sluice.settings import Settings
from web.idempotency import expire_keys

from .execution import expire_if_late
from .routing import DIRECT_PREFIX, direct_queue, publish_committed, queue_name

log = logging.getLogger(__name__)

BATCH = 500


def sweep(db: Database, redis_client: redis.Redis, celery: Celery, settings: Settings) -> dict[str, int]:
    return {
        "published": _publish_unpublished(db, celery, settings),
        **_recover_orphans(db, redis_client, celery, settings),
        "unreserved": _recover_reserved(db, redis_client, celery),
        "rerouted": _reroute_direct(db, redis_client, celery, settings),
        "expired": _expire_late(db),
        "cancel_flags": _reraise_cancel_flags(db, redis_client),
        # Last, so requests the steps above just ended are released in this same run.
        "released": reconcile_in_flight(db, limiter_for(redis_client)),
        "idempotency_keys_expired": expire_keys(db, settings.idempotency_window_s),
    }


def _publish_unpublished(db: Database, celery: Celery, settings: Settings) -> int:
    t = InferenceRequest
    cutoff = utcnow() - timedelta(seconds=settings.publish_grace_s)
    with db.session() as session:
        rows = session.execute(
            select(t.id, t.queue).where(t.status == Status.QUEUED, t.enqueued_at.is_(None),
                                        t.created_at < cutoff)
            .order_by(t.created_at).limit(BATCH)).all()
    publish_committed(db, celery, rows)
    return len(rows)


def _recover_orphans(db: Database, redis_client: redis.Redis, celery: Celery,
                     settings: Settings) -> dict[str, int]:
    t = InferenceRequest
    counts = {"requeued": 0, "worker_lost": 0, "cancelled_orphans": 0}
    now = utcnow()
    cutoff = now - timedelta(seconds=settings.worker_dead_after_s)
    running = (t.status == Status.RUNNING, t.started_at < cutoff)
    # Past its time limit by a wide margin, a row is lost even if its worker lives (its outcome
    # write failed for good); the engine would have stopped it long ago.
    grace_s = settings.worker_dead_after_s + 60
    overdue = t.started_at + func.make_interval(0, 0, 0, 0, 0, 0, t.time_limit_s + grace_s) < now
    with db.session() as session:
        workers = session.scalars(select(t.worker).where(*running).distinct()).all()
        dead = [w for w in workers if w is None or not redis_client.exists(worker_key(w))]
        rows = session.execute(
            select(t.id, t.queue, t.worker, t.attempts, t.cancel_requested_at)
            .where(*running, or_(t.worker.in_([w for w in dead if w]), t.worker.is_(None), overdue))
            .order_by(t.started_at).limit(BATCH).with_for_update(skip_locked=True)).all()
        requeued = []
        for row in rows:
            owned = (t.id == row.id, t.status == Status.RUNNING, t.worker == row.worker)
            if row.cancel_requested_at is not None:
                session.execute(update(t).where(*owned).values(
                    status=Status.CANCELLED, finished_at=now, error_code="cancelled",
                    error_message="Cancelled by the client; its worker died while running it."))
                counts["cancelled_orphans"] += 1
            elif row.attempts >= settings.max_attempts:
                session.execute(update(t).where(*owned).values(
                    status=Status.FAILED, finished_at=now, error_code="worker_lost",
                    error_message=f"The worker running this died {row.attempts} times; gave up."))
                counts["worker_lost"] += 1
            else:
                session.execute(update(t).where(*owned).values(
                    status=Status.QUEUED, worker=None, device=None, started_at=None, enqueued_at=None))
                requeued.append(row)
                counts["requeued"] += 1
    # Publish only after the requeue is committed.
    publish_committed(db, celery, requeued)
    if any(counts.values()):
        log.warning("recovered requests of dead workers: %s", counts)
    return counts


def _recover_reserved(db: Database, redis_client: redis.Redis, celery: Celery) -> int:
    reserved = redis_client.hgetall(RESERVED_KEY)
    alive = {w: bool(redis_client.exists(worker_key(w))) for w in set(reserved.values())}
    dead = [rid for rid, w in reserved.items() if not alive[w]]
    if not dead:
        return 0
    t = InferenceRequest
    with db.session() as session:
        rows = session.execute(select(t.id, t.queue).where(
            t.id.in_([uuid.UUID(r) for r in dead]), t.status == Status.QUEUED)).all()
    publish_committed(db, celery, rows)
    redis_client.hdel(RESERVED_KEY, *dead)
    return len(rows)


def _reroute_direct(db: Database, redis_client: redis.Redis, celery: Celery, settings: Settings) -> int:
    t = InferenceRequest
    registry = settings.registry
    cutoff = utcnow() - timedelta(seconds=settings.worker_dead_after_s)
    moved: list[Routed] = []
    with db.session() as session:
        rows = session.execute(
            select(t.id, t.queue, t.priority, t.size_class, t.model_requested, t.model_routed)
            .where(t.status == Status.QUEUED, t.queue.startswith(DIRECT_PREFIX), t.enqueued_at < cutoff)
            .limit(BATCH).with_for_update(skip_locked=True)).all()
        nodes = {r.queue.removeprefix(DIRECT_PREFIX) for r in rows}
        dead = {n for n in nodes if not redis_client.exists(node_key(n))}
        for row in rows:
            if row.queue.removeprefix(DIRECT_PREFIX) not in dead:
                continue
            model = registry.get(row.model_routed or row.model_requested) or registry.default
            queue = queue_name(row.priority, row.size_class, registry.queue_suffix(model))
            session.execute(update(t).where(t.id == row.id, t.status == Status.QUEUED)
                            .values(queue=queue, enqueued_at=None))
            moved.append(Routed(row.id, queue))
    publish_committed(db, celery, moved)
    # Nobody consumes a dead node's queue; its rows were rerouted above (or will be next time).
    for node in dead:
        if not redis_client.exists(node_key(node)):  # not restarted under the same name meanwhile
            redis_client.delete(direct_queue(node))
    return len(moved)


class Routed(NamedTuple):
    id: uuid.UUID
    queue: str


def _expire_late(db: Database) -> int:
    with db.session() as session:
        return expire_if_late(session)


def _reraise_cancel_flags(db: Database, redis_client: redis.Redis) -> int:
    t = InferenceRequest
    with db.session() as session:
        rows = session.execute(select(t.id, t.time_limit_s).where(
            t.status == Status.RUNNING, t.cancel_requested_at.is_not(None)).limit(BATCH)).all()
    for row in rows:
        raise_cancel_flag(redis_client, str(row.id), row.time_limit_s)
    return len(rows)
