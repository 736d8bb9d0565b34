"""Liveness: this process answers, and can reach Postgres and Redis."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify
from sqlalchemy import text

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> tuple[Response, int]:
    checks = {}
    try:
        with current_app.extensions["sluice.db"].session() as session:
            session.execute(text("SELECT 1"))
        checks["postgres"] = "ok"
    except Exception:
        checks["postgres"] = "unreachable"
    try:
        current_app.extensions["sluice.redis"].ping()
        checks["redis"] = "ok"
    except Exception:
        checks["redis"] = "unreachable"
    healthy = all(v == "ok" for v in checks.values())
    return jsonify(status="ok" if healthy else "degraded", checks=checks), 200 if healthy else 503
