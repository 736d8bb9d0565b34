"""The request metadata table: one row per request, the contract between every layer.

The row is written (and committed) before anything is queued; its primary key is the Celery
task id. Every later step (publish, start, first token, finish) writes its timestamp here, so
queue wait and inference time can always be told apart.
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    CheckConstraint,
    Computed,
    Enum,
    ForeignKey,
    Index,
    LargeBinary,
    Numeric,
    String,
    Text,
    Update,
    func,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base


class Status(enum.StrEnum):
    """Changed only through ``models/lifecycle.py``, which owns the allowed transitions."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    REJECTED = "rejected"  # not written: a refused request has no row (refusing touches no Postgres)

    @property
    def terminal(self) -> bool:
        return self not in (Status.QUEUED, Status.RUNNING)


class Priority(enum.StrEnum):
    REALTIME = "realtime"
    BATCH = "batch"


class ServiceTier(enum.StrEnum):
    """What a request bought (docs/tiers.md): its class, its place in line and its price."""

    PRIORITY = "priority"  # realtime, served ahead of default work, a share held for it
    DEFAULT = "default"  # realtime
    FLEX = "flex"  # batch class with a deadline: answered by it, or refused at once
    BATCH = "batch"  # idle capacity

    @property
    def priority(self) -> Priority:
        """The class that runs it."""
        return Priority.REALTIME if self in (ServiceTier.PRIORITY, ServiceTier.DEFAULT) else Priority.BATCH

    @classmethod
    def of(cls, priority: Priority | str) -> ServiceTier:
        """The tier a request that names none gets: its class's plain tier."""
        return cls.DEFAULT if Priority(priority) == Priority.REALTIME else cls.BATCH


class Source(enum.StrEnum):
    """Which door a request came in by: its usage is reported apart (core/usage/)."""

    API = "api"  # POST /v1/requests
    OPENAI = "openai"  # the OpenAI front
    JOB = "job"  # a bulk job's or an OpenAI batch's line, submitted by the feeder


# A request's cost (USD): its prices (per million tokens, fixed on the row at admission) times the
# tokens the engine reported, computed by Postgres whenever they are written, so it is fixed when
# the request ends and a later price change rewrites nothing. Nothing for an answer no engine
# computed for it (a cache hit, a twin) or for a request that never ran. numeric: sums are exact.
COST_SQL = ("CASE WHEN cache_hit OR output_tokens IS NULL THEN 0 ELSE round(("
            "greatest(input_tokens - coalesce(cached_tokens, 0), 0) * price_input"
            " + coalesce(cached_tokens, 0) * price_cached + output_tokens * price_output) / 1000000, 10) END")


class SizeClass(enum.StrEnum):
    SMALL = "small"
    LARGE = "large"
    EMBED = "embed"  # embeddings: prefill only, cheap; queues and workers of their own


def _str_enum(cls: type[enum.StrEnum], name: str) -> Enum:
    # VARCHAR + CHECK rather than a native PG enum: adding a value later is a plain migration.
    return Enum(cls, name=name, native_enum=False, create_constraint=True, length=16,
                values_callable=lambda e: [m.value for m in e])


class InferenceRequest(Base):
    __tablename__ = "requests"
    __table_args__ = (
        Index("ix_requests_status_created_at", "status", "created_at"),
        Index("ix_requests_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_requests_follows_id", "follows_id", postgresql_where=text("follows_id IS NOT NULL")),
        # GET /v1/requests: a tenant's requests of some statuses, newest first; and by a metadata pair.
        Index("ix_requests_tenant_id_status_created_at", "tenant_id", "status", "created_at"),
        Index("ix_requests_metadata", "metadata", postgresql_using="gin",
              postgresql_ops={"metadata": "jsonb_path_ops"}),
        # The retention sweep's work list: finished rows whose text is still kept.
        Index("ix_requests_unredacted_finished_at", "finished_at",
              postgresql_where=text("redacted_at IS NULL AND finished_at IS NOT NULL")),
        CheckConstraint("source IN ('api', 'openai', 'job')", name="source"),
        CheckConstraint("service_tier IN ('priority', 'default', 'flex', 'batch')", name="service_tier"),
    )
    # created_at and deadline_at are computed by the database at INSERT: read them back with
    # RETURNING, so a committed row says when it was created without another query.
    __mapper_args__ = {"eager_defaults": True}

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    # The key that submitted it (a job's line: the key that submitted the job); usage is kept per key.
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    source: Mapped[str] = mapped_column(String(16), default=Source.API, server_default="api")
    status: Mapped[Status] = mapped_column(_str_enum(Status, "status"), default=Status.QUEUED)
    priority: Mapped[Priority] = mapped_column(_str_enum(Priority, "priority"))
    # The tier that serves it (ServiceTier: it bills at that tier's price); a priority request run
    # as default says so in degradation_step ("default_tier").
    service_tier: Mapped[str] = mapped_column(String(16), default=ServiceTier.DEFAULT, server_default="default")
    size_class: Mapped[SizeClass] = mapped_column(_str_enum(SizeClass, "size_class"))
    queue: Mapped[str] = mapped_column(String(64))

    model_requested: Mapped[str] = mapped_column(String(128))
    model_used: Mapped[str | None] = mapped_column(String(128))
    # Set when admission sends the request to another model than the one asked for; the one
    # reason today is "long_context": it named no model and did not fit the default's context.
    model_routed: Mapped[str | None] = mapped_column(String(128))
    route_reason: Mapped[str | None] = mapped_column(String(32))

    # What to run. Prompt text lives only here, never in logs or task messages.
    input: Mapped[dict[str, Any]] = mapped_column(JSONB)
    params: Mapped[dict[str, Any]] = mapped_column(JSONB)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSONB, default=dict)
    # Turns of one conversation go to the worker that served the last one (prefix cache reuse).
    conversation_id: Mapped[str | None] = mapped_column(String(128))
    # Where its lifecycle events are POSTed (core/delivery/webhooks.py), and which: started, completed.
    webhook_url: Mapped[str | None] = mapped_column(Text)
    webhook_events: Mapped[list[str] | None] = mapped_column(ARRAY(String(16)))

    # Resource quota granted at admission.
    max_tokens: Mapped[int]
    time_limit_s: Mapped[float]
    reserved_tokens: Mapped[int]  # input estimate + max_tokens, what admission priced
    # Its model's prices when it was admitted, USD per million tokens, the batch discount applied
    # (core/usage/prices.py); cost is worked out from them and the token columns (COST_SQL).
    price_input: Mapped[Decimal] = mapped_column(Numeric(12, 4), default=0, server_default="0")
    price_cached: Mapped[Decimal] = mapped_column(Numeric(12, 4), default=0, server_default="0")
    price_output: Mapped[Decimal] = mapped_column(Numeric(12, 4), default=0, server_default="0")
    cost: Mapped[Decimal] = mapped_column(Numeric(24, 10), Computed(COST_SQL, persisted=True))

    # Outcome.
    input_tokens: Mapped[int]  # estimate at admission; the engine's count once it ran
    output_tokens: Mapped[int | None]
    cached_tokens: Mapped[int | None]
    output_text: Mapped[str | None] = mapped_column(Text)  # the first choice's text
    # Set when the answer holds more than one text: every choice (n > 1) and each token's log
    # probabilities (logprobs asked): [{text, finish_reason, output_tokens, logprobs}], the first
    # choice being output_text's. Null for a plain answer.
    choices: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONB)
    # An embeddings request's vectors, one per input in order: float32, little-endian, end to end
    # (len = inputs × dimensions × 4). Null for a generation.
    embedding: Mapped[bytes | None] = mapped_column(LargeBinary)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(String(500))
    # Degradation steps that changed the request at admission (core/submit/ladder.py), comma-separated.
    degradation_step: Mapped[str | None] = mapped_column(Text)
    # Answered without an engine run of its own: from the hot answer cache (core/submit/answers.py),
    # or from the identical request it followed (follows_id).
    cache_hit: Mapped[bool] = mapped_column(default=False)
    # A twin parked on an identical request already in flight (core/submit/twins.py): never published,
    # it takes that request's answer when it succeeds, or is published on its own when it does not.
    follows_id: Mapped[uuid.UUID | None]

    # Who ran it. `worker` names one worker process instance, so a restarted worker with the
    # same node name is a different owner and the sweep can tell its rows from the dead one's.
    worker: Mapped[str | None] = mapped_column(String(200))
    # The device that computed the answer: a cached or twin answer carries its source's.
    device: Mapped[str | None] = mapped_column(String(64))
    attempts: Mapped[int] = mapped_column(default=0)

    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    enqueued_at: Mapped[datetime | None]
    # The broker epoch (core/broker/queues.py:BrokerEpoch) its latest message was published into: a
    # queued row with an older one lost its message with the broker's data and is published again.
    broker_epoch: Mapped[str | None] = mapped_column(String(32))
    started_at: Mapped[datetime | None]
    first_token_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    cancel_requested_at: Mapped[datetime | None]
    # Not started by then → dropped as `expired` instead of computing an answer nobody reads.
    deadline_at: Mapped[datetime | None]
    # Its prompt and output were deleted by the retention sweep (SLUICE_RETENTION_DAYS); the
    # rest of the row (tokens, timings, outcome) stays.
    redacted_at: Mapped[datetime | None]

    @property
    def target_model(self) -> str:
        """The registry model whose queues carry this request."""
        return self.model_routed or self.model_requested

    def __repr__(self) -> str:
        return f"<InferenceRequest {self.id} {self.status} {self.queue}>"

    @property
    def queue_wait_s(self) -> float | None:
        if self.started_at is None:
            return None
        return (self.started_at - self.created_at).total_seconds()

    @property
    def inference_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()


def storable(text: str) -> bool:
    """Whether PostgreSQL text can hold ``text`` as it is: no NUL, no lone UTF-16 surrogate."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def storable_text(text: str) -> str:
    """``text`` as PostgreSQL text can hold it: a model may emit NUL, which text columns refuse."""
    return text.replace("\x00", "\ufffd")


# What a request keeps of its text once it is redacted (retention ran out, or its response was
# deleted): its accounting stays.
REDACTED_INPUT = {"redacted": True}


def redaction(*where: Any) -> Update:
    """The UPDATE that redacts the text of the requests ``where`` picks."""
    return update(InferenceRequest).where(*where).values(input=REDACTED_INPUT, output_text=None, choices=None,
                                                          embedding=None, redacted_at=func.now())
