"""Bulk jobs for a tenant the API authenticated: the service the API and the CLI call.

It submits through ``core/jobs/params.py`` (the query string) and ``core/jobs/intake.py`` (the
upload into items, or a refusal), and answers the reads: a job's view with its progress (counts
per item status, tokens, rate and ETA), the tenant's list, and its results and errors as JSONL.
Running the items is the feeder's (``core/jobs/feeder.py``); cancelling stops it feeding,
cancels the requests in flight, and keeps what finished.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import IO, Any

from sqlalchemy import func, select, text

from core.admission.load import ClassLoad
from core.errors import Conflict, NotFound
from core.ids import uuid_or_404
from core.jobs import estimate, intake
from core.jobs.params import JobParams, parse_params
from core.rediskeys import FEEDER_STATE_KEY
from core.settings import Settings
from core.submit.embeddings import shown, vectors
from core.submit.service import RequestService
from core.tenants.scopes import Caller
from models import InferenceRequest, Tenant, job_lifecycle
from models.job import ItemStatus, Job, JobItem, JobStatus
from models.lifecycle import TransitionRefused
from models.session import Database

log = logging.getLogger(__name__)

# The feeder writes its state every SLUICE_FEEDER_INTERVAL_S; older than this, it is not running.
FEEDER_STALE_S = 10.0


class JobService:
    def __init__(self, settings: Settings, db: Database, requests: RequestService, redis_client) -> None:
        self.settings = settings
        self.db = db
        self.requests = requests
        self.redis = redis_client

    # ------------------------------------------------------------------ submit

    def params(self, args: dict[str, str], tenant: Tenant) -> JobParams:
        """The job's parameters from the query string; 422 naming every bad or unknown one."""
        return parse_params(self.settings, args, tenant)

    def check_intake(self, tenant: Tenant) -> None:
        """Refuse a new job at once, before its file is read: the tenant is over its request limits
        (what POST /v1/requests would answer 429 now also refuses a job), or already has as many
        unfinished jobs or stored lines as it may (``intake.check_standing``). Each door calls it
        before :meth:`submit`: the upload route before it reads the body, a batch before its file."""
        self.requests.admission.refuse_over_limits(tenant)
        intake.check_standing(self.settings, self.db, tenant)

    def submit(self, tenant: Tenant, params: JobParams, stream: IO[bytes]) -> dict[str, Any]:
        """Create a job from an upload (refused with nothing kept, or admitted); its view."""
        return self.get(Caller(tenant.id), str(intake.submit(
            self.settings, self.db, tenant, params, stream, loads=lambda: ClassLoad.read_all(self.redis),
            lessons=estimate.Lessons(self.redis))))

    # ------------------------------------------------------------------ read

    def job(self, caller: Caller, job_id: str) -> Job:
        """A job ``caller`` sees (a key scoped ``own``: one it submitted), or 404."""
        visible = caller.sees(Job.tenant_id, Job.api_key_id, "jobs")
        jid = _parse_id(job_id)
        with self.db.session() as session:
            job = session.scalar(select(Job).where(Job.id == jid, visible))
        if job is None:
            raise caller.missing("job", job_id)
        return job

    def get(self, caller: Caller, job_id: str) -> dict[str, Any]:
        job = self.job(caller, job_id)
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

    def list(self, caller: Caller, limit: int, before: str | None) -> list[dict[str, Any]]:
        """The jobs ``caller`` sees, newest first; ``before``: those older than that job."""
        visible = caller.sees(Job.tenant_id, Job.api_key_id, "jobs")
        query = select(Job).where(visible).order_by(Job.created_at.desc()).limit(limit)
        if before:
            anchor = self.job(caller, before)
            query = query.where(Job.created_at < anchor.created_at)
        with self.db.session() as session:
            jobs = session.scalars(query).all()
        progress = self._progress([job.id for job in jobs])
        return [view(job, progress[job.id]) for job in jobs]

    def _progress(self, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, dict[str, Any]]:
        """Counts per item status, tokens and the last minute's finishes of each job, in one query."""
        with self.db.session() as session:
            rows = session.execute(text("""
                SELECT job_id, status, count(*), coalesce(sum(input_tokens), 0), coalesce(sum(cached_tokens), 0),
                       coalesce(sum(output_tokens), 0),
                       count(*) FILTER (WHERE finished_at > now() - interval '60 seconds'),
                       extract(epoch FROM now() - min(finished_at)
                               FILTER (WHERE finished_at > now() - interval '60 seconds'))
                FROM job_items WHERE job_id = ANY(:jobs) GROUP BY job_id, status"""), {"jobs": job_ids}).all()
        progress = {job_id: {"counts": {s.value: 0 for s in ItemStatus},
                             "tokens": {"input": 0, "cached": 0, "output": 0}, "recent": 0, "span": 0.0}
                    for job_id in job_ids}
        for job_id, status, n, tokens_in, tokens_cached, tokens_out, last_minute, since in rows:
            one = progress[job_id]
            one["counts"][status] = n
            one["tokens"]["input"] += int(tokens_in)
            one["tokens"]["cached"] += int(tokens_cached)
            one["tokens"]["output"] += int(tokens_out)
            if status in (ItemStatus.SUCCEEDED.value, ItemStatus.FAILED.value):  # computed, not called off
                one["recent"] += last_minute
                one["span"] = max(one["span"], float(since or 0))
        return progress

    def items(self, caller: Caller, job_id: str, errors: bool) -> Iterator[bytes]:
        """JSONL of the job's finished items in input order (``errors``: invalid and failed lines),
        read through a server-side cursor: a million results stream without being held."""
        job = self.job(caller, job_id)
        statuses = (ItemStatus.INVALID, ItemStatus.FAILED) if errors else (
            ItemStatus.SUCCEEDED, ItemStatus.FAILED, ItemStatus.CANCELLED, ItemStatus.EXPIRED)
        # An OpenAI line's one request (a document's stages are several; none has these): every
        # choice and its logprobs, an embeddings line's vectors.
        first = JobItem.requests[1]
        columns = (JobItem.line, JobItem.custom_id, JobItem.status, JobItem.result, JobItem.finish_reason,
                   JobItem.input_tokens, JobItem.cached_tokens, JobItem.output_tokens, JobItem.chunks, JobItem.depth,
                   JobItem.request_count,
                   JobItem.error_code, JobItem.error_message, InferenceRequest.choices, InferenceRequest.embedding,
                   func.jsonb_array_length(InferenceRequest.input["texts"]).label("texts"),
                   InferenceRequest.params["encoding_format"].astext.label("encoding"))

        def generate() -> Iterator[bytes]:
            with self.db.session() as session:
                rows = session.execute(select(*columns).outerjoin(InferenceRequest, InferenceRequest.id == first)
                                       .where(JobItem.job_id == job.id, JobItem.status.in_(statuses))
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

    def cancel(self, caller: Caller, job_id: str) -> dict[str, Any]:
        """Stop feeding, cancel the requests in flight, keep what finished (a job ``caller`` sees)."""
        visible = caller.sees(Job.tenant_id, Job.api_key_id, "jobs")
        jid = _parse_id(job_id)
        with self.db.session() as session:
            job = session.scalar(select(Job).where(Job.id == jid, visible).with_for_update())
            if job is None:
                raise caller.missing("job", job_id)
            if job.status.terminal:
                raise Conflict(f"Job is already {job.status.value}; nothing to cancel.", code="not_cancellable")
            in_flight: list[uuid.UUID] = []
            if job_lifecycle.request_cancel(session, jid):  # else it was cancelling already
                in_flight = stop_items(session, jid, ItemStatus.CANCELLED, "cancelled",
                                       "The job was cancelled before it ran.")
        cancel_requests(self.requests, caller.tenant_id, in_flight)
        log.info("job cancel requested: %d requests in flight cancelled", len(in_flight))
        return self.get(caller, job_id)


def stop_items(session, job_id: uuid.UUID, status: ItemStatus, code: str, message: str) -> list[uuid.UUID]:
    """End a stopping job's pending items as ``status``; the ids of the requests its running items
    have in flight, for the caller to cancel once this commits (their items end as the feeder sees them)."""
    job_lifecycle.stop_pending(session, job_id, status, code, message)
    return list(session.scalars(select(func.unnest(JobItem.requests)).where(
        JobItem.job_id == job_id, JobItem.status == ItemStatus.RUNNING)))


def cancel_requests(requests: RequestService, tenant_id: uuid.UUID, ids: list[uuid.UUID]) -> None:
    """Cancel each request that is still queued or running (a missing or finished one is skipped)."""
    for rid in ids:
        try:
            requests.cancel(Caller(tenant_id), str(rid))
        except (NotFound, Conflict, TransitionRefused):
            pass


def result_line(row, errors: bool = False) -> dict[str, Any]:
    line = {"custom_id": row.custom_id, "line": row.line, "outcome": row.status.value}
    if row.status == ItemStatus.SUCCEEDED:
        line.update(output=row.result, finish_reason=row.finish_reason)
        if getattr(row, "choices", None):
            line["choices"] = row.choices
        if getattr(row, "embedding", None) is not None:
            line["embeddings"] = [shown(v, getattr(row, "encoding", None) or "float")
                                  for v in vectors(row.embedding, row.texts or 0)]
    if row.status != ItemStatus.INVALID:
        line.update(usage={"input_tokens": row.input_tokens, "cached_tokens": row.cached_tokens,
                           "output_tokens": row.output_tokens, "requests": row.request_count},
                    chunks=row.chunks, depth=row.depth)
    line["error"] = None if row.error_code is None else {"code": row.error_code, "message": row.error_message}
    return line


def view(job: Job, progress: dict[str, Any]) -> dict[str, Any]:
    counts = progress["counts"]
    total = job.total_items
    done = sum(counts[s.value] for s in ItemStatus if s.terminal and s != ItemStatus.INVALID)
    rate = progress["recent"] / max(progress["span"], 1.0) if progress["recent"] else 0.0
    left = counts["pending"] + counts["running"]
    live = job.status in (JobStatus.IN_PROGRESS, JobStatus.FINALIZING)
    now = datetime.now(UTC)
    # While it runs, from the rate its lines finish at; before any has, the estimate made at submit.
    eta = round(left / rate, 1) if rate > 0 and left and live else (
        round(max(0.0, (job.estimated_finish_at - now).total_seconds()), 1)
        if live and left and job.estimated_finish_at is not None else None)
    return {
        "id": str(job.id), "object": "job", "status": job.status.value, "model": job.model,
        "priority": job.priority, "service_tier": job.service_tier, "instruction": job.instruction,
        "summary_tokens": job.summary_tokens,
        "completion_window_s": job.completion_window_s, "metadata": job.meta or {},
        "counts": {"total": total, **counts},
        "done": done, "progress": round(done / total, 4) if total else 0.0,
        "tokens": progress["tokens"], "estimated_tokens": job.estimated_tokens, "input_bytes": job.input_bytes,
        "rate_items_per_s": round(rate, 3), "eta_s": eta,
        "estimated_finish_at": _iso(now + timedelta(seconds=eta)) if eta is not None else None,
        "estimated_finish_at_submit": _iso(job.estimated_finish_at),
        "created_at": _iso(job.created_at), "started_at": _iso(job.started_at), "expires_at": _iso(job.expires_at),
        "cancel_requested_at": _iso(job.cancel_requested_at), "finished_at": _iso(job.finished_at),
        "redacted_at": _iso(job.redacted_at),
        "error": None if job.error_code is None else {"code": job.error_code, "message": job.error_message},
        "results_url": f"/v1/jobs/{job.id}/results", "errors_url": f"/v1/jobs/{job.id}/errors",
        "webhook_url": job.webhook_url, "webhook_events": job.webhook_events,
    }


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


def _parse_id(job_id: str) -> uuid.UUID:
    return uuid_or_404(job_id, "job")
