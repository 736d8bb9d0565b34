"""The OpenAPI description of the OpenAI-compatible routes (``web/openai/chat.py``), added to
/openapi.json by ``web/openapi.py``. Request bodies come from the marshmallow schemas that
validate them (``core/openai/shapes.py``); answers are OpenAI's shapes, written here."""

from __future__ import annotations

from typing import Any

from apispec import APISpec

from core.openai import shapes
from core.settings import Settings
from core.submit.plan import SERVICE_TIER_HEADER
from models import ServiceTier
from web.openai import patience
from web.openai.errors import add_schema
from web.openai.errors import documented as _error

_STRING = {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[^\\u0000]*$"}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {**{name: {"type": "integer"}
                            for name in ("prompt_tokens", "completion_tokens", "total_tokens")},
                         "prompt_tokens_details": {
                             "type": "object", "description": "cached_tokens: the prompt tokens the engine's "
                                                              "prefix cache held, billed at the cached price.",
                             "properties": {"cached_tokens": {"type": "integer"}}}}}
_EXTENSION = {"type": "object", "description": "Sluice's extension: the request row (GET /v1/requests/{request_id}) "
                                               "and the degradation steps that changed it.",
              "properties": {"request_id": {"type": "string", "format": "uuid"},
                             "degradation": {"type": "array", "items": {"type": "string"}},
                             "cache_hit": {"type": "boolean"}, "queue_wait_s": {"type": ["number", "null"]}}}
_COMMON = {"id": {"type": "string"}, "created": {"type": "integer"},
           "model": {"type": "string", "description": "The model that ran it: a lighter one when degraded."},
           "service_tier": {"enum": [t.value for t in ServiceTier]}, "system_fingerprint": {"type": "null"},
           "usage": _USAGE, "sluice": _EXTENSION}
_TOOL_CALLS = {"type": "array", "items": {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}}
SCHEMAS: dict[str, dict[str, Any]] = {
    "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {**_COMMON, "object": {"const": "chat.completion"}, "choices": {
                           "type": "array", "minItems": 1, "items": {
                               "type": "object", "required": ["index", "message", "finish_reason"],
                               "properties": {"index": {"type": "integer", "minimum": 0},
                                              "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
                                              "logprobs": {"type": ["object", "null"]},
                                              "message": {"type": "object", "required": ["role", "content"],
                                                          "properties": {"role": {"const": "assistant"},
                                                                         "content": {"type": ["string", "null"]},
                                                                         "tool_calls": _TOOL_CALLS}}}}}}},
    "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                   "properties": {**_COMMON, "object": {"const": "text_completion"}, "choices": {
                       "type": "array", "minItems": 1, "items": {
                           "type": "object", "required": ["index", "text", "finish_reason"],
                           "properties": {"index": {"type": "integer", "minimum": 0}, "text": {"type": "string"},
                                          "logprobs": {"type": ["object", "null"]},
                                          "finish_reason": {"enum": ["stop", "length"]}}}}}},
    "EmbeddingList": {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
        "object": {"const": "list"}, "model": {"type": "string"},
        "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"],
                                            "properties": {"object": {"const": "embedding"},
                                                           "index": {"type": "integer", "minimum": 0},
                                                           "embedding": {"oneOf": [
                                                               {"type": "array", "items": {"type": "number"}},
                                                               {"type": "string", "contentEncoding": "base64"}]}}}},
        "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"],
                  "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}},
        "sluice": {**_EXTENSION, "properties": {**_EXTENSION["properties"], "simulated": {
            "type": "boolean", "description": "A simulated engine made these vectors: they mean nothing."}}}}},
    "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                           "owned_by": {"type": "string"},
                           "sluice": {"type": "object", "properties": {
                               "role": {"enum": ["main", "light", "long", "embed"]},
                               "context_tokens": {"type": "integer"},
                               "warm_workers": {"type": ["integer", "null"], "description": "Live warm workers "
                                                "serving it now (null: unknown, Redis unreachable)."}}}}}}}},
}
# One event of a completion stream: `data: {chunk}` (chat.completion.chunk or text_completion,
# an error object if the request ended without an answer), and `data: [DONE]` last.
STREAM_EVENT = {"type": "object", "required": ["data"],
                "properties": {"data": {"type": "string", "description": "A chunk as JSON, or [DONE]."}}}


def add_paths(spec: APISpec) -> None:
    add_schema(spec)
    for name, schema in SCHEMAS.items():
        spec.components.schema(name, schema)
    spec.components.schema("ChatCompletionRequest", schema=shapes.ChatCompletionRequestSchema)
    spec.components.schema("CompletionRequest", schema=shapes.CompletionRequestSchema)
    spec.components.schema("EmbeddingRequest", schema=shapes.EmbeddingRequestSchema)
    limit_headers = {f"x-ratelimit-{kind}-{unit}": {"schema": {"type": "string"}}
                     for kind in ("limit", "remaining", "reset") for unit in ("tokens", "requests")}
    call_headers = {  # on every answer once the body is valid: success, refusal, stream
        patience.DEADLINE_HEADER: {"schema": {"type": "number", "minimum": 0},
                                   "description": "The request's deadline in seconds: the client's patience less "
                                                  "min(1 s, 10%), or the default."},
        patience.SOURCE_HEADER: {"schema": {"enum": [patience.READ_TIMEOUT_HEADER, patience.PREFER,
                                                     patience.DEFAULT]},
                                 "description": "Where the deadline came from."},
        SERVICE_TIER_HEADER: {"schema": {"enum": [t.value for t in ServiceTier]},
                                     "description": "The service tier that serves the call (a refusal: the one "
                                                    "asked for); docs/tiers.md."}}
    answer_headers = {**limit_headers, **call_headers,
                      "Sluice-Request-Id": {"schema": {"type": "string", "format": "uuid"},
                                            "description": "The request row: GET /v1/requests/{id}."},
                      "Sluice-Degradation": {"schema": {"type": "string"},
                                             "description": "Degradation steps applied, comma-separated."}}
    retry_headers = {**limit_headers, **call_headers, "Retry-After": {"schema": {"type": "integer"}},
                     "retry-after-ms": {"schema": {"type": "integer"}}}
    # The patience headers are told in the description rather than declared as parameters: any
    # value is taken or ignored, never refused, and a generated one (a fuzzer's "1") is a deadline
    # nobody meant, whose documented answer may be 503 or 504.
    patience_told = (f" The deadline is the client's patience: `{patience.READ_TIMEOUT_HEADER}` (seconds; the "
                     "official SDKs send their read timeout; not taken on a stream, which pings keep alive) or "
                     "`Prefer: wait=N`, the shorter, less min(1 s, 10%), never past the default "
                     "(SLUICE_OPENAI_DEFAULT_DEADLINE_S); a malformed value is ignored. Every answer names it in "
                     f"`{patience.DEADLINE_HEADER}` and `{patience.SOURCE_HEADER}`.")
    for path, schema, answer, summary in (
            ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletion", "OpenAI-compatible chat completion"),
            ("/v1/completions", "CompletionRequest", "Completion", "OpenAI-compatible text completion"),
            ("/v1/embeddings", "EmbeddingRequest", "EmbeddingList", "OpenAI-compatible embeddings")):
        spec.path(path=path, operations={"post": {
            "summary": summary, "tags": ["openai"],
            "description": "A request row like POST /v1/requests (same admission, queues, ladder and limits), "
                           "answered when it ends, or streamed with `stream: true`. Errors in OpenAI's shape."
                           + patience_told,
            "security": [{"bearer": []}],
            "parameters": [{"name": "Idempotency-Key", "in": "header", "required": False,
                            "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$"},
                            "description": "A retry with the same key and body attaches to the original request."}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": {
                "200": {"description": "The completion; with `stream: true`, Server-Sent Events of chunks, "
                                       "then `data: [DONE]`.",
                        "content": {"application/json": {"schema": answer},
                                    "text/event-stream": {"schema": STREAM_EVENT}},
                        "headers": answer_headers},
                "400": _error("Invalid body (invalid_request: `param` names the field), malformed JSON, n ≠ 1."),
                "401": _error("Missing, malformed, invalid or revoked API key."),
                "403": _error("Tenant disabled (tenant_disabled), or the key's scope refuses it (key_scope)."),
                "409": _error("The request was cancelled before it ended (cancelled)."),
                "413": _error("Body too large, or input + max_tokens over the context or the tenant's maximum."),
                "415": _error("Body is not JSON."),
                "429": {**_error("rate_limited or tenant_concurrency_limit; retry after Retry-After."),
                        "headers": retry_headers},
                "503": {**_error("overloaded: the platform sheds load or pauses batch work, or the queue cannot "
                                 "finish the request within its deadline (Sluice-Deadline-S)."),
                        "headers": retry_headers},
                "504": _error("It ran out of time (time_limit_exceeded, deadline_exceeded, wait_timeout); "
                              "x-should-retry: false."),
            }}})
    spec.path(path="/v1/models", operations={"get": {
        "summary": "The served models, with their warm workers", "tags": ["openai"], "security": [{"bearer": []}],
        "responses": {"200": {"description": "The registry's models.",
                              "content": {"application/json": {"schema": "ModelList"}}},
                      "401": _error("Missing, malformed, invalid or revoked API key."),
                      "403": _error("Tenant disabled (tenant_disabled), or the key's scope refuses it (key_scope).")}}})


def finish(document: dict[str, Any], settings: Settings | None) -> None:
    """What marshmallow cannot say: ``stop``'s two forms, the rules across
    fields (``user`` takes a metadata pair), and this deployment's models and caps."""
    found = document["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        body = found[name]
        body["properties"]["stop"] = {"oneOf": [_STRING, {"type": "array", "items": _STRING,
                                                          "minItems": 1, "maxItems": 4}]}
        body["not"] = {"required": ["max_tokens", "max_completion_tokens"]}
        body["dependentSchemas"] = {"stream_options": {"required": ["stream"],
                                                       "properties": {"stream": {"const": True}}},
                                    "user": {"properties": {"metadata": {"maxProperties": shapes.MAX_METADATA - 1}}}}
        if settings is not None:
            body["properties"]["model"]["enum"] = [model.name for model in settings.registry.models
                                                   if model.role != "embed"]
            for field in ("max_tokens", "max_completion_tokens"):
                if field in body["properties"]:
                    body["properties"][field]["maximum"] = settings.max_output_tokens
    # The input's two forms (EmbedInputField), and this deployment's embedding models.
    text = {"type": "string", "minLength": 1, "pattern": "^[^\\u0000]*$"}
    found["EmbeddingRequest"]["properties"]["input"] = {"oneOf": [text, {"type": "array", "items": text,
                                                                         "minItems": 1, "maxItems": 2048}]}
    prompt = found["CompletionRequest"]["properties"]["prompt"]
    if settings is not None:
        prompt["maxLength"] = settings.max_prompt_chars
    one = {k: v for k, v in prompt.items() if k != "description"}
    found["CompletionRequest"]["properties"]["prompt"] = {
        "oneOf": [one, {"type": "array", "items": one, "minItems": 1, "maxItems": 64}],
        "description": prompt.get("description", "")}
    found["CompletionRequest"]["dependentSchemas"]["prompt"] = {  # a list of prompts cannot stream
        "anyOf": [{"properties": {"prompt": {"type": "string"}}}, {"properties": {"stream": {"const": False}}}]}
    if settings is not None:
        embed = [model.name for model in settings.registry.models if model.role == "embed"]
        found["EmbeddingRequest"]["properties"]["model"]["enum"] = embed or ["(no embedding model is served)"]
