"""The OpenAPI description of OpenAI's Responses routes (``web/openai/responses_api.py``), added to
/openapi.json by ``web/openapi.py``. Plain JSON Schema: these bodies are OpenAI's, checked by
``core/openai/responses.py`` and then as a chat body is."""

from __future__ import annotations

from apispec import APISpec

from core.openai.responses import EXTENSIONS, FIELDS, HOSTED_TOOLS
from web.openai.batches_spec import AUTH, COMMON
from web.openai.batches_spec import json_answer as _json
from web.openai.errors import documented as _error

_STRING_OR_NULL = {"type": ["string", "null"]}
SCHEMAS = {
    "OpenAIResponseCreate": {
        "type": "object", "required": ["model", "input"], "additionalProperties": False,
        "properties": {
            **{name: {} for name in sorted(FIELDS)}, **{name: {} for name in EXTENSIONS},
            "model": {"type": "string"},
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "object"}}],
                      "description": "A string (the user's message), or message, function_call and "
                                     "function_call_output items."},
            "instructions": _STRING_OR_NULL, "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
            "background": {"type": "boolean"}, "stream": {"type": "boolean"}, "store": {"type": "boolean"},
            "previous_response_id": _STRING_OR_NULL,
            "tools": {"type": "array", "items": {"type": "object", "description": "Function tools; the hosted "
                                                 f"ones ({', '.join(sorted(HOSTED_TOOLS))}) are refused."}},
            "truncation": {"enum": ["disabled", None]},
            "deadline_s": {"type": "number", "description": "Sluice extension: the request's deadline."},
            "webhook_url": {"type": "string", "description": "Sluice extension: its webhook, as natively."},
        }},
    "OpenAIResponse": {
        "type": "object", "required": ["id", "object", "created_at", "status", "model", "output"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
            "status": {"enum": ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]},
            "background": {"type": "boolean"}, "model": {"type": "string"},
            "output": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": ["object", "null"]}, "error": {"type": ["object", "null"]},
            "previous_response_id": _STRING_OR_NULL}},
    "OpenAIResponseDeleted": {"type": "object", "required": ["id", "object", "deleted"], "properties": {
        "id": {"type": "string"}, "object": {"const": "response"}, "deleted": {"const": True}}},
    "OpenAIInputItemList": {"type": "object", "required": ["object", "data", "has_more"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}},
        "first_id": _STRING_OR_NULL, "last_id": _STRING_OR_NULL, "has_more": {"type": "boolean"}}},
}


# One event of a streamed response, as a client's SSE reader parses it: its type, and the event
# itself as JSON (the same type inside, with its sequence_number).
STREAM_EVENT = {"type": "object", "required": ["event", "data"],
                "properties": {"event": {"type": "string", "description": "response.created, "
                                         "response.output_text.delta, ... response.completed"},
                               "data": {"type": "string", "contentMediaType": "application/json"}}}


def add_paths(spec: APISpec) -> None:
    for name, schema in SCHEMAS.items():
        spec.components.schema(name, schema)
    common, auth = COMMON, AUTH
    response_id = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"},
                   "description": "resp_<hex>."}
    missing = {"404": _error("No such response for this key, or deleted (response_not_found).")}
    spec.path(path="/v1/responses", operations={"post": {
        **common, "summary": "Create a response (OpenAI Responses): a chat request row; answered when done, "
                             "streamed as typed events (stream), or at once, queued (background)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": "OpenAIResponseCreate"}}},
        "responses": {"200": {**_json("OpenAIResponse", "The response (queued when background)."),
                              "content": {"application/json": {"schema": "OpenAIResponse"},
                                          "text/event-stream": {"schema": STREAM_EVENT}}},
                      **auth, "400": _error("Invalid or refused fields, each named (param)."),
                      "413": _error("Longer than the model's context."),
                      "429": {**_error("Over the tenant's limits; Retry-After."),
                              "headers": {"Retry-After": {"schema": {"type": "integer"}}}},
                      "503": {**_error("Overloaded: the answer cannot come by its deadline; Retry-After."),
                              "headers": {"Retry-After": {"schema": {"type": "integer"}}}},
                      "504": _error("Did not end within its deadline (wait_timeout).")}}})
    spec.path(path="/v1/responses/{response_id}", operations={
        "get": {**common, "summary": "A response (poll a background one)", "parameters": [response_id],
                "responses": {"200": _json("OpenAIResponse", "The response."), **auth, **missing,
                              "400": _error("stream is not served on GET.")}},
        "delete": {**common, "summary": "Delete a response (one still running is cancelled)",
                   "parameters": [response_id],
                   "responses": {"200": _json("OpenAIResponseDeleted", "Deleted."), **auth, **missing}}})
    spec.path(path="/v1/responses/{response_id}/cancel", operations={"post": {
        **common, "summary": "Cancel a background response", "parameters": [response_id],
        "responses": {"200": _json("OpenAIResponse", "The response, cancelled (or as it ended)."), **auth, **missing,
                      "400": _error("Not a background response.")}}})
    spec.path(path="/v1/responses/{response_id}/input_items", operations={"get": {
        **common, "summary": "A response's own input items", "parameters": [
            response_id, {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
            {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
            {"name": "after", "in": "query", "schema": {"type": "string"}}],
        "responses": {"200": _json("OpenAIInputItemList", "The items."), **auth, **missing,
                      "400": _error("limit, order or after out of range.")}}})


def finish(document: dict, settings) -> None:
    """This deployment's models and output cap."""
    if settings is None:
        return
    body = document["components"]["schemas"]["OpenAIResponseCreate"]["properties"]
    body["model"]["enum"] = [model.name for model in settings.registry.models if model.role != "embed"]
    body["max_output_tokens"]["maximum"] = settings.max_output_tokens
