"""The web tier's /metrics endpoint: the series of ``core/observe/submit_metrics.py`` and
``core/observe/metrics.py`` that this process (under gunicorn: every web process) recorded."""

from __future__ import annotations

from flask import Blueprint, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from core.observe.metrics import scrape_registry

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
def metrics() -> Response:
    return Response(generate_latest(scrape_registry()), content_type=CONTENT_TYPE_LATEST)
