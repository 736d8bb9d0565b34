"""Request and response schemas: they validate input and generate /openapi.json.

Fields are strict about JSON types: ``"5"`` is not a number and ``true`` is not an integer,
because a client that sends those has a bug we should tell it about, not guess around.
"""

from __future__ import annotations

import hashlib
import numbers

from marshmallow import Schema, ValidationError, fields, pre_dump, validate, validates_schema

from models.request import storable
from sluice.queues import DIRECT_PREFIX


class StrictInteger(fields.Integer):
    """A JSON integer: no strings, no booleans. ``5.0`` is one too (JSON Schema says so)."""

    def _validated(self, value):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise self.make_error("invalid")
        return super()._validated(value)


class StrictFloat(fields.Float):
    def _validated(self, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self.make_error("invalid")
        return super()._validated(value)


class SafeString(fields.String):
    """A string PostgreSQL can store: no NUL, no lone UTF-16 surrogates (both valid in JSON)."""

    def _deserialize(self, value, attr, data, **kwargs):
        text = super()._deserialize(value, attr, data, **kwargs)
        if not storable(text):
            raise ValidationError("Must not contain the NUL character (\\u0000)." if "\x00" in text
                                  else "Must be valid Unicode (no unpaired surrogates).")
        return text


class StrictBoolean(fields.Boolean):
    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, bool):
            raise self.make_error("invalid", input=value)
        return value


class ChatMessageSchema(Schema):
    role = SafeString(required=True, validate=validate.OneOf(["system", "user", "assistant"]))
    content = SafeString(required=True, validate=validate.Length(min=1))


class SubmitRequestSchema(Schema):
    """Body of POST /v1/requests. Exactly one of `prompt` or `messages`."""

    prompt = SafeString(validate=validate.Length(min=1),
                           metadata={"description": "Plain-text prompt. Give this or `messages`."})
    messages = fields.List(fields.Nested(ChatMessageSchema), validate=validate.Length(min=1, max=256),
                           metadata={"description": "Chat messages, oldest first. Give this or `prompt`."})
    model = SafeString(validate=validate.Length(min=1, max=128),
                          metadata={"description": "Model name; default: the platform's main model."})
    max_tokens = StrictInteger(validate=validate.Range(min=1),
                               metadata={"description": "Most tokens to generate (server caps apply)."})
    priority = SafeString(load_default="realtime", validate=validate.OneOf(["realtime", "batch"]),
                             metadata={"description": "realtime: interactive; batch: uses idle capacity."})
    temperature = StrictFloat(load_default=1.0, validate=validate.Range(min=0, max=2))
    top_p = StrictFloat(load_default=1.0, validate=validate.Range(min=0, max=1, min_inclusive=False))
    seed = StrictInteger(validate=validate.Range(min=0, max=2**63 - 1))
    stop = fields.List(SafeString(validate=validate.Length(min=1, max=64)),
                       validate=validate.Length(max=4),
                       metadata={"description": "Up to 4 strings that end generation when produced."})
    ignore_eos = StrictBoolean(metadata={"description": "Keep generating past end-of-sequence up to max_tokens "
                                                        "(fixed-length benchmarks)."})
    deadline_s = StrictFloat(validate=validate.Range(min=0, max=7 * 86400, min_inclusive=False),
                             metadata={"description": "Seconds from submission by which it must finish. Refused at "
                                                      "once (503) when the queue says it cannot; `expired` if not "
                                                      "started or still running by then. Default depends on priority."})
    time_limit_s = StrictFloat(validate=validate.Range(min=0, min_inclusive=False),
                               metadata={"description": "Inference time limit in seconds; at most the server's."})
    metadata = fields.Dict(keys=SafeString(validate=validate.Length(min=1, max=64)),
                           values=SafeString(validate=validate.Length(max=512)),
                           validate=validate.Length(max=16),
                           metadata={"description": "Up to 16 string pairs, echoed back, never interpreted."})

    conversation_id = SafeString(
        validate=validate.Length(min=1, max=128),
        metadata={"description": "Turns sharing this id run on the worker that served the previous turn, "
                                 "reusing its prefix cache, while that worker is alive."})
    stream = StrictBoolean(metadata={
        "description": "Answer with Server-Sent Events (`text/event-stream`): `accepted`, `started` (with its "
                       "queue wait), `token` events as the engine produces them, then `done` with the request's "
                       "view. Leaving the stream cancels the request unless `detach` is true."})
    detach = StrictBoolean(metadata={
        "description": "Keep computing when the client leaves a wait or a stream (default: leaving cancels)."})
    abandon_after_s = StrictFloat(validate=validate.Range(min=1, max=86400), metadata={
        "description": "Polling clients: with no GET of this request for this many seconds, the client is "
                       "taken to have left and the request is cancelled (unless it already ended)."})

    webhook_url = SafeString(validate=validate.Length(min=1, max=2048), metadata={
        "format": "uri",
        "description": "POST the request's events here, signed per Standard Webhooks with the tenant's secret "
                       "(POST /v1/webhooks/secret/rotate creates it). https only; public addresses only, checked "
                       "after DNS resolution and on every redirect (422 webhook_url_refused names the reason)."})
    webhook_events = fields.List(SafeString(validate=validate.OneOf(["started", "completed"])),
                                 validate=validate.Length(min=1, max=2), metadata={
        "description": "Which events to send (default: completed): started (a worker took it), completed "
                       "(any final status)."})

    # What `_one_input` enforces, as /openapi.json states it.
    OPENAPI_ONE_OF = [{"required": ["prompt"]}, {"required": ["messages"]}]

    @validates_schema
    def _one_input(self, data, **kwargs):
        if ("prompt" in data) == ("messages" in data):
            raise ValidationError("Give exactly one of `prompt` or `messages`.", "_schema")
        if "webhook_events" in data and "webhook_url" not in data:
            raise ValidationError("Events are sent to a webhook_url; give one.", "webhook_events")


class UsageSchema(Schema):
    input_tokens = fields.Integer()
    output_tokens = fields.Integer(allow_none=True)
    cached_tokens = fields.Integer(allow_none=True,
                                   metadata={"description": "Input tokens served from the prefix cache."})
    reserved_tokens = fields.Integer()


class TimingsSchema(Schema):
    created_at = fields.DateTime()
    enqueued_at = fields.DateTime(allow_none=True)
    started_at = fields.DateTime(allow_none=True)
    first_token_at = fields.DateTime(allow_none=True)
    finished_at = fields.DateTime(allow_none=True)
    queue_wait_s = fields.Float(allow_none=True, metadata={"description": "started_at - created_at"})
    inference_s = fields.Float(allow_none=True, metadata={"description": "finished_at - started_at"})
    time_to_first_token_s = fields.Float(allow_none=True)


class OutputSchema(Schema):
    text = SafeString()
    finish_reason = SafeString(allow_none=True)


class RequestErrorSchema(Schema):
    code = SafeString()
    message = SafeString()


def worker_tag(worker: str | None) -> str | None:
    """What a tenant sees of the worker that ran its request: a tag, not host and process names."""
    return None if worker is None else "w-" + hashlib.sha256(worker.encode()).hexdigest()[:12]


def public_queue(queue: str) -> str:
    """A queue's name as a tenant sees it: a worker's own queue is named after its host."""
    return "direct" if queue.startswith(DIRECT_PREFIX) else queue


class RequestViewSchema(Schema):
    id = fields.UUID()
    status = SafeString(metadata={"enum": ["queued", "running", "succeeded", "failed", "timed_out",
                                              "cancelled", "expired", "rejected"]})
    priority = SafeString()
    size_class = SafeString()
    queue = SafeString(metadata={"description": "The queue it went to; `direct` for a conversation turn "
                                                "sent to the worker holding its prefix cache."})
    model = SafeString(metadata={"description": "Model asked for."})
    model_used = SafeString(allow_none=True, metadata={"description": "Model that actually ran."})
    model_routed = SafeString(allow_none=True, metadata={
        "description": "Model admission sent the request to instead of `model`, if any."})
    route_reason = SafeString(allow_none=True, metadata={
        "enum": ["long_context", "light_model"],
        "description": "Why: `long_context` = too long for the default model; `light_model` = the "
                       "degradation ladder's first step."})
    degradation_step = SafeString(allow_none=True, metadata={
        "description": "Degradation steps that changed this request at admission, comma-separated "
                       "(light_model, shorter_output); null when none did."})
    max_tokens = fields.Integer()
    time_limit_s = fields.Float()
    output = fields.Nested(OutputSchema, allow_none=True)
    usage = fields.Nested(UsageSchema)
    timings = fields.Nested(TimingsSchema)
    error = fields.Nested(RequestErrorSchema, allow_none=True)
    cancel_requested = fields.Boolean()
    cache_hit = fields.Boolean(metadata={"description": "Answered from the hot answer cache: no engine ran."})
    redacted_at = fields.DateTime(allow_none=True, metadata={
        "description": "When its prompt and output were deleted (SLUICE_RETENTION_DAYS); null: kept."})
    attempts = fields.Integer()
    worker = SafeString(allow_none=True, metadata={
        "description": "An opaque tag of the worker process that ran it (the same tag: the same "
                       "process); never its host name."})
    metadata = fields.Dict()
    conversation_id = SafeString(allow_none=True)
    webhook_url = SafeString(allow_none=True)
    webhook_events = fields.List(SafeString(), allow_none=True)

    @pre_dump
    def _from_row(self, row, **kwargs) -> dict:
        """The request row in this schema's shape: the one place a row becomes its API view."""
        ttft = ((row.first_token_at - row.started_at).total_seconds()
                if row.first_token_at and row.started_at else None)
        done = (row.status == "succeeded" or row.output_text is not None) and row.redacted_at is None
        return {
            "id": row.id, "status": row.status.value, "priority": row.priority.value,
            "size_class": row.size_class.value, "queue": public_queue(row.queue), "model": row.model_requested,
            "model_used": row.model_used, "model_routed": row.model_routed, "route_reason": row.route_reason,
            "degradation_step": row.degradation_step,
            "max_tokens": row.max_tokens, "time_limit_s": row.time_limit_s,
            "output": {"text": row.output_text or "", "finish_reason": row.finish_reason} if done else None,
            "usage": {"input_tokens": row.input_tokens, "output_tokens": row.output_tokens,
                      "cached_tokens": row.cached_tokens, "reserved_tokens": row.reserved_tokens},
            "timings": {"created_at": row.created_at, "enqueued_at": row.enqueued_at, "started_at": row.started_at,
                        "first_token_at": row.first_token_at, "finished_at": row.finished_at,
                        "queue_wait_s": row.queue_wait_s, "inference_s": row.inference_s,
                        "time_to_first_token_s": ttft},
            "error": {"code": row.error_code, "message": row.error_message} if row.error_code else None,
            "cancel_requested": row.cancel_requested_at is not None, "cache_hit": row.cache_hit,
            "redacted_at": row.redacted_at,
            "attempts": row.attempts,
            "worker": worker_tag(row.worker), "metadata": row.meta, "conversation_id": row.conversation_id,
            "webhook_url": row.webhook_url, "webhook_events": row.webhook_events,
        }


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
    output = fields.Integer()


class FeederStateSchema(Schema):
    running = fields.Boolean(allow_none=True, metadata={"description": "null: Redis could not say."})
    paused = SafeString(allow_none=True, metadata={"description": "Why no item is fed now (degradation level, "
                                                                  "a peak reservation); null: feeding."})
    in_flight = fields.Integer(metadata={"description": "Job requests queued or running, all jobs."})
    capacity = fields.Integer(metadata={"description": "The most the feeder keeps in flight now."})


class JobViewSchema(Schema):
    """A bulk job as ``GET /v1/jobs/<id>`` shows it (``web/jobs.py: view``)."""

    id = fields.UUID()
    object = SafeString(metadata={"enum": ["job"]})
    status = SafeString(metadata={"enum": ["validating", "in_progress", "finalizing", "completed", "failed",
                                           "cancelling", "cancelled", "expired"]})
    model = SafeString()
    priority = SafeString()
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
    eta_s = fields.Float(allow_none=True, metadata={"description": "Seconds to finish at that rate; null when "
                                                                   "unknown or not running."})
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


class TenantViewSchema(Schema):
    """A tenant as the admin API shows it (``sluice.tenants.tenant_view``)."""

    id = fields.UUID()
    name = SafeString()
    tier = SafeString()
    tier_is_default = fields.Boolean()
    overrides = fields.Dict(keys=fields.String(), values=fields.Integer(),
                            metadata={"description": "The limits this tenant sets itself, over its tier's."})
    limits = fields.Nested(LimitsSchema, metadata={"description": "Effective limits: tier plus overrides."})
    created_at = fields.DateTime(allow_none=True)
    batch_weight = fields.Float(metadata={"description": "Share of batch capacity for bulk jobs (tokens)."})
    disabled = fields.Boolean(metadata={"description": "Every key of the tenant gets 403 tenant_disabled."})
    disabled_at = fields.DateTime(allow_none=True)
    active_keys = fields.Integer()
    api_key = SafeString(metadata={"description": "Only in the answer that created the key; never shown again."})


class KeyViewSchema(Schema):
    """An API key as the admin API shows it (``sluice.tenants.key_view``): never the key itself."""

    id = fields.UUID()
    prefix = fields.String(metadata={"description": "The key's first characters, to tell keys apart."})
    created_at = fields.DateTime()
    last_used_at = fields.DateTime(allow_none=True, metadata={"description": "Stamped at most once a minute."})
    revoked_at = fields.DateTime(allow_none=True)
    already_revoked = fields.Boolean(metadata={"description": "Only in a revocation's answer: an earlier call "
                                                              "revoked it (revoked_at is that call's)."})


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
    """One class (priority × model) as the load monitor last published it (``sluice.load.ClassLoad``)."""

    priority = SafeString()
    model = SafeString()
    queued_tokens = fields.Integer(metadata={"description": "Reserved tokens (input + max_tokens) queued."})
    queued_requests = fields.Integer()
    queued_work = fields.Integer(metadata={"description": "max_tokens of the queued requests."})
    drain_tps = fields.Float(metadata={"description": "Work claimed off the queue per second; 0 = unknown."})
    seq_tps = fields.Float(metadata={"description": "Tokens per second one running sequence gets."})
    wait_s = fields.Float(metadata={"description": "Estimated queue wait; -1 = unknown."})
    level = fields.Integer(metadata={"description": "Degradation level 0-6 (sluice/load.py)."})
    workers = fields.Integer(metadata={"description": "Warm workers consuming this class's queues."})
    updated_at_ms = fields.Integer()
    deadline_s = fields.Float(metadata={"description": "The deadline the level judges the wait against: the queued "
                                                       "requests' mean, or the class default if shorter."})


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


class LoadViewSchema(Schema):
    level = fields.Integer(allow_none=True, metadata={"description": "The platform level admission reads."})
    steps = fields.List(SafeString(), metadata={
        "description": "The degradation steps this level turns on, of those switched on (SLUICE_LADDER_STEPS)."})
    monitor = SafeString()
    classes = fields.List(fields.Nested(ClassLoadSchema))
    reservations = fields.List(fields.Nested(ReservationViewSchema), metadata={
        "description": "Peak reservations in force or to come."})
    paused_for_reservations = fields.List(SafeString(), metadata={
        "description": "Workers (node names) that stopped reading batch queues for a reservation now."})
