"""Prometheus series that more than one kind of Sluice process records, and how each exposes them.

Who exports what (each a scrape target of its own):

* the web tier at ``/metrics``: admissions and rejections, degradation steps applied, cache
  hits, abandoned requests, and the requests it ended (a cancel of a queued one). Under
  gunicorn every web process writes into ``PROMETHEUS_MULTIPROC_DIR`` (``sluice web`` sets it),
  so one scrape of any of them sums all of them;
* each worker on ``SLUICE_WORKER_METRICS_PORT``: queue wait, inference time and time to first
  token per priority and model, output tokens, the requests it ended and their tokens, its
  engine (running and waiting sequences, KV use) and, on a GPU host, its devices;
* the monitor on ``SLUICE_MONITOR_METRICS_PORT``: the queues in requests *and tokens*, the level
  and the steps it turns on, job items by status, webhook deliveries by status.

Labels are bounded: priority, model, status, gate, reason, step, device — never a request id,
and a tenant id only in the monitor's fair-line series, for the ten tenants with most work queued
per class queue (the rest as ``other``).
"""

from __future__ import annotations

import logging
import os

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, multiprocess, start_http_server

from models import Status
from models.lifecycle import Moved

log = logging.getLogger(__name__)

# Seconds, from a cache-served millisecond to a long batch request's hour.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)

QUEUE_WAIT = Histogram("sluice_queue_wait_seconds", "From a request's acceptance to a worker claiming it.",
                       ["priority", "model"], buckets=_BUCKETS)
INFERENCE = Histogram("sluice_inference_seconds", "From a worker claiming a request to its end in the engine.",
                      ["priority", "model"], buckets=_BUCKETS)
FIRST_TOKEN = Histogram("sluice_time_to_first_token_seconds", "From a worker claiming a request to its first token.",
                        ["priority", "model"], buckets=_BUCKETS)
OUTPUT_TOKENS = Counter("sluice_output_tokens_total", "Tokens generated (rate() is output tokens per second).",
                        ["priority", "model"])
ENDED = Counter("sluice_requests_ended_total", "Requests that reached a final status, by that status.",
                ["status", "priority", "model"])
ENDED_TOKENS = Counter("sluice_request_tokens_total",
                       "Input and output tokens of requests that reached a final status: what expired, "
                       "timed-out and cancelled requests cost.", ["status", "kind"])


def count_end(moved: Moved) -> None:
    """Lifecycle ``on_end`` hook: one more request ended here, and what it had cost."""
    status = moved.status.value
    ENDED.labels(status, moved.priority.value, moved.model).inc()
    if moved.source == Status.RUNNING:  # only a run spends engine time; a queued one cost nothing
        ENDED_TOKENS.labels(status, "input").inc(moved.input_tokens)
        ENDED_TOKENS.labels(status, "output").inc(moved.output_tokens or 0)


def scrape_registry() -> CollectorRegistry:
    """What this process's /metrics shows: every process's series when gunicorn's processes
    share a multiprocess directory, else this process's own."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


def serve(host: str, port: int, what: str) -> bool:
    """Expose this process's series on ``host:port`` (port 0: not at all). A port in use is a
    warning, not a failure: a second worker on one host needs a port of its own, but it serves."""
    if not port:
        return False
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        log.warning("%s metrics not served on port %d (%s); give this process its own port", what, port, exc)
        return False
    log.info("%s metrics on :%d/metrics", what, port)
    return True
