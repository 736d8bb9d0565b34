"""Domain errors: what went wrong, for whom, and what to do about it.

Each carries the HTTP status and the stable code the web tier answers with (``web/errors.py``
turns one into the JSON error envelope, ``web/openai/errors.py`` into OpenAI's); the core raises
them without knowing about HTTP frameworks.
"""

from __future__ import annotations

import json
from typing import Any


class ApiError(Exception):
    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 details: Any = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.code
        self.status = status or self.status
        self.details = details
        self.headers = headers or {}


class InvalidRequest(ApiError):
    status, code = 422, "invalid_request"


class Unauthorized(ApiError):
    status, code = 401, "invalid_api_key"


class Forbidden(ApiError):
    status, code = 403, "forbidden"


class KeyScopeRefused(Forbidden):
    """The key authenticated, but its scope (``core/tenants/scopes.py``) does not reach this call."""

    code = "key_scope"


class NotFound(ApiError):
    status, code = 404, "not_found"


class Conflict(ApiError):
    status, code = 409, "conflict"


class RateLimited(ApiError):
    status, code = 429, "rate_limited"


class Overloaded(ApiError):
    status, code = 503, "overloaded"


class RequestTooLarge(ApiError):
    status, code = 413, "request_too_large"


class FileQuotaExceeded(RequestTooLarge):
    """An upload would take the tenant's stored files past its bytes or its count
    (``core/openai/file_quotas.py``); ``details`` has what is used, the quota and this upload."""

    code = "file_quota_exceeded"


class UploadRateLimited(RateLimited):
    """More ``POST /v1/files`` calls this minute than the tenant's ``uploads_per_minute``."""

    code = "upload_rate_limited"


class TooManyUploads(RateLimited):
    """As many upload bodies of the tenant as it may spool at once are being spooled by this web process."""

    code = "too_many_uploads"


class BudgetExhausted(ApiError):
    status, code = 429, "budget_exhausted"


class BudgetUnavailable(ApiError):
    status, code = 503, "budget_unavailable"

    def __init__(self, why: str, retry_after_s: int) -> None:
        super().__init__(f"A hard budget applies to this request and {why}; retry after {retry_after_s} s.",
                         headers={"Retry-After": str(retry_after_s)})


class OpenAIBodyError(InvalidRequest):
    """An OpenAI request body Sluice cannot run. ``details`` maps each bad field to its reasons;
    ``unsupported`` names those refused because Sluice does not take them (fields it does not
    know, ``n`` other than 1, streaming in a batch line) rather than for a bad value."""

    def __init__(self, details: dict[str, Any], unsupported: set[str]) -> None:
        super().__init__("The request has invalid fields; see details.", details=details)
        self.unsupported = unsupported

    def problems(self, prefix: str = "") -> str:
        return describe(self.details, prefix)


def describe(problems: dict[str, Any], prefix: str = "") -> str:
    """Fields and their reasons (marshmallow's errors) in one line, for a message:
    ``messages: Missing data for required field.; n: …``."""
    return "; ".join(f"{prefix}{_shown(name)}: {_reasons(why)}" for name, why in problems.items())


def is_problem(why: Any) -> bool:
    """Whether ``why`` is what a field's validation says (a list of reasons, or nested fields'),
    not some other detail (the numbers of a refused budget)."""
    if isinstance(why, list):
        return bool(why) and all(isinstance(item, str) for item in why)
    return isinstance(why, dict) and bool(why) and all(is_problem(item) for item in why.values())


def _reasons(why: Any) -> str:
    if isinstance(why, list):
        return " ".join(_reasons(item) for item in why)
    if isinstance(why, dict):
        return "; ".join(f"{_shown(name)}: {_reasons(item)}" for name, item in why.items())
    return str(why)


def _shown(name: Any) -> str:
    """A field name as a message quotes it: the client's own keys JSON-escaped (no NUL or lone
    surrogate reaches a stored message) and cut short."""
    return json.dumps(str(name))[1:-1][:60]
