"""Webhooks: a request's or a job's events POSTed to the URL its submit named, signed.

Deliveries follow Standard Webhooks (standardwebhooks.com): headers ``webhook-id`` (the
delivery's id, the same on every retry, so receivers deduplicate), ``webhook-timestamp`` and
``webhook-signature`` (HMAC-SHA256 with the tenant's secret, ``whsec_…``), and a JSON body

    {"type": "request.completed", "timestamp": "<when it happened>", "data": {<request view>}}

This module is the web side: it checks a URL at submit (``core/delivery/ssrf.py``; 422
``webhook_url_refused`` naming the reason), turns lifecycle moves into delivery rows (the
lifecycle hook :meth:`Webhooks.moved`, run after commit in whichever process moved the row),
publishes them onto the ``webhooks`` queue once committed, and lists, redelivers and rotates
secrets for the API and the CLI. Sending, retrying and the sweep's part are
``workers/webhooks.py``'s, in a worker of its own: a dead receiver never holds a GPU worker.
"""

from __future__ import annotations

import base64
import logging
import secrets
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from sqlalchemy import case, func, select, tuple_, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from core.broker.queues import DELIVER_TASK, WEBHOOKS_QUEUE
from core.delivery import ssrf
from core.errors import InvalidRequest, NotFound
from core.settings import Settings
from core.submit.schemas import RequestViewSchema
from models import Delivery, DeliveryStatus, InferenceRequest, Status, Tenant, delivery_lifecycle
from models.lifecycle import Moved, about
from models.session import Database

log = logging.getLogger(__name__)

JOB_EVENTS = ("started", "progress", "completed")
DEFAULT_EVENTS = ("completed",)
_view = RequestViewSchema()


def check_url(url: str, allow: ssrf.AllowList) -> None:
    """422 ``webhook_url_refused`` when the SSRF guard refuses ``url``; its message says why."""
    try:
        ssrf.check(url, allow)
    except ssrf.Refused as exc:
        raise InvalidRequest(f"webhook_url refused ({exc.reason}): {exc.message}", code="webhook_url_refused",
                             details={"webhook_url": [exc.message]}) from None


def require_secret(tenant: Tenant) -> None:
    """A webhook is signed with its tenant's secret, which the tenant must have been shown first."""
    if tenant.webhook_secret is None:
        raise InvalidRequest("This API key's tenant has no webhook signing secret yet: create it with POST "
                             "/v1/webhooks/secret/rotate (shown once), then submit again.",
                             code="webhook_secret_missing")


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def payload(event: str, data: dict[str, Any]) -> dict[str, Any]:
    return {"type": event, "timestamp": datetime.now(UTC).isoformat(), "data": data}


class Webhooks:
    """Delivery rows and tenants' secrets in one database; publishes through ``publisher``."""

    def __init__(self, settings: Settings, db: Database, publisher: Celery) -> None:
        self.settings = settings
        self.db = db
        self.publisher = publisher

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
               request_id: uuid.UUID | None = None, job_id: uuid.UUID | None = None) -> uuid.UUID | None:
        """Insert a pending delivery in ``session``; its id, or None when that event of that
        request or job was already recorded. Publish it (:meth:`publish`) once committed."""
        retry_until = func.now() + timedelta(seconds=self.settings.webhook_retry_for_s)
        return session.scalar(insert(Delivery).values(
            id=uuid.uuid4(), tenant_id=tenant_id, request_id=request_id, job_id=job_id, event=event, url=url,
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
        """Send a delivery again now, whatever its status, with a new retry window; same id and body."""
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
        previous one signs."""
        secret = new_secret()
        grace = func.now() + timedelta(seconds=self.settings.webhook_rotation_grace_s)
        with self.db.session() as session:
            previous_until = session.scalar(update(Tenant).where(Tenant.id == tenant_id).values(
                webhook_previous_secret=Tenant.webhook_secret, webhook_secret=secret,
                webhook_previous_until=case((Tenant.webhook_secret.is_not(None), grace), else_=None))
                .returning(Tenant.webhook_previous_until))
        log.info("webhook secret rotated for tenant %s", tenant_id)
        return secret, previous_until
