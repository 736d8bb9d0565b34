"""Prometheus metrics of the web tier and the /metrics endpoint that exposes them.

Counters are per process: under gunicorn each worker answers /metrics with its own counts, so
scrape every worker or sum over them. (Multi-process aggregation belongs to the observability
issue.)
"""

from __future__ import annotations

from flask import Blueprint, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest

ADMITTED = Counter("sluice_admission_admitted_total", "Requests admitted, by the limiter that admitted them.",
                   ["limiter"])
REJECTIONS = Counter("sluice_admission_rejections_total", "Requests rejected at admission, by gate and reason.",
                     ["gate", "reason"])
IDEMPOTENT_REPLAYS = Counter("sluice_idempotent_replays_total",
                             "Submits answered with the request an earlier submit with the same key created.")
CACHE_HITS = Counter("sluice_cache_hits_total", "Submits answered from the hot answer cache, no GPU used.")
ABANDONED = Counter("sluice_requests_abandoned_total",
                    "Requests cancelled because their client left: closed a wait or a stream, or stopped polling.",
                    ["how"])
LOCAL_FLOOR = Gauge("sluice_admission_local_floor", "1 while this process admits on its local floor (Redis away).")

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
def metrics() -> Response:
    return Response(generate_latest(), content_type=CONTENT_TYPE_LATEST)
