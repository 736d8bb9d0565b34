"""Celery tasks. Names, queues and ack behaviour are declared here; the work lives elsewhere."""

from __future__ import annotations

import logging
import uuid

from celery import shared_task
from celery.exceptions import Reject
from flask import current_app

from sluice.keys import RESERVED_KEY
from sluice.logs import current_request_id

from . import execution, sweep
from .bootstrap import current_runtime
from .execution import DB_UNAVAILABLE
from .routing import RUN_TASK, SWEEP_TASK

log = logging.getLogger(__name__)


@shared_task(name=RUN_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_request(request_id: str) -> None:
    """Run one request. Safe to deliver twice: the row's conditional claim lets one run win."""
    token = current_request_id.set(request_id)
    try:
        execution.execute(current_app.extensions["sluice.db"], current_app.extensions["sluice.redis"],
                          current_runtime(), uuid.UUID(request_id))
    except (*DB_UNAVAILABLE, RuntimeError) as exc:
        # Postgres unreachable through every retry, or no engine in this process: hand the
        # message back to the queue rather than ack it, so the request is not stranded. The
        # claim is conditional, so a later delivery can never run it twice.
        log.error("handing the message back to the queue: %s", type(exc).__name__)
        raise Reject(requeue=True) from exc
    finally:
        # Claimed (the heartbeat now covers it) or not ours to run: either way no longer reserved.
        try:
            current_app.extensions["sluice.redis"].hdel(RESERVED_KEY, request_id)
        except Exception:
            log.warning("could not clear reservation; the sweep will")
        current_request_id.reset(token)


@shared_task(name=SWEEP_TASK, ignore_result=True)
def sweep_stranded() -> dict:
    report = sweep.sweep(current_app.extensions["sluice.db"], current_app.extensions["sluice.redis"],
                         current_app.extensions["celery"], current_app.config["SLUICE"])
    if any(report.values()):
        log.info("sweep: %s", report)
    return report
