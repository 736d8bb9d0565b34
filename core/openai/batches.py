"""OpenAI Batches on Sluice bulk jobs: a batch *is* a job, made from a stored file's lines.

Creating a batch submits the stored file to ``JobService.submit`` as it would an upload to
``POST /v1/jobs`` (the OpenAI Batch input format is one ``core/jobs/ingest.py`` already reads), with
the lines held to the batch's endpoint (``JobParams.endpoint``) and ``on_invalid=skip``: a bad
line does not refuse the batch, it becomes an invalid item reported in the batch's error file,
as OpenAI reports a request that failed. A file with no valid line at all is refused (400).
The upload is read into the job before the answer, so a new batch is already ``in_progress``.

The job's status names are OpenAI's, so the batch's status is the job's. Its results are
written on each read from the job's items, in OpenAI's batch output format: the output file
holds the succeeded lines, the error file every other finished one (invalid, failed, expired,
cancelled), each with the item's error code and message.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

from sqlalchemy import func, select, tuple_

from core.errors import InvalidRequest, NotFound
from core.ids import uuid_or_404
from core.jobs.service import JobService
from core.openai.files import ChunkReader, FileStore, parse_id, unix
from core.openai.shapes import CHAT_URL, EMBEDDINGS_URL, URLS, choices, embedding_list, token_usage
from core.submit.embeddings import shown, vectors
from core.tenants.scopes import Caller
from models import Batch, InferenceRequest, ItemStatus, Job, JobItem, JobStatus, Tenant
from models.request import storable
from models.session import Database

FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata")
ERRORS = (ItemStatus.INVALID, ItemStatus.FAILED, ItemStatus.EXPIRED, ItemStatus.CANCELLED)
_ID = re.compile(r"^batch_([0-9a-f]{32})$")


def parse_batch_id(batch_id: str) -> uuid.UUID:
    match = _ID.match(batch_id)
    return uuid_or_404(match.group(1) if match else "", "batch", hint="batch ids look like batch_<32 hex digits>",
                       code="batch_not_found")  # "" is no UUID: the same 404


class BatchService:
    def __init__(self, db: Database, jobs: JobService, files: FileStore) -> None:
        self.db = db
        self.jobs = jobs
        self.files = files

    def create(self, tenant: Tenant, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise InvalidRequest("Send a JSON object: input_file_id, endpoint, completion_window, metadata.")
        problems: dict[str, list[str]] = {name: [f"Unknown field; a batch takes {', '.join(FIELDS)}."]
                                          for name in set(body) - set(FIELDS)}
        if body.get("endpoint") not in URLS:
            problems["endpoint"] = [f"Must be one of {', '.join(URLS)}."]
        if body.get("completion_window") != "24h":
            problems["completion_window"] = ["Must be 24h."]
        if not isinstance(body.get("input_file_id"), str):
            problems["input_file_id"] = ["Required: the id of a file uploaded with purpose batch."]
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(storable(k) and isinstance(v, str) and storable(v)
                                                     for k, v in metadata.items()):
            problems["metadata"] = ["Must be an object of at most 16 string values (no NUL)."]
        if problems:
            raise InvalidRequest("The batch has invalid fields; see details.", details=problems)
        kind, file_id = parse_id(body["input_file_id"])
        if kind is not None:  # a batch's results are no batch's input
            raise NotFound(f"No uploaded file {body['input_file_id']} for this API key.", code="file_not_found")
        file = self.files.get(Caller.of(tenant), file_id, body["input_file_id"], to_use=True)
        args = {"completion_window": "24h", "on_invalid": "skip"}
        if metadata:
            args["metadata"] = json.dumps(metadata)
        params = dataclasses.replace(self.jobs.params(args, tenant), endpoint=body["endpoint"])
        self.jobs.check_intake(tenant)
        job = self.jobs.submit(tenant, params, ChunkReader(self.files.chunks(file.id)))
        with self.db.session() as session:
            session.add(Batch(job_id=uuid.UUID(job["id"]), input_file_id=file.id, endpoint=body["endpoint"]))
        return self.get(Caller(tenant.id), f"batch_{uuid.UUID(job['id']).hex}")  # the submit's own answer

    def get(self, caller: Caller, batch_id: str) -> dict[str, Any]:
        job, batch = self._find(caller, batch_id)
        return view(job, batch, self._counts([job.id])[job.id])

    def list(self, caller: Caller, limit: int, after: str | None) -> list[dict[str, Any]]:
        """The batches ``caller`` sees, newest first; ``after``: those older than that batch (OpenAI's cursor)."""
        visible = caller.sees(Job.tenant_id, Job.api_key_id, "batches")
        query = (select(Job, Batch).join(Batch, Batch.job_id == Job.id).where(visible)
                 .order_by(Job.created_at.desc(), Job.id.desc()).limit(limit))
        if after:
            anchor, _ = self._find(caller, after)
            query = query.where(tuple_(Job.created_at, Job.id) < tuple_(anchor.created_at, anchor.id))
        with self.db.session() as session:
            rows = session.execute(query).all()
        counts = self._counts([job.id for job, _ in rows])
        return [view(job, batch, counts[job.id]) for job, batch in rows]

    def cancel(self, caller: Caller, batch_id: str) -> dict[str, Any]:
        job, _ = self._find(caller, batch_id)
        self.jobs.cancel(caller, str(job.id))
        return self.get(caller, batch_id)

    def output(self, caller: Caller, job_id: uuid.UUID, errors: bool) -> Iterator[bytes]:
        """One OpenAI batch output line per finished item, in input order, through a server-side cursor."""
        job, batch = self._results_of(caller, job_id, errors)
        statuses = ERRORS if errors else (ItemStatus.SUCCEEDED,)
        request_id = JobItem.requests[1]
        query = (select(JobItem.line, JobItem.custom_id, JobItem.result, JobItem.finish_reason, JobItem.input_tokens,
                        JobItem.output_tokens, JobItem.cached_tokens, JobItem.error_code,
                        JobItem.error_message, JobItem.finished_at,
                        request_id.label("request_id"), InferenceRequest.choices, InferenceRequest.params,
                        InferenceRequest.input["tools"].label("tools"), InferenceRequest.embedding,
                        func.jsonb_array_length(InferenceRequest.input["texts"]).label("texts"),
                        JobItem.body["url"].astext.label("url"),
                        func.coalesce(InferenceRequest.model_used, InferenceRequest.model_requested,
                                      job.model).label("model"))
                 .outerjoin(InferenceRequest, InferenceRequest.id == request_id)
                 .where(JobItem.job_id == job.id, JobItem.status.in_(statuses)).order_by(JobItem.line)
                 .execution_options(yield_per=2000))

        def generate() -> Iterator[bytes]:
            with self.db.session() as session:
                lines: list[str] = []
                for row in session.execute(query):
                    lines.append(json.dumps(output_line(job, batch, row)))
                    if len(lines) >= 500:
                        yield ("\n".join(lines) + "\n").encode()
                        lines = []
                if lines:
                    yield ("\n".join(lines) + "\n").encode()

        return generate()

    def output_file(self, caller: Caller, job_id: uuid.UUID, errors: bool) -> dict[str, Any]:
        """The file object of a batch's output or error file; its size is known only by writing it."""
        job, _ = self._results_of(caller, job_id, errors)
        kind = "err" if errors else "out"
        return {"id": f"file-{kind}-{job.id.hex}", "object": "file", "bytes": None,
                "created_at": unix(job.finished_at or job.created_at),
                "filename": f"batch_{job.id.hex}_{'error' if errors else 'output'}.jsonl", "purpose": "batch_output",
                "status": "processed", "expires_at": None, "status_details": None}

    def _find(self, caller: Caller, batch_id: str) -> tuple[Job, Batch]:
        """A batch ``caller`` sees (a key scoped ``own``: one it created), or 404."""
        visible = caller.sees(Job.tenant_id, Job.api_key_id, "batches")
        job_id = parse_batch_id(batch_id)
        with self.db.session() as session:
            row = session.execute(select(Job, Batch).join(Batch, Batch.job_id == Job.id)
                                  .where(Job.id == job_id, visible)).first()
        if row is None:
            raise caller.missing("batch", batch_id, code="batch_not_found", plural="batches")
        return row.Job, row.Batch

    def _results_of(self, caller: Caller, job_id: uuid.UUID, errors: bool) -> tuple[Job, Batch]:
        try:
            return self._find(caller, f"batch_{job_id.hex}")
        except NotFound:
            shown = f"file-{'err' if errors else 'out'}-{job_id.hex}"
            raise caller.missing("file", shown, code="file_not_found") from None

    def _counts(self, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, dict[str, int]]:
        """Items per status of each job, and the tokens its items spent (``input_tokens``,
        ``cached_tokens``, ``output_tokens``: the engine's counts, summed as each item ended)."""
        spent = ("input_tokens", "cached_tokens", "output_tokens")
        counts = {job_id: {s.value: 0 for s in ItemStatus} | dict.fromkeys(spent, 0) for job_id in job_ids}
        with self.db.session() as session:
            for job_id, status, n, *sums in session.execute(
                    select(JobItem.job_id, JobItem.status, func.count(),
                           *(func.sum(getattr(JobItem, name)) for name in spent))
                    .where(JobItem.job_id.in_(job_ids)).group_by(JobItem.job_id, JobItem.status)):
                counts[job_id][status.value] = n
                for name, tokens in zip(spent, sums, strict=True):
                    counts[job_id][name] += int(tokens or 0)
        return counts


def view(job: Job, batch: Batch, counts: dict[str, int]) -> dict[str, Any]:
    """The OpenAI batch object of a job. The output and error files are named once the job has
    ended and has lines for them (they can be read by id while it runs, partial)."""
    ended = job.status.terminal
    failed = sum(counts[s.value] for s in ERRORS)
    finished = {JobStatus.COMPLETED: "completed_at", JobStatus.FAILED: "failed_at", JobStatus.EXPIRED: "expired_at",
                JobStatus.CANCELLED: "cancelled_at"}
    stamps = {name: unix(job.finished_at) if job.status == status else None for status, name in finished.items()}
    errors = None if job.error_code is None else {"object": "list", "data": [
        {"code": job.error_code, "message": job.error_message, "param": None, "line": None}]}
    return {
        "id": f"batch_{job.id.hex}", "object": "batch", "endpoint": batch.endpoint, "errors": errors,
        "input_file_id": f"file-{batch.input_file_id.hex}", "completion_window": "24h", "status": job.status.value,
        "output_file_id": f"file-out-{job.id.hex}" if ended and counts[ItemStatus.SUCCEEDED.value] else None,
        "error_file_id": f"file-err-{job.id.hex}" if ended and failed else None,
        "created_at": unix(job.created_at), "in_progress_at": unix(job.started_at), "expires_at": unix(job.expires_at),
        "finalizing_at": None, "cancelling_at": unix(job.cancel_requested_at), **stamps,
        "request_counts": {"total": job.total_items + job.invalid_lines,
                           "completed": counts[ItemStatus.SUCCEEDED.value],
                           "failed": failed - counts[ItemStatus.CANCELLED.value]},
        "metadata": job.meta or None, "model": job.model,
        # As OpenAI's: what the batch's lines used so far.
        "usage": {"input_tokens": counts["input_tokens"],
                  "input_tokens_details": {"cached_tokens": counts["cached_tokens"]},
                  "output_tokens": counts["output_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": counts["input_tokens"] + counts["output_tokens"]},
    }


EXPIRED_LINE_CODE = "batch_expired"


def output_line(job: Job, batch: Batch, row) -> dict[str, Any]:
    """A line of OpenAI's batch output format; the response body is what the endpoint would answer."""
    line_id = f"batch_req_{job.id.hex}_{row.line}"
    if row.error_code is not None or row.result is None:
        # A line its batch's window ended before: OpenAI's code for it.
        code, message = ((EXPIRED_LINE_CODE, "The batch's completion window ended before this request ran.")
                         if row.error_code == "expired" else (row.error_code, row.error_message))
        return {"id": line_id, "custom_id": row.custom_id, "response": None,
                "error": {"code": code, "message": message}}
    usage = token_usage(row.input_tokens, row.output_tokens, row.cached_tokens)
    url = row.url or batch.endpoint  # a batch may mix the routes: each line answers as its own
    rid, chat = row.request_id.hex, url == CHAT_URL
    if url == EMBEDDINGS_URL:
        encoding = (row.params or {}).get("encoding_format", "float")
        body = embedding_list([shown(vector, encoding) for vector in vectors(row.embedding or b"", row.texts or 0)],
                              row.model, row.input_tokens)
        return {"id": line_id, "custom_id": row.custom_id,
                "response": {"status_code": 200, "request_id": str(row.request_id), "body": body}, "error": None}
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": "chat.completion" if chat else "text_completion",
            "created": unix(row.finished_at), "model": row.model,
            "choices": choices(str(row.request_id), row.result, row.finish_reason, row.choices, row.params or {},
                               row.tools, chat), "usage": usage}
    return {"id": line_id, "custom_id": row.custom_id,
            "response": {"status_code": 200, "request_id": str(row.request_id), "body": body}, "error": None}
