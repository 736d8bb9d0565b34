"""Which job items the feeder starts next: fair shares of the capacity the workers have.

Per model and priority, at most ``SLUICE_JOB_INFLIGHT_PER_WORKER`` requests are queued or
running per warm worker serving them (one paused for a peak reservation serves no batch), so
Redis never holds more than that many of any job's messages. Tenants share that capacity in
proportion to their ``batch_weight``, counted in the tokens each request reserves (start-time
fair queueing: the next item is the one of the tenant that has used the least per unit of
weight; a tenant that comes back starts level with the others, not with credit). A tenant's own
jobs go earliest window first (a 1 h job overtakes its 24 h one), and those due together share its
part the same way. A disabled tenant's jobs wait.
"""

from __future__ import annotations

import uuid
from collections import defaultdict, deque

from sqlalchemy import select

from core.fleet.workers import live_workers
from core.jobs.estimate import SAME_DUE_S
from core.jobs.stages import Stages
from core.rediskeys import PAUSED_KEY
from core.services import Services
from models import Tenant
from models.job import ItemStatus, Job, JobItem

FETCH = 32  # pending items read per job at a time


def _due_first(jobs: list[Job]) -> list[Job]:
    """A tenant's jobs promised first (``estimated_finish_at``, made at submit by
    ``core/jobs/estimate.py place``; a job without a promise: its window's end), within
    ``SAME_DUE_S`` of the earliest: a 1 h job overtakes the tenant's 24 h job where the 24 h job's
    promise left it room, and jobs due together share the tenant's part by the tokens fed."""
    keys = {j.id: j.estimated_finish_at or j.expires_at for j in jobs}
    due = {i: key.timestamp() if key is not None else float("inf") for i, key in keys.items()}
    first = min(due.values())
    return [j for j in jobs if due[j.id] <= first + SAME_DUE_S]


class Scheduler:
    """The fair-share state of the leading feeder: what each tenant and job was fed, lines read ahead."""

    def __init__(self, svc: Services, stages: Stages) -> None:
        self.settings = svc.settings
        self.db = svc.db
        self.redis = svc.redis
        self.stages = stages
        self.tenant_used: dict[uuid.UUID, float] = {}  # tokens fed ÷ weight, while the tenant has work
        self.job_used: dict[uuid.UUID, float] = {}
        self.pending: dict[uuid.UUID, deque] = {}  # job → lines read ahead

    def capacity(self) -> dict[tuple[str, str], int]:
        """Requests the feeder may keep in flight per (model, priority): a bound per warm worker
        serving that model's queues of that priority (one paused for a reservation serves no batch)."""
        paused = set(self.redis.hkeys(PAUSED_KEY))
        capacity: dict[tuple[str, str], int] = defaultdict(int)
        for worker in live_workers(self.redis, self.settings.worker_heartbeat_s):
            for priority in ("realtime", "batch"):
                if priority == "batch" and worker.get("worker") in paused:
                    continue
                if any(q.startswith(priority + ".") for q in worker.get("queues", ())):
                    capacity[(worker.get("model", "?"), priority)] += self.settings.job_inflight_per_worker
        return capacity

    def feed(self, jobs: list[Job], tenants: dict[uuid.UUID, Tenant], capacity: dict[tuple[str, str], int],
             in_flight: dict[tuple[str, str], int]) -> int:
        """Start the next items, least-served tenant and job first, until the free capacity is used,
        every job waits, or the platform refuses; how many were started (or failed to)."""
        free = {key: capacity.get(key, 0) - in_flight.get(key, 0) for key in capacity}
        by_tenant: dict[uuid.UUID, list[Job]] = defaultdict(list)
        for job in jobs:
            tenant = tenants.get(job.tenant_id)
            if tenant is not None and tenant.disabled_at is None:  # a disabled tenant's jobs wait
                by_tenant[job.tenant_id].append(job)
        self._level(self.tenant_used, set(by_tenant))
        self._level(self.job_used, {j.id for j in jobs})
        for job_id in list(self.pending):
            if job_id not in self.job_used:
                del self.pending[job_id]
        exhausted: set[uuid.UUID] = set()
        blocked: set[uuid.UUID] = set()
        fed = 0
        while True:
            open_jobs = {t: [j for j in js if j.id not in exhausted and free.get((j.model, j.priority), 0) > 0]
                         for t, js in by_tenant.items() if t not in blocked}
            open_jobs = {t: js for t, js in open_jobs.items() if js}
            if not open_jobs:
                break
            tenant_id = min(open_jobs, key=lambda t: self.tenant_used[t])
            job = min(_due_first(open_jobs[tenant_id]), key=lambda j: self.job_used[j.id])
            item = self._next_item(job)
            if item is None:
                exhausted.add(job.id)
                continue
            line, custom_id, text_, body = item
            outcome, tokens, made = self.stages.guarded(job.id, line, self.stages.start, job.id, line, job,
                                                        tenants[tenant_id], text_, body, 0, [],
                                                        custom_id=custom_id, on_conflict=("retry", 0, 0)
                                                        ) or ("failed", 0, 1)
            free[(job.model, job.priority)] -= max(made, 1)
            weight = max(float(tenants[tenant_id].batch_weight or 1.0), 1e-6)
            self.tenant_used[tenant_id] += max(tokens, 1) / weight
            self.job_used[job.id] += max(tokens, 1)
            if outcome is None or outcome == "failed":
                fed += 1
            elif outcome == "retry":
                blocked.add(tenant_id)
            elif outcome == "overloaded":
                break
        return fed

    @staticmethod
    def _level(used: dict[uuid.UUID, float], present: set[uuid.UUID]) -> None:
        """Forget who has no work; one that (re)appears starts level with the least-served."""
        for key in list(used):
            if key not in present:
                del used[key]
        floor = min(used.values(), default=0.0)
        for key in present:
            used.setdefault(key, floor)

    def _next_item(self, job: Job):
        queue = self.pending.setdefault(job.id, deque())
        if not queue:
            with self.db.session() as session:
                queue.extend(session.execute(
                    select(JobItem.line, JobItem.custom_id, JobItem.text, JobItem.body)
                    .where(JobItem.job_id == job.id, JobItem.status == ItemStatus.PENDING)
                    .order_by(JobItem.line).limit(FETCH)).all())
        return queue.popleft() if queue else None
