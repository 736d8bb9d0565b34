"""Reading request bodies: JSON object in, schema-validated dict out, or the matching 4xx; and the
two halves of a list route, its ``limit`` parameter in and its page out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flask import Response, jsonify, request
from marshmallow import Schema, ValidationError

from web.errors import ApiError, InvalidRequest

# Nothing Sluice accepts nests deeper; a body that does is refused before anything recurses on it
# (the JSON encoder of the idempotency hash, Postgres's JSONB, marshmallow).
MAX_DEPTH = 32


def json_object() -> dict[str, Any]:
    """The body as a JSON object: 415 if not sent as JSON, 400 if unparseable, 422 if not an object."""
    if not request.is_json:
        raise ApiError("Send the body as JSON with Content-Type: application/json.",
                       code="unsupported_media_type", status=415)
    try:
        body = request.get_json(silent=True)
    except RecursionError:  # nested deeper than the parser's recursion allows
        body = None
    if body is None:
        raise ApiError("The body is not valid JSON.", code="malformed_json", status=400)
    if _deeper_than(body, MAX_DEPTH):
        raise ApiError(f"The body nests arrays or objects more than {MAX_DEPTH} levels deep.",
                       code="malformed_json", status=400)
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object.")
    return body


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests containers more than ``limit`` levels (iteratively: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def validated(schema: Schema, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` loaded through ``schema``; 422 naming every bad field."""
    try:
        return schema.load(body)
    except ValidationError as exc:
        raise InvalidRequest("The request has invalid fields; see details.", details=exc.messages) from None


def page_limit(default: int = 20, most: int = 100) -> int:
    """The ``limit`` query parameter of a list route: a whole number from 1 to ``most``."""
    raw = request.args.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"limit must be a whole number from 1 to {most}.", details={"limit": [f"1 to {most}."]})
    return int(raw)


def list_page(rows: Sequence[Any], limit: int, view: Callable[[Any], dict[str, Any]] | None = None, *,
              openai: bool = False) -> Response:
    """A list route's answer from ``rows`` fetched with ``limit + 1`` (the extra row only says more
    exist), each shown through ``view``: ``{object: list, data, has_more, next_before}``, where
    next_before is the last shown row's id (the cursor of the next page, null on the last one);
    ``openai``: OpenAI's shape, ``{object: list, data, first_id, last_id, has_more}``."""
    data = [view(row) for row in rows[:limit]] if view else list(rows[:limit])
    has_more = len(rows) > limit
    if openai:
        return jsonify({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                        "last_id": data[-1]["id"] if data else None, "has_more": has_more})
    return jsonify({"object": "list", "data": data, "has_more": has_more,
                    "next_before": data[-1]["id"] if has_more else None})
