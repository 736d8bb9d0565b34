"""The single JSON error envelope every native error response uses.

    {"error": {"code": "<stable_snake_case>", "message": "<what to do about it>", "details": {...}}}

Handlers and the core raise :class:`~core.errors.ApiError` subclasses; nothing else reaches the
client. An unexpected exception becomes a generic 500 and its traceback goes to the log, never
to the response.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import psycopg
from flask import Blueprint, Flask, Response, current_app, jsonify
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as SQLAlchemyTimeoutError
from werkzeug.exceptions import HTTPException

from core.errors import ApiError, Conflict, Forbidden, InvalidRequest, NotFound, Unauthorized
from core.observe.logs import current_call_id

__all__ = ["ApiError", "Conflict", "Forbidden", "InvalidRequest", "NotFound", "Unauthorized",
           "error_response", "register_error_handlers"]

log = logging.getLogger(__name__)


# Werkzeug's own errors (routing, body size, methods) mapped to stable codes and plain messages.
_HTTP_CODES = {
    400: ("bad_request", "The request could not be read."),
    404: ("not_found", "No such endpoint. See /openapi.json for the API."),
    405: ("method_not_allowed", "This endpoint does not accept that HTTP method."),
    413: ("body_too_large", "The request body is larger than this server accepts."),
    415: ("unsupported_media_type", "Send the body as JSON with Content-Type: application/json."),
}


def error_response(status: int, code: str, message: str, details: Any = None,
                   headers: dict[str, str] | None = None) -> Response:
    body: dict[str, Any] = {"code": code, "message": message}
    if details is not None:
        body["details"] = details
    call_id = current_call_id.get()
    if call_id != "-":
        body["request_id"] = call_id  # the HTTP call's id (X-Request-Id), not a request row's
    response = jsonify(error=body)
    response.status_code = status
    response.headers.update(headers or {})
    return response


def register_error_handlers(target: Flask | Blueprint, *,
                            domain: Callable[[ApiError], Response] | None = None,
                            render: Callable[..., Response] | None = None) -> None:
    """The one handler set, on the app (the native envelope) or on a blueprint with an envelope of
    its own (the OpenAI routes, ``web/openai/errors.py``). ``domain`` answers a domain error;
    ``render(status, code, message, headers=...)`` every other one: Werkzeug's own, the database
    out of reach (503 with Retry-After), anything unexpected (a generic 500, the traceback logged)."""
    render = render or error_response
    target.register_error_handler(ApiError, domain or _domain_error)

    def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        code, message = _HTTP_CODES.get(status, ("http_error", exc.name))
        if status == 413:
            limit = current_app.config.get("MAX_CONTENT_LENGTH")
            message = f"The request body is larger than the {limit} bytes this server accepts."
        headers = {"Allow": ", ".join(exc.valid_methods)} if getattr(exc, "valid_methods", None) else None
        return render(status, code, message, headers=headers)

    def _database_unavailable(exc: Exception) -> Response:
        cause = getattr(exc, "orig", exc)
        if isinstance(cause, psycopg.errors.QueryCanceled):  # a statement past its timeout
            log.error("database statement timed out: %s", type(cause).__name__)
            return render(503, "service_unavailable", "The request store took too long over this call; "
                          "retry shortly.", headers={"Retry-After": "5"})
        log.error("database unavailable: %s", type(exc).__name__)
        return render(503, "service_unavailable", "The request store is unreachable right now; retry shortly.",
                      headers={"Retry-After": "5"})

    def _unexpected(exc: Exception) -> Response:
        if isinstance(exc, DBAPIError):
            # The driver's message can quote the data (CONTEXT: JSON data …): class name only.
            log.error("unhandled database error: %s", type(exc.orig).__name__)
        else:
            log.exception("unhandled error")
        return render(500, "internal_error", "Something went wrong on our side. It was logged; retry later.")

    target.register_error_handler(HTTPException, _http_error)
    target.register_error_handler(OperationalError, _database_unavailable)
    # The driver's own, from work on its connection outside SQLAlchemy (a job's COPY).
    target.register_error_handler(psycopg.OperationalError, _database_unavailable)
    target.register_error_handler(SQLAlchemyTimeoutError, _database_unavailable)
    target.register_error_handler(Exception, _unexpected)


def _domain_error(exc: ApiError) -> Response:
    return error_response(exc.status, exc.code, exc.message, exc.details, exc.headers)
