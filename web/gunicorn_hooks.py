"""gunicorn's side of `sluice web`: its server hooks (loaded with ``-c python:web.gunicorn_hooks``)
and its logger class (``--logger-class web.gunicorn_hooks.GunicornLogger``).

Metrics: every web process writes its series into ``PROMETHEUS_MULTIPROC_DIR``; when one exits,
its live gauges must stop counting (its counters stay in the sums, as Prometheus expects).
"""

from __future__ import annotations

import logging
import os

from gunicorn import glogging

from core.observe.logs import configure_logging, log_context


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
