"""Settling bulk jobs: each live job's status follows its items, its window and its cancel.

Every tick, after the items in flight moved on: a job past its completion window expires (its
pending items expire, the requests of its running ones are cancelled; finished items stay); a
cancelling job is cancelled once nothing of it runs; an in-progress job with nothing left to
feed is finalizing while items run, then completed (any item succeeded) or failed (none did).
Every ``STALE_CHECK_S``, uploads that never finished (their web process died) fail. The job's
row moves only through ``models/job_lifecycle.py``, from the status read this tick: a cancel
that came meanwhile wins.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque

from sqlalchemy import exists, func, select

from core.jobs import estimate
from core.jobs.intake import STALE_UPLOAD_S
from core.jobs.service import cancel_requests, stop_items
from core.services import Services
from models import job_lifecycle
from models.job import ItemStatus, Job, JobItem, JobStatus

log = logging.getLogger(__name__)

STALE_CHECK_S = 60.0


class Settler:
    """Moves each live job on as its items, its window and its cancel say."""

    def __init__(self, svc: Services, left: dict[uuid.UUID, float | None], pending: dict[uuid.UUID, deque],
                 clock=time.monotonic) -> None:
        self.svc = svc
        self.db = svc.db
        self.left = left  # seconds left in each live job's window, refreshed by the feeder every tick
        self.pending = pending  # the scheduler's lines read ahead: a job with some still has pending items
        self.clock = clock
        self._stale_checked = float("-inf")

    def check_stale_uploads(self) -> None:
        """Fail the uploads that never finished, every ``STALE_CHECK_S``."""
        if self.clock() - self._stale_checked >= STALE_CHECK_S:
            self._fail_stale_uploads()
            self._stale_checked = self.clock()

    def settle(self, jobs: dict[uuid.UUID, Job], running_jobs: set[uuid.UUID]) -> None:
        """Once per tick: ``running_jobs`` are those with an item in flight after the items moved on."""
        for job in jobs.values():
            if job.status in (JobStatus.IN_PROGRESS, JobStatus.FINALIZING) and self._past_window(job):
                self._expire(job)
            elif job.status == JobStatus.CANCELLING and not self._running(job, running_jobs):
                self._finish(job, JobStatus.CANCELLED)
            elif job.status == JobStatus.IN_PROGRESS and not self._has_pending(job):
                status = JobStatus.FINALIZING if self._running(job, running_jobs) else self._outcome(job)
                self._finish(job, status)
            elif job.status == JobStatus.FINALIZING and not self._running(job, running_jobs):
                self._finish(job, self._outcome(job))

    def _past_window(self, job: Job) -> bool:
        left = self.left.get(job.id)
        return left is not None and left <= 0

    def _has_item(self, job: Job, status: ItemStatus) -> bool:
        """Whether ``job`` has an item in ``status`` now, as its rows say."""
        with self.db.session() as session:
            return bool(session.scalar(select(exists().where(JobItem.job_id == job.id, JobItem.status == status))))

    def _has_pending(self, job: Job) -> bool:
        return bool(self.pending.get(job.id)) or self._has_item(job, ItemStatus.PENDING)

    def _running(self, job: Job, running_jobs: set[uuid.UUID]) -> bool:
        """Whether an item of ``job`` runs: seen so this tick, or running in its row now. A stale
        leader (one whose lease lapsed mid-tick) can start an item after this tick read the running
        ones; settling from the tick's read alone would fail a job whose item had just started."""
        return job.id in running_jobs or self._has_item(job, ItemStatus.RUNNING)

    def _outcome(self, job: Job) -> JobStatus:
        return JobStatus.COMPLETED if self._has_item(job, ItemStatus.SUCCEEDED) else JobStatus.FAILED

    def _finish(self, job: Job, status: JobStatus) -> None:
        with self.db.session() as session:
            moved = job_lifecycle.settle(session, job, status)  # from the status read this tick, or not at all
        if moved:
            log.info("job %s %s", job.id, status.value)
            if status == JobStatus.COMPLETED:
                self._learn(job, ended=True)

    def _learn(self, job: Job, ended: bool) -> None:
        """What a job that had a promise took beside it teaches its model's estimates
        (``estimate.learn``), from its row's stamps: the promise and the end, from its start."""
        with self.db.session() as session:
            row = session.execute(select(
                func.extract("epoch", Job.estimated_finish_at - Job.started_at),
                func.extract("epoch", Job.finished_at - Job.started_at)).where(Job.id == job.id)).one_or_none()
        if estimate.Lessons(self.svc.redis).was_idle_priced(job.id):
            log.info("job %s was priced by the idle model: its %s s teach %s's estimates nothing", job.id,
                     "?" if row is None or row[1] is None else f"{float(row[1]):.0f}", job.model)
            return
        if row is None or row[0] is None or row[1] is None:
            return  # accepted without an estimate
        factor = estimate.learn(self.svc.redis, job.model, float(row[0]), float(row[1]), ended=ended)
        if factor is not None:
            log.info("job %s took %.0f s of the %.0f s promised: %s's estimates now scaled by %.2f", job.id,
                     float(row[1]), float(row[0]), job.model, factor)

    def _expire(self, job: Job) -> None:
        """Past its window: unfinished items expire (running ones once their requests are stopped),
        finished ones stay."""
        with self.db.session() as session:
            if not job_lifecycle.expire(session, job):  # ``job`` shows it expired once it is
                return
            in_flight = stop_items(session, job.id, ItemStatus.EXPIRED, "expired",
                                   "The job's completion window passed before this item ran.")
        self.pending.pop(job.id, None)
        cancel_requests(self.svc.requests, job.tenant_id, in_flight)
        log.info("job %s expired; %d requests in flight cancelled", job.id, len(in_flight))
        self._learn(job, ended=False)

    def _fail_stale_uploads(self) -> None:
        with self.db.session() as session:
            job_lifecycle.fail_stale_uploads(session, STALE_UPLOAD_S)
