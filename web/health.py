"""Liveness (/healthz: this process, Postgres, Redis) and readiness (/readyz: warm workers)."""

from __future__ import annotations

import time

from flask import Blueprint, Response, jsonify
from sqlalchemy import text

from core.fleet.workers import warm_workers
from core.rediskeys import SWEEP_LAST_KEY, eviction_policy
from web.services import services

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> tuple[Response, int]:
    checks = {}
    try:
        with services().db.session() as session:
            session.execute(text("SELECT 1"))
        checks["postgres"] = "ok"
    except Exception:
        checks["postgres"] = "unreachable"
    try:
        services().redis.ping()
        checks["redis"] = "ok"
    except Exception:
        checks["redis"] = "unreachable"
    healthy = all(v == "ok" for v in checks.values())
    return jsonify(status="ok" if healthy else "degraded", checks=checks), 200 if healthy else 503


@bp.get("/readyz")
def readyz() -> tuple[Response, int]:
    """Which workers are warm (engine loaded and warmed up), serving which model, with stats.

    200 when the default model has at least one warm worker, else 503: nothing would run.
    """
    settings = services().settings
    try:
        workers = warm_workers(services().redis)
        sweep = _last_sweep(services().redis)
    except Exception:
        return jsonify(ready=False, reason="redis unreachable", workers=[], models={}), 503
    models = {m.name: 0 for m in settings.registry.models}
    for w in workers:
        models[w.get("model", "?")] = models.get(w.get("model", "?"), 0) + 1
    ready = models.get(settings.registry.default.name, 0) > 0
    return jsonify(ready=ready, models=models, workers=workers, sweep=sweep,
                   redis_eviction_policy=eviction_policy(services().redis)), 200 if ready else 503


def _last_sweep(redis) -> dict | None:
    """When the sweep last finished (it publishes what was lost and requeues what died)."""
    last = redis.hgetall(SWEEP_LAST_KEY)
    if not last:
        return None
    return {"age_s": round(time.time() - float(last["at"]), 1), "took_ms": int(last["took_ms"])}
