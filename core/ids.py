"""Values a URL carries: an id from its path (a UUID, or a 404 that does not repeat what was
sent), and an instant from its query (RFC 3339 or Unix seconds).

The message never echoes the raw id: it may hold what no JSON string in the error envelope may
(a NUL, found by the OpenAPI fuzz test), and a 404 names what is missing, not what was typed.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from core.errors import NotFound


def uuid_or_404(raw: str, what: str, *, hint: str | None = None, code: str | None = None) -> uuid.UUID:
    """``raw`` as a UUID; else NotFound "No such <what>: <hint>." (``hint`` defaults to
    "<what> ids are UUIDs"; ``code`` to NotFound's, ``not_found``). ``raw`` is not in the message."""
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise NotFound(f"No such {what}: {hint or f'{what} ids are UUIDs'}.", code=code) from None


def is_uuid(raw: str) -> bool:
    """Whether ``raw`` reads as a UUID."""
    try:
        uuid.UUID(raw)
    except ValueError:
        return False
    return True


def instant(raw: str) -> datetime | None:
    """An RFC 3339 time (naive: UTC) or Unix seconds; None when it is neither."""
    try:
        if raw.replace(".", "", 1).isdigit():
            return datetime.fromtimestamp(float(raw), UTC)
        moment = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except (ValueError, OverflowError, OSError):
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
