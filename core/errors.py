"""Domain errors: what went wrong, for whom, and what to do about it.

Each carries the HTTP status and the stable code the web tier answers with (``web/errors.py``
turns one into the JSON error envelope, ``web/openai/errors.py`` into OpenAI's); the core raises
them without knowing about HTTP frameworks.
"""

from __future__ import annotations

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


class NotFound(ApiError):
    status, code = 404, "not_found"


class Conflict(ApiError):
    status, code = 409, "conflict"
