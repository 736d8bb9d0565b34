"""Submitting a bulk job: its upload read into items, or refused with nothing kept.

A submit is checked against the tenant's standing first (:func:`check_standing`: its open jobs
and stored items), then writes the job row (``validating``, so a long upload shows), then reads
the upload, already spooled to local storage by the web tier, into its items in one transaction
(``core/jobs/ingest.py``). A refused upload (too large, bad lines when the caller refuses those,
no valid line, over the tenant's token budget with its other open jobs, over its stored items)
rolls the items back and deletes the job row: nothing half-written stays.

The items go in through COPY, a new statement every ``COPY_CHUNK_S`` seconds (or ``COPY_CHUNK_ROWS``
rows), so that no statement runs longer than a small share of the connection's statement timeout
whatever the file's size (a million-line file in one COPY, parsed as it went and with its per-row
foreign-key check, ran into the 15 s timeout). The statements that work on the whole job at once
(the duplicate check, the admission) get a budget of their own that grows with the job
(``SET LOCAL statement_timeout``).

A web process that dies while it reads the file leaves a ``validating`` job with no items, which the feeder fails
(``upload_interrupted``) after ``STALE_UPLOAD_S`` (``core/jobs/settle.py``). A job cancelled
while its file is read keeps the cancel: its lines are dropped, and it ends ``cancelled``.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import IO, Any

from sqlalchemy import delete, func, select, text

from core.admission.load import ClassLoad
from core.errors import ApiError, InvalidRequest
from core.jobs import estimate, ingest
from core.jobs.params import PROMPT_MARGIN_TOKENS, JobParams, chunk_budget, human
from core.observe.logs import bind_request
from core.settings import Settings
from core.submit.tokens import estimate_text_tokens
from core.tenants.tiers import effective_limits
from core.usage.budgets import Budgets
from models import Priority, Tenant, job_lifecycle
from models.job import LIVE_JOB, ItemStatus, Job, JobItem, JobStatus
from models.session import Database

log = logging.getLogger(__name__)

JSONL_TYPES = ("application/jsonl", "application/x-ndjson", "application/x-jsonlines", "application/json-lines",
               "application/jsonlines", "text/jsonl")
# An upload still ``validating`` this long after its job was created has no process reading it.
STALE_UPLOAD_S = 3600
# A COPY statement is open while this process parses the lines it carries (~10 µs a line of a few
# hundred bytes here, far more for long documents), so it ends after this many seconds or rows,
# whichever comes first: a small share of the 15 s statement timeout every connection has
# (models/session.py), however slow the parsing.
COPY_CHUNK_S = 2.0
COPY_CHUNK_ROWS = 50_000
# The statements over a whole job's items: the connection's timeout, and this much more per line.
BASE_STATEMENT_MS = 15_000
WHOLE_JOB_MS_PER_ITEM = 0.1
# When to ask again after a refusal for too many unfinished jobs or stored lines.
OPEN_JOBS_RETRY_S = 60


class _NotValidating(Exception):
    """The job left ``validating`` while its file was read: cancelled, or failed as a stale upload."""


def submit(settings: Settings, db: Database, tenant: Tenant, params: JobParams, stream: IO[bytes],
           loads: Callable[[], list[ClassLoad]] = list, lessons: estimate.Lessons | None = None) -> uuid.UUID:
    """Create the job and read ``stream`` into its items; the job's id. Raises the refusal (the
    job row deleted, no item kept) when the file is refused. ``loads``: the monitor's figures for
    every class (``ClassLoad.read_all``), which the job's estimated finish is worked out from;
    ``lessons``: what the jobs that finished taught each model's estimates (``estimate.Lessons``)."""
    job = Job(id=uuid.uuid4(), tenant_id=tenant.id, status=JobStatus.VALIDATING, model=params.model,
              priority=params.priority, service_tier=params.service_tier, instruction=params.instruction,
              summary_tokens=params.summary_tokens,
              completion_window_s=params.completion_window_s, meta=params.metadata,
              webhook_url=params.webhook_url, webhook_events=list(params.webhook_events) or None,
              api_key_id=tenant.via_key)
    with db.session() as session:
        session.add(job)
    bind_request(str(job.id))
    try:
        tally = _load(settings, db, tenant, job, params, stream, loads, lessons or estimate.Lessons(None))
    except _NotValidating:
        log.info("job cancelled or failed while its file was read; its lines were dropped")
        return job.id
    except BaseException:
        with db.session() as session:
            session.execute(delete(Job).where(Job.id == job.id))
        raise
    log.info("job accepted: %d items, %d invalid lines, %d bytes, ~%d tokens; slowest COPY %.2f s of %.0f s, "
             "duplicate check %.2f s of %.0f s", tally.valid, tally.invalid, tally.bytes, job.estimated_tokens,
             tally.timings["slowest_copy_s"], BASE_STATEMENT_MS / 1000, tally.timings["duplicates_s"],
             tally.timings["whole_job_budget_s"])
    return job.id


def _load(settings: Settings, db: Database, tenant: Tenant, job: Job, params: JobParams, stream: IO[bytes],
          loads: Callable[[], list[ClassLoad]], lessons: estimate.Lessons) -> ingest.Tally:
    """COPY the upload's lines into the job's items, refuse the file or admit the job, in one transaction."""
    model = settings.registry.get(params.model)
    assert model is not None
    limits = effective_limits(settings.tiers, settings.default_tier, tenant)
    overhead = estimate_text_tokens(params.instruction) + PROMPT_MARGIN_TOKENS
    budget = chunk_budget(model.context_tokens, limits.max_request_tokens, overhead - PROMPT_MARGIN_TOKENS,
                          params.summary_tokens)
    served = {m.name for m in settings.registry.models}
    tally, priced, work = ingest.Tally(), 0, estimate.Work()
    with db.session() as session:
        conn = session.connection().connection.driver_connection
        with _ChunkedCopy(conn) as copy:
            for number, raw in ingest.lines(stream, settings.job_max_bytes, settings.job_max_line_bytes, tally):
                tally.lines += 1
                if tally.lines > settings.job_max_items:
                    raise ApiError(f"The file has more than {settings.job_max_items} lines, the most one job "
                                   "takes (SLUICE_JOB_MAX_ITEMS); split it.", code="too_many_lines", status=413)
                if raw is None:
                    error = ingest.LineError("line_too_long", f"The line is longer than "
                                             f"{settings.job_max_line_bytes} bytes (SLUICE_JOB_MAX_LINE_BYTES).")
                    custom_id = None
                else:
                    try:
                        custom_id, doc, body, tokens = ingest.parse(raw, served)
                        error = _off_endpoint(body, params.endpoint)
                    except ingest.LineError as exc:
                        error, custom_id = exc, None
                if error is not None:
                    tally.error(number, custom_id, error.code, error.message)
                    copy.write_row(ingest.copy_row(job.id, number, custom_id, ItemStatus.INVALID, None, None, 0,
                                                   error.code, error.message))
                    continue
                tally.valid += 1
                tally.input_tokens += tokens
                if body is None:
                    priced += ingest.item_tokens(tokens, overhead, params.summary_tokens, budget)
                    work.document(tokens, overhead, params.summary_tokens, budget)
                else:
                    output = body.get("max_completion_tokens", body.get("max_tokens", settings.default_max_tokens))
                    priced += tokens + output
                    work.add(tokens, output)
                copy.write_row(ingest.copy_row(job.id, number, custom_id, ItemStatus.PENDING, doc, body, tokens))
        whole_ms = _whole_job_budget_ms(tally.lines)
        session.execute(text(f"SET LOCAL statement_timeout = {whole_ms}"))
        began = time.monotonic()
        duplicates = job_lifecycle.invalidate_duplicates(session, job.id)
        tally.timings = {"slowest_copy_s": copy.slowest_s, "duplicates_s": time.monotonic() - began,
                         "whole_job_budget_s": whole_ms / 1000}
        for line, custom_id, first in duplicates:
            tally.valid -= 1
            tally.error(line, custom_id, "duplicate_custom_id", f"custom_id first appears on line {first}.")
        _refuse_bad_file(tally, params)
        # One tenant's intakes judged one at a time from here to their commit: two files sent at once
        # cannot both fit in what is left of its budget and storage.
        session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"),
                        {"key": f"job-intake:{tenant.id}"})
        others = _standing(session, tenant.id, excluding=job.id)
        _refuse_over_storage(settings, others, tally.lines)
        _refuse_over_budget(tally, priced, others.open_tokens, params, limits)
        # A hard budget that cannot hold this job's estimate (its input, and every output token it
        # may ask for at its model's price for its tier) refuses it now rather than line by line later.
        price = settings.price_for(params.model, params.service_tier)
        Budgets(db).covers(tenant.id, tenant.via_key, priced,
                           price.cost(tally.input_tokens, 0, max(priced - tally.input_tokens, 0)),
                           queued=_queued(session, settings, tenant.id, job.id))
        finish_s = _estimate(session, settings, params, tenant, job.id, work, priced, loads, lessons)
        if finish_s is not None and finish_s > params.completion_window_s:
            earliest = estimate.window_text(finish_s)
            raise ApiError(
                f"This job would finish in about {human(finish_s)} ({finish_s:.0f} s) at the platform's present "
                f"load, after its {human(params.completion_window_s)} window ends; the earliest window it could keep "
                f"is {earliest}. "
                "Send it with a longer completion_window, or later.", code="completion_window_too_short", status=422,
                details={"estimated_finish_s": round(finish_s), "completion_window_s": params.completion_window_s,
                         "earliest_window": earliest, "items": tally.valid, "estimated_tokens": priced})
        if not job_lifecycle.admit(session, job.id, params.completion_window_s, total_items=tally.valid,
                                   invalid_lines=tally.invalid, input_bytes=tally.bytes, estimated_tokens=priced,
                                   estimated_finish_s=finish_s):
            raise _NotValidating  # its lines roll back; the job stays as the cancel (or stale check) left it
    job.estimated_tokens = priced
    return tally


class _ChunkedCopy:
    """``COPY job_items FROM STDIN``, ended and begun again every ``COPY_CHUNK_S`` or ``COPY_CHUNK_ROWS``."""

    def __init__(self, conn) -> None:
        self._cursor = conn.cursor()
        self._manager = None  # the cursor's copy() context, while a COPY is open
        self._copy = None
        self._rows = 0
        self._began = 0.0
        self.slowest_s = 0.0  # the longest one COPY statement took

    def __enter__(self) -> _ChunkedCopy:
        return self

    def write_row(self, row: tuple) -> None:
        if self._copy is None:
            self._began = time.monotonic()
            self._manager = self._cursor.copy(f"COPY job_items ({', '.join(ingest.COPY_COLUMNS)}) FROM STDIN")
            self._copy = self._manager.__enter__()
            self._copy.set_types(list(ingest.COPY_TYPES))
        self._copy.write_row(row)
        self._rows += 1
        if self._rows >= COPY_CHUNK_ROWS or time.monotonic() - self._began >= COPY_CHUNK_S:
            self._end(None, None, None)

    def _end(self, *exc_info) -> None:
        manager, self._manager, self._copy, self._rows = self._manager, None, None, 0
        if manager is not None:
            manager.__exit__(*exc_info)
            self.slowest_s = max(self.slowest_s, time.monotonic() - self._began)

    def __exit__(self, *exc_info) -> None:
        self._end(*exc_info)
        self._cursor.close()


def _whole_job_budget_ms(lines: int) -> int:
    """The statement timeout of the statements over a whole job's items: the connection's own
    for a small job, and ``WHOLE_JOB_MS_PER_ITEM`` more for each line (a margin of several times
    over what a million lines took here)."""
    return int(BASE_STATEMENT_MS + WHOLE_JOB_MS_PER_ITEM * lines)


@dataclass(frozen=True)
class Standing:
    """What a tenant already has: its unfinished jobs, their estimated tokens, its stored lines."""

    open_jobs: int
    open_tokens: int
    stored_items: int


def _estimate(session, settings: Settings, params: JobParams, tenant: Tenant, job_id: uuid.UUID,
              work: estimate.Work, priced: int, loads: Callable[[], list[ClassLoad]],
              lessons: estimate.Lessons) -> float | None:
    """Seconds until the job would finish (``core/jobs/estimate.py``); None where the platform has
    no figures for its model's classes, or for a job whose lines run as realtime."""
    if params.priority != Priority.BATCH:
        return None
    try:
        found = {(c.priority, c.model): c for c in loads()}
    except Exception:  # Redis away: no figures, no estimate; the tenant's limits still judge the job
        log.warning("no load figures for the job's estimate", exc_info=True)
        return None
    batch, realtime = found.get(("batch", params.model)), found.get(("realtime", params.model))
    if batch is None:
        return None
    def items(status: ItemStatus):  # each count reads its status's partial index (models/job.py)
        return select(func.count()).where(JobItem.job_id == Job.id, JobItem.status == status) \
            .correlate(Job).scalar_subquery()

    # Each job's place in its tenant's line: its promise, else its window's end (the feeder's key).
    due = func.extract("epoch", func.coalesce(Job.estimated_finish_at, Job.expires_at) - func.now())
    rows = session.execute(
        select(Job.tenant_id, due, Job.estimated_tokens, Job.total_items, items(ItemStatus.PENDING),
               items(ItemStatus.RUNNING), Tenant.batch_weight)
        .join(Tenant, Tenant.id == Job.tenant_id)
        .where(Job.id != job_id, Job.model == params.model, Job.priority == Priority.BATCH,
               Job.status.in_(LIVE_JOB), Tenant.disabled_at.is_(None))).all()
    # The tenant's own jobs make its line; other tenants share the engines with it by weight. What
    # the feeder already put in the queues or the engines, any tenant's, is ahead of every job.
    line, others, in_flight, in_flight_requests = [], {}, 0.0, 0
    for tenant_id, due_s, tokens, count, pending, running, weight in rows:
        per_item = (tokens or 0) / count if count else 0.0
        remaining = per_item * pending
        in_flight += per_item * running
        in_flight_requests += running
        if tenant_id != tenant.id:
            theirs, _ = others.get(tenant_id, (0.0, 1.0))
            others[tenant_id] = (theirs + remaining, float(weight or 1.0))
        elif remaining > 0:
            line.append((float(due_s) if due_s is not None else math.inf, remaining))
    factor = lessons.factor(params.model)
    plan = estimate.capacity(work, batch, realtime, tokens=priced, weight=float(tenant.batch_weight or 1.0),
                             others=[estimate.Tenant(t, w) for t, w in others.values()],
                             overhead_s=4 * settings.feeder_interval_s, calibration=factor, in_flight=in_flight,
                             in_flight_requests=in_flight_requests)
    if plan is None:
        return None
    finish = estimate.place(plan, priced, line)
    if not plan.measured:
        lessons.mark_idle_priced(job_id, params.completion_window_s)
    log.info("job %s estimated to finish in %.0f s: %d tokens at %.2g s each, share %.2f, %.1f s ahead (%.0f "
             "tokens in flight), its chain %.1f s, %d of the tenant's jobs in line, %d other tenants (batch "
             "class: busy %.1f, claimed %.1f, drain %.1f tokens/s; calibration %.2f)", job_id, finish, priced,
             plan.per_token_s, plan.share, plan.ahead_s, in_flight, plan.floor_s, len(line), len(others),
             batch.busy_tps, batch.claimed_tps, batch.drain_tps, factor)
    return finish


def _standing(session, tenant_id: uuid.UUID, excluding: uuid.UUID | None = None) -> Standing:
    open_ = Job.status.in_((JobStatus.VALIDATING, *LIVE_JOB))
    others = (Job.tenant_id == tenant_id, *(() if excluding is None else (Job.id != excluding,)))
    row = session.execute(select(
        func.count().filter(open_),
        func.coalesce(func.sum(Job.estimated_tokens).filter(open_), 0),
        func.coalesce(func.sum(Job.total_items + Job.invalid_lines).filter(Job.redacted_at.is_(None)), 0),
    ).where(*others)).one()
    return Standing(int(row[0]), int(row[1]), int(row[2]))


def _queued(session, settings: Settings, tenant_id: uuid.UUID, excluding: uuid.UUID
            ) -> list[tuple[uuid.UUID | None, int, Decimal]]:
    """What the tenant's other unfinished jobs still hold for a hard budget: for each, (its key,
    its estimate's share of the items not started yet, that priced as output at its model's batch
    price: the most it may cost). Items running or ended are in the budget's own figures already
    (requests in flight, rollups)."""
    pending = (select(func.count()).where(JobItem.job_id == Job.id, JobItem.status == ItemStatus.PENDING)
               .correlate(Job).scalar_subquery())
    rows = session.execute(select(Job.api_key_id, Job.model, Job.service_tier, Job.estimated_tokens, Job.total_items,
                                  pending).where(
        Job.tenant_id == tenant_id, Job.id != excluding, Job.status.in_(LIVE_JOB))).all()
    queued = []
    for key, model, tier, estimated, items, waiting in rows:
        tokens = int(estimated * waiting / items) if items else 0
        if tokens:
            queued.append((key, tokens, settings.price_for(model, tier).cost(0, 0, tokens)))
    return queued


def check_standing(settings: Settings, db: Database, tenant: Tenant) -> None:
    """Refuse a new job before its file is read when the tenant already has as many unfinished
    jobs as it may (``SLUICE_JOB_MAX_OPEN_PER_TENANT``) or stores as many lines as it may
    (``SLUICE_JOB_MAX_STORED_ITEMS_PER_TENANT``)."""
    with db.session() as session:
        standing = _standing(session, tenant.id)
    if standing.open_jobs >= settings.job_max_open_per_tenant:
        raise ApiError(f"You have {standing.open_jobs} unfinished jobs, the most a tenant may have "
                       f"(SLUICE_JOB_MAX_OPEN_PER_TENANT); submit this one when one of them ends.",
                       code="too_many_open_jobs", status=429, headers={"Retry-After": str(OPEN_JOBS_RETRY_S)},
                       details={"open_jobs": standing.open_jobs, "limit": settings.job_max_open_per_tenant})
    _refuse_over_storage(settings, standing, 0)


def _refuse_over_storage(settings: Settings, standing: Standing, lines: int) -> None:
    cap = settings.job_max_stored_items_per_tenant
    if standing.stored_items + max(lines, 1) > cap:
        raise ApiError(f"Your jobs store {standing.stored_items} lines; with {lines or 'this'} more that is over "
                       f"the {cap} a tenant may keep (SLUICE_JOB_MAX_STORED_ITEMS_PER_TENANT) until retention "
                       "removes finished jobs.", code="job_storage_full", status=429,
                       headers={"Retry-After": str(OPEN_JOBS_RETRY_S)},
                       details={"stored_items": standing.stored_items, "lines": lines, "limit": cap})


def _refuse_bad_file(tally: ingest.Tally, params: JobParams) -> None:
    if tally.lines == 0:
        raise InvalidRequest("The file is empty: send one JSON object per line.", code="empty_file")
    details = {"invalid_lines": tally.invalid, "lines": sorted(tally.errors, key=lambda e: e["line"])}
    if tally.valid == 0:
        raise InvalidRequest(f"No valid line in the file ({tally.invalid} invalid); see details.",
                             code="no_valid_lines", details=details)
    if tally.invalid and params.on_invalid == "reject":
        raise InvalidRequest(f"{tally.invalid} of {tally.lines} lines are invalid; fix them, or submit with "
                             "on_invalid=skip to run the valid ones and list the rest.", code="invalid_lines",
                             details=details)


def _refuse_over_budget(tally: ingest.Tally, priced: int, others: int, params: JobParams, limits) -> None:
    """The job, with the tokens the tenant's other unfinished jobs still have priced, must fit in
    what its tokens-per-minute limit admits over the job's window."""
    minutes = params.completion_window_s / 60
    budget = int(limits.tokens_per_minute * minutes)
    if priced + others > budget:
        need = (priced + others) / limits.tokens_per_minute * 60
        with_others = f" on top of the {others} your unfinished jobs have" if others else ""
        raise InvalidRequest(
            f"This job needs about {priced} tokens{with_others}; your limit of {limits.tokens_per_minute} tokens "
            f"per minute admits {budget} in its {human(params.completion_window_s)} window. It needs a window of at "
            f"least {human(need)}, a higher limit, or a smaller file.", code="job_over_token_budget",
            details={"estimated_tokens": priced, "open_jobs_tokens": others,
                     "tokens_per_minute": limits.tokens_per_minute,
                     "completion_window_s": params.completion_window_s, "budget_tokens": budget,
                     "items": tally.valid})


def _off_endpoint(body: dict[str, Any] | None, endpoint: str | None) -> ingest.LineError | None:
    """A batch's line that is no OpenAI request (a document to summarise). Its requests may go to
    any of the routes Sluice serves whatever the batch's endpoint, so one batch can mix chat,
    completions and embeddings (OpenAI's would refuse the lines off its endpoint)."""
    if endpoint is None or body is not None:
        return None
    return ingest.LineError("invalid_url", "Every line of a batch must be an OpenAI request (custom_id, method, "
                                           f"url, body); this batch's endpoint is {endpoint}.")
