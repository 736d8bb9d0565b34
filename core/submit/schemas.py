"""The request's own schemas: a submit body (validated wherever one enters: the REST API, the
OpenAI front's mapping, job lines) and the request's view (the API's answer and a webhook's payload).
The web tier's /openapi.json is generated from these too.

Fields are strict about JSON types: ``"5"`` is not a number and ``true`` is not an integer,
because a client that sends those has a bug we should tell it about, not guess around.
"""

from __future__ import annotations

import hashlib

from marshmallow import Schema, ValidationError, fields, post_load, pre_dump, validate, validates_schema

from core.broker.queues import DIRECT_PREFIX
from core.submit import embeddings
from core.submit.fields import SafeString, StrictBoolean, StrictFloat, StrictInteger
from core.submit.sampling import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_TOOLS,
    EmbedInputField,
    LogitBiasField,
    ResponseFormatSchema,
    SchemasWithinCaps,
    ToolCallSchema,
    ToolChoiceField,
    ToolSchema,
    tool_calls,
)
from models import ServiceTier

SERVICE_TIERS = [*(t.value for t in ServiceTier), "auto"]


class ChatMessageSchema(Schema):
    role = SafeString(required=True, validate=validate.OneOf(["system", "user", "assistant", "tool"]))
    content = SafeString(allow_none=True, validate=validate.Length(min=1), metadata={
        "description": "Required, except on an assistant message that carries tool_calls."})
    tool_calls = fields.List(fields.Nested(ToolCallSchema), validate=validate.Length(min=1, max=MAX_TOOLS),
                             metadata={"description": "An assistant message: the calls it made."})
    tool_call_id = SafeString(validate=validate.Length(min=1, max=128),
                              metadata={"description": "A tool message: the call it answers."})

    @validates_schema
    def _by_role(self, data, **kwargs):
        role = data["role"]
        if "tool_calls" in data and role != "assistant":
            raise ValidationError("Only an assistant message carries tool_calls.", "tool_calls")
        if ("tool_call_id" in data) != (role == "tool"):
            raise ValidationError("A tool message, and only one, names the tool_call_id it answers.",
                                  "tool_call_id")
        if data.get("content") is None and not data.get("tool_calls"):
            raise ValidationError("Missing data for required field.", "content")


class SubmitRequestSchema(SchemasWithinCaps):
    """Body of POST /v1/requests. Exactly one of `prompt` or `messages`."""

    prompt = SafeString(validate=validate.Length(min=1),
                           metadata={"description": "Plain-text prompt. Give this or `messages`."})
    messages = fields.List(fields.Nested(ChatMessageSchema), validate=validate.Length(min=1, max=256),
                           metadata={"description": "Chat messages, oldest first. Give this or `prompt`."})
    model = SafeString(validate=validate.Length(min=1, max=128),
                          metadata={"description": "Model name; default: the platform's main model."})
    max_tokens = StrictInteger(validate=validate.Range(min=1),
                               metadata={"description": "Most tokens to generate (server caps apply)."})
    priority = SafeString(validate=validate.OneOf(["realtime", "batch"]), metadata={
        "description": "realtime (the default): interactive; batch: uses idle capacity. Set by service_tier "
                       "when that is given."})
    service_tier = SafeString(validate=validate.OneOf(SERVICE_TIERS), metadata={
        "description": "What the request buys (docs/tiers.md): priority (realtime, served ahead of default, "
                       "2x price), default (realtime), flex (answered by its deadline or refused at once, 0.5x), "
                       "batch (idle capacity, 0.5x); auto: the tenant's auto tier (default unless it chose "
                       "priority, which may then run as default). Default: the priority's plain tier."})
    temperature = StrictFloat(load_default=1.0, validate=validate.Range(min=0, max=2))
    top_p = StrictFloat(load_default=1.0, validate=validate.Range(min=0, max=1, min_inclusive=False))
    seed = StrictInteger(validate=validate.Range(min=0, max=2**63 - 1))
    stop = fields.List(SafeString(validate=validate.Length(min=1, max=64)),
                       validate=validate.Length(max=4),
                       metadata={"description": "Up to 4 strings that end generation when produced."})
    ignore_eos = StrictBoolean(metadata={"description": "Keep generating past end-of-sequence up to max_tokens "
                                                        "(fixed-length benchmarks)."})
    n = StrictInteger(validate=validate.Range(min=1, max=MAX_N), metadata={
        "description": "Choices to generate, computed as one engine request sharing the prompt's KV; "
                       "admission prices n × max_tokens."})
    logprobs = StrictInteger(validate=validate.Range(min=0, max=MAX_LOGPROBS), metadata={
        "description": "Return each output token's log probability and this many likeliest alternatives."})
    top_k = StrictInteger(validate=validate.Range(min=1, max=1_000_000),
                          metadata={"description": "Sample only among the k likeliest tokens."})
    min_p = StrictFloat(validate=validate.Range(min=0, max=1),
                        metadata={"description": "Drop tokens less likely than min_p × the likeliest one's."})
    presence_penalty = StrictFloat(validate=validate.Range(min=-2, max=2))
    frequency_penalty = StrictFloat(validate=validate.Range(min=-2, max=2))
    repetition_penalty = StrictFloat(validate=validate.Range(min=0, max=2, min_inclusive=False))
    logit_bias = LogitBiasField(metadata={"description": "Token id → bias added to its logit, in [-100, 100]."})
    min_tokens = StrictInteger(validate=validate.Range(min=0),
                               metadata={"description": "Generate at least this many tokens before a stop."})
    response_format = fields.Nested(ResponseFormatSchema, metadata={
        "description": "Constrain the output: json_object, json_schema (validated at submit), regex or choice."})
    tools = fields.List(fields.Nested(ToolSchema), validate=validate.Length(min=1, max=MAX_TOOLS), metadata={
        "description": "Functions the model may call (with `messages`); the calls come back in output.tool_calls."})
    tool_choice = ToolChoiceField(metadata={
        "description": "none, auto (needs the model's tool-call parser), required, or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}; the last two are enforced by "
                       "structured decoding. Default: auto with tools."})
    parallel_tool_calls = StrictBoolean(metadata={"description": "false: at most one call (default true)."})
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

    input = EmbedInputField(metadata={
        "description": "Embeddings: a string or a list of strings, each embedded by an embedding model (the "
                       "registry's role embed; default: its first). Give this, `prompt` or `messages`."})
    dimensions = StrictInteger(validate=validate.Range(min=1, max=65536), metadata={
        "description": "Embeddings: vectors this long (a Matryoshka model only)."})
    encoding_format = SafeString(validate=validate.OneOf(["float", "base64"]), metadata={
        "description": "Embeddings: vectors as float lists (default) or base64 of little-endian float32."})

    # Fields of a generation that an embeddings request (`input`) cannot carry, and the reverse.
    GENERATION_ONLY = ("max_tokens", "seed", "stop", "ignore_eos", "n", "logprobs", "top_k", "min_p",
                       "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                       "response_format", "tools", "tool_choice", "parallel_tool_calls", "conversation_id", "stream",
                       "temperature", "top_p")
    EMBED_ONLY = ("dimensions", "encoding_format")

    @staticmethod
    def openapi_tier_rule() -> list[dict]:
        """What `_one_input` enforces of a service tier and a priority, as /openapi.json states it:
        when both are given they agree (priority and default run as realtime, flex and batch as batch)."""
        return [{"not": {"required": ["service_tier", "priority"],
                         "properties": {"service_tier": {"enum": [t.value for t in ServiceTier if t.priority == runs]},
                                        "priority": {"enum": [p for p in ("realtime", "batch") if p != runs]}}}}
                for runs in ("realtime", "batch")]

    @classmethod
    def openapi_one_of(cls, generation_models: list[str] | None = None,
                       embed_models: list[str] | None = None) -> list[dict]:
        """What `_one_input` enforces, as /openapi.json states it; with a deployment's models, which
        each kind may name (no embeddings branch where no embedding model is served)."""
        def none_of(names) -> dict:
            return {"not": {"anyOf": [{"required": [name]} for name in names]}}

        def named(models) -> dict:
            return {} if models is None else {"properties": {"model": {"enum": models}}}

        branches = [{"required": [kind], **none_of((*cls.EMBED_ONLY, "input")), **named(generation_models)}
                    for kind in ("prompt", "messages")]
        if embed_models is None or embed_models:
            branches.append({"required": ["input"], **none_of((*cls.GENERATION_ONLY, "prompt", "messages")),
                             **named(embed_models)})
        return branches

    @validates_schema(pass_original=True)
    def _one_input(self, data, original, **kwargs):
        if sum(name in data for name in ("prompt", "messages", "input")) != 1:
            raise ValidationError("Give exactly one of `prompt`, `messages` or `input` (embeddings).", "_schema")
        given = original if isinstance(original, dict) else {}
        if "input" in data:
            wrong = [name for name in self.GENERATION_ONLY if name in given]
        else:
            wrong = [name for name in self.EMBED_ONLY if name in data]
        if wrong:
            raise ValidationError({name: ["Only for a generation (prompt or messages)." if "input" in data
                                          else "Only for embeddings (input)."] for name in wrong})
        if "webhook_events" in data and "webhook_url" not in data:
            raise ValidationError("Events are sent to a webhook_url; give one.", "webhook_events")
        if "tools" in data and "messages" not in data:
            raise ValidationError("Tools go with `messages`.", "tools")
        if data.get("min_tokens", 0) > data.get("max_tokens", data.get("min_tokens", 0)):
            raise ValidationError("Must be at most max_tokens.", "min_tokens")
        tier = data.get("service_tier")
        runs_as = ServiceTier(tier).priority if tier not in (None, "auto") else data.get("priority")
        if data.get("priority", runs_as) != runs_as:
            raise ValidationError(f"The {tier} service tier runs as {runs_as}; leave priority out or make it "
                                  "agree.", "priority")


    @post_load
    def _class(self, data, **kwargs):
        """The class the request runs in: its tier's, else realtime."""
        tier = data.get("service_tier")
        data.setdefault("priority", ServiceTier(tier).priority.value if tier not in (None, "auto") else "realtime")
        return data


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
    text = SafeString(metadata={"description": "The (first) choice's text."})
    finish_reason = SafeString(allow_none=True)
    choices = fields.List(fields.Dict(), metadata={
        "description": "With n > 1 or logprobs: every choice, {index, text, finish_reason, output_tokens, logprobs: "
                       "[{token, logprob, top: [[token, logprob], ...]}] or null}."})
    embeddings = fields.List(fields.Raw(), metadata={
        "description": "An embeddings request: one vector per input, in order, as encoding_format asks (float "
                       "lists, or base64 of little-endian float32)."})
    dimensions = fields.Integer(metadata={"description": "An embeddings request: the vectors' length."})
    tool_calls = fields.List(fields.Dict(), metadata={
        "description": "With tools: the calls the (first) choice holds, as OpenAI's "
                       "({id, type: function, function: {name, arguments}}); absent when it holds none."})


class RequestErrorSchema(Schema):
    code = SafeString()
    message = SafeString()


def worker_tag(worker: str | None) -> str | None:
    """What a tenant sees of the worker that ran its request: a tag, not host and process names."""
    return None if worker is None else "w-" + hashlib.sha256(worker.encode()).hexdigest()[:12]


def public_queue(queue: str) -> str:
    """A queue's name as a tenant sees it: a worker's own queue is named after its host."""
    return "direct" if queue.startswith(DIRECT_PREFIX) else queue


def output_view(row) -> dict:
    """A finished row's answer: its text, every choice when there are several (or logprobs), the
    tool calls its text holds."""
    if row.embedding is not None:
        return embeddings.view(row)
    view = {"text": row.output_text or "", "finish_reason": row.finish_reason}
    if row.choices:
        view["choices"] = [{"index": i, **choice} for i, choice in enumerate(row.choices)]
    called = tool_calls(str(row.id), row.params, row.input.get("tools"), row.output_text or "",
                        row.params.get("tool_parser"))
    if called is not None:
        view["tool_calls"] = called[0]
    return view


class RequestViewSchema(Schema):
    id = fields.UUID()
    status = SafeString(metadata={"enum": ["queued", "running", "succeeded", "failed", "timed_out",
                                              "cancelled", "expired", "rejected"]})
    priority = SafeString()
    service_tier = SafeString(metadata={"enum": [t.value for t in ServiceTier], "description": (
        "The service tier that serves it, and bills it (docs/tiers.md): `default` for a priority request "
        "that ran as default (its degradation_step says default_tier).")})
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
                       "(light_model, shorter_output, default_tier); null when none did."})
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
            "service_tier": row.service_tier,
            "size_class": row.size_class.value, "queue": public_queue(row.queue), "model": row.model_requested,
            "model_used": row.model_used, "model_routed": row.model_routed, "route_reason": row.route_reason,
            "degradation_step": row.degradation_step,
            "max_tokens": row.max_tokens, "time_limit_s": row.time_limit_s,
            "output": output_view(row) if done else None,
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
