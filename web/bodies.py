"""Reading request bodies: JSON object in, schema-validated dict out, or the matching 4xx; and the
two halves of a list route, its ``limit`` parameter in and its page out."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import flask
from flask import Response, jsonify, request
from marshmallow import Schema, ValidationError
from werkzeug.exceptions import RequestEntityTooLarge

from core.submit.service import CHEAP_GATE_CHARS
from web.errors import ApiError, InvalidRequest

# Nothing Sluice accepts nests deeper; a body that does is refused before anything recurses on it
# (the JSON encoder of the idempotency hash, Postgres's JSONB, marshmallow).
MAX_DEPTH = 32
# A body refused with one of these after it was read (invalid, too large) still spends one request
# of its tenant's rate (``Admission.spend_refused``): checking it was the web tier's work.
BODY_REFUSALS = (400, 413, 422)
# A number as a query parameter may write it: ASCII digits only (str.isdigit() also takes "²",
# which int() refuses), few enough that int() never meets its limit of 4,300 digits.
_WHOLE_NUMBER = re.compile(r"[0-9]{1,9}")


class Request(flask.Request):
    """Flask's request, except that a streamed body (``Transfer-Encoding: chunked``, no
    Content-Length) longer than ``max_content_length`` is refused with 413, as one that declares
    its length is.

    Werkzeug reads such a body through a stream capped at the limit and stops there without a
    word, so a parser was handed the first MiB of a larger document (400 ``malformed_json``
    instead of 413 ``body_too_large``). Only a read that found the cap full asks the server for one
    byte more: a body of exactly the limit is still accepted."""

    def get_data(self, cache: bool = True, as_text: bool = False,  # type: ignore[override]
                 parse_form_data: bool = False) -> bytes | str:
        data = super().get_data(cache=cache, as_text=False, parse_form_data=parse_form_data)
        limit = self.max_content_length
        if (self.content_length is None and limit is not None and len(data) >= limit
                and "wsgi.input_terminated" in self.environ and self.input_stream.read(1)):
            raise RequestEntityTooLarge()
        return data.decode(errors="replace") if as_text else data


def json_object() -> dict[str, Any]:
    """The body as a JSON object: 415 if not sent as JSON, 400 if unparseable, 422 if not an object."""
    if not request.is_json:
        raise ApiError("Send the body as JSON with Content-Type: application/json.",
                       code="unsupported_media_type", status=415)
    try:
        body = request.get_json(silent=True)
    except RecursionError:  # nested deeper than the parser's recursion allows
        body = None
    except RequestEntityTooLarge:  # as an ApiError, which the submit routes count against the tenant
        limit = request.max_content_length
        raise ApiError(f"The request body is larger than this server accepts ({limit} bytes).",
                       code="body_too_large", status=413) from None
    if body is None:
        raise ApiError("The body is not valid JSON.", code="malformed_json", status=400)
    if _deeper_than(body, MAX_DEPTH):
        raise ApiError(f"The body nests arrays or objects more than {MAX_DEPTH} levels deep.",
                       code="malformed_json", status=400)
    if not isinstance(body, dict):
        raise InvalidRequest("The body must be a JSON object.")
    return body


def large(body_bytes: int | None) -> bool:
    """Whether a body this long is run past the tenant's gate before it is validated (the schemas
    of tools, the messages): a tenant over its limits then costs the web tier one Redis call."""
    return (body_bytes or 0) > CHEAP_GATE_CHARS


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
    limit = whole_number(request.args.get("limit", str(default)), 1, most)
    if limit is None:
        raise InvalidRequest(f"limit must be a whole number from 1 to {most}.", details={"limit": [f"1 to {most}."]})
    return limit


def whole_number(raw: str, low: int, high: int) -> int | None:
    """``raw`` as a whole number from ``low`` to ``high`` (at most 9 digits), or None: ASCII digits
    only, no sign, no spaces."""
    if not _WHOLE_NUMBER.fullmatch(raw):
        return None
    number = int(raw)
    return number if low <= number <= high else None


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
