"""An id from a URL path: a UUID, or a 404 that does not repeat what was sent.

The message never echoes the raw id: it may hold what no JSON string in the error envelope may
(a NUL, found by the OpenAPI fuzz test), and a 404 names what is missing, not what was typed.
"""

from __future__ import annotations

import uuid

from core.errors import NotFound


def uuid_or_404(raw: str, what: str, *, hint: str | None = None, code: str | None = None) -> uuid.UUID:
    """``raw`` as a UUID; else NotFound "No such <what>: <hint>." (``hint`` defaults to
    "<what> ids are UUIDs"; ``code`` to NotFound's, ``not_found``). ``raw`` is not in the message."""
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise NotFound(f"No such {what}: {hint or f'{what} ids are UUIDs'}.", code=code) from None
