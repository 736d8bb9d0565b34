"""Logging for every process: one format, and on every line the ids of what it is about.

Two ids, two names:

* ``call=`` the HTTP call (the ``X-Request-Id`` the client sent or got, the ``request_id`` of
  an error envelope) or the Celery task that is running;
* ``req=`` the request row: once a row exists, every line about it, on the web tier, the
  worker and the sweep, carries the row's id, so one grep follows a request through the system.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from contextlib import contextmanager

current_call_id: contextvars.ContextVar[str] = contextvars.ContextVar("call_id", default="-")
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s call=%(call_id)s req=%(request_id)s: %(message)s"


class ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.call_id = current_call_id.get()
        # A line about one row of many (the sweep's) names it with extra={"request_id": ...}.
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id.get()
        return True


def bind_request(request_id: str) -> None:
    """From here to the end of this HTTP call or task, log lines are about ``request_id``."""
    current_request_id.set(request_id)


@contextmanager
def log_context(*, call: str = "-", request: str = "-") -> Iterator[None]:
    """Bind both ids for the block (a task's run, an HTTP call); restore the previous ones after."""
    tokens = current_call_id.set(call), current_request_id.set(request)
    try:
        yield
    finally:
        current_call_id.reset(tokens[0])
        current_request_id.reset(tokens[1])


def configure_logging(level: str = "INFO") -> None:
    """Idempotent: safe to call from every entry point."""
    root = logging.getLogger()
    if any(isinstance(f, ContextFilter) for h in root.handlers for f in h.filters):
        root.setLevel(level.upper())
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(ContextFilter())
    root.addHandler(handler)
    root.setLevel(level.upper())
