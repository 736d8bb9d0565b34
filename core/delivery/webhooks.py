"""Webhooks: a request's or a job's events POSTed to the URL its submit named, signed.

Deliveries follow Standard Webhooks (standardwebhooks.com): headers ``webhook-id`` (the
delivery's id, the same on every retry, so receivers deduplicate), ``webhook-timestamp`` and
``webhook-signature`` (HMAC-SHA256 with the tenant's secret, ``whsec_…``), and a JSON body

    {"type": "request.completed", "timestamp": "<when it happened>", "data": {<request view>}}

This module is the web side: it checks a URL at submit (``core/delivery/ssrf.py``; 422
``webhook_url_refused`` naming the reason), turns lifecycle moves into delivery rows (the
lifecycle hook :meth:`Webhooks.moved`, run after commit in whichever process moved the row),
publishes them onto the ``webhooks`` queue once committed, and lists, redelivers and rotates
secrets for the API and the CLI; a tenant's redeliveries and rotations share a per-minute limit
(SLUICE_WEBHOOK_ACTIONS_PER_MINUTE, a Redis counter per tenant). Sending, retrying and the sweep's part are
``workers/webhooks.py``'s, in a worker of its own: a dead receiver never holds a GPU worker.
"""

from __future__ import annotations

import base64
import logging
import secrets
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from celery import Celery
from sqlalchemy import case, func, or_, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from core.broker.queues import DELIVER_TASK, WEBHOOKS_QUEUE
from core.errors import Conflict, NotFound, RateLimited
from core.rediskeys import count_in_window, webhook_actions_key
from core.settings import Settings
from core.submit.schemas import RequestViewSchema
from models import Delivery, DeliveryStatus, InferenceRequest, Status, Tenant, delivery_lifecycle
from models.lifecycle import Moved, about
from models.session import Database

log = logging.getLogger(__name__)

# A tenant's redeliveries and rotations are counted per window of this length.
ACTIONS_WINDOW_S = 60
_view = RequestViewSchema()


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def payload(event: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"type": event, "timestamp": datetime.now(UTC).isoformat(), "data": data}


class Webhooks:
    """Delivery rows and tenants' secrets in one database; publishes through ``publisher``."""

    def __init__(self, settings: Settings, db: Database, publisher: Celery, redis_client: redis.Redis) -> None:
        self.settings = settings
        self.db = db
        self.publisher = publisher
        # The web tier's admission client (one short timeout, no retries): a hung Redis costs a
        # redelivery or a rotation at most SLUICE_REDIS_TIMEOUT_S, then lets it through.
        self.redis = redis_client

    # ------------------------------------------------------------------ events

    def moved(self, moved: Moved) -> None:
        """The lifecycle hook: ``started`` on queued → running, ``completed`` on any terminal
        status. A row without a webhook returns at once; a repeated event (a requeued request
        starts again) makes no second delivery."""
        if not moved.webhook:
            return
        if moved.status.terminal:
            event = "completed"
        elif moved.status == Status.RUNNING and moved.source == Status.QUEUED:
            event = "started"
        else:
            return
        with self.db.session() as session:
            row = session.get(InferenceRequest, moved.id)
            if row is None or row.webhook_url is None or event not in (row.webhook_events or ()):
                return
            delivery_id = self.record(session, row.tenant_id, row.webhook_url, f"request.{event}",
                                      _view.dump(row), request_id=row.id)
        if delivery_id is not None:
            log.info("webhook request.%s: delivery %s", event, delivery_id, extra=about(moved.id))
            self.publish(delivery_id)

    def record(self, session: Session, tenant_id: uuid.UUID, url: str, event: str, data: dict[str, Any],
               request_id: uuid.UUID | None = None, job_id: uuid.UUID | None = None,
               budget_id: uuid.UUID | None = None) -> uuid.UUID | None:
        """Insert a pending delivery in ``session``; its id, or None when that event of that
        request or job was already recorded. Publish it (:meth:`publish`) once committed."""
        retry_until = func.now() + timedelta(seconds=self.settings.webhook_retry_for_s)
        return session.scalar(insert(Delivery).values(
            id=uuid.uuid4(), tenant_id=tenant_id, request_id=request_id, job_id=job_id, budget_id=budget_id,
            event=event, url=url,
            payload=payload(event, data), status=DeliveryStatus.PENDING, attempts=0, retry_until=retry_until)
            .on_conflict_do_nothing().returning(Delivery.id))

    def publish(self, delivery_id: uuid.UUID, countdown: float | None = None) -> None:
        """Queue an attempt of a committed delivery; if the broker is away, the sweep does it later."""
        try:
            self.publisher.send_task(DELIVER_TASK, args=[str(delivery_id)], queue=WEBHOOKS_QUEUE,
                                     routing_key=WEBHOOKS_QUEUE, countdown=countdown)
        except Exception:
            log.warning("webhook delivery %s not published; the sweep will", delivery_id, exc_info=True)

    # ------------------------------------------------------------------ the API's

    def list(self, tenant_id: uuid.UUID, limit: int, *, request_id: uuid.UUID | None = None,
             job_id: uuid.UUID | None = None, status: DeliveryStatus | None = None,
             before: uuid.UUID | None = None) -> list[Delivery]:
        """The tenant's deliveries, newest first, filtered by request, job or status."""
        query = select(Delivery).where(Delivery.tenant_id == tenant_id)
        for column, value in ((Delivery.request_id, request_id), (Delivery.job_id, job_id),
                              (Delivery.status, status)):
            if value is not None:
                query = query.where(column == value)
        if before is not None:
            anchor = self.get(tenant_id, before)
            query = query.where(tuple_(Delivery.created_at, Delivery.id) < tuple_(anchor.created_at, anchor.id))
        with self.db.session() as session:
            return list(session.scalars(query.order_by(Delivery.created_at.desc(), Delivery.id.desc()).limit(limit)))

    def get(self, tenant_id: uuid.UUID | None, delivery_id: uuid.UUID) -> Delivery:
        """A delivery of the tenant's (any tenant's when None: the operator's CLI); else 404."""
        with self.db.session() as session:
            row = session.get(Delivery, delivery_id)
        if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
            raise NotFound(f"No webhook delivery {delivery_id} for this API key.")
        return row

    def redeliver(self, tenant_id: uuid.UUID | None, delivery_id: uuid.UUID) -> Delivery:
        """Send a delivery again now, whatever its status, with a new retry window; same id and body.
        A tenant's call counts against its actions per minute (:meth:`count_action`)."""
        if tenant_id is not None:
            self.count_action(tenant_id)
        with self.db.session() as session:
            row = delivery_lifecycle.redeliver(session, delivery_id, tenant_id, self.settings.webhook_retry_for_s)
        if row is None:
            raise NotFound(f"No webhook delivery {delivery_id} for this API key.")
        log.info("webhook delivery %s: redelivery requested", delivery_id)
        self.publish(row.id)
        return row

    def rotate(self, tenant_id: uuid.UUID) -> tuple[str, datetime | None]:
        """A new signing secret for the tenant (its first, or the next); the previous one goes on
        signing beside it for SLUICE_WEBHOOK_ROTATION_GRACE_S. The secret and until when the
        previous one signs.

        Refused (409 ``rotation_in_progress``, saying when it ends) while an earlier rotation's
        grace runs: only two secrets sign at once, so a rotation then would drop the one that
        receivers which have not switched yet still verify with. Counts against the tenant's
        actions per minute (:meth:`count_action`)."""
        self.count_action(tenant_id)
        secret = new_secret()
        grace = func.now() + timedelta(seconds=self.settings.webhook_rotation_grace_s)
        with self.db.session() as session:
            # One statement decides, so two rotations at once cannot both pass the check.
            rotated = session.execute(update(Tenant).where(
                Tenant.id == tenant_id,
                or_(Tenant.webhook_previous_until.is_(None), Tenant.webhook_previous_until <= func.now()))
                .values(webhook_previous_secret=Tenant.webhook_secret, webhook_secret=secret,
                        webhook_previous_until=case((Tenant.webhook_secret.is_not(None), grace), else_=None))
                .returning(Tenant.webhook_previous_until)).first()
            grace_ends = None if rotated is not None else session.scalar(
                select(Tenant.webhook_previous_until).where(Tenant.id == tenant_id))
        if rotated is None:
            if grace_ends is None:
                raise NotFound("No such tenant.")
            raise Conflict(f"The previous webhook secret still signs beside the current one until "
                           f"{grace_ends.isoformat()} (the last rotation's grace); rotating now would stop "
                           "signing with a secret receivers may still verify with. Rotate again after then.",
                           code="rotation_in_progress", details={"previous_valid_until": grace_ends.isoformat()})
        log.info("webhook secret rotated for tenant %s", tenant_id)
        return secret, rotated.webhook_previous_until

    def count_action(self, tenant_id: uuid.UUID) -> None:
        """Count a redelivery or a rotation of the tenant's; 429 ``rate_limited`` with Retry-After
        (to the end of its window) once SLUICE_WEBHOOK_ACTIONS_PER_MINUTE were asked for in one.
        When Redis does not answer, the call goes through uncounted: the limit guards against a
        flood, and refusing every rotation during an outage would guard nothing."""
        limit = self.settings.webhook_actions_per_minute
        if not limit:
            return
        key = webhook_actions_key(str(tenant_id))
        try:
            count, ttl = count_in_window(self.redis, key, ACTIONS_WINDOW_S)
        except redis.RedisError as exc:
            log.warning("webhook action limit not checked for tenant %s: Redis %s", tenant_id, type(exc).__name__)
            return
        if count > limit:
            retry_s = max(1, ttl)
            raise RateLimited(f"Rate limit reached: {limit} webhook redeliveries and secret rotations per minute; "
                              f"retry after {retry_s} s.", headers={"Retry-After": str(retry_s)},
                              details={"limit": "webhook_actions_per_minute", "limit_per_minute": limit})
