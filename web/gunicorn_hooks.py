"""gunicorn server hooks of `sluice web` (loaded with ``-c python:web.gunicorn_hooks``).

Metrics: every web process writes its series into ``PROMETHEUS_MULTIPROC_DIR``; when one exits,
its live gauges must stop counting (its counters stay in the sums, as Prometheus expects).
"""

from __future__ import annotations

import os


def child_exit(server, worker) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
