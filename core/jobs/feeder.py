"""The bulk job feeder: moves job items from Postgres onto the queues as capacity frees up.

One feeder is active at a time (a Redis lease, like the load monitor's, in whose process it
runs); another stands by and takes over within a lease. Every ``SLUICE_FEEDER_INTERVAL_S`` the
leader:

1. reads the items in flight (``job_items`` that are ``running``: a bounded set) and the
   requests of their current stage. An item whose requests all ended moves on: its result, its
   failure, or its next map-reduce stage; a stage request that does not exist yet (a feeder
   died between writing its id on the item and creating it, or admission refused it a moment
   ago) is created now, with the id the item holds: no item is ever computed twice
   (``core/jobs/stages.py``, the requests' bodies ``core/jobs/bodies.py``);
2. settles its jobs: expired past their window, cancelled once nothing runs, finalizing once
   every item was fed, completed once none runs (``core/jobs/settle.py``);
3. unless the platform is degraded (any level above normal) or a peak reservation is in force,
   feeds: the next items of each tenant and job by fair share of the capacity the warm workers
   have (``core/jobs/scheduling.py``).

Every request goes through the same submit pipeline as one sent to the API (admission with the
tenant's limits, the hot cache and twins, the row, the publish): a tenant over its token rate is
paced by it, and the request is retried on worker loss like any other. What the feeder last did
is written to Redis (``FEEDER_STATE_KEY``) and shown on every job.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from typing import Any

from sqlalchemy import func, select

from core.fleet.lease import Lease, run_leading
from core.jobs.bodies import Bodies
from core.jobs.scheduling import Scheduler
from core.jobs.settle import Settler
from core.jobs.stages import Running, Stages
from core.rediskeys import FEEDER_STATE_KEY
from core.services import Services
from models import InferenceRequest, Priority, Tenant
from models.job import LIVE_JOB, ItemStatus, Job, JobItem, JobStatus
from models.reservation import active

log = logging.getLogger(__name__)

LEADER_KEY = "sluice:feeder:leader"
READ_RESERVATIONS_S = 5.0
_REQUEST_COLUMNS = (InferenceRequest.id, InferenceRequest.status, InferenceRequest.output_text,
                    InferenceRequest.finish_reason, InferenceRequest.error_code, InferenceRequest.error_message,
                    InferenceRequest.input_tokens, InferenceRequest.cached_tokens, InferenceRequest.output_tokens)


class Feeder:
    def __init__(self, svc: Services, clock=time.monotonic) -> None:
        self.svc = svc
        self.settings = svc.settings
        self.db = svc.db
        self.redis = svc.redis
        self.clock = clock
        self.lease = Lease(svc.redis, LEADER_KEY, max(3.0, 6 * self.settings.feeder_interval_s))
        self._reservations: tuple[float, bool] = (float("-inf"), False)
        self.left: dict[uuid.UUID, float | None] = {}  # seconds left in each live job's window, this tick
        self.stages = Stages(svc, Bodies(svc, self.left))
        self.scheduler = Scheduler(svc, self.stages)
        self.settler = Settler(svc, self.left, self.scheduler.pending, clock)

    # ------------------------------------------------------------------ the loop

    def lead(self) -> bool:
        return self.lease.hold()

    def run(self, stop: threading.Event) -> None:
        run_leading("job feeder", self.lease, self.tick, self.settings.feeder_interval_s, stop, self.clock,
                    on_change=lambda _: self.scheduler.pending.clear())  # read-ahead lines may be stale by then

    def tick(self) -> dict[str, Any]:
        self.settler.check_stale_uploads()
        jobs = self._live_jobs()
        tenants = self._tenants({job.tenant_id for job in jobs.values()})
        running = self._running()
        states = self._states([rid for item in running for rid in item.requests])
        in_flight: dict[tuple[str, str], int] = defaultdict(int)
        running_jobs: set[uuid.UUID] = set()
        advanced = 0
        for item in running:
            job = jobs.get(item.job_id) or self._job(item.job_id)
            if job is None:
                continue
            rows = [states.get(rid) for rid in item.requests]
            open_ = [rid for rid, row in zip(item.requests, rows, strict=True)
                     if row is None or not row.status.terminal]
            if open_:
                running_jobs.add(job.id)
                in_flight[(job.model, job.priority)] += len(open_)
                missing = [rid for rid, row in zip(item.requests, rows, strict=True) if row is None]
                if missing:
                    self.stages.guarded(item.job_id, item.line, self.stages.create_missing, item, job,
                                        tenants.get(job.tenant_id), missing)
                continue
            next_stage = self.stages.guarded(item.job_id, item.line, self.stages.advance, item, job,
                                             tenants.get(job.tenant_id), rows)
            advanced += 1
            if next_stage:
                running_jobs.add(job.id)
                in_flight[(job.model, job.priority)] += next_stage
        self.settler.settle(jobs, running_jobs)
        feeding = [j for j in jobs.values() if j.status == JobStatus.IN_PROGRESS]
        paused, feeding = self._paused(feeding)
        capacity = self.scheduler.capacity()
        fed = 0
        if feeding:
            fed = self.scheduler.feed(feeding, tenants, capacity, in_flight)
        report = {"at": time.time(), "paused": paused or "", "in_flight": sum(in_flight.values()),
                  "capacity": sum(capacity.values()), "fed": fed, "advanced": advanced}
        try:
            self.redis.hset(FEEDER_STATE_KEY, mapping=report)
            self.redis.expire(FEEDER_STATE_KEY, 60)
        except Exception:
            log.debug("feeder state not written", exc_info=True)
        return report

    # ------------------------------------------------------------------ reading

    def _live_jobs(self) -> dict[uuid.UUID, Job]:
        """Jobs being fed or finished, and (in ``left``) the seconds left in each one's window."""
        with self.db.session() as session:
            rows = session.execute(select(Job, func.extract("epoch", Job.expires_at - func.now()))
                                   .where(Job.status.in_(LIVE_JOB))).all()
        self.left.clear()  # in place: the stages and the settler read it too
        self.left.update({job.id: None if left is None else float(left) for job, left in rows})
        return {job.id: job for job, _ in rows}

    def _job(self, job_id: uuid.UUID) -> Job | None:
        with self.db.session() as session:
            return session.get(Job, job_id)

    def _tenants(self, ids: set[uuid.UUID]) -> dict[uuid.UUID, Tenant]:
        if not ids:
            return {}
        with self.db.session() as session:
            return {t.id: t for t in session.scalars(select(Tenant).where(Tenant.id.in_(ids)))}

    def _running(self) -> list[Running]:
        with self.db.session() as session:
            rows = session.execute(select(JobItem.job_id, JobItem.line, JobItem.custom_id, JobItem.requests,
                                          JobItem.depth, JobItem.final, JobItem.body)
                                   .where(JobItem.status == ItemStatus.RUNNING)).all()
        return [Running(*row) for row in rows]

    def _states(self, ids: list[uuid.UUID]) -> dict[uuid.UUID, Any]:
        if not ids:
            return {}
        with self.db.session() as session:
            return {row.id: row for row in session.execute(
                select(*_REQUEST_COLUMNS).where(InferenceRequest.id.in_(ids)))}

    def _paused(self, feeding: list[Job]) -> tuple[str | None, list[Job]]:
        """Why feeding stops now, and the jobs it goes on for: a job's class is degraded (its own
        level, or its model's realtime level: bulk work uses idle capacity only), or a peak
        reservation is in force (no job is fed)."""
        levels, _ = self.svc.requests.ladder.reader.current()  # the levels admission applies (stale: 0)
        held = {(j.priority, j.model): level for j in feeding if (level := levels.of(j.priority, j.model)) > 0}
        feeding = [j for j in feeding if (j.priority, j.model) not in held]
        read_at, in_force = self._reservations
        if self.clock() - read_at >= READ_RESERVATIONS_S:
            try:
                with self.db.session() as session:
                    in_force = bool(active(session))
                self._reservations = (self.clock(), in_force)
            except Exception:
                log.warning("reservations not read; keeping the last known", exc_info=True)
        if in_force:
            return "peak reservation in force", []
        if held:
            return "degradation level " + ", ".join(
                f"{int(level)} on {Priority(p).value}:{m}" for (p, m), level in sorted(held.items())), feeding
        return None, feeding

__all__ = ["Feeder", "LEADER_KEY"]
