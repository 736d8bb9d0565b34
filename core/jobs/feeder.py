"""The bulk job feeder: moves job items from Postgres onto the queues as capacity frees up.

One feeder is active at a time (a Redis lease, like the load monitor's, in whose process it
runs); another stands by and takes over within a lease. Every ``SLUICE_FEEDER_INTERVAL_S`` the
leader:

1. reads the items in flight (``job_items`` that are ``running``: a bounded set) and the
   requests of their current stage. An item whose requests all ended moves on: its result, its
   failure, or its next map-reduce stage (the chunk summaries joined and summarised again, split
   again while they do not fit). A stage request that does not exist yet (a feeder died between
   writing its id on the item and creating it, or admission refused it a moment ago) is created
   now, with the id the item holds: no item is ever computed twice;
2. settles its jobs: expired past their window, cancelled once nothing runs, finalizing once
   every item was fed, completed once none runs;
3. unless the platform is degraded (any level above normal) or a peak reservation is in force,
   feeds: per model and priority, at most ``SLUICE_JOB_INFLIGHT_PER_WORKER`` requests queued or
   running per warm worker serving them, so Redis never holds more than that many of any job's
   messages. Tenants share that capacity in proportion to their ``batch_weight``, counted in the
   tokens each request reserves (start-time fair queueing: the next item is the one of the tenant
   that has used the least per unit of weight; a tenant that comes back starts level with the
   others, not with credit); a tenant's own jobs share its part the same way.

Every request goes through the same submit pipeline as one sent to the API (admission with the
tenant's limits, the hot cache and twins, the row, the publish): a tenant over its token rate is
paced by it, and the request is retried on worker loss like any other.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

from sqlalchemy import exists, func, select, text, update

from core.errors import ApiError
from core.fleet.lease import Lease, run_leading
from core.fleet.workers import live_workers
from core.jobs.service import STALE_UPLOAD_S, cancel_requests, chunk_budget, stop_items
from core.observe.logs import current_request_id
from core.rediskeys import FEEDER_STATE_KEY, PAUSED_KEY
from core.services import Services
from core.submit.tokens import estimate_text_tokens
from core.tenants.tiers import effective_limits
from models import InferenceRequest, Status, Tenant
from models.job import LIVE_JOB, ItemStatus, Job, JobItem, JobStatus
from models.reservation import active

log = logging.getLogger(__name__)

LEADER_KEY = "sluice:feeder:leader"
READ_RESERVATIONS_S = 5.0
STALE_CHECK_S = 60.0
FETCH = 32  # pending items read per job at a time
_REQUEST_COLUMNS = (InferenceRequest.id, InferenceRequest.status, InferenceRequest.output_text,
                    InferenceRequest.finish_reason, InferenceRequest.error_code, InferenceRequest.error_message,
                    InferenceRequest.input_tokens, InferenceRequest.output_tokens)


@dataclass
class _Running:
    job_id: uuid.UUID
    line: int
    custom_id: str | None
    requests: list[uuid.UUID]
    depth: int
    final: bool
    body: dict[str, Any] | None


class Feeder:
    def __init__(self, svc: Services, clock=time.monotonic) -> None:
        self.svc = svc
        self.settings = svc.settings
        self.db = svc.db
        self.redis = svc.redis
        self.clock = clock
        self.lease = Lease(svc.redis, LEADER_KEY, max(3.0, 6 * self.settings.feeder_interval_s))
        self.tenant_used: dict[uuid.UUID, float] = {}  # tokens fed ÷ weight, while the tenant has work
        self.job_used: dict[uuid.UUID, float] = {}
        self._pending: dict[uuid.UUID, deque] = {}  # job → lines read ahead
        self._reservations: tuple[float, bool] = (float("-inf"), False)
        self._stale_checked = float("-inf")
        self._left: dict[uuid.UUID, float | None] = {}

    # ------------------------------------------------------------------ the loop

    def lead(self) -> bool:
        return self.lease.hold()

    def run(self, stop: threading.Event) -> None:
        run_leading("job feeder", self.lease, self.tick, self.settings.feeder_interval_s, stop, self.clock,
                    on_change=lambda _: self._pending.clear())  # read-ahead lines may be stale by then

    def tick(self) -> dict[str, Any]:
        if self.clock() - self._stale_checked >= STALE_CHECK_S:
            self._fail_stale_uploads()
            self._stale_checked = self.clock()
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
                    self._guarded(item.job_id, item.line, self._create_missing, item, job,
                                  tenants.get(job.tenant_id), missing)
                continue
            next_stage = self._guarded(item.job_id, item.line, self._advance, item, job, tenants.get(job.tenant_id),
                                       rows)
            advanced += 1
            if next_stage:
                running_jobs.add(job.id)
                in_flight[(job.model, job.priority)] += next_stage
        self._settle(jobs, running_jobs)
        paused = self._paused()
        capacity = self._capacity()
        fed = 0
        if not paused:
            fed = self._feed([j for j in jobs.values() if j.status == JobStatus.IN_PROGRESS], tenants, capacity,
                             in_flight)
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
        """Jobs being fed or finished, and (in ``_left``) the seconds left in each one's window."""
        with self.db.session() as session:
            rows = session.execute(select(Job, func.extract("epoch", Job.expires_at - func.now()))
                                   .where(Job.status.in_(LIVE_JOB))).all()
        self._left = {job.id: None if left is None else float(left) for job, left in rows}
        return {job.id: job for job, _ in rows}

    def _job(self, job_id: uuid.UUID) -> Job | None:
        with self.db.session() as session:
            return session.get(Job, job_id)

    def _tenants(self, ids: set[uuid.UUID]) -> dict[uuid.UUID, Tenant]:
        if not ids:
            return {}
        with self.db.session() as session:
            return {t.id: t for t in session.scalars(select(Tenant).where(Tenant.id.in_(ids)))}

    def _running(self) -> list[_Running]:
        with self.db.session() as session:
            rows = session.execute(select(JobItem.job_id, JobItem.line, JobItem.custom_id, JobItem.requests,
                                          JobItem.depth, JobItem.final, JobItem.body)
                                   .where(JobItem.status == ItemStatus.RUNNING)).all()
        return [_Running(*row) for row in rows]

    def _states(self, ids: list[uuid.UUID]) -> dict[uuid.UUID, Any]:
        if not ids:
            return {}
        with self.db.session() as session:
            return {row.id: row for row in session.execute(
                select(*_REQUEST_COLUMNS).where(InferenceRequest.id.in_(ids)))}

    def _paused(self) -> str | None:
        """Why feeding stops now: the platform is degraded, or a peak reservation is in force."""
        level, _ = self.svc.requests.ladder.reader.current()  # the level admission applies (a stale one: 0)
        if level > 0:
            return f"degradation level {int(level)}"
        read_at, in_force = self._reservations
        if self.clock() - read_at >= READ_RESERVATIONS_S:
            try:
                with self.db.session() as session:
                    in_force = bool(active(session))
                self._reservations = (self.clock(), in_force)
            except Exception:
                log.warning("reservations not read; keeping the last known", exc_info=True)
        return "peak reservation in force" if in_force else None

    def _capacity(self) -> dict[tuple[str, str], int]:
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

    # ------------------------------------------------------------------ items in flight

    def _advance(self, item: _Running, job: Job, tenant: Tenant | None, rows: list[Any]) -> int:
        """Every request of the item's stage ended: record the outcome, or start the next stage
        (how many requests that stage has in flight; 0 when the item ended)."""
        spent_in = sum(r.input_tokens or 0 for r in rows)
        spent_out = sum(r.output_tokens or 0 for r in rows)
        failed = next((r for r in rows if r.status != Status.SUCCEEDED), None)
        stopping = self._stopping(job)
        if failed is not None:
            status = {Status.CANCELLED: ItemStatus.CANCELLED, Status.EXPIRED: ItemStatus.EXPIRED}.get(
                failed.status, ItemStatus.FAILED)
            if stopping is not None and status == ItemStatus.CANCELLED:
                status = stopping
            self._end(item, status, spent_in, spent_out, code=failed.error_code or failed.status.value,
                      message=failed.error_message or f"A request of this item ended {failed.status.value}.")
            for other in rows:  # the rest of its stage is of no use now
                if not other.status.terminal:
                    cancel_requests(self.svc.requests, job.tenant_id, [other.id])
            return 0
        if item.final:
            self._end(item, ItemStatus.SUCCEEDED, spent_in, spent_out, result=rows[0].output_text,
                      finish_reason=rows[0].finish_reason)
            return 0
        if stopping is not None or tenant is None:
            self._end(item, stopping or ItemStatus.CANCELLED, spent_in, spent_out, code="cancelled",
                      message="The job stopped before this item's summary was complete.")
            return 0
        joined = "\n\n".join(r.output_text or "" for r in rows)
        outcome, _, made = self._start(item.job_id, item.line, job, tenant, joined, None, item.depth + 1,
                                       item.requests, spent=(spent_in, spent_out), custom_id=item.custom_id)
        return 0 if outcome in ("failed", "gone") else made

    def _stopping(self, job: Job) -> ItemStatus | None:
        if job.status in (JobStatus.CANCELLING, JobStatus.CANCELLED):
            return ItemStatus.CANCELLED
        if job.status == JobStatus.EXPIRED:
            return ItemStatus.EXPIRED
        return None

    def _end(self, item: _Running, status: ItemStatus, spent_in: int, spent_out: int, *, result: str | None = None,
             finish_reason: str | None = None, code: str | None = None, message: str | None = None) -> None:
        with self.db.session() as session:
            session.execute(update(JobItem).where(
                JobItem.job_id == item.job_id, JobItem.line == item.line, JobItem.status == ItemStatus.RUNNING,
                JobItem.requests == item.requests).values(
                status=status, result=result, finish_reason=finish_reason, error_code=code,
                error_message=(message or "")[:500] or None, finished_at=func.now(),
                input_tokens=JobItem.input_tokens + spent_in, output_tokens=JobItem.output_tokens + spent_out,
                text=None if status == ItemStatus.SUCCEEDED else JobItem.text))

    def _create_missing(self, item: _Running, job: Job, tenant: Tenant | None, missing: list[uuid.UUID]) -> None:
        """Create the stage requests the item names but that do not exist yet, with those ids."""
        if tenant is None or self._stopping(job) is not None:
            with self.db.session() as session:  # never created: nothing to wait for
                remaining = [rid for rid in item.requests if rid not in missing]
                session.execute(update(JobItem).where(JobItem.job_id == item.job_id, JobItem.line == item.line,
                                                      JobItem.requests == item.requests)
                                .values(requests=remaining))
            item.requests = remaining
            if not remaining:
                self._end(item, self._stopping(job) or ItemStatus.CANCELLED, 0, 0, code="cancelled",
                          message="The job stopped before this item ran.")
            return
        with self.db.session() as session:
            source = session.execute(select(JobItem.text, JobItem.result).where(
                JobItem.job_id == item.job_id, JobItem.line == item.line)).one()
        # Rebuilt from what the item keeps: its document at depth 0, else the joined summaries the
        # stage was planned from (``result`` holds them while the item runs).
        text_ = source.text if item.depth == 0 else source.result
        _, bodies = self._stage(job, tenant, item.line, item.custom_id, text_, item.body, item.depth)
        for rid, body in zip(item.requests, bodies, strict=False):
            if rid in missing:
                outcome = self._submit(tenant, rid, body)
                if outcome not in (None, "retry"):
                    self._end(item, ItemStatus.FAILED, 0, 0, code=outcome[0], message=outcome[1])
                    cancel_requests(self.svc.requests, job.tenant_id, [r for r in item.requests if r not in missing])
                    return
                if outcome == "retry":
                    return

    def _stage(self, job: Job, tenant: Tenant, line: int, custom_id: str | None, text_: str | None,
               body: dict[str, Any] | None, depth: int) -> tuple[bool, list[dict[str, Any]]]:
        """(final, request bodies) of an item's stage: an OpenAI line's one request as it is, or the
        summaries of ``text_`` (the document, or the joined summaries of the stage before)."""
        if body is not None:
            return True, [self._openai_body(job, body)]
        final, prompts = self._plan(job, tenant, text_ or "")
        return final, [self._document_body(job, line, custom_id, p, depth, i, len(prompts))
                       for i, p in enumerate(prompts)]

    # ------------------------------------------------------------------ starting a stage

    def _plan(self, job: Job, tenant: Tenant, text_: str) -> tuple[bool, list[str]]:
        """(final, prompts) for summarising ``text_``: one prompt when it fits a request with the
        instruction and the summary, else one per chunk, cut on the model's token boundaries."""
        model = self.settings.registry.get(job.model) or self.settings.registry.default
        counter = self.svc.requests.planner.counters.for_model(model)
        instruction_tokens = counter.count({"prompt": job.instruction})
        limits = effective_limits(self.settings.tiers, self.settings.default_tier, tenant)
        budget = chunk_budget(model.context_tokens, limits.max_request_tokens, instruction_tokens, job.summary_tokens)
        if counter.count({"prompt": text_}) <= budget:
            return True, [_prompt(job, text_)]
        return False, [_prompt(job, piece) for piece in counter.split(text_, budget)]

    def _document_body(self, job: Job, line: int, custom_id: str | None, prompt: str, depth: int, index: int,
                       of: int) -> dict[str, Any]:
        return {"prompt": prompt, "max_tokens": job.summary_tokens, "priority": job.priority, "model": job.model,
                "temperature": 0.0, "deadline_s": self._deadline_s(job),
                "metadata": {"job_id": str(job.id), "line": str(line), "custom_id": custom_id or "",
                             "stage": f"depth {depth}, part {index + 1} of {of}"}}

    def _openai_body(self, job: Job, body: dict[str, Any]) -> dict[str, Any]:
        request: dict[str, Any] = {"priority": job.priority, "model": body.get("model", job.model),
                                   "deadline_s": self._deadline_s(job), "metadata": {"job_id": str(job.id)}}
        if "messages" in body:
            request["messages"] = [{"role": "system" if m["role"] == "developer" else m["role"],
                                    "content": m["content"]} for m in body["messages"]]
        else:
            request["prompt"] = body["prompt"]
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None:
            request["max_tokens"] = min(max(1, limit), self.settings.max_output_tokens)
        for name in ("temperature", "top_p", "seed"):
            if name in body:
                request[name] = body[name]
        if "stop" in body:
            request["stop"] = [body["stop"]] if isinstance(body["stop"], str) else list(body["stop"])
        return request

    def _deadline_s(self, job: Job) -> float:
        """A job's requests must start before its window ends (the request's deadline)."""
        left = self._left.get(job.id)
        return float(job.completion_window_s) if left is None else max(1.0, left)

    def _start(self, job_id: uuid.UUID, line: int, job: Job, tenant: Tenant, text_: str | None,
               body: dict[str, Any] | None, depth: int, previous: list[uuid.UUID],
               spent: tuple[int, int] = (0, 0), custom_id: str | None = None) -> tuple[str | None, int, int]:
        """Write the item's next stage (its request ids first), then create the requests.

        Returns (outcome, tokens reserved, requests made): outcome None when all were created,
        ``retry`` when admission paced them (they are created at a later tick), ``overloaded``
        when the platform refused, else the item failed."""
        final, bodies = self._stage(job, tenant, line, custom_id, text_, body, depth)
        ids = [uuid.uuid4() for _ in bodies]
        source_state = ItemStatus.PENDING if depth == 0 and not previous else ItemStatus.RUNNING
        values: dict[str, Any] = {"status": ItemStatus.RUNNING, "requests": ids, "depth": depth, "final": final,
                                  "request_count": JobItem.request_count + len(ids),
                                  "input_tokens": JobItem.input_tokens + spent[0],
                                  "output_tokens": JobItem.output_tokens + spent[1]}
        if depth == 0:
            values.update(chunks=len(ids), started_at=func.now())
        else:
            values["result"] = text_  # the joined summaries this stage summarises, until it ends
        with self.db.session() as session:
            done = session.execute(update(JobItem).where(
                JobItem.job_id == job_id, JobItem.line == line, JobItem.status == source_state,
                *((JobItem.requests == previous),) if previous else ()).values(**values)).rowcount
        if not done:
            return "gone", 0, 0
        tokens = 0
        for rid, request in zip(ids, bodies, strict=True):
            outcome = self._submit(tenant, rid, request)
            if outcome == "retry" or outcome == "overloaded":
                return outcome, tokens, len(ids)
            if outcome is not None:
                item = _Running(job_id, line, custom_id, ids, depth, final, body)
                self._end(item, ItemStatus.FAILED, *spent, code=outcome[0], message=outcome[1])
                cancel_requests(self.svc.requests, job.tenant_id, ids)
                return "failed", tokens, len(ids)
            tokens += estimate_text_tokens(request.get("prompt", "")) + request.get("max_tokens", 0)
        return None, tokens, len(ids)

    def _submit(self, tenant: Tenant, request_id: uuid.UUID, body: dict[str, Any]):
        """Create one request through the submit pipeline. None: created; ``retry``: the tenant's
        limits paced it; ``overloaded``: the platform refused it; (code, message): it cannot run."""
        requests = self.svc.requests
        try:
            plan = dataclasses.replace(requests.prepare(tenant, body), request_id=request_id)
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

    def _guarded(self, job_id: uuid.UUID, line: int, step, *args, **kwargs):
        """Run one item's step; an unexpected error fails that item (logged), never the whole tick:
        a tick that failed on the same item every time would stop every job."""
        try:
            return step(*args, **kwargs)
        except Exception:
            log.exception("job item %s:%d failed in the feeder", job_id, line)
            with self.db.session() as session:
                session.execute(update(JobItem).where(
                    JobItem.job_id == job_id, JobItem.line == line,
                    JobItem.status.in_((ItemStatus.PENDING, ItemStatus.RUNNING))).values(
                    status=ItemStatus.FAILED, finished_at=func.now(), error_code="internal_error",
                    error_message="Sluice could not run this item; the error was logged."))
            return None

    # ------------------------------------------------------------------ feeding

    def _feed(self, jobs: list[Job], tenants: dict[uuid.UUID, Tenant], capacity: dict[tuple[str, str], int],
              in_flight: dict[tuple[str, str], int]) -> int:
        free = {key: capacity.get(key, 0) - in_flight.get(key, 0) for key in capacity}
        by_tenant: dict[uuid.UUID, list[Job]] = defaultdict(list)
        for job in jobs:
            tenant = tenants.get(job.tenant_id)
            if tenant is not None and tenant.disabled_at is None:  # a disabled tenant's jobs wait
                by_tenant[job.tenant_id].append(job)
        self._level(self.tenant_used, set(by_tenant))
        self._level(self.job_used, {j.id for j in jobs})
        for job_id in list(self._pending):
            if job_id not in self.job_used:
                del self._pending[job_id]
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
            job = min(open_jobs[tenant_id], key=lambda j: self.job_used[j.id])
            item = self._next_item(job)
            if item is None:
                exhausted.add(job.id)
                continue
            line, custom_id, text_, body = item
            outcome, tokens, made = self._guarded(job.id, line, self._start, job.id, line, job, tenants[tenant_id],
                                                  text_, body, 0, [], custom_id=custom_id) or ("failed", 0, 1)
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
        queue = self._pending.setdefault(job.id, deque())
        if not queue:
            with self.db.session() as session:
                queue.extend(session.execute(
                    select(JobItem.line, JobItem.custom_id, JobItem.text, JobItem.body)
                    .where(JobItem.job_id == job.id, JobItem.status == ItemStatus.PENDING)
                    .order_by(JobItem.line).limit(FETCH)).all())
        return queue.popleft() if queue else None

    # ------------------------------------------------------------------ settling jobs

    def _settle(self, jobs: dict[uuid.UUID, Job], running_jobs: set[uuid.UUID]) -> None:
        for job in jobs.values():
            if job.status in (JobStatus.IN_PROGRESS, JobStatus.FINALIZING) and self._past_window(job):
                self._expire(job)
            elif job.status == JobStatus.CANCELLING and job.id not in running_jobs:
                self._finish(job, JobStatus.CANCELLED)
            elif job.status == JobStatus.IN_PROGRESS and not self._has_pending(job):
                status = JobStatus.FINALIZING if job.id in running_jobs else self._outcome(job)
                self._finish(job, status)
            elif job.status == JobStatus.FINALIZING and job.id not in running_jobs:
                self._finish(job, self._outcome(job))

    def _past_window(self, job: Job) -> bool:
        left = self._left.get(job.id)
        return left is not None and left <= 0

    def _has_pending(self, job: Job) -> bool:
        if self._pending.get(job.id):
            return True
        with self.db.session() as session:
            return bool(session.scalar(select(exists().where(JobItem.job_id == job.id,
                                                             JobItem.status == ItemStatus.PENDING))))

    def _outcome(self, job: Job) -> JobStatus:
        with self.db.session() as session:
            any_success = session.scalar(select(exists().where(JobItem.job_id == job.id,
                                                               JobItem.status == ItemStatus.SUCCEEDED)))
        return JobStatus.COMPLETED if any_success else JobStatus.FAILED

    def _finish(self, job: Job, status: JobStatus) -> None:
        values: dict[str, Any] = {"status": status}
        if status.terminal:
            values["finished_at"] = func.now()
        if status == JobStatus.FAILED:
            values.update(error_code="no_item_succeeded", error_message="Every item of the job failed; see /errors.")
        with self.db.session() as session:
            session.execute(update(Job).where(Job.id == job.id, Job.status == job.status).values(**values))
        job.status = status
        log.info("job %s %s", job.id, status.value)

    def _expire(self, job: Job) -> None:
        """Past its window: unfinished items expire (running ones once their requests are stopped),
        finished ones stay."""
        with self.db.session() as session:
            done = session.execute(update(Job).where(Job.id == job.id, Job.status == job.status).values(
                status=JobStatus.EXPIRED, finished_at=func.now(), error_code="expired",
                error_message="The completion window passed; unfinished items expired.")).rowcount
            if not done:
                return
            in_flight = stop_items(session, job.id, ItemStatus.EXPIRED, "expired",
                                   "The job's completion window passed before this item ran.")
        job.status = JobStatus.EXPIRED
        self._pending.pop(job.id, None)
        cancel_requests(self.svc.requests, job.tenant_id, in_flight)
        log.info("job %s expired; %d requests in flight cancelled", job.id, len(in_flight))

    def _fail_stale_uploads(self) -> None:
        with self.db.session() as session:
            session.execute(text("""
                UPDATE jobs SET status = 'failed', finished_at = now(), error_code = 'upload_interrupted',
                       error_message = 'The upload never finished (the web process handling it stopped).'
                WHERE status = 'validating' AND created_at < now() - make_interval(secs => :stale)"""),
                            {"stale": STALE_UPLOAD_S})


def _prompt(job: Job, text_: str) -> str:
    return f"{job.instruction}\n\n{text_}"


__all__ = ["Feeder", "LEADER_KEY"]
