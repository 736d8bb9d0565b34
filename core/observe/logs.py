"""Logging for every process: one format, and on every line the ids of what it is about.

Two ids, two names:

* ``call=`` the HTTP call (the ``X-Request-Id`` the client sent or got, the ``request_id`` of
  an error envelope) or the Celery task that is running;
* ``req=`` the request row: once a row exists, every line about it, on the web tier, the
  worker and the sweep, carries the row's id, so one grep follows a request through the system.

Two formats (SLUICE_LOG_FORMAT): ``text`` for people, ``json`` for log pipelines, one object per
line with the same ids (``call_id``, ``request_id``). Every line of a process goes through the
one handler :func:`configure_logging` installs on the root logger: Celery's own loggers reach it
because workers do not let Celery take the root logger over (``worker_hijack_root_logger``),
gunicorn's through ``web/gunicorn_hooks.py GunicornLogger``. No line carries a prompt or an output: code logs
ids and lengths only.
"""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

current_call_id: contextvars.ContextVar[str] = contextvars.ContextVar("call_id", default="-")
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s call=%(call_id)s req=%(request_id)s: %(message)s"


class ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.call_id = current_call_id.get()
        # Celery's own lines about a task (received, succeeded, failed) are written outside its
        # run, with the task in ``data``: they get the call id the task's own lines carry.
        data = getattr(record, "data", None)
        if record.call_id == "-" and isinstance(data, dict) and data.get("id"):
            record.call_id = str(data["id"])
        # A line about one row of many (the sweep's) names it with extra={"request_id": ...}.
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: a newline in a message or a traceback stays
    inside its string, so no message can forge or split a line. An id not bound is null."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "process": record.process,
                 "message": record.getMessage(), "call_id": _id(record, "call_id"),
                 "request_id": _id(record, "request_id")}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def _id(record: logging.LogRecord, name: str) -> str | None:
    value = getattr(record, name, "-")
    return None if value == "-" else str(value)


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


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Idempotent: safe to call from every entry point; a later call sets the level and format
    of the one handler instead of adding another."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if any(isinstance(f, ContextFilter) for f in h.filters)), None)
    if handler is None:
        handler = logging.StreamHandler()
        handler.addFilter(ContextFilter())
        root.addHandler(handler)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_FORMAT))
    # A library's warning is printed to stderr as several raw lines: in JSON it becomes a record
    # (logger py.warnings) instead, so that every line parses.
    logging.captureWarnings(fmt == "json")
    root.setLevel(level.upper())
