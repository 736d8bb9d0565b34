"""A job item's way through its stages: started, advanced when its requests end, ended.

An item in flight (``running``) names its current stage's requests; their ids are written on
the item before the requests are created (``start``), so a feeder that dies in between creates
the missing ones with those ids later (``create_missing``) and nothing runs twice. Once every
request of the stage ended (``advance``): a failed one ends the item (cancelling the rest of
the stage), the final stage's answer is the item's result, and a map's summaries are joined
into the next stage, until one request covers everything. A stopping job (cancelled, expired)
ends its items as their stage ends. Every request goes through the submit pipeline, as one sent
to the API does. The item's status moves only through ``models/job_lifecycle.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from psycopg import errors as pg_errors
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError

from core.errors import ApiError
from core.jobs.bodies import Bodies
from core.jobs.service import cancel_requests
from core.observe.logs import current_request_id
from core.services import Services
from core.submit.tokens import estimate_text_tokens
from models import Source, Status, Tenant, job_lifecycle
from models.job import ItemStatus, Job, JobItem, JobStatus
from models.job_lifecycle import NOTHING, Spent

log = logging.getLogger(__name__)

# What another writer's lock on an item's row raises after the session's lock_timeout (a job's
# cancel updating every item in one transaction, say): a conflict to retry at a later tick.
_CONFLICTS = (pg_errors.LockNotAvailable, pg_errors.DeadlockDetected, pg_errors.SerializationFailure)


@dataclass
class Running:
    """An item in flight, as the feeder read it this tick."""

    job_id: uuid.UUID
    line: int
    custom_id: str | None
    requests: list[uuid.UUID]
    depth: int
    final: bool
    body: dict[str, Any] | None


class Stages:
    """Starts, advances and ends job items, creating their requests through the submit pipeline."""

    def __init__(self, svc: Services, bodies: Bodies) -> None:
        self.svc = svc
        self.db = svc.db
        self.bodies = bodies

    def advance(self, item: Running, job: Job, tenant: Tenant | None, rows: list[Any]) -> int:
        """Every request of the item's stage ended: record the outcome, or start the next stage
        (how many requests that stage has in flight; 0 when the item ended)."""
        spent = Spent.of(rows)
        failed = next((r for r in rows if r.status != Status.SUCCEEDED), None)
        stopping = self._stopping(job)
        if failed is not None:
            status = {Status.CANCELLED: ItemStatus.CANCELLED, Status.EXPIRED: ItemStatus.EXPIRED}.get(
                failed.status, ItemStatus.FAILED)
            code = failed.error_code or failed.status.value
            if stopping is not None and status == ItemStatus.CANCELLED:
                # Its request was stopped because the job stopped: the item ends as the job did (an
                # expired job's running items are `expired`, with the expiry's code).
                status = stopping
                code = ItemStatus.EXPIRED.value if stopping == ItemStatus.EXPIRED else code
            self._end(item, status, spent, code=code,
                      message=failed.error_message or f"A request of this item ended {failed.status.value}.")
            for other in rows:  # the rest of its stage is of no use now
                if not other.status.terminal:
                    cancel_requests(self.svc.requests, job.tenant_id, [other.id])
            return 0
        if item.final:
            self._end(item, ItemStatus.SUCCEEDED, spent, result=rows[0].output_text,
                      finish_reason=rows[0].finish_reason)
            return 0
        if stopping is not None or tenant is None:
            self._end(item, stopping or ItemStatus.CANCELLED, spent, code=(stopping or ItemStatus.CANCELLED).value,
                      message="The job stopped before this item's summary was complete.")
            return 0
        joined = "\n\n".join(r.output_text or "" for r in rows)
        outcome, _, made = self.start(item.job_id, item.line, job, tenant, joined, None, item.depth + 1,
                                      item.requests, spent=spent, custom_id=item.custom_id)
        return 0 if outcome in ("failed", "gone") else made

    def _stopping(self, job: Job) -> ItemStatus | None:
        if job.status in (JobStatus.CANCELLING, JobStatus.CANCELLED):
            return ItemStatus.CANCELLED
        if job.status == JobStatus.EXPIRED:
            return ItemStatus.EXPIRED
        return None

    def _end(self, item: Running, status: ItemStatus, spent: Spent, *, result: str | None = None,
             finish_reason: str | None = None, code: str | None = None, message: str | None = None) -> None:
        with self.db.session() as session:
            job_lifecycle.end(session, item.job_id, item.line, item.requests, status, spent=spent,
                              result=result, finish_reason=finish_reason, code=code, message=message)

    def create_missing(self, item: Running, job: Job, tenant: Tenant | None, missing: list[uuid.UUID]) -> None:
        """Create the stage requests the item names but that do not exist yet, with those ids."""
        if tenant is None or self._stopping(job) is not None:
            with self.db.session() as session:  # never created: nothing to wait for
                remaining = [rid for rid in item.requests if rid not in missing]
                session.execute(update(JobItem).where(JobItem.job_id == item.job_id, JobItem.line == item.line,
                                                      JobItem.requests == item.requests)
                                .values(requests=remaining))
            item.requests = remaining
            if not remaining:
                ended = self._stopping(job) or ItemStatus.CANCELLED
                self._end(item, ended, NOTHING, code=ended.value, message="The job stopped before this item ran.")
            return
        with self.db.session() as session:
            source = session.execute(select(JobItem.text, JobItem.result).where(
                JobItem.job_id == item.job_id, JobItem.line == item.line)).one()
        # Rebuilt from what the item keeps: its document at depth 0, else the joined summaries the
        # stage was planned from (``result`` holds them while the item runs).
        text_ = source.text if item.depth == 0 else source.result
        _, bodies = self.bodies.stage(job, tenant, item.line, item.custom_id, text_, item.body, item.depth)
        for rid, body in zip(item.requests, bodies, strict=False):
            if rid in missing:
                outcome = self._submit(tenant, rid, body, job.api_key_id)
                if outcome not in (None, "retry"):
                    self._end(item, ItemStatus.FAILED, NOTHING, code=outcome[0], message=outcome[1])
                    cancel_requests(self.svc.requests, job.tenant_id, [r for r in item.requests if r not in missing])
                    return
                if outcome == "retry":
                    return

    def start(self, job_id: uuid.UUID, line: int, job: Job, tenant: Tenant, text_: str | None,
              body: dict[str, Any] | None, depth: int, previous: list[uuid.UUID],
              spent: Spent = NOTHING, custom_id: str | None = None) -> tuple[str | None, int, int]:
        """Write the item's next stage (its request ids first), then create the requests.

        Returns (outcome, tokens reserved, requests made): outcome None when all were created,
        ``retry`` when admission paced them (they are created at a later tick), ``overloaded``
        when the platform refused, else the item failed."""
        final, bodies = self.bodies.stage(job, tenant, line, custom_id, text_, body, depth)
        ids = [uuid.uuid4() for _ in bodies]
        with self.db.session() as session:
            done = job_lifecycle.begin_stage(session, job_id, line, depth=depth, previous=previous, requests=ids,
                                             final=final, spent=spent, summarised=text_)
        if not done:
            return "gone", 0, 0
        tokens = 0
        for rid, request in zip(ids, bodies, strict=True):
            outcome = self._submit(tenant, rid, request, job.api_key_id)
            if outcome == "retry" or outcome == "overloaded":
                return outcome, tokens, len(ids)
            if outcome is not None:
                item = Running(job_id, line, custom_id, ids, depth, final, body)
                # begin_stage added the previous stage's tokens already
                self._end(item, ItemStatus.FAILED, NOTHING, code=outcome[0], message=outcome[1])
                cancel_requests(self.svc.requests, job.tenant_id, ids)
                return "failed", tokens, len(ids)
            tokens += estimate_text_tokens(request.get("prompt", "")) + request.get("max_tokens", 0)
        return None, tokens, len(ids)

    def _submit(self, tenant: Tenant, request_id: uuid.UUID, body: dict[str, Any], key: uuid.UUID | None):
        """Create one request through the submit pipeline, as usage of the job's ``key``. None:
        created; ``retry``: the tenant's limits paced it; ``overloaded``: the platform refused it;
        (code, message): it cannot run."""
        requests = self.svc.requests
        try:
            plan = dataclasses.replace(requests.prepare(tenant, body, Source.JOB, key), request_id=request_id)
            requests.submit(tenant, body, None, plan)
        except ApiError as exc:
            if exc.status == 429:
                return "retry"
            if exc.status == 503:
                return "overloaded"
            return exc.code, exc.message
        finally:
            current_request_id.set("-")  # the feeder's own lines are about no one request
        return None

    def guarded(self, job_id: uuid.UUID, line: int, step, *args, on_conflict=None, **kwargs):
        """Run one item's step; an unexpected error fails that item (logged), never the whole tick:
        a tick that failed on the same item every time would stop every job. A lock another
        writer held past the lock timeout is no error of the item's: the step's transaction rolled
        back, the item's rows still say where it stands, a later tick goes on from there, and this
        answers ``on_conflict``. Failing it lost an item to a cancel that was locking its job."""
        try:
            return step(*args, **kwargs)
        except OperationalError as exc:
            if not isinstance(exc.orig, _CONFLICTS):
                return self._failed(job_id, line)
            log.info("job item %s:%d: its row is locked by another writer (%s); retried at a later tick",
                     job_id, line, type(exc.orig).__name__)
            return on_conflict
        except Exception:
            return self._failed(job_id, line)

    def _failed(self, job_id: uuid.UUID, line: int) -> None:
        log.exception("job item %s:%d failed in the feeder", job_id, line)
        with self.db.session() as session:
            job_lifecycle.fail(session, job_id, line, "internal_error",
                               "Sluice could not run this item; the error was logged.")
