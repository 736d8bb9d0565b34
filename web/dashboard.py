"""The operator page (``/dashboard``): the entry queue first, then what drains it.

The page is static (``web/static/``: its HTML and a small chart script of our own, no build
step, nothing from a CDN); it asks ``GET /v1/admin/dashboard`` every two seconds with the admin
key, which the operator gives once (``/dashboard#key=…`` or the form) and the browser keeps for
the tab only. The data endpoint answers from what the platform already keeps: the load
monitor's class snapshots and the level (Redis), the workers' heartbeats (engine batch and KV),
recent request timings, live jobs and reservations (Postgres), and this web tier's rejection
counters (all its processes, ``core/observe/metrics.py``). This month's usage by tenant and its
top models by cost (``GET /v1/admin/dashboard/usage``, the usage report's rollups) change
slowly: the page asks for them once a minute.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from flask import Blueprint, Response, jsonify
from sqlalchemy import Float, cast, func, select

from core.admission.load import load_view
from core.broker.fair import lines_view, name_tenants
from core.fleet.workers import live_workers
from core.observe.metrics import scrape_registry
from core.usage.report import UsageQuery, usage
from models import InferenceRequest, Job, JobItem
from models.reservation import current_views
from web.admin import _require_admin_key
from web.errors import NotFound
from web.services import services

STATIC = Path(__file__).resolve().parent / "static"
_TYPES = {".html": "text/html", ".js": "text/javascript"}
# What a name of one of those files can look like. Anything else (a NUL, which the filesystem
# calls refuse with ValueError; a name too long for it; a path) is no file of the page.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\.[a-z]{1,8}")
TIMING_WINDOW_S = 60  # the queue wait / inference figures cover requests that ended this recently
TOP_MODELS = 5
_LABELS = {"tenant": ("tenant_id", "tenant_name"), "model": ("model",)}  # what names a row of the usage panel
page_bp = Blueprint("dashboard", __name__)
data_bp = Blueprint("dashboard_data", __name__, url_prefix="/v1/admin")
data_bp.before_request(_require_admin_key)
_t = InferenceRequest


@page_bp.get("/dashboard")
def page() -> Response:
    return _static("dashboard.html", max_age=0, kinds=(".html",))


@page_bp.get("/dashboard/static/<path:name>")
def asset(name: str) -> Response:
    # Its scripts only, as documented: the page itself is /dashboard (the API fuzzer found
    # /dashboard/static/dashboard.html answering HTML where the document says JavaScript).
    return _static(name, max_age=300, kinds=(".js",))


def _static(name: str, max_age: int, kinds: tuple[str, ...]) -> Response:
    """One of the page's few small files of a suffix in ``kinds`` (of ``_TYPES``), read whole (no
    open file handed to the server); 404 for any other name."""
    if not _NAME.fullmatch(name):
        raise NotFound("No such file of the operator page.")
    path = (STATIC / name).resolve()
    if path.parent != STATIC or path.suffix not in kinds or not path.is_file():
        raise NotFound("No such file of the operator page.")
    return Response(path.read_bytes(), mimetype=_TYPES[path.suffix], headers={"Cache-Control": f"max-age={max_age}"})


@data_bp.get("/dashboard")
def data() -> Response:
    svc = services()
    with svc.db.session() as session:
        reservations = current_views(session)
        timings = _timings(session)
        jobs = _jobs(session)
        lines = name_tenants(session, lines_view(svc.redis))
    load = load_view(svc.redis, svc.settings.ladder, reservations)
    workers = [{"worker": w.get("worker"), "model": w.get("model"), "device": w.get("device"),
                "role": w.get("role"), "running": w.get("running", 0), "waiting": w.get("waiting", 0),
                "max_batch_seen": w.get("max_batch_seen", 0), "threads": w.get("threads"),
                "engine_limit": w.get("engine_limit"), "batch_open": w.get("batch_open"),
                "kv_used_tokens": w.get("kv_used_tokens", 0), "kv_capacity_tokens": w.get("kv_capacity_tokens", 0)}
               for w in live_workers(svc.redis, svc.settings.worker_heartbeat_s)]
    return jsonify({"level": load["level"], "steps": load["steps"], "monitor": load["monitor"],
                    "classes": load["classes"], "reservations": reservations,
                    "paused_for_reservations": load["paused_for_reservations"], "workers": workers,
                    "timings": timings, "jobs": jobs, "rejections": _rejections(), "lines": lines})


@data_bp.get("/dashboard/usage")
def month_usage() -> Response:
    """This month (UTC) so far: every tenant's requests, tokens and cost, most costly first, and
    the models that cost most."""
    now = datetime.now(UTC)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return jsonify({"start": start.isoformat(), "end": now.isoformat(), "tenants": _summed(start, now, "tenant"),
                    "models": _summed(start, now, "model")[:TOP_MODELS]})


def _summed(start: datetime, end: datetime, group: str) -> list[dict[str, Any]]:
    """The usage report grouped by ``group``, its day buckets summed: one row per tenant (model),
    highest cost first."""
    labels = _LABELS[group]
    rows: dict[str, dict[str, Any]] = {}
    for bucket in usage(services().db, UsageQuery(start, end, "day", (group,), None))["data"]:
        for result in bucket["results"]:
            row = rows.setdefault(result[labels[0]], {**{f: result[f] for f in labels}, "requests": 0,
                                                      "input_tokens": 0, "output_tokens": 0, "cost": Decimal(0)})
            for name in ("requests", "input_tokens", "output_tokens"):
                row[name] += result[name]
            row["cost"] += Decimal(result["cost_usd"])
    ranked = sorted(rows.values(), key=lambda r: (-r["cost"], -r["requests"], str(r[labels[-1]])))
    return [{**r, "cost": float(r["cost"]), "cost_usd": str(r["cost"])} for r in ranked]


def _timings(session) -> list[dict[str, Any]]:
    """Median queue wait and inference time per priority, over requests that ended lately."""
    wait = func.extract("epoch", _t.started_at - _t.created_at)
    run = func.extract("epoch", _t.finished_at - _t.started_at)
    rows = session.execute(
        select(_t.priority, func.count(),
               cast(func.percentile_cont(0.5).within_group(wait), Float),
               cast(func.percentile_cont(0.5).within_group(run), Float))
        .where(_t.finished_at > func.now() - func.make_interval(0, 0, 0, 0, 0, 0, TIMING_WINDOW_S),
               _t.started_at.is_not(None))
        .group_by(_t.priority)).all()
    return [{"priority": p.value, "requests": n, "queue_wait_p50_s": w, "inference_p50_s": r} for p, n, w, r in rows]


def _jobs(session) -> list[dict[str, Any]]:
    live = select(Job.id).where(Job.status.in_(("in_progress", "finalizing", "cancelling"))).limit(20).subquery()
    rows = session.execute(select(JobItem.job_id, JobItem.status, func.count())
                           .where(JobItem.job_id.in_(select(live.c.id)))
                           .group_by(JobItem.job_id, JobItem.status)).all()
    jobs: dict[str, dict[str, int]] = {}
    for job_id, status, count in rows:
        jobs.setdefault(str(job_id), {})[status.value] = count
    return [{"id": job_id, "items": counts} for job_id, counts in jobs.items()]


def _rejections() -> dict[str, float]:
    """Rejections since the web tier started, by gate and reason (the page shows the change)."""
    totals: dict[str, float] = {}
    for family in scrape_registry().collect():
        if family.name == "sluice_admission_rejections":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = f"{sample.labels['gate']}: {sample.labels['reason']}"
                    totals[key] = totals.get(key, 0.0) + sample.value
    return totals
