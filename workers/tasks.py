"""Celery tasks. Names, queues and ack behaviour are declared here; the work lives elsewhere.

Every task runs through :class:`workers.celery_app.SluiceTask` (the process's services, ids on log lines).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid

import redis
from celery import shared_task
from celery.exceptions import Reject

from core.broker.queues import RUN_TASK, SWEEP_TASK, publish_committed
from core.rediskeys import RESERVED_KEY, SWEEP_LAST_KEY
from workers import execution, sweep
from workers.bootstrap import WORKER, EngineNotStarted, top_up
from workers.celery_app import SluiceTask
from workers.execution import DB_UNAVAILABLE

log = logging.getLogger(__name__)


# How long a thread that found every batch slot taken waits before handing the message back:
# long enough not to spin on a queue of batch work, short enough that a realtime message
# arriving meanwhile waits little.
BATCH_FULL_PAUSE_S = 0.2


@shared_task(bind=True, name=RUN_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_request(self: SluiceTask, request_id: str) -> None:
    """Run one request. Safe to deliver twice: the row's conditional claim lets one run win."""
    svc = self.services
    runtime = WORKER.runtime
    if runtime is not None and runtime.draining.is_set():
        _unreserve(svc, request_id)
        raise Reject(requeue=True)  # this worker is stopping: the message goes back, unclaimed
    queue = (self.request.delivery_info or {}).get("routing_key") or ""
    slots = WORKER.batch if queue.startswith("batch.") else None
    if slots is not None and not slots.try_take():
        time.sleep(BATCH_FULL_PAUSE_S)
        _unreserve(svc, request_id)
        raise Reject(requeue=True)  # not claimed: the row stays queued, the message goes back
    _top_up(svc, queue)
    try:
        def publish(rows, head: bool = False) -> None:  # the broker is svc.redis's Redis
            publish_committed(svc.lifecycle, svc.broker, rows, svc.epoch, head=svc.redis if head else None,
                              fair=svc.fair)

        execution.execute(svc.lifecycle, svc.redis, WORKER.require(), uuid.UUID(request_id), svc.answers,
                          svc.twins, publish)
    except (*DB_UNAVAILABLE, EngineNotStarted) as exc:
        # Postgres unreachable through every retry, or no engine in this process: hand the
        # message back to the queue rather than ack it, so the request is not stranded. The
        # claim is conditional, so a later delivery can never run it twice.
        log.error("handing the message back to the queue: %s", type(exc).__name__)
        raise Reject(requeue=True) from exc
    finally:
        if slots is not None:
            slots.give_back()
        # Claimed (the heartbeat now covers it) or not ours to run: either way no longer reserved.
        _unreserve(svc, request_id)


def _top_up(svc, queue: str) -> None:
    """This message is taken for good (not handed back): its queue is topped up from its fair line,
    in fair order (core/broker/fair.py), to the free seats the engines state (this request's seat
    is spoken for since its message came: EngineRuntime.arriving), or where no engine states its
    room, to the line's depth; the
    engine tops it up again as a request leaves (``bootstrap.start_runtime``'s ``on_room``), and
    failing both, the load monitor does within a second."""
    if not svc.fair.handles(queue):
        return
    try:
        top_up(svc, [queue])
    except Exception:
        log.warning("could not top up %s from its fair line; the load monitor will", queue)


def _unreserve(svc, request_id: str) -> None:
    if WORKER.runtime is not None:
        WORKER.runtime.arrived(request_id)
    try:
        svc.redis.hdel(RESERVED_KEY, request_id)
    except Exception:
        log.warning("could not clear reservation; the sweep will")


@shared_task(bind=True, name=SWEEP_TASK, ignore_result=True)
def sweep_stranded(self: SluiceTask) -> dict:
    began = time.monotonic()
    report = sweep.sweep(self.services)
    with contextlib.suppress(redis.RedisError):
        self.services.redis.hset(SWEEP_LAST_KEY, mapping={
            "at": time.time(), "took_ms": round((time.monotonic() - began) * 1000)})
    if any(report.values()):
        log.info("sweep: %s", report)
    return report
