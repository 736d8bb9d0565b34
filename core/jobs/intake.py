"""Submitting a bulk job: its upload read into items, or refused with nothing kept.

A submit writes the job row first (``validating``, so a long upload shows), then reads the
upload into its items in one transaction (``core/jobs/ingest.py``). A refused upload (too large,
bad lines when the caller refuses those, no valid line, over the tenant's token budget)
rolls the items back and deletes the job row: nothing half-written stays. A web process that
dies mid-upload leaves a ``validating`` job with no items, which the feeder fails
(``upload_interrupted``) after ``STALE_UPLOAD_S`` (``core/jobs/settle.py``). A job cancelled
while its file is read keeps the cancel: its lines are dropped, and it ends ``cancelled``.
"""

from __future__ import annotations

import logging
import uuid
from typing import IO, Any

from sqlalchemy import delete

from core.errors import ApiError, InvalidRequest
from core.jobs import ingest
from core.jobs.params import PROMPT_MARGIN_TOKENS, JobParams, chunk_budget, human
from core.observe.logs import bind_request
from core.settings import Settings
from core.submit.tokens import estimate_text_tokens
from core.tenants.tiers import effective_limits
from models import Tenant, job_lifecycle
from models.job import ItemStatus, Job, JobStatus
from models.session import Database

log = logging.getLogger(__name__)

JSONL_TYPES = ("application/jsonl", "application/x-ndjson", "application/x-jsonlines", "application/json-lines",
               "application/jsonlines", "text/jsonl")
# An upload still ``validating`` this long after its job was created has no process reading it.
STALE_UPLOAD_S = 3600


class _NotValidating(Exception):
    """The job left ``validating`` while its file was read: cancelled, or failed as a stale upload."""


def submit(settings: Settings, db: Database, tenant: Tenant, params: JobParams, stream: IO[bytes]) -> uuid.UUID:
    """Create the job and read ``stream`` into its items; the job's id. Raises the refusal (the
    job row deleted, no item kept) when the file is refused."""
    job = Job(id=uuid.uuid4(), tenant_id=tenant.id, status=JobStatus.VALIDATING, model=params.model,
              priority=params.priority, instruction=params.instruction, summary_tokens=params.summary_tokens,
              completion_window_s=params.completion_window_s, meta=params.metadata,
              webhook_url=params.webhook_url, webhook_events=list(params.webhook_events) or None)
    with db.session() as session:
        session.add(job)
    bind_request(str(job.id))
    try:
        tally = _load(settings, db, tenant, job, params, stream)
    except _NotValidating:
        log.info("job cancelled or failed while its file was read; its lines were dropped")
        return job.id
    except BaseException:
        with db.session() as session:
            session.execute(delete(Job).where(Job.id == job.id))
        raise
    log.info("job accepted: %d items, %d invalid lines, %d bytes, ~%d tokens", tally.valid, tally.invalid,
             tally.bytes, job.estimated_tokens)
    return job.id


def _load(settings: Settings, db: Database, tenant: Tenant, job: Job, params: JobParams, stream: IO[bytes]
          ) -> ingest.Tally:
    """COPY the upload's lines into the job's items, refuse the file or admit the job, in one transaction."""
    model = settings.registry.get(params.model)
    assert model is not None
    limits = effective_limits(settings.tiers, settings.default_tier, tenant)
    overhead = estimate_text_tokens(params.instruction) + PROMPT_MARGIN_TOKENS
    budget = chunk_budget(model.context_tokens, limits.max_request_tokens, overhead - PROMPT_MARGIN_TOKENS,
                          params.summary_tokens)
    served = {m.name for m in settings.registry.models}
    tally, priced = ingest.Tally(), 0
    with db.session() as session:
        conn = session.connection().connection.driver_connection
        with conn.cursor().copy(f"COPY job_items ({', '.join(ingest.COPY_COLUMNS)}) FROM STDIN") as copy:
            copy.set_types(list(ingest.COPY_TYPES))
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
                else:
                    priced += tokens + body.get("max_completion_tokens", body.get("max_tokens",
                                                                                  settings.default_max_tokens))
                copy.write_row(ingest.copy_row(job.id, number, custom_id, ItemStatus.PENDING, doc, body, tokens))
        duplicates = job_lifecycle.invalidate_duplicates(session, job.id)
        for line, custom_id, first in duplicates:
            tally.valid -= 1
            tally.error(line, custom_id, "duplicate_custom_id", f"custom_id first appears on line {first}.")
        _refuse_bad_file(tally, params)
        _refuse_over_budget(tally, priced, params, limits)
        if not job_lifecycle.admit(session, job.id, params.completion_window_s, total_items=tally.valid,
                                   invalid_lines=tally.invalid, input_bytes=tally.bytes, estimated_tokens=priced):
            raise _NotValidating  # its lines roll back; the job stays as the cancel (or stale check) left it
    job.estimated_tokens = priced
    return tally


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


def _refuse_over_budget(tally: ingest.Tally, priced: int, params: JobParams, limits) -> None:
    minutes = params.completion_window_s / 60
    budget = int(limits.tokens_per_minute * minutes)
    if priced > budget:
        need = priced / limits.tokens_per_minute * 60
        raise InvalidRequest(
            f"This job needs about {priced} tokens; your limit of {limits.tokens_per_minute} tokens per minute "
            f"admits {budget} in its {human(params.completion_window_s)} window. It needs a window of at least "
            f"{human(need)}, a higher limit, or a smaller file.", code="job_over_token_budget",
            details={"estimated_tokens": priced, "tokens_per_minute": limits.tokens_per_minute,
                     "completion_window_s": params.completion_window_s, "budget_tokens": budget,
                     "items": tally.valid})


def _off_endpoint(body: dict[str, Any] | None, endpoint: str | None) -> ingest.LineError | None:
    """A batch's line that is not a request to the batch's endpoint (OpenAI refuses those too)."""
    if endpoint is None or (body is not None and body["url"] == endpoint):
        return None
    return ingest.LineError("invalid_url", f"Every line of this batch must be an OpenAI request to {endpoint}.")
