"""Webhook deliveries: one row per event sent (or to be sent) to a request's or a job's webhook.

The row's id is the Standard Webhooks ``webhook-id``: stable across retries and redeliveries,
so a receiver that sees it twice knows it is the same event. The payload is fixed when the
event happens, so every attempt sends the same body (only ``webhook-timestamp`` and the
signature change).

    pending ─(2xx)─► succeeded
       └──(refused by the SSRF guard, or no 2xx within the retry window)──► failed
    succeeded | failed ─(redeliver)─► pending

While ``pending``, ``next_attempt_at`` says when the next attempt is due; a worker that takes
an attempt moves it past the attempt's longest duration first, so a second copy of the task
message finds nothing due and a dead worker's attempt is found overdue by the sweep. The
status changes only through ``models/delivery_lifecycle.py``.
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import CheckConstraint, ForeignKey, Index, String, Text, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base
from models.request import _str_enum


class DeliveryStatus(enum.StrEnum):
    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class Delivery(Base):
    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        CheckConstraint("num_nonnulls(request_id, job_id, budget_id) = 1", name="one_subject"),
        Index("ix_webhook_deliveries_tenant_id_created_at", "tenant_id", "created_at"),
        # The sweep's work list: deliveries whose next attempt may be overdue.
        Index("ix_webhook_deliveries_pending", "next_attempt_at", postgresql_where=text("status = 'pending'")),
        # A request's started and completed are sent once each, however often the hook runs (a
        # requeued request starts again); so are a job's started and completed.
        Index("uq_webhook_deliveries_request_id_event", "request_id", "event", unique=True,
              postgresql_where=text("request_id IS NOT NULL")),
        Index("uq_webhook_deliveries_job_id_event", "job_id", "event", unique=True,
              postgresql_where=text("job_id IS NOT NULL AND event <> 'job.progress'")),
        Index("ix_webhook_deliveries_job_id_created_at", "job_id", "created_at",
              postgresql_where=text("job_id IS NOT NULL")),
    )
    __mapper_args__ = {"eager_defaults": True}

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    request_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"))
    job_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    # A budget's threshold crossed (budget.threshold, core/usage/budgets.py): no request, no job.
    budget_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("budgets.id", ondelete="CASCADE"))
    event: Mapped[str] = mapped_column(String(32))  # request.started, request.completed, job.progress, …
    url: Mapped[str] = mapped_column(Text)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB)
    status: Mapped[DeliveryStatus] = mapped_column(_str_enum(DeliveryStatus, "delivery_status"),
                                                   default=DeliveryStatus.PENDING)
    attempts: Mapped[int] = mapped_column(default=0)
    last_status_code: Mapped[int | None]  # the receiver's last answer; NULL: no answer (or none yet)
    last_error: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    next_attempt_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # Attempts stop after this (SLUICE_WEBHOOK_RETRY_FOR_S from the event, or from a redelivery).
    retry_until: Mapped[datetime]
    finished_at: Mapped[datetime | None]
