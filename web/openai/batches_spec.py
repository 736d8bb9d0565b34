"""The OpenAPI description of OpenAI's Files and Batches routes (``web/openai/batches_api.py``),
added to /openapi.json by ``web/openapi.py``. Plain JSON Schema: these bodies are OpenAI's, not
marshmallow schemas Sluice validates with."""

from __future__ import annotations

from apispec import APISpec

from core.openai.shapes import URLS
from web.openai.errors import add_schema
from web.openai.errors import documented as _error

NULLABLE_INT = {"type": ["integer", "null"]}
SCHEMAS = {
    "OpenAIFile": {"type": "object",
                   "required": ["id", "object", "bytes", "created_at", "filename", "purpose", "status"],
                   "properties": {"id": {"type": "string"}, "object": {"const": "file"},
                                  "bytes": NULLABLE_INT, "created_at": {"type": "integer"},
                                  "filename": {"type": "string"},
                                  "purpose": {"enum": ["batch", "batch_output"]}, "status": {"const": "processed"}}},
    "OpenAIBatch": {"type": "object", "required": ["id", "object", "endpoint", "input_file_id", "completion_window",
                                                   "status", "request_counts", "created_at"],
                    "properties": {
                        "id": {"type": "string"}, "object": {"const": "batch"}, "endpoint": {"enum": list(URLS)},
                        "input_file_id": {"type": "string"}, "completion_window": {"type": "string"},
                        "status": {"enum": ["validating", "in_progress", "finalizing", "completed", "failed",
                                            "expired", "cancelling", "cancelled"]},
                        "output_file_id": {"type": ["string", "null"]}, "error_file_id": {"type": ["string", "null"]},
                        "request_counts": {"type": "object", "properties": {
                            name: {"type": "integer"} for name in ("total", "completed", "failed")}},
                        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
                        "model": {"type": "string"},
                        "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"],
                                  "properties": {name: {"type": "integer"} for name in (
                                      "input_tokens", "output_tokens", "total_tokens")}},
                        **{name: NULLABLE_INT for name in (
                            "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
                            "failed_at", "expired_at", "cancelling_at", "cancelled_at")}}},
    "OpenAIFileList": {"type": "object", "required": ["object", "data", "has_more"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": "#/components/schemas/OpenAIFile"}},
        "first_id": {"type": ["string", "null"]}, "last_id": {"type": ["string", "null"]},
        "has_more": {"type": "boolean"}}},
    "OpenAIFileDeleted": {"type": "object", "required": ["id", "object", "deleted"], "properties": {
        "id": {"type": "string"}, "object": {"const": "file"}, "deleted": {"const": True}}},
    "OpenAIBatchList": {"type": "object", "required": ["object", "data", "has_more"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": "#/components/schemas/OpenAIBatch"}},
        "first_id": {"type": ["string", "null"]}, "last_id": {"type": ["string", "null"]},
        "has_more": {"type": "boolean"}}},
}


def json_answer(schema: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


# What every OpenAI route takes and may answer before its own checks: a tenant's bearer key.
COMMON = {"security": [{"bearer": []}]}
AUTH = {"401": _error("Missing, malformed, invalid or revoked API key."),
        "403": _error("Tenant disabled (tenant_disabled), or the key's scope refuses it (key_scope).")}


def add_paths(spec: APISpec) -> None:
    add_schema(spec)
    for name, schema in SCHEMAS.items():
        spec.components.schema(name, schema)
    common, auth = COMMON, AUTH
    file_id = {"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"},
               "description": "file-<hex> (an upload), file-out-<hex> or file-err-<hex> (a batch's results)."}
    batch_id = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}}
    no_file = {"404": _error("No such file for this key (file_not_found).")}
    no_batch = {"404": _error("No such batch for this key (batch_not_found).")}
    form = {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary"}, "purpose": {"const": "batch"}}}
    body = {"type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
            "additionalProperties": False, "properties": {
                "input_file_id": {"type": "string"}, "endpoint": {"enum": list(URLS)},
                "completion_window": {"const": "24h"},
                "metadata": {"type": ["object", "null"], "maxProperties": 16,
                             "propertyNames": {"type": "string", "maxLength": 64, "pattern": "^[^\\u0000]*$"},
                             "additionalProperties": {"type": "string", "maxLength": 512,
                                                      "pattern": "^[^\\u0000]*$"}}}}
    spec.path(path="/v1/files", operations={"get": {
        **common, "summary": "The tenant's uploaded files, newest first",
        "parameters": [{"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 10000}},
                       {"name": "after", "in": "query", "schema": {"type": "string"},
                        "description": "A file id: list the files past it, in the order asked for."},
                       {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
                       {"name": "purpose", "in": "query", "schema": {"const": "batch"}}],
        "responses": {"200": json_answer("OpenAIFileList", "The files."), **auth,
                      "400": _error("limit, order or purpose out of range."),
                      "404": _error("`after` names no file of this key (file_not_found).")}}, "post": {
        **common, "summary": "Upload a batch input file (OpenAI Files), streamed into Postgres",
        "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": form}}},
        "responses": {"200": json_answer("OpenAIFile", "The stored file."), **auth,
                      "400": _error("Another purpose (invalid_purpose), no file part, an unreadable form."),
                      "408": _error("The upload stopped arriving (body_timeout)."),
                      "413": _error("Over SLUICE_JOB_MAX_BYTES (file_too_large), or over the tenant's stored bytes "
                                    "or file count (file_quota_exceeded: what its files hold, its quota, this "
                                    "upload)."),
                      "415": _error("Not multipart/form-data."),
                      "429": _error("Over the tenant's uploads per minute (upload_rate_limited), or as many of "
                                    "its uploads as it may have at once are being received (too_many_uploads); "
                                    "Retry-After.")}}})
    spec.path(path="/v1/files/{file_id}", operations={"get": {
        **common, "summary": "A file object", "parameters": [file_id],
        "responses": {"200": json_answer("OpenAIFile", "The file."), **auth, **no_file}}, "delete": {
        **common, "summary": "Delete an uploaded file; a batch made from it keeps its lines and the file's id",
        "parameters": [file_id],
        "responses": {"200": json_answer("OpenAIFileDeleted", "Deleted."), **auth, **no_file,
                      "400": _error("A batch's output or error file (file_not_deletable).")}}})
    spec.path(path="/v1/files/{file_id}/content", operations={"get": {
        **common, "summary": "A file's content: an upload as sent, or a batch's results in OpenAI's output format",
        "parameters": [file_id],
        "responses": {"200": {"description": "JSONL.",
                              "content": {"application/jsonl": {"schema": {"type": "string"}}}}, **auth, **no_file}}})
    spec.path(path="/v1/batches", operations={
        "post": {**common, "summary": "Create a batch (OpenAI Batches): a bulk job of the file's request lines",
                 "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                 "responses": {"200": json_answer("OpenAIBatch", "The batch, its lines already read (in_progress)."),
                               **auth, **no_file,
                               "400": _error("Invalid fields; a file with no valid line (no_valid_lines), empty "
                                             "(empty_file) or over the tenant's token budget "
                                             "(job_over_token_budget)."),
                               "429": {**_error("Over the tenant's request limits, its unfinished jobs "
                                                "(too_many_open_jobs) or its stored lines (job_storage_full)."),
                                       "headers": {"Retry-After": {"schema": {"type": "integer"}}}}}},
        "get": {**common, "summary": "The tenant's batches, newest first",
                "parameters": [{"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                                           "maximum": 100}},
                               {"name": "after", "in": "query", "schema": {"type": "string"},
                                "description": "A batch id: list the batches created before it."}],
                "responses": {"200": json_answer("OpenAIBatchList", "The batches."), **auth,
                              "400": _error("limit is not a whole number from 1 to 100."),
                              "404": _error("`after` names no batch of this key (batch_not_found).")}},
    })
    spec.path(path="/v1/batches/{batch_id}", operations={"get": {
        **common, "summary": "A batch: status, request counts, output and error files", "parameters": [batch_id],
        "responses": {"200": json_answer("OpenAIBatch", "The batch."), **auth, **no_batch}}})
    spec.path(path="/v1/batches/{batch_id}/cancel", operations={"post": {
        **common, "summary": "Cancel a batch; the lines that finished stay in its output file",
        "parameters": [batch_id],
        "responses": {"200": json_answer("OpenAIBatch", "The batch (cancelling until nothing runs)."), **auth,
                      **no_batch, "409": _error("Already ended (not_cancellable).")}}})
