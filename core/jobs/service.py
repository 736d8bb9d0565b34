"""Bulk jobs for a tenant the API authenticated: submit a file, read progress and results, cancel.

A submit writes the job row first (``validating``, so a long upload shows), then reads the
upload into its items in one transaction (``core/jobs/ingest.py``). A refused upload (too large,
bad lines when the caller refuses those, no valid line, over the tenant's token budget)
rolls the items back and deletes the job row: nothing half-written stays. A web process that
dies mid-upload leaves a ``validating`` job with no items, which the feeder fails
(``upload_interrupted``) after ``STALE_UPLOAD_S``.

Running the items is the feeder's (``core/jobs/feeder.py``); cancelling stops it feeding, cancels
the requests in flight, and keeps what finished.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import IO, Any

from sqlalchemy import delete, func, select, text, update

from core.delivery import webhooks
from core.errors import ApiError, Conflict, InvalidRequest, NotFound
from core.jobs import ingest
from core.observe.logs import bind_request
from core.rediskeys import FEEDER_STATE_KEY
from core.settings import Settings
from core.submit.service import RequestService
from core.submit.tokens import estimate_text_tokens
from core.tenants.tiers import effective_limits
from models import Tenant
from models.job import ItemStatus, Job, JobItem, JobStatus
from models.lifecycle import TransitionRefused
from models.session import Database

log = logging.getLogger(__name__)

JSONL_TYPES = ("application/jsonl", "application/x-ndjson", "application/x-jsonlines", "application/json-lines",
               "application/jsonlines", "text/jsonl")
# A document request's prompt leaves this many tokens of room beyond the instruction and the
# summary: the separator between them, and the model's special tokens.
PROMPT_MARGIN_TOKENS = 16
STALE_UPLOAD_S = 3600
_WINDOW = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
# The feeder writes its state every SLUICE_FEEDER_INTERVAL_S; older than this, it is not running.
FEEDER_STALE_S = 10.0
PARAMS = ("model", "summary_tokens", "instruction", "priority", "completion_window", "on_invalid", "metadata",
          "webhook_url", "webhook_events")


@dataclass(frozen=True)
class JobParams:
    model: str
    summary_tokens: int
    instruction: str
    priority: str
    completion_window_s: int
    on_invalid: str  # reject: any bad line refuses the file; skip: bad lines are listed, the rest run
    metadata: dict[str, str]
    webhook_url: str | None = None  # its events (webhook_events) are sent by the sweep: workers/webhooks.py
    webhook_events: tuple[str, ...] = ()
    # An OpenAI batch's (core/openai/batches.py): every line must be an OpenAI request to this url.
    endpoint: str | None = None


def chunk_budget(context_tokens: int, max_request_tokens: int, instruction_tokens: int, summary_tokens: int) -> int:
    """Input tokens one document request may carry: what the model's context and the tenant's
    per-request limit leave after the instruction, the summary and a margin."""
    return min(context_tokens, max_request_tokens) - instruction_tokens - summary_tokens - PROMPT_MARGIN_TOKENS


class JobService:
    def __init__(self, settings: Settings, db: Database, requests: RequestService, redis_client) -> None:
        self.settings = settings
        self.db = db
        self.requests = requests
        self.redis = redis_client

    # ------------------------------------------------------------------ submit

    def params(self, args: dict[str, str], tenant: Tenant) -> JobParams:
        """The job's parameters from the query string; 422 naming every bad or unknown one."""
        settings = self.settings
        problems: dict[str, list[str]] = {}
        for name in set(args) - set(PARAMS):
            problems[name] = [f"Unknown parameter; a job takes {', '.join(PARAMS)}."]
        model = settings.registry.get(args["model"]) if "model" in args else settings.registry.default
        if model is None:
            problems["model"] = [f"Unknown model {args['model']!r}; this platform serves: "
                                 f"{', '.join(m.name for m in settings.registry.models)}."]
        summary = _integer(args, "summary_tokens", settings.job_summary_tokens, problems, 1, settings.max_output_tokens)
        instruction = args.get("instruction", settings.job_instruction)
        if not instruction.strip() or len(instruction) > 4000 or "\x00" in instruction:
            problems["instruction"] = ["Must be 1 to 4000 characters."]
        priority = args.get("priority", "batch")
        if priority not in ("batch", "realtime"):
            problems["priority"] = ["Must be batch or realtime."]
        window = _window(args.get("completion_window"), settings, problems)
        on_invalid = args.get("on_invalid", "reject")
        if on_invalid not in ("reject", "skip"):
            problems["on_invalid"] = ["Must be reject (any bad line refuses the file) or skip (bad lines are listed)."]
        metadata: dict[str, str] = {}
        if "metadata" in args:
            try:
                metadata = json.loads(args["metadata"])
            except ValueError:
                metadata = None  # type: ignore[assignment]
            if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                    isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                    for k, v in metadata.items()):
                problems["metadata"] = ["Must be a JSON object of at most 16 string values."]
        if model is not None and not problems:
            limits = effective_limits(settings.tiers, settings.default_tier, tenant)
            room = chunk_budget(model.context_tokens, limits.max_request_tokens, estimate_text_tokens(instruction), 0)
            if "summary_tokens" not in args:  # the default, shortened to what this model's context allows
                summary = max(1, min(summary, room // 3))
            if room - summary < 2 * summary:  # each reduce round must shrink what it summarises
                holds = min(model.context_tokens, limits.max_request_tokens)
                problems["summary_tokens"] = [
                    f"Too long for {model.name}: a request holds {holds} tokens, which must fit the instruction "
                    "and at least twice the summary."]
        events = _events(args, problems)
        if problems:
            raise InvalidRequest("The job has invalid parameters; see details.", details=problems)
        if "webhook_url" in args:
            webhooks.check_url(args["webhook_url"], settings.webhook_allow_list)
            webhooks.require_secret(tenant)
        return JobParams(model.name, summary, instruction, priority, window, on_invalid, metadata,
                         args.get("webhook_url"), events)

    def submit(self, tenant: Tenant, params: JobParams, stream: IO[bytes]) -> Job:
        job = Job(id=uuid.uuid4(), tenant_id=tenant.id, status=JobStatus.VALIDATING, model=params.model,
                  priority=params.priority, instruction=params.instruction, summary_tokens=params.summary_tokens,
                  completion_window_s=params.completion_window_s, meta=params.metadata,
                  webhook_url=params.webhook_url, webhook_events=list(params.webhook_events) or None)
        with self.db.session() as session:
            session.add(job)
        bind_request(str(job.id))
        try:
            tally = self._load(tenant, job, params, stream)
        except BaseException:
            with self.db.session() as session:
                session.execute(delete(Job).where(Job.id == job.id))
            raise
        log.info("job accepted: %d items, %d invalid lines, %d bytes, ~%d tokens", tally.valid, tally.invalid,
                 tally.bytes, job.estimated_tokens)
        return self.get(tenant.id, str(job.id))

    def _load(self, tenant: Tenant, job: Job, params: JobParams, stream: IO[bytes]) -> ingest.Tally:
        settings = self.settings
        model = settings.registry.get(params.model)
        assert model is not None
        limits = effective_limits(settings.tiers, settings.default_tier, tenant)
        overhead = estimate_text_tokens(params.instruction) + PROMPT_MARGIN_TOKENS
        budget = chunk_budget(model.context_tokens, limits.max_request_tokens, overhead - PROMPT_MARGIN_TOKENS,
                              params.summary_tokens)
        served = {m.name for m in settings.registry.models}
        tally, priced = ingest.Tally(), 0
        with self.db.session() as session:
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
            duplicates = _duplicates(session, job.id)
            for line, custom_id, first in duplicates:
                tally.valid -= 1
                tally.error(line, custom_id, "duplicate_custom_id", f"custom_id first appears on line {first}.")
            self._refuse_bad_file(tally, params)
            self._refuse_over_budget(tally, priced, params, limits)
            session.execute(update(Job).where(Job.id == job.id).values(
                status=JobStatus.IN_PROGRESS, total_items=tally.valid, invalid_lines=tally.invalid,
                input_bytes=tally.bytes, estimated_tokens=priced, started_at=func.now(),
                expires_at=func.now() + timedelta(seconds=params.completion_window_s)))
        job.estimated_tokens = priced
        return tally

    def _refuse_bad_file(self, tally: ingest.Tally, params: JobParams) -> None:
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

    def _refuse_over_budget(self, tally: ingest.Tally, priced: int, params: JobParams, limits) -> None:
        minutes = params.completion_window_s / 60
        budget = int(limits.tokens_per_minute * minutes)
        if priced > budget:
            need = priced / limits.tokens_per_minute * 60
            raise InvalidRequest(
                f"This job needs about {priced} tokens; your limit of {limits.tokens_per_minute} tokens per minute "
                f"admits {budget} in its {_human(params.completion_window_s)} window. It needs a window of at least "
                f"{_human(need)}, a higher limit, or a smaller file.", code="job_over_token_budget",
                details={"estimated_tokens": priced, "tokens_per_minute": limits.tokens_per_minute,
                         "completion_window_s": params.completion_window_s, "budget_tokens": budget,
                         "items": tally.valid})

    # ------------------------------------------------------------------ read

    def job(self, tenant_id: uuid.UUID, job_id: str) -> Job:
        jid = _parse_id(job_id)
        with self.db.session() as session:
            job = session.scalar(select(Job).where(Job.id == jid, Job.tenant_id == tenant_id))
        if job is None:
            raise NotFound(f"No job {job_id} for this API key.")
        return job

    def get(self, tenant_id: uuid.UUID, job_id: str) -> dict[str, Any]:
        job = self.job(tenant_id, job_id)
        return {**view(job, self._progress([job.id])[job.id]), "feeder": self.feeder()}

    def feeder(self) -> dict[str, Any]:
        """What the feeder last did: whether it runs, and why it pauses (degradation, a reservation)."""
        try:
            state = self.redis.hgetall(FEEDER_STATE_KEY)
        except Exception:
            return {"running": None, "paused": None}
        if not state or time.time() - float(state.get("at", 0)) > FEEDER_STALE_S:
            return {"running": False, "paused": None}
        return {"running": True, "paused": state.get("paused") or None,
                "in_flight": int(state.get("in_flight", 0)), "capacity": int(state.get("capacity", 0))}

    def list(self, tenant_id: uuid.UUID, limit: int, before: str | None) -> list[dict[str, Any]]:
        query = select(Job).where(Job.tenant_id == tenant_id).order_by(Job.created_at.desc()).limit(limit)
        if before:
            anchor = self.job(tenant_id, before)
            query = query.where(Job.created_at < anchor.created_at)
        with self.db.session() as session:
            jobs = session.scalars(query).all()
        progress = self._progress([job.id for job in jobs])
        return [view(job, progress[job.id]) for job in jobs]

    def _progress(self, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, dict[str, Any]]:
        """Counts per item status, tokens and the last minute's finishes of each job, in one query."""
        with self.db.session() as session:
            rows = session.execute(text("""
                SELECT job_id, status, count(*), coalesce(sum(input_tokens), 0), coalesce(sum(output_tokens), 0),
                       count(*) FILTER (WHERE finished_at > now() - interval '60 seconds'),
                       extract(epoch FROM now() - min(finished_at)
                               FILTER (WHERE finished_at > now() - interval '60 seconds'))
                FROM job_items WHERE job_id = ANY(:jobs) GROUP BY job_id, status"""), {"jobs": job_ids}).all()
        progress = {job_id: {"counts": {s.value: 0 for s in ItemStatus}, "tokens": {"input": 0, "output": 0},
                             "recent": 0, "span": 0.0} for job_id in job_ids}
        for job_id, status, n, tokens_in, tokens_out, last_minute, since in rows:
            one = progress[job_id]
            one["counts"][status] = n
            one["tokens"]["input"] += int(tokens_in)
            one["tokens"]["output"] += int(tokens_out)
            if status in (ItemStatus.SUCCEEDED.value, ItemStatus.FAILED.value):  # computed, not called off
                one["recent"] += last_minute
                one["span"] = max(one["span"], float(since or 0))
        return progress

    def items(self, tenant_id: uuid.UUID, job_id: str, errors: bool) -> Iterator[bytes]:
        """JSONL of the job's finished items in input order (``errors``: invalid and failed lines),
        read through a server-side cursor: a million results stream without being held."""
        job = self.job(tenant_id, job_id)
        statuses = (ItemStatus.INVALID, ItemStatus.FAILED) if errors else (
            ItemStatus.SUCCEEDED, ItemStatus.FAILED, ItemStatus.CANCELLED, ItemStatus.EXPIRED)
        columns = (JobItem.line, JobItem.custom_id, JobItem.status, JobItem.result, JobItem.finish_reason,
                   JobItem.input_tokens, JobItem.output_tokens, JobItem.chunks, JobItem.depth, JobItem.request_count,
                   JobItem.error_code, JobItem.error_message)

        def generate() -> Iterator[bytes]:
            with self.db.session() as session:
                rows = session.execute(select(*columns).where(JobItem.job_id == job.id, JobItem.status.in_(statuses))
                                       .order_by(JobItem.line).execution_options(yield_per=2000))
                batch: list[str] = []
                for row in rows:
                    batch.append(json.dumps(result_line(row, errors)))
                    if len(batch) >= 500:
                        yield ("\n".join(batch) + "\n").encode()
                        batch = []
                if batch:
                    yield ("\n".join(batch) + "\n").encode()

        return generate()

    # ------------------------------------------------------------------ cancel

    def cancel(self, tenant_id: uuid.UUID, job_id: str) -> dict[str, Any]:
        """Stop feeding, cancel the requests in flight, keep what finished."""
        jid = _parse_id(job_id)
        with self.db.session() as session:
            job = session.scalar(select(Job).where(Job.id == jid, Job.tenant_id == tenant_id).with_for_update())
            if job is None:
                raise NotFound(f"No job {job_id} for this API key.")
            if job.status.terminal:
                raise Conflict(f"Job is already {job.status.value}; nothing to cancel.", code="not_cancellable")
            in_flight: list[uuid.UUID] = []
            if job.status != JobStatus.CANCELLING:
                job.status, job.cancel_requested_at = JobStatus.CANCELLING, func.now()
                in_flight = stop_items(session, jid, ItemStatus.CANCELLED, "cancelled",
                                       "The job was cancelled before it ran.")
        cancel_requests(self.requests, tenant_id, in_flight)
        log.info("job cancel requested: %d requests in flight cancelled", len(in_flight))
        return self.get(tenant_id, job_id)


def stop_items(session, job_id: uuid.UUID, status: ItemStatus, code: str, message: str) -> list[uuid.UUID]:
    """End a stopping job's pending items as ``status``; the ids of the requests its running items
    have in flight, for the caller to cancel once this commits (their items end as the feeder sees them)."""
    session.execute(update(JobItem).where(JobItem.job_id == job_id, JobItem.status == ItemStatus.PENDING)
                    .values(status=status, finished_at=func.now(), error_code=code, error_message=message))
    return list(session.scalars(select(func.unnest(JobItem.requests)).where(
        JobItem.job_id == job_id, JobItem.status == ItemStatus.RUNNING)))


def cancel_requests(requests: RequestService, tenant_id: uuid.UUID, ids: list[uuid.UUID]) -> None:
    """Cancel each request that is still queued or running (a missing or finished one is skipped)."""
    for rid in ids:
        try:
            requests.cancel(tenant_id, str(rid))
        except (NotFound, Conflict, TransitionRefused):
            pass


def result_line(row, errors: bool = False) -> dict[str, Any]:
    line = {"custom_id": row.custom_id, "line": row.line, "outcome": row.status.value}
    if row.status == ItemStatus.SUCCEEDED:
        line.update(output=row.result, finish_reason=row.finish_reason)
    if row.status != ItemStatus.INVALID:
        line.update(usage={"input_tokens": row.input_tokens, "output_tokens": row.output_tokens,
                           "requests": row.request_count}, chunks=row.chunks, depth=row.depth)
    line["error"] = None if row.error_code is None else {"code": row.error_code, "message": row.error_message}
    return line


def view(job: Job, progress: dict[str, Any]) -> dict[str, Any]:
    counts = progress["counts"]
    total = job.total_items
    done = sum(counts[s.value] for s in ItemStatus if s.terminal and s != ItemStatus.INVALID)
    rate = progress["recent"] / max(progress["span"], 1.0) if progress["recent"] else 0.0
    left = counts["pending"] + counts["running"]
    eta = round(left / rate, 1) if rate > 0 and left and job.status in (JobStatus.IN_PROGRESS, JobStatus.FINALIZING) \
        else None
    return {
        "id": str(job.id), "object": "job", "status": job.status.value, "model": job.model,
        "priority": job.priority, "instruction": job.instruction, "summary_tokens": job.summary_tokens,
        "completion_window_s": job.completion_window_s, "metadata": job.meta or {},
        "counts": {"total": total, **counts},
        "done": done, "progress": round(done / total, 4) if total else 0.0,
        "tokens": progress["tokens"], "estimated_tokens": job.estimated_tokens, "input_bytes": job.input_bytes,
        "rate_items_per_s": round(rate, 3), "eta_s": eta,
        "created_at": _iso(job.created_at), "started_at": _iso(job.started_at), "expires_at": _iso(job.expires_at),
        "cancel_requested_at": _iso(job.cancel_requested_at), "finished_at": _iso(job.finished_at),
        "redacted_at": _iso(job.redacted_at),
        "error": None if job.error_code is None else {"code": job.error_code, "message": job.error_message},
        "results_url": f"/v1/jobs/{job.id}/results", "errors_url": f"/v1/jobs/{job.id}/errors",
        "webhook_url": job.webhook_url, "webhook_events": job.webhook_events,
    }


def _duplicates(session, job_id: uuid.UUID) -> list[tuple[int, str, int]]:
    """Lines whose custom_id an earlier line of the job already used: made invalid, listed."""
    return [tuple(r) for r in session.execute(text("""
        WITH seen AS (
            SELECT line, custom_id, min(line) OVER (PARTITION BY custom_id) AS first
            FROM job_items WHERE job_id = :job AND status = 'pending')
        UPDATE job_items i SET status = 'invalid', text = NULL, body = NULL, estimated_tokens = 0,
               error_code = 'duplicate_custom_id', error_message = 'custom_id first appears on line ' || seen.first
        FROM seen WHERE i.job_id = :job AND i.line = seen.line AND seen.line <> seen.first
        RETURNING i.line, i.custom_id, seen.first"""), {"job": job_id})]


def _off_endpoint(body: dict[str, Any] | None, endpoint: str | None) -> ingest.LineError | None:
    """A batch's line that is not a request to the batch's endpoint (OpenAI refuses those too)."""
    if endpoint is None or (body is not None and body["url"] == endpoint):
        return None
    return ingest.LineError("invalid_url", f"Every line of this batch must be an OpenAI request to {endpoint}.")


def _events(args: dict[str, str], problems: dict[str, list[str]]) -> tuple[str, ...]:
    """webhook_events: comma-separated, of started, progress, completed (default: completed)."""
    if "webhook_url" not in args:
        if "webhook_events" in args:
            problems["webhook_events"] = ["Events are sent to a webhook_url; give one."]
        return ()
    if len(args["webhook_url"]) > 2048:
        problems["webhook_url"] = ["At most 2048 characters."]
    events = tuple(dict.fromkeys(e.strip() for e in args.get("webhook_events", "completed").split(",")))
    if not events or not set(events) <= set(webhooks.JOB_EVENTS):
        problems["webhook_events"] = [f"Comma-separated, of {', '.join(webhooks.JOB_EVENTS)}."]
    return events


def _integer(args: dict[str, str], name: str, default: int, problems: dict[str, list[str]], low: int, high: int) -> int:
    if name not in args:
        return default
    try:
        value = int(args[name])
    except ValueError:
        problems[name] = ["Must be a whole number."]
        return default
    if not low <= value <= high:
        problems[name] = [f"Must be between {low} and {high}."]
    return value


def _window(raw: str | None, settings: Settings, problems: dict[str, list[str]]) -> int:
    if raw is None:
        return int(settings.job_window_s)
    match = _WINDOW.match(raw.strip().lower())
    seconds = float(match.group(1)) * _UNITS[match.group(2)] if match else 0
    if not match or not 60 <= seconds <= settings.job_max_window_s:
        problems["completion_window"] = [f"Must be a duration like 24h, 90m or 3600 (seconds), from 60 s to "
                                         f"{_human(settings.job_max_window_s)}."]
        return int(settings.job_window_s)
    return int(seconds)


def _human(seconds: float) -> str:
    if seconds >= 86400 and seconds % 3600 == 0:
        return f"{seconds / 86400:g} d" if seconds % 86400 == 0 else f"{seconds / 3600:g} h"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


def _parse_id(job_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(job_id)
    except ValueError:
        raise NotFound("No such job: job ids are UUIDs.") from None  # not echoed: it may hold a NUL
