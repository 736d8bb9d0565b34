"""Response schemas of the web tier's own routes (jobs, tenants, keys, health, load), beside the
request's schemas from ``core/submit/schemas.py``; together they generate /openapi.json."""

from __future__ import annotations

from marshmallow import Schema, fields

# RequestViewSchema, SubmitRequestSchema and worker_tag are re-exported: the routes and
# /openapi.json name the request's own schemas here with the rest.
from core.submit.schemas import (  # noqa: F401
    RequestErrorSchema,
    RequestViewSchema,
    SafeString,
    SubmitRequestSchema,
    worker_tag,
)


class JobCountsSchema(Schema):
    total = fields.Integer(metadata={"description": "Valid lines: the job's items."})
    pending = fields.Integer()
    running = fields.Integer()
    succeeded = fields.Integer()
    failed = fields.Integer()
    cancelled = fields.Integer()
    expired = fields.Integer()
    invalid = fields.Integer(metadata={"description": "Lines refused at upload (listed at errors_url)."})


class JobTokensSchema(Schema):
    input = fields.Integer()
    cached = fields.Integer(metadata={"description": "Of input: the prompt tokens the engine's prefix cache held."})
    output = fields.Integer()


class FeederStateSchema(Schema):
    running = fields.Boolean(allow_none=True, metadata={"description": "null: Redis could not say."})
    paused = SafeString(allow_none=True, metadata={"description": "Why no item is fed now (degradation level, "
                                                                  "a peak reservation); null: feeding."})
    in_flight = fields.Integer(metadata={"description": "Job requests queued or running, all jobs."})
    capacity = fields.Integer(metadata={"description": "The most the feeder keeps in flight now."})


class JobViewSchema(Schema):
    """A bulk job as ``GET /v1/jobs/<id>`` shows it (``core/jobs/service.py: view``)."""

    id = fields.UUID()
    object = SafeString(metadata={"enum": ["job"]})
    status = SafeString(metadata={"enum": ["validating", "in_progress", "finalizing", "completed", "failed",
                                           "cancelling", "cancelled", "expired"]})
    model = SafeString()
    priority = SafeString()
    service_tier = SafeString(metadata={"enum": ["priority", "default", "flex", "batch"],
                                        "description": "Its lines' service tier (docs/tiers.md)."})
    instruction = SafeString()
    summary_tokens = fields.Integer()
    completion_window_s = fields.Integer()
    metadata = fields.Dict(keys=fields.String(), values=fields.String())
    counts = fields.Nested(JobCountsSchema, metadata={"description": "Items per status."})
    done = fields.Integer(metadata={"description": "Items finished, whatever their outcome."})
    progress = fields.Float(metadata={"description": "done ÷ total."})
    tokens = fields.Nested(JobTokensSchema, metadata={"description": "Engine tokens spent so far, map-reduce "
                                                                     "rounds included."})
    estimated_tokens = fields.Integer(metadata={"description": "What the submit priced the job at."})
    input_bytes = fields.Integer()
    rate_items_per_s = fields.Float(metadata={"description": "Items finished per second over the last minute."})
    eta_s = fields.Float(allow_none=True, metadata={"description": "Seconds to finish at that rate (before any "
                                                                   "line finished: at the estimate made at "
                                                                   "submit); null when unknown or not running."})
    estimated_finish_at = fields.DateTime(allow_none=True, metadata={
        "description": "When it is estimated to finish: now + eta_s (docs/tiers.md); null when unknown."})
    estimated_finish_at_submit = fields.DateTime(allow_none=True, metadata={
        "description": "When it was estimated to finish at submit, from the engines' figures, what realtime "
                       "leaves and the tenants' shares; null where the platform had no figures."})
    created_at = fields.DateTime()
    started_at = fields.DateTime(allow_none=True)
    expires_at = fields.DateTime(allow_none=True)
    cancel_requested_at = fields.DateTime(allow_none=True)
    finished_at = fields.DateTime(allow_none=True)
    redacted_at = fields.DateTime(allow_none=True, metadata={
        "description": "When its documents and results were deleted (SLUICE_RETENTION_DAYS); null: kept."})
    error = fields.Nested(RequestErrorSchema, allow_none=True)
    results_url = SafeString()
    errors_url = SafeString()
    feeder = fields.Nested(FeederStateSchema, metadata={"description": "What the job feeder last did."})
    webhook_url = SafeString(allow_none=True)
    webhook_events = fields.List(SafeString(), allow_none=True)


class RequestListSchema(Schema):
    object = SafeString(metadata={"enum": ["list"]})
    data = fields.List(fields.Nested(RequestViewSchema))
    has_more = fields.Boolean(metadata={"description": "More match, older: ask with before=next_before."})
    next_before = SafeString(allow_none=True)


class JobListSchema(Schema):
    object = SafeString(metadata={"enum": ["list"]})
    data = fields.List(fields.Nested(JobViewSchema))
    has_more = fields.Boolean(metadata={"description": "More jobs are older than these: ask with before=next_before."})
    next_before = SafeString(allow_none=True)


class AcceptedSchema(Schema):
    id = fields.UUID()
    status = SafeString()
    status_url = fields.Url()
    priority = SafeString()
    service_tier = SafeString(metadata={"description": "The service tier that serves it (also the "
                                                       "Sluice-Service-Tier header); docs/tiers.md."})
    size_class = SafeString()
    estimated_wait_s = fields.Float(allow_none=True, metadata={
        "description": "Seconds it is expected to wait in the queue, from the load monitor's figures "
                       "(also the Sluice-Estimated-Wait header); null while the monitor has none."})


class ErrorBodySchema(Schema):
    code = SafeString(metadata={"description": "Stable, machine-readable error code."})
    message = SafeString(metadata={"description": "What went wrong and what to do about it."})
    details = fields.Raw(metadata={"description": "Per-field problems, when there are any."})
    request_id = SafeString()


class ErrorSchema(Schema):
    error = fields.Nested(ErrorBodySchema)


class LimitsSchema(Schema):
    tokens_per_minute = fields.Integer()
    requests_per_minute = fields.Integer()
    max_concurrent = fields.Integer()
    max_request_tokens = fields.Integer()


class FileQuotasSchema(Schema):
    max_stored_bytes = fields.Integer()
    max_files = fields.Integer()
    uploads_per_minute = fields.Integer()
    max_concurrent_uploads = fields.Integer()


class TenantViewSchema(Schema):
    """A tenant as the admin API shows it (``core.tenants.manage.tenant_view``)."""

    id = fields.UUID()
    name = SafeString()
    tier = SafeString()
    tier_is_default = fields.Boolean()
    overrides = fields.Dict(keys=fields.String(), values=fields.Integer(),
                            metadata={"description": "The limits this tenant sets itself, over its tier's."})
    limits = fields.Nested(LimitsSchema, metadata={"description": "Effective limits: tier plus overrides."})
    file_quotas = fields.Nested(FileQuotasSchema, metadata={
        "description": "Effective file quotas: the tier's (SLUICE_FILE_QUOTAS) plus overrides."})
    created_at = fields.DateTime(allow_none=True)
    batch_weight = fields.Float(metadata={"description": "Share of batch capacity for bulk jobs (tokens)."})
    reserved_share = fields.Float(allow_none=True, metadata={
        "description": "Its reserved share of each class's engine time (null: none)."})
    auto_service_tier = fields.String(metadata={"description": "What its `service_tier: auto` buys."})
    disabled = fields.Boolean(metadata={"description": "Every key of the tenant gets 403 tenant_disabled."})
    disabled_at = fields.DateTime(allow_none=True)
    active_keys = fields.Integer()
    api_key = SafeString(metadata={"description": "Only in the answer that created the key; never shown again."})


class KeyViewSchema(Schema):
    """An API key as the admin API shows it (``core.tenants.manage.key_view``): never the key itself."""

    id = fields.UUID()
    prefix = fields.String(metadata={"description": "The key's first characters, to tell keys apart."})
    name = fields.String(allow_none=True, metadata={"description": "What the key is for."})
    owner = fields.String(allow_none=True, metadata={"description": "Who holds it."})
    scope = fields.String(metadata={"enum": ["tenant", "own", "submit"], "description":
                                    "What it may read: tenant everything of the tenant, own only the requests, "
                                    "jobs and files it made, submit nothing."})
    created_at = fields.DateTime()
    expires_at = fields.DateTime(allow_none=True, metadata={"description": "Refused from then on (401)."})
    last_used_at = fields.DateTime(allow_none=True, metadata={"description": "Stamped at most once a minute."})
    revoked_at = fields.DateTime(allow_none=True)
    already_revoked = fields.Boolean(metadata={"description": "Only in a revocation's answer: an earlier call "
                                                              "revoked it (revoked_at is that call's)."})


class BudgetViewSchema(Schema):
    """A budget as the API shows it (``core/usage/budgets.py view``), with its current window."""

    id = fields.UUID()
    object = fields.String(metadata={"enum": ["budget"]})
    api_key_id = fields.UUID(allow_none=True, metadata={"description": "Set: one key's own budget."})
    unit = fields.String(metadata={"enum": ["tokens", "usd"]})
    amount = fields.Float()
    period = fields.String(metadata={"enum": ["day", "week", "month", "fixed"]})
    hard = fields.Boolean(metadata={"description": "Charged at admission (429 budget_exhausted past it)."})
    starts_at = fields.DateTime(allow_none=True)
    ends_at = fields.DateTime(allow_none=True)
    webhook_url = fields.String(allow_none=True)
    window_start = fields.DateTime(allow_none=True, metadata={"description": "Null: a fixed window not in force."})
    resets_at = fields.DateTime(allow_none=True)
    used = fields.Float(metadata={"description": "By the window's ended requests (the usage rollups)."})
    reserved = fields.Float(metadata={"description": "Held by its requests in flight (a hard budget)."})
    remaining = fields.Float()
    used_percent = fields.Float()


class HealthSchema(Schema):
    status = SafeString(metadata={"enum": ["ok", "degraded"]})
    checks = fields.Dict(keys=fields.String(), values=fields.String(),
                         metadata={"description": "postgres and redis: ok or unreachable."})


class SweepSchema(Schema):
    age_s = fields.Float(metadata={"description": "Seconds since it finished."})
    took_ms = fields.Integer()


class ReadinessSchema(Schema):
    ready = fields.Boolean()
    reason = SafeString()
    models = fields.Dict(keys=fields.String(), values=fields.Integer(),
                         metadata={"description": "Warm workers per registry model."})
    workers = fields.List(fields.Dict(), metadata={"description": "Heartbeats of warm workers, with engine stats."})
    sweep = fields.Nested(SweepSchema, allow_none=True,
                          metadata={"description": "When the sweep last finished; null: not since Redis started."})
    redis_eviction_policy = SafeString(allow_none=True, metadata={
        "description": "Redis's maxmemory-policy; Sluice needs noeviction. null: unreadable."})


class ClassLoadSchema(Schema):
    """One class (priority × model) as the load monitor last published it (``core.admission.load.ClassLoad``)."""

    priority = SafeString()
    model = SafeString()
    queued_tokens = fields.Integer(metadata={"description": "Reserved tokens (input + max_tokens) queued."})
    queued_requests = fields.Integer()
    queued_work = fields.Integer(metadata={"description": "max_tokens of the queued requests."})
    drain_tps = fields.Float(metadata={"description": "Work claimed off the queue per second; 0 = unknown."})
    seq_tps = fields.Float(metadata={"description": "Tokens per second one running sequence gets."})
    wait_s = fields.Float(metadata={"description": "Estimated queue wait; -1 = unknown."})
    level = fields.Integer(metadata={"description": "Degradation level 0-6 (core/admission/load.py)."})
    workers = fields.Integer(metadata={"description": "Warm workers consuming this class's queues."})
    updated_at_ms = fields.Integer()
    deadline_s = fields.Float(metadata={"description": "The deadline the level judges the wait against: the queued "
                                                       "requests' mean, or the class default if shorter."})
    room = fields.Integer(metadata={"description": "Requests the serving engines would take in now, below their "
                                                   "in-engine limits; -1 = unknown (no governed worker)."})
    slot_wait_s = fields.Float(metadata={"description": "While the engines are full: the estimated wait for a slot."})
    fair_wait_s = fields.Float(metadata={"description": "The wait of a tenant one turn away in the class's fair "
                                                        "lines: wait_s less what tenants queued past their turns; "
                                                        "-1 = unknown (docs/fairness.md)."})
    fair_level = fields.Integer(metadata={"description": "The level of fair_wait_s: what every tenant but those "
                                                        "queued past their turns is judged at."})


class ReservationViewSchema(Schema):
    """A peak reservation (``models/reservation.py``)."""

    id = fields.UUID()
    from_ = fields.DateTime(data_key="from")
    until = fields.DateTime()
    role = SafeString(allow_none=True, metadata={"description": "Workers of this role pause; null: every worker "
                                                               "serving both realtime and batch."})
    note = SafeString(allow_none=True)
    state = SafeString(metadata={"description": "scheduled, active, ended or cancelled."})
    created_at = fields.DateTime()
    cancelled_at = fields.DateTime(allow_none=True)


class TenantLineSchema(Schema):
    """One tenant's work waiting in a class queue's fair line (``core/broker/fair.py lines_view``)."""

    tenant = SafeString(metadata={"description": "The tenant's id; `other` sums the tenants past the ten with most "
                                                 "work."})
    name = SafeString(metadata={"description": "The tenant's name (its id where it has none to show)."})
    requests = fields.Integer(metadata={"description": "Its requests waiting in the line."})
    seconds = fields.Float(metadata={"description": "Their engine time: output at the class's drain, prompts at "
                                                   "the prefill prices."})
    reserved_share = fields.Float(allow_none=True, metadata={"description": "Its reserved share; null: none."})
    share = fields.Float(metadata={"description": "The share of the engines its weight gets while the tenants "
                                                 "listed all have work (0-1)."})
    wait_s = fields.Float(metadata={"description": "How long its line takes to drain in fair order, at the "
                                                  "class's whole capacity."})


class FairLineSchema(Schema):
    queue = SafeString()
    tenants = fields.List(fields.Nested(TenantLineSchema), metadata={"description": "By engine seconds, most first."})


class LoadViewSchema(Schema):
    level = fields.Integer(allow_none=True, metadata={
        "description": "The platform's level: the highest realtime class's (each request is judged by its "
                       "own class's level, under classes)."})
    steps = fields.List(SafeString(), metadata={
        "description": "The degradation steps this level turns on, of those switched on (SLUICE_LADDER_STEPS)."})
    monitor = SafeString()
    classes = fields.List(fields.Nested(ClassLoadSchema))
    reservations = fields.List(fields.Nested(ReservationViewSchema), metadata={
        "description": "Peak reservations in force or to come."})
    paused_for_reservations = fields.List(SafeString(), metadata={
        "description": "Workers (node names) that stopped reading batch queues for a reservation now."})
    lines = fields.List(fields.Nested(FairLineSchema), metadata={
        "description": "Each class queue's fair line, tenant by tenant (docs/fairness.md)."})
