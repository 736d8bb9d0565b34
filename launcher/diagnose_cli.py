"""``sluice diagnose``: the figures the platform already keeps, gathered, and the verdict printed.

Redis holds the load monitor's per-class snapshots (``core/admission/load.py``) and each warm worker's
heartbeat with its engine's stats (``workers/runtime.py``); Postgres holds the request rows, whose
timestamps say how long recent requests queued and ran. The judging is ``core/observe/diagnose.py``'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import timedelta

import click
import redis
from sqlalchemy import case, func, select

from core.admission.load import ClassLoad
from core.observe.diagnose import ClassFigures, EngineFigures, Figures, diagnose
from core.rediskeys import redis_client
from core.settings import Settings
from launcher.options import service_settings
from models import Database, InferenceRequest


def gather(settings: Settings, client: redis.Redis, db: Database, window_s: float) -> Figures:
    """Every class the monitor published, with the rows of the last ``window_s`` seconds, and
    every live worker. The batch size of an engine is SLUICE_VLLM_MAX_NUM_SEQS as this process
    reads it: heartbeats do not carry it."""
    from core.fleet.workers import live_workers

    recent = _recent(db, window_s)
    classes = []
    for load in ClassLoad.read_all(client):
        arrived, started, queue_wait, inference = recent.get((load.priority, load.model), (0, 0, None, None))
        default = settings.realtime_deadline_s if load.priority == "realtime" else settings.batch_deadline_s
        classes.append(ClassFigures(
            load.priority, load.model, deadline_s=load.deadline_s or default, queued_requests=load.queued_requests,
            queued_work=load.queued_work, wait_s=load.wait_s,
            # Before a backlog lets the monitor measure it, the rows say what was claimed.
            drain_tps=load.drain_tps or started / window_s, arrival_tps=arrived / window_s,
            queue_wait_s=queue_wait, inference_s=inference))
    engines = tuple(EngineFigures(
        worker=beat["worker"], model=beat.get("model", "?"), queues=tuple(beat.get("queues", ())),
        threads=beat.get("threads", 0), batch=settings.vllm_max_num_seqs, running=beat.get("running", 0),
        waiting=beat.get("waiting", 0), in_flight=beat.get("in_flight", 0),
        kv_used_tokens=beat.get("kv_used_tokens", 0), kv_capacity_tokens=beat.get("kv_capacity_tokens", 0))
        for beat in live_workers(client, settings.worker_heartbeat_s))
    return Figures(tuple(classes), engines)


def _recent(db: Database, window_s: float) -> dict[tuple[str, str], tuple[int, int, float | None, float | None]]:
    """Per class, of the requests created in the window that went onto a queue (not answered from
    the cache, not parked on a twin): work (max_tokens) arrived and started, the median wait
    before starting (so far, for those still queued) and the median inference time."""
    t = InferenceRequest
    model = func.coalesce(t.model_routed, t.model_requested)
    waited = func.extract("epoch", func.coalesce(t.started_at, t.finished_at, func.now()) - t.created_at)
    ran = func.extract("epoch", t.finished_at - t.started_at)  # NULL until it finished: the median skips it
    with db.session() as session:
        rows = session.execute(
            select(t.priority, model, func.sum(t.max_tokens),
                   func.sum(case((t.started_at.is_not(None), t.max_tokens), else_=0)),
                   func.percentile_cont(0.5).within_group(waited), func.percentile_cont(0.5).within_group(ran))
            .where(t.created_at >= func.now() - timedelta(seconds=window_s), t.cache_hit.is_(False),
                   t.follows_id.is_(None))
            .group_by(t.priority, model)).all()
    return {(priority.value, name): (int(arrived or 0), int(started or 0), _seconds(wait), _seconds(run))
            for priority, name, arrived, started, wait, run in rows}


def _seconds(value) -> float | None:
    return None if value is None else round(float(value), 3)


@click.command("diagnose")
@click.option("--window", "window_s", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds of recent requests to read (arrivals, queue waits, inference times).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: the verdict, its numbers and every figure.")
def diagnose_command(window_s: float, as_json: bool) -> None:
    """Why requests are slow: a batching or concurrency problem, a model too big for the traffic,
    too little capacity (and how many workers to add), or healthy, with the numbers behind it."""
    settings = service_settings()
    db = Database()
    db.configure(settings.sqlalchemy_url, pool_size=1, max_overflow=0)
    try:
        figures = gather(settings, redis_client(settings.redis_url), db, window_s)
    finally:
        db.dispose()
    verdict = diagnose(figures)
    if as_json:
        click.echo(json.dumps({"verdict": verdict.kind, "sentence": verdict.sentence, "numbers": verdict.numbers,
                               "window_s": window_s, "figures": asdict(figures)}, indent=2))
        return
    click.echo(f"{verdict.kind}: {verdict.sentence}\n")
    for name, value in verdict.numbers.items():
        click.echo(f"  {name:20} {'-' if value is None else value}")
