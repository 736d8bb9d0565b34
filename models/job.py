"""Bulk jobs: a file of documents, one row per line, fed to the batch queues as capacity frees up.

A job's items stay in Postgres: only the requests the feeder made for the items in flight are
on a queue (``core/jobs/feeder.py``). An item's work is one request, or, for a document longer
than the model's context, a map-reduce: its chunks are summarised (the *map*, depth 0), those
summaries joined and summarised again (depth 1, 2, …) until one request covers everything
(the item's ``final`` stage). ``requests`` holds the ids of the current stage's requests in
input order; their ids are written here before the requests are created, so a feeder that
dies between the two creates the missing ones with the same ids and nothing runs twice.

Both statuses change only through ``models/job_lifecycle.py``, which draws them and holds their
tables of allowed moves; an item may also be born ``invalid`` (a line that failed validation).
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, ForeignKey, Index, String, Text, func, text
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base
from models.request import _str_enum


class JobStatus(enum.StrEnum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"  # every item was fed; the last ones are running
    COMPLETED = "completed"
    FAILED = "failed"  # the upload never finished, or no item succeeded
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED)


class ItemStatus(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    INVALID = "invalid"

    @property
    def terminal(self) -> bool:
        return self not in (ItemStatus.PENDING, ItemStatus.RUNNING)


# Statuses a job still feeds or finishes items in.
LIVE_JOB = (JobStatus.IN_PROGRESS, JobStatus.FINALIZING, JobStatus.CANCELLING)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_jobs_live", "status", postgresql_where=text(
            "status IN ('validating', 'in_progress', 'finalizing', 'cancelling')")),
    )
    __mapper_args__ = {"eager_defaults": True}

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    # The key that submitted it: its lines' requests are that key's usage (and charged to its budget).
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    status: Mapped[JobStatus] = mapped_column(_str_enum(JobStatus, "job_status"), default=JobStatus.VALIDATING)
    model: Mapped[str] = mapped_column(String(128))
    priority: Mapped[str] = mapped_column(String(16))
    # Its lines' service tier (models.ServiceTier): their place in line and their price.
    service_tier: Mapped[str] = mapped_column(String(16), default="batch", server_default="batch")
    instruction: Mapped[str] = mapped_column(Text)
    summary_tokens: Mapped[int]
    completion_window_s: Mapped[int]
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSONB, default=dict)
    # Where its events are POSTed (the sweep sends them, workers/webhooks.py): started, progress, completed.
    webhook_url: Mapped[str | None] = mapped_column(Text)
    webhook_events: Mapped[list[str] | None] = mapped_column(ARRAY(String(16)))

    total_items: Mapped[int] = mapped_column(default=0)  # valid lines
    invalid_lines: Mapped[int] = mapped_column(default=0)
    input_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # What the submit priced the job at (input estimate + summary tokens per item, map-reduce included).
    estimated_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(String(500))

    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    started_at: Mapped[datetime | None]  # the upload was admitted
    expires_at: Mapped[datetime | None]
    # When it was estimated to finish at submit (core/jobs/estimate.py); null where the platform
    # had no figures to say.
    estimated_finish_at: Mapped[datetime | None]
    cancel_requested_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    # Its documents and results were deleted by the retention sweep (SLUICE_RETENTION_DAYS); the
    # counts, tokens and outcomes stay.
    redacted_at: Mapped[datetime | None]


class JobItem(Base):
    __tablename__ = "job_items"
    __table_args__ = (
        # The feeder's work lists: the next lines to feed, and the items in flight.
        Index("ix_job_items_pending", "job_id", "line", postgresql_where=text("status = 'pending'")),
        Index("ix_job_items_running", "job_id", postgresql_where=text("status = 'running'")),
    )

    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    line: Mapped[int] = mapped_column(primary_key=True)  # 1-based line of the uploaded file: input order
    custom_id: Mapped[str | None] = mapped_column(Text)
    status: Mapped[ItemStatus] = mapped_column(_str_enum(ItemStatus, "item_status"))
    # A document (Sluice's format) or a request body (the OpenAI Batch format); never both.
    text: Mapped[str | None] = mapped_column(Text)
    body: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    estimated_tokens: Mapped[int] = mapped_column(default=0)

    # Map-reduce: chunks the document was split into, the reduce rounds so far, and whether the
    # current stage is the one that produces the result.
    chunks: Mapped[int] = mapped_column(default=0)
    depth: Mapped[int] = mapped_column(default=0)
    final: Mapped[bool] = mapped_column(default=False)
    requests: Mapped[list[uuid.UUID]] = mapped_column(ARRAY(UUID(as_uuid=True)), default=list)
    request_count: Mapped[int] = mapped_column(default=0)  # every request the item used, all stages

    input_tokens: Mapped[int] = mapped_column(default=0)  # the engine's counts, summed over its requests
    cached_tokens: Mapped[int] = mapped_column(default=0, server_default="0")  # of input_tokens
    output_tokens: Mapped[int] = mapped_column(default=0)
    result: Mapped[str | None] = mapped_column(Text)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(String(500))
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
