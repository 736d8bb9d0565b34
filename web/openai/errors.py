"""OpenAI's error shape, for every OpenAI route (``chat.py``, ``batches_api.py``):

    {"error": {"message": "...", "type": "<OpenAI's kind>", "param": "<field>" | null, "code": "<Sluice's code>"}}

One builder (``error_body``) and one handler set (``register``, on each OpenAI blueprint), so a
route answers the same way whatever failed: a domain error (``core/errors.py``), Werkzeug's own
(a body too large), the database out of reach (503, ``Retry-After``) or an unexpected exception
(500, logged, never shown). The native routes keep their envelope (``web/errors.py``).

* ``type`` depends on the status alone (``TYPES``): the OpenAI SDKs pick their exception class
  from the status (``openai/_client.py _make_status_error``); ``type`` says the same in words.
* ``code`` is Sluice's stable snake_case code, the one the native envelope carries.
* ``param`` is the first field a validation error names, else null.
* The status is the native one, except that a body OpenAI would call invalid is 400, not 422
  (``BadRequestError`` in the SDKs, as OpenAI answers). Headers (``Retry-After``,
  ``retry-after-ms``, ``x-ratelimit-*``, ``x-should-retry``) are kept.
"""

from __future__ import annotations

from typing import Any

from apispec import APISpec
from flask import Blueprint, Response, jsonify

from core.errors import ApiError, describe, is_problem
from web.errors import register_error_handlers

# Status → OpenAI's error `type`. OpenAI's error-code guide names invalid_request_error (400),
# rate_limit_error (429), service_unavailable_error (503) and server_error (500); the others name
# the SDK's exception class for the status (AuthenticationError, PermissionDeniedError,
# NotFoundError, ConflictError). 422 never goes out: OpenAI answers an invalid body with 400.
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error", 500: "server_error",
         503: "service_unavailable_error"}
SCHEMA_NAME = "OpenAIError"
SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"},
                   "type": {"enum": sorted(set(TYPES.values())), "description": "OpenAI's kind, by status."},
                   "param": {"type": ["string", "null"], "description": "The first invalid field, if any."},
                   "code": {"type": ["string", "null"], "description": "Sluice's stable error code."}}}}}


def error_type(status: int) -> str:
    """OpenAI's ``type`` for an answer of ``status``: another 4xx is an invalid request, a 5xx a server error."""
    return TYPES.get(status) or ("server_error" if status >= 500 else "invalid_request_error")


def openai_status(status: int) -> int:
    return 400 if status == 422 else status


def error_body(message: str, status: int, code: str | None, param: str | None = None) -> dict[str, Any]:
    """The error object of an answer of ``status`` (also a stream's last event, ``chat.py``)."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(status: int, code: str | None, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    response = jsonify(error_body(message, status, code, param))
    response.status_code = openai_status(status)
    response.headers.update(headers or {})
    return response


def api_error_response(exc: ApiError) -> Response:
    """A domain error in OpenAI's shape. OpenAI has no ``details``: a validation error's fields and
    their reasons go into the message, the first field into ``param``."""
    problems = ({name: why for name, why in exc.details.items() if is_problem(why)}
                if isinstance(exc.details, dict) else {})
    message = f"{exc.message.replace('; see details.', '.')} {describe(problems)}" if problems else exc.message
    param = next((str(name) for name in problems if not str(name).startswith("_")), None)  # _schema: the body
    return error_response(exc.status, exc.code, message, param, exc.headers)


def register(*blueprints: Blueprint) -> None:
    """The one handler set of ``web/errors.py``, answering in OpenAI's shape, on each OpenAI
    blueprint (``web/openai/__init__.py`` lists them)."""
    for bp in blueprints:
        register_error_handlers(bp, domain=api_error_response, render=error_response)


def add_schema(spec: APISpec) -> None:
    """The error object as /openapi.json names it, once for both OpenAI documents."""
    if SCHEMA_NAME not in spec.components.schemas:
        spec.components.schema(SCHEMA_NAME, SCHEMA)


def documented(description: str) -> dict[str, Any]:
    """An error answer of an OpenAI operation, for its OpenAPI ``responses``."""
    return {"description": description, "content": {"application/json": {"schema": SCHEMA_NAME}}}
