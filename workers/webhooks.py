"""Sending webhooks: the delivery task, its retries, and what the sweep does for deliveries.

The task runs in `sluice worker --role webhooks` (a thread pool, no engine) and only there: its
queue is no GPU worker's. One attempt:

    claim    the row, if pending and due: attempts + 1, next_attempt_at pushed past the longest an
             attempt can take, so a duplicate message finds nothing due and a worker that dies
             mid-attempt leaves the row overdue for the sweep
    send     signed (Standard Webhooks), through the SSRF guard: every hop's URL is checked after
             its name resolves, the connection goes to the checked address, redirects are
             followed by hand (MAX_REDIRECTS), no proxy from the environment is used
    record   2xx → succeeded; refused by the guard → failed at once (retrying cannot help); any
             other answer or error → pending again after the next BACKOFF step, or failed once
             that would fall past the delivery's retry window

Each step moves the row through ``models/delivery_lifecycle.py``, the one writer of its status.
A retry due within COUNTDOWN_MAX_S is published with that countdown; a later one is left to
the sweep, which publishes overdue deliveries while the webhooks queue is empty (a lost message,
a dead worker) and sends the events of jobs (started, progress at a bounded rate, completed).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import urljoin

import httpx
import redis
from celery import shared_task
from sqlalchemy import case, delete, func, select, text
from standardwebhooks import Webhook

from core import ssrf
from core.broker.queues import DELIVER_TASK, WEBHOOKS_QUEUE, queue_length
from core.services import Services
from core.settings import Settings
from core.tenants.scopes import Caller
from models import Delivery, DeliveryStatus, JobStatus, Tenant, delivery_lifecycle
from workers.celery_app import SluiceTask

log = logging.getLogger(__name__)

# Retry delays, in multiples of SLUICE_WEBHOOK_BACKOFF_S (5 s: 5 s, 30 s, 2 min, 10 min, 30 min,
# then hourly until the retry window closes).
BACKOFF = (1, 6, 24, 120, 360, 720)
MAX_REDIRECTS = 3
# ETA messages wait in a worker's memory; longer waits are the sweep's (it runs every few seconds).
COUNTDOWN_MAX_S = 300.0
# A message may arrive this much before its row is due (the publisher's clock vs the database's).
EARLY_S = 1.0
USER_AGENT = "Sluice-Webhooks/1"
_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class Outcome:
    status_code: int | None  # the last answer; None: no answer
    error: str | None  # None: delivered (2xx)
    final: bool = False  # retrying cannot help (the guard refused a hop)


@shared_task(bind=True, name=DELIVER_TASK, queue=WEBHOOKS_QUEUE, acks_late=True, ignore_result=True)
def deliver_webhook(self: SluiceTask, delivery_id: str) -> None:
    """One attempt of one delivery. Safe to deliver twice: the claim lets one attempt run."""
    deliver(self.services, uuid.UUID(delivery_id))


def deliver(svc: Services, delivery_id: uuid.UUID) -> None:
    settings = svc.settings
    claim = _claim(svc, delivery_id)
    if claim is None:
        log.info("webhook delivery %s: not due (sent, failed, or taken by another attempt)", delivery_id)
        return
    url, body, attempts, signers = claim
    outcome = send(url, delivery_id, body, signers, settings)
    delay = backoff_s(attempts, settings.webhook_backoff_s)
    status = _record(svc, delivery_id, outcome, delay)
    log.info("webhook delivery %s attempt %d: %s → %s", delivery_id, attempts,
             outcome.error or f"HTTP {outcome.status_code}",
             status.value if status else "not recorded (no longer pending)")
    if status == DeliveryStatus.PENDING and delay <= COUNTDOWN_MAX_S:
        svc.webhooks.publish(delivery_id, countdown=delay)


def backoff_s(attempts: int, base_s: float) -> float:
    """The wait after attempt number ``attempts`` (1-based) failed."""
    return BACKOFF[min(attempts, len(BACKOFF)) - 1] * base_s


def _claim(svc: Services, delivery_id: uuid.UUID) -> tuple[str, str, int, list[Webhook]] | None:
    """(url, body, attempt number, signers) of a due pending delivery, now taken; else None."""
    hops = MAX_REDIRECTS + 1
    lease_s = hops * 4 * svc.settings.webhook_timeout_s + 30  # connect, write, read, pool
    with svc.db.session() as session:
        row = delivery_lifecycle.claim(session, delivery_id, EARLY_S, lease_s)
        if row is None:
            return None
        # The previous secret signs too until its grace ends (receivers switch without a gap).
        tenant = session.execute(select(Tenant.webhook_secret, case(
            (Tenant.webhook_previous_until > func.now(), Tenant.webhook_previous_secret), else_=None))
            .where(Tenant.id == row.tenant_id)).one()
    signers = [Webhook(secret) for secret in tenant if secret]
    return row.url, json.dumps(row.payload, separators=(",", ":")), row.attempts, signers


def send(url: str, delivery_id: uuid.UUID, body: str, signers: list[Webhook], settings: Settings) -> Outcome:
    """POST ``body`` to ``url``, signed by every signer, following redirects by hand and checking
    each hop with the SSRF guard."""
    now = datetime.now(UTC)
    headers = {"content-type": "application/json", "user-agent": USER_AGENT, "webhook-id": str(delivery_id),
               "webhook-timestamp": str(int(now.timestamp())),
               "webhook-signature": " ".join(s.sign(str(delivery_id), now, body) for s in signers)}
    status = None
    with httpx.Client(timeout=settings.webhook_timeout_s, follow_redirects=False, trust_env=False) as client:
        for hop in range(MAX_REDIRECTS + 1):
            try:
                target = ssrf.check(url, settings.webhook_allow_list)
            except ssrf.Refused as exc:
                where = f"redirect to {url}" if hop else "the URL"
                return Outcome(status, _short(f"refused ({exc.reason}): {where}: {exc.message}"), final=True)
            extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
            try:
                with client.stream("POST", target.pinned_url, content=body.encode(), extensions=extensions,
                                   headers={**headers, "host": target.host_header}) as response:
                    status, location = response.status_code, response.headers.get("location")
            except httpx.HTTPError as exc:
                return Outcome(None, _short(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__))
            if status not in _REDIRECTS or not location:
                return Outcome(status, None if 200 <= status < 300 else f"HTTP {status}")
            url = urljoin(url, location)
    return Outcome(status, f"more than {MAX_REDIRECTS} redirects", final=True)


def _record(svc: Services, delivery_id: uuid.UUID, outcome: Outcome, delay_s: float) -> DeliveryStatus | None:
    """Write an attempt's outcome; the delivery's status after it (None: it was no longer pending,
    another attempt's end recorded first)."""
    with svc.db.session() as session:
        return delivery_lifecycle.record(session, delivery_id, status_code=outcome.status_code, error=outcome.error,
                                         final=outcome.final, retry_in_s=delay_s)


def _short(text: str) -> str:
    return text if len(text) <= 500 else text[:497] + "..."


# ---------------------------------------------------------------------- the sweep's part

BATCH = 500
# Live jobs with a webhook, and ended ones whose `completed` is wanted but not yet recorded; for
# each, the events already recorded and its last progress event.
_JOBS = text("""
    SELECT j.id, j.tenant_id, j.status, j.webhook_url, j.webhook_events,
           ARRAY(SELECT d.event FROM webhook_deliveries d WHERE d.job_id = j.id AND d.event <> 'job.progress') AS sent,
           p.done AS progress_done, coalesce(p.created_at < now() - make_interval(secs => :every), true) AS progress_due
    FROM jobs j
    LEFT JOIN LATERAL (SELECT d.created_at, (d.payload -> 'data' ->> 'done')::int AS done FROM webhook_deliveries d
                       WHERE d.job_id = j.id AND d.event = 'job.progress' ORDER BY d.created_at DESC LIMIT 1) p ON true
    WHERE j.webhook_url IS NOT NULL AND j.status <> 'validating'
      AND (j.finished_at IS NULL OR (j.finished_at > now() - make_interval(secs => :window)
           AND 'completed' = ANY(j.webhook_events) AND NOT EXISTS (
               SELECT 1 FROM webhook_deliveries d WHERE d.job_id = j.id AND d.event = 'job.completed')))
    ORDER BY j.created_at LIMIT :batch""")


def sweep(svc: Services) -> dict[str, int]:
    """What workers/sweep.py runs for webhooks every SLUICE_SWEEP_INTERVAL_S."""
    return {"webhook_job_events": _job_events(svc), "webhooks_republished": _republish_overdue(svc),
            "webhooks_abandoned": _abandon(svc), "webhooks_deleted": _delete_old(svc)}


def _job_events(svc: Services) -> int:
    """Record and publish the jobs' due events: started, completed, and progress when items
    finished since the last one and SLUICE_WEBHOOK_PROGRESS_S passed (at most one per sweep)."""
    settings, hooks = svc.settings, svc.webhooks
    with svc.db.session() as session:
        jobs = session.execute(_JOBS, {"every": settings.webhook_progress_s, "batch": BATCH,
                                       "window": settings.webhook_retry_for_s}).all()
    made: list[uuid.UUID] = []
    for job in jobs:
        wanted, ended = set(job.webhook_events or ()), JobStatus(job.status).terminal
        due = [e for e in ("started", "completed") if e in wanted and f"job.{e}" not in job.sent
               and (e == "started" or ended)]
        if not due and ("progress" not in wanted or ended or not job.progress_due):
            continue
        view = svc.jobs.get(Caller(job.tenant_id), str(job.id))
        view.pop("feeder", None)
        if "progress" in wanted and not ended and job.progress_due and view["done"] != (job.progress_done or 0):
            due.append("progress")
        with svc.db.session() as session:
            made += [i for e in due if (i := hooks.record(session, job.tenant_id, job.webhook_url, f"job.{e}", view,
                                                          job_id=job.id)) is not None]
    for delivery_id in made:
        hooks.publish(delivery_id)
    return len(made)


def _republish_overdue(svc: Services) -> int:
    """Pending deliveries overdue past the publish grace, while the webhooks queue is empty: their
    message was lost (Redis lost its data) or their worker died mid-attempt. With no webhooks
    worker running the queue fills once and stays full, so nothing is published twice over."""
    try:
        if queue_length(svc.redis, WEBHOOKS_QUEUE):
            return 0
    except redis.RedisError:
        return 0
    with svc.db.session() as session:
        ids = session.scalars(select(Delivery.id).where(
            Delivery.status == DeliveryStatus.PENDING, Delivery.retry_until > func.now(),
            Delivery.next_attempt_at < func.now() - timedelta(seconds=svc.settings.publish_grace_s))
            .order_by(Delivery.next_attempt_at).limit(BATCH)).all()
    hooks = svc.webhooks
    for delivery_id in ids:
        hooks.publish(delivery_id)
    return len(ids)


def _abandon(svc: Services) -> int:
    """Pending deliveries no attempt reached before their retry window closed → failed."""
    with svc.db.session() as session:
        return delivery_lifecycle.abandon(session, svc.settings.publish_grace_s)


def _delete_old(svc: Services) -> int:
    """Finished deliveries older than SLUICE_RETENTION_DAYS: their payloads hold outputs."""
    days = svc.settings.retention_days
    if days is None:
        return 0
    with svc.db.session() as session:
        old = (select(Delivery.id).where(Delivery.status != DeliveryStatus.PENDING,
                                         Delivery.created_at < func.now() - timedelta(days=days))
               .limit(BATCH).scalar_subquery())
        return session.execute(delete(Delivery).where(Delivery.id.in_(old))).rowcount
