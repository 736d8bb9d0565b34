"""Reading request bodies: JSON object in, schema-validated dict out, or the matching 4xx."""

from __future__ import annotations

from typing import Any

from flask import request
from marshmallow import Schema, ValidationError

from .errors import ApiError, InvalidRequest


def json_object() -> dict[str, Any]:
    """The body as a JSON object: 415 if not sent as JSON, 400 if unparseable, 422 if not an object."""
    if not request.is_json:
        raise ApiError("Send the body as JSON with Content-Type: application/json.",
                       code="unsupported_media_type", status=415)
    body = request.get_json(silent=True)
    if body is None:
        raise ApiError("The body is not valid JSON.", code="malformed_json", status=400)
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object.")
    return body


def validated(schema: Schema, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` loaded through ``schema``; 422 naming every bad field."""
    try:
        return schema.load(body)
    except ValidationError as exc:
        raise InvalidRequest("The request has invalid fields; see details.", details=exc.messages) from None
