"""The sweep: gets every accepted request moving again after a crash anywhere.

Beat runs it every few seconds on the maintenance queue. Each rule is a conditional update
on rows locked with SKIP LOCKED, so overlapping sweeps never act on one row twice.

1. Unpublished: `queued`, never published, older than the publish grace (the web process
   died or the broker refused between commit and publish) → publish.
   Lost: `queued` and published, but the message is gone — published into an older epoch of the
   broker's data (Redis restarted empty or flushed), or, past the lost-message grace, in no
   queue list and taken by no worker that recorded it (a list deleted or evicted, a replica
   behind, a worker killed as it took the message) → publish again.
2. Orphaned: `running` on a worker whose heartbeat expired (SIGKILL, OOM, lost host) →
   back to `queued` and republished, or `failed` with `worker_lost` once it used all its
   attempts, or `cancelled` if the client had asked for that. One whose worker's watchdog found
   the event loop held inside it (``workers/runtime.py _blame``) → `failed` with
   `stalled_worker`: requeued, it would stall the next worker too.
3. Reserved but unclaimed: messages a dead worker had taken off a queue but not yet claimed
   (recorded in Redis on receipt) → republish the row if it is still `queued`.
4. Stranded conversation turns: `queued` on the direct queue of a worker that is gone →
   moved to the model's shared queue (they only lose their prefix cache hit).
5. Expired: `queued` past its deadline → `expired` now, not when a worker finally dequeues it.
   Parked twins (core/submit/twins.py) are never published by rule 1; those whose leader ended
   without settling them take its answer or are un-parked and published.
6. Cancel flags: `running` with a cancel request → make sure the flag is in Redis (it may
   have been lost with a Redis restart, or never written).
7. Abandoned: a request whose polling client declared ``abandon_after_s`` and has not polled
   for that long → cancelled (web/waits.py): nobody will read its answer.
8. Retention: prompts and outputs of requests finished more than SLUICE_RETENTION_DAYS ago
   are deleted (``redacted_at`` stamped); the row's accounting stays.
9. Webhooks (workers/webhooks.py): jobs' events recorded and published; deliveries overdue (a
   lost message, a dead webhooks worker) published again; finished ones past retention deleted.

Then admission housekeeping: release the token reservation and concurrency slot of every request
that ended without its own release (the terminal paths above, a worker killed between its final
write and the release, a Redis blip), and delete idempotency keys past their window.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import redis
from sqlalchemy import case, func, or_, select, update

from core.admission.limiter import limiter_for, reconcile_in_flight
from core.broker.fair import FairQueues
from core.broker.queues import (
    DIRECT_PREFIX,
    BrokerEpoch,
    direct_queue,
    messages_queued,
    publish_committed,
    queue_length,
    queue_name,
)
from core.delivery.waits import abandon_idle_pollers
from core.rediskeys import (
    EPOCH_SEEN_KEY,
    LOST_CHECK_KEY,
    RESERVED_KEY,
    STALLED_PREFIX,
    node_key,
    raise_cancel_flag,
    worker_key,
)
from core.services import Services
from core.settings import Settings
from core.submit.twins import Twins
from core.usage import refusals
from models import InferenceRequest, Job, JobItem, Priority, Status
from models.idempotency import expire_keys
from models.lifecycle import Lifecycle, Requeued, reroute
from models.request import redaction
from models.session import Database
from workers import webhooks

log = logging.getLogger(__name__)

BATCH = 500
JOB_BATCH = 5  # jobs whose items are redacted per sweep (a job may hold millions)
# Published rows checked for a lost message per sweep (ids and queue names only).
LOST_SCAN_ROWS = 20_000
# After a broker loss, one sweep re-publishes for at most this long; the next goes on.
LOST_BUDGET_S = 5.0
_t = InferenceRequest
# Rows (anything with ``id`` and ``queue``) committed as queued → published and stamped.
Publish = Callable[[Sequence[Any]], None]


# What publishing a row needs: its queue, its tier (its message's step) and, for its place in its
# queue's fair line (core/broker/fair.py), its tenant and tokens.
_PUBLISH_COLUMNS = (_t.id, _t.queue, _t.service_tier, _t.tenant_id, _t.input_tokens, _t.reserved_tokens)


def sweep(svc: Services) -> dict[str, int]:
    db, redis_client, settings = svc.db, svc.redis, svc.settings
    publish = functools.partial(publish_committed, svc.lifecycle, svc.broker, epoch=svc.epoch, fair=svc.fair)
    return {
        "published": _publish_unpublished(db, publish, settings),
        **_republish_lost(db, publish, redis_client, svc.epoch, svc.fair, settings),
        "twins_settled": _settle_twins(db, svc.twins),
        **_recover_orphans(db, svc.lifecycle, redis_client, publish, settings),
        "unreserved": _recover_reserved(db, redis_client, publish),
        "rerouted": _reroute_direct(db, redis_client, publish, settings),
        "expired": svc.lifecycle.expire_late(),
        "cancel_flags": _reraise_cancel_flags(db, redis_client),
        "abandoned": abandon_idle_pollers(svc),
        "redacted": _redact_old(db, settings),
        "jobs_redacted": _redact_old_jobs(db, settings),
        **webhooks.sweep(svc),
        **_usage(svc),
        # Last, so requests the steps above just ended are released in this same run.
        "released": reconcile_in_flight(db, limiter_for(redis_client)),
        "idempotency_keys_expired": expire_keys(db, settings.idempotency_window_s),
    }


def _usage(svc: Services) -> dict[str, int]:
    """Refusal counts from Redis into the usage rollups; budget thresholds crossed, announced."""
    try:
        refused = refusals.flush(svc.db, svc.redis)
    except redis.RedisError as exc:
        log.warning("refusal counts not copied: Redis unreachable (%s)", type(exc).__name__)
        refused = 0

    def record(session, budget, data):
        return svc.webhooks.record(session, budget.tenant_id, budget.webhook_url, "budget.threshold", data,
                                   budget_id=budget.id)

    deliveries = svc.budgets.thresholds(record)
    for delivery in deliveries:
        svc.webhooks.publish(delivery)
    return {"refusal_groups": refused, "budget_thresholds": len(deliveries)}


def _ago(seconds: float):
    """The database clock ``seconds`` ago, the clock every stamp compared with it was written on."""
    return func.now() - timedelta(seconds=seconds)


def _publish_unpublished(db: Database, publish: Publish, settings: Settings) -> int:
    with db.session() as session:
        rows = session.execute(
            select(*_PUBLISH_COLUMNS).where(_t.status == Status.QUEUED, _t.enqueued_at.is_(None),
                                          _t.follows_id.is_(None), _t.created_at < _ago(settings.publish_grace_s))
            .order_by(_t.created_at).limit(BATCH)).all()
    publish(rows)
    return len(rows)


def _republish_lost(db: Database, publish: Publish, redis_client: redis.Redis, epoch: BrokerEpoch,
                    fair: FairQueues, settings: Settings) -> dict[str, int]:
    """Queued rows whose message the broker no longer has: published into an older epoch of its
    data, or (past the grace, checked message by message) in no queue and taken by no worker.
    A Redis error skips this step, not the sweep."""
    try:
        current = epoch.current()
        if current is None:  # Redis was never reached: nothing can be published now anyway
            return {"lost_epoch": 0, "lost_missing": 0}
        older = _republish_older_epochs(db, publish, redis_client, epoch, current)
        missing = _republish_missing(db, publish, redis_client, current, fair, settings)
    except redis.RedisError as exc:
        log.warning("lost-message check skipped: Redis unreachable (%s)", type(exc).__name__)
        return {"lost_epoch": 0, "lost_missing": 0}
    if older or missing:
        log.warning("re-published queued requests whose message was lost: %d from an older broker epoch, "
                    "%d missing from their queue", older, missing)
    return {"lost_epoch": older, "lost_missing": missing}


_PUBLISHED = (_t.status == Status.QUEUED, _t.enqueued_at.is_not(None), _t.follows_id.is_(None))
_REALTIME_FIRST = case((_t.priority == Priority.REALTIME, 0), else_=1)


def _republish_older_epochs(db: Database, publish: Publish, redis_client: redis.Redis, epoch: BrokerEpoch,
                            current: str) -> int:
    """Every queued row of an older epoch of this Redis database, realtime first, for up to
    LOST_BUDGET_S per sweep. Looked for only when the epoch differs from the one the last
    complete pass saw: a loss takes that record with it, so normally this is one GET."""
    if redis_client.get(EPOCH_SEEN_KEY) == current:
        return 0
    stale = or_(_t.broker_epoch.is_(None),  # published before epochs were recorded
                _t.broker_epoch.startswith(epoch.prefix, autoescape=True) & (_t.broker_epoch != current))
    began, done = time.monotonic(), 0
    while True:
        with db.session() as session:
            rows = session.execute(select(*_PUBLISH_COLUMNS).where(*_PUBLISHED, stale)
                                   .order_by(_REALTIME_FIRST, _t.enqueued_at).limit(BATCH)).all()
        publish(rows)  # stamps them with the current epoch: the next round finds the rest
        done += len(rows)
        if len(rows) < BATCH:
            redis_client.set(EPOCH_SEEN_KEY, current)
            return done
        if time.monotonic() - began > LOST_BUDGET_S:
            return done  # the next sweep goes on


def _republish_missing(db: Database, publish: Publish, redis_client: redis.Redis, current: str,
                       fair: FairQueues, settings: Settings) -> int:
    """Rows queued past the grace whose message is in no queue list, that are in no fair line
    (taken off it by a process that died before publishing them) and that no worker recorded
    taking (a message a worker took unrecorded, killed in that instant, would wait for the
    visibility timeout). A queue is read message by message only when it and the workers'
    records together hold fewer messages than it has published queued rows (a duplicate can
    hide a loss until it is consumed), and at most a few times per grace."""
    if not redis_client.set(LOST_CHECK_KEY, 1, nx=True, ex=max(1, int(settings.lost_message_grace_s / 4))):
        return 0
    with db.session() as session:
        suspects = session.execute(
            select(*_PUBLISH_COLUMNS).where(*_PUBLISHED, _t.broker_epoch == current,
                                                           _t.enqueued_at < _ago(settings.lost_message_grace_s))
            .order_by(_REALTIME_FIRST, _t.enqueued_at).limit(LOST_SCAN_ROWS)).all()
        queues = {r.queue for r in suspects}
        counts = dict(session.execute(
            select(_t.queue, func.count()).where(*_PUBLISHED, _t.broker_epoch == current, _t.queue.in_(queues))
            .group_by(_t.queue)).all()) if queues else {}
    taken = redis_client.hlen(RESERVED_KEY)
    short = {q for q in queues if queue_length(redis_client, q) + fair.size(q) + taken < counts.get(q, 0)}
    if not short:
        return 0
    present = messages_queued(redis_client, short)
    for queue in short:
        present.update(fair.in_line(queue))
    present.update(redis_client.hkeys(RESERVED_KEY))
    missing = [r for r in suspects if r.queue in short and str(r.id) not in present][:BATCH]
    publish(missing)
    return len(missing)


def _settle_twins(db: Database, twins: Twins) -> int:
    """Twins parked on a request that ended without settling them (its process died between the
    commit and the hook): they take its answer, or are un-parked and published."""
    leader = _t.__table__.alias("leader")
    with db.session() as session:
        leaders = session.scalars(
            select(_t.follows_id).join(leader, leader.c.id == _t.follows_id)
            .where(_t.status == Status.QUEUED, _t.follows_id.is_not(None), leader.c.status.not_in(_LIVE))
            .distinct().limit(BATCH)).all()
    for leader_id in leaders:
        twins.settle(leader_id)
    return len(leaders)


_LIVE = (Status.QUEUED, Status.RUNNING)


def _recover_orphans(db: Database, lifecycle: Lifecycle, redis_client: redis.Redis, publish: Publish,
                     settings: Settings) -> dict[str, int]:
    running = (_t.status == Status.RUNNING, _t.started_at < _ago(settings.worker_dead_after_s))
    # Past its time limit by a wide margin, a row is lost even if its worker lives (its outcome
    # write failed for good); the engine would have stopped it long ago.
    grace_s = settings.worker_dead_after_s + 60
    overdue = _t.started_at + func.make_interval(0, 0, 0, 0, 0, 0, _t.time_limit_s + grace_s) < func.now()
    with db.session() as session:
        workers = session.scalars(select(_t.worker).where(*running).distinct()).all()
    dead = [w for w in workers if w is not None and not redis_client.exists(worker_key(w))]
    # Requests a dying worker's watchdog found its loop inside: failed, not run into the next one.
    # (A mark outlives its row's end by a day at most: it names a request that has ended by then.)
    stalled = frozenset(_stalled(redis_client)) if dead else frozenset()
    counts, requeued = lifecycle.recover_orphans(
        running[1], or_(_t.worker.in_(dead), _t.worker.is_(None), overdue),
        max_attempts=settings.max_attempts, limit=BATCH, stalled=stalled)
    # Publish only after the requeue is committed.
    publish(requeued)
    if any(counts.values()):
        log.warning("recovered requests of dead workers: %s", counts)
    return counts


def _stalled(redis_client: redis.Redis) -> Iterator[uuid.UUID]:
    for key in redis_client.scan_iter(match=STALLED_PREFIX + "*", count=500):
        text = (key if isinstance(key, str) else key.decode())[len(STALLED_PREFIX):]
        with contextlib.suppress(ValueError):
            yield uuid.UUID(text)


def _recover_reserved(db: Database, redis_client: redis.Redis, publish: Publish) -> int:
    reserved = redis_client.hgetall(RESERVED_KEY)
    alive = {w: bool(redis_client.exists(worker_key(w))) for w in set(reserved.values())}
    dead = [rid for rid, w in reserved.items() if not alive[w]]
    if not dead:
        return 0
    with db.session() as session:
        rows = session.execute(select(*_PUBLISH_COLUMNS).where(
            _t.id.in_([uuid.UUID(r) for r in dead]), _t.status == Status.QUEUED)).all()
    publish(rows)
    redis_client.hdel(RESERVED_KEY, *dead)
    return len(rows)


def _reroute_direct(db: Database, redis_client: redis.Redis, publish: Publish, settings: Settings) -> int:
    """Queued turns on a dead worker's direct queue move to their model's shared queue. Not a
    status change: the row stays ``queued``, on another queue, to be published again."""
    registry = settings.registry
    moved: list[Requeued] = []
    with db.session() as session:
        rows = session.execute(
            select(*_PUBLISH_COLUMNS, _t.priority, _t.size_class, _t.model_requested, _t.model_routed)
            .where(_t.status == Status.QUEUED, _t.queue.startswith(DIRECT_PREFIX),
                   _t.enqueued_at < _ago(settings.worker_dead_after_s))
            .limit(BATCH).with_for_update(skip_locked=True)).all()
        nodes = {r.queue.removeprefix(DIRECT_PREFIX) for r in rows}
        dead = {n for n in nodes if not redis_client.exists(node_key(n))}
        for row in rows:
            if row.queue.removeprefix(DIRECT_PREFIX) not in dead:
                continue
            model = registry.get(row.model_routed or row.model_requested) or registry.default
            queue = queue_name(row.priority, row.size_class, registry.queue_suffix(model))
            session.execute(reroute(row.id, queue))
            moved.append(Requeued.of(row)._replace(queue=queue))
    publish(moved)
    # Nobody consumes a dead node's queue; its rows were rerouted above (or will be next time).
    for node in dead:
        if not redis_client.exists(node_key(node)):  # not restarted under the same name meanwhile
            redis_client.delete(direct_queue(node))
    return len(moved)


def _redact_old(db: Database, settings: Settings) -> int:
    if settings.retention_days is None:
        return 0
    with db.session() as session:
        old = (select(_t.id).where(_t.redacted_at.is_(None), _t.finished_at.is_not(None),
                                   _t.finished_at < _ago(settings.retention_days * 86400))
               .limit(BATCH).with_for_update(skip_locked=True).scalar_subquery())
        done = session.execute(redaction(_t.id.in_(old)))
        return done.rowcount


def _redact_old_jobs(db: Database, settings: Settings) -> int:
    """Documents and results of jobs finished SLUICE_RETENTION_DAYS ago (a few jobs per sweep)."""
    if settings.retention_days is None:
        return 0
    with db.session() as session:
        old = session.scalars(select(Job.id).where(Job.redacted_at.is_(None), Job.finished_at.is_not(None),
                                                   Job.finished_at < _ago(settings.retention_days * 86400))
                              .limit(JOB_BATCH).with_for_update(skip_locked=True)).all()
        if old:
            session.execute(update(JobItem).where(JobItem.job_id.in_(old)).values(text=None, body=None, result=None))
            session.execute(update(Job).where(Job.id.in_(old)).values(redacted_at=func.now()))
    return len(old)


def _reraise_cancel_flags(db: Database, redis_client: redis.Redis) -> int:
    with db.session() as session:
        rows = session.execute(select(_t.id, _t.time_limit_s).where(
            _t.status == Status.RUNNING, _t.cancel_requested_at.is_not(None)).limit(BATCH)).all()
    for row in rows:
        raise_cancel_flag(redis_client, str(row.id), row.time_limit_s)
    return len(rows)
