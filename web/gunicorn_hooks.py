"""gunicorn's side of `sluice web`: its server hooks (loaded with ``-c python:web.gunicorn_hooks``),
its logger class (``--logger-class web.gunicorn_hooks.GunicornLogger``) and its own error answers.

Metrics: every web process writes its series into ``PROMETHEUS_MULTIPROC_DIR``; when one exits,
its live gauges must stop counting (its counters stay in the sums, as Prometheus expects).
"""

from __future__ import annotations

import json
import logging
import os

from gunicorn import glogging, util

from core.observe.logs import configure_logging, log_context

# gunicorn answers what it refuses before the app sees a request (a request line over
# limit_request_line: 414; headers over limit_request_fields or their size: 431; a malformed
# request: 400) with an HTML page of its own. Clients of an API parse JSON: these answers carry the
# one error envelope instead (web/errors.py), with a stable code. gunicorn writes them through
# ``util.write_error``; this module is its config, imported by the master before it forks.
_GUNICORN_CODES = {400: "bad_request", 403: "forbidden", 414: "uri_too_long", 417: "expectation_failed",
                   431: "headers_too_large", 500: "internal_error", 501: "not_implemented"}


def write_error(sock, status_int: int, reason: str, mesg: str) -> None:
    body = json.dumps({"error": {"code": _GUNICORN_CODES.get(status_int, "bad_request"),
                                 "message": f"{reason}: {mesg}" if mesg else reason}}).encode()
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode("latin1")
    util.write_nonblock(sock, head + body)


util.write_error = write_error


def child_exit(server, worker) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


class GunicornLogger(glogging.Logger):
    """gunicorn's own logs (the master's, each worker's error log, the access log) through the
    root handler, so they share the format and the ids of the app's lines (``--logger-class``)."""

    log_format = "text"

    def setup(self, cfg) -> None:
        super().setup(cfg)
        configure_logging(cfg.loglevel, self.log_format)
        # gunicorn keeps its access log at INFO whatever --log-level says, and a propagated line
        # passes the root's level: at WARNING every call was still logged.
        self.access_log.setLevel(max(logging.INFO, logging.getLogger().getEffectiveLevel()))
        for log in (self.error_log, self.access_log):
            for handler in [h for h in log.handlers if getattr(h, "_gunicorn", False)]:
                log.removeHandler(handler)
            log.propagate = True

    def access(self, resp, req, environ, request_time) -> None:
        if not self.access_log.isEnabledFor(logging.INFO):
            return  # before gunicorn builds the line's atoms (3% of a poll)
        # gunicorn logs a call after the app unbound its ids: name it by the id it answered with.
        call = next((value for name, value in resp.headers if name.lower() == "x-request-id"), "-")
        with log_context(call=call):
            super().access(resp, req, environ, request_time)


class JsonGunicornLogger(GunicornLogger):
    log_format = "json"
