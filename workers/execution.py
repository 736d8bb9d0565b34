"""One request's life on a worker: claim the row, run it in the engine, write the outcome.

No database session is held across inference: the claim and the outcome are separate short
transactions. Both are conditional updates, so a duplicate delivery, a cancel that won the
race, or a sweep that requeued the row after this worker was presumed dead can never make a
request run twice or reach two terminal states.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from models import InferenceRequest, Priority, Status, utcnow
from models.session import Database
from sluice.keys import conversation_key
from sluice.limiter import limiter_for

from .engines import GenerationRequest, SamplingParams
from .runtime import EngineRuntime, RunResult

log = logging.getLogger(__name__)

# Seconds to wait before each retry of the outcome write when Postgres is briefly unreachable;
# the answer was computed at GPU cost, so it is worth a few seconds of patience.
OUTCOME_WRITE_BACKOFF = (0.5, 2.0, 5.0, 10.0)
# Postgres unreachable, or every pooled connection busy past pool_timeout (a worker runs more
# threads than it has connections): transient, so retried, then the message is handed back.
DB_UNAVAILABLE = (OperationalError, PoolTimeout)

ENGINE_PRIORITY = {Priority.REALTIME: 0, Priority.BATCH: 1}


@dataclass(frozen=True)
class Claim:
    request: GenerationRequest
    time_limit_s: float
    tenant_id: uuid.UUID
    conversation_id: str | None


def db_now():
    """The database's clock, as `created_at` uses: queue wait and inference time subtract these
    stamps, so they must not mix the clocks of different hosts."""
    return func.clock_timestamp()


def with_db_retries(attempt):
    """Run ``attempt()``, retrying while the database is unavailable along OUTCOME_WRITE_BACKOFF."""
    for delay in (*OUTCOME_WRITE_BACKOFF, None):
        try:
            return attempt()
        except DB_UNAVAILABLE as exc:
            if delay is None:
                raise
            log.warning("database unavailable (%s); retrying in %.1fs", type(exc).__name__, delay)
            time.sleep(delay)


def claim(db: Database, request_id: uuid.UUID, worker_id: str, device: str) -> Claim | None:
    """queued → running for this worker, or None if the row is not ours to run."""
    return with_db_retries(lambda: _claim_once(db, request_id, worker_id, device))


def _claim_once(db: Database, request_id: uuid.UUID, worker_id: str, device: str) -> Claim | None:
    table = InferenceRequest
    now = utcnow()
    with db.session() as session:
        row = session.execute(
            update(table)
            .where(table.id == request_id, table.status == Status.QUEUED,
                   table.cancel_requested_at.is_(None),
                   or_(table.deadline_at.is_(None), table.deadline_at > now))
            .values(status=Status.RUNNING, started_at=db_now(), worker=worker_id, device=device,
                    attempts=table.attempts + 1)
            .returning(table.input, table.params, table.max_tokens, table.time_limit_s,
                       table.priority, table.input_tokens, table.tenant_id, table.conversation_id)
        ).one_or_none()
        if row is None:
            if expire_if_late(session, table.id == request_id):
                log.info("expired: its deadline passed while it was queued")
                return None
            status = session.scalar(select(table.status).where(table.id == request_id))
            log.info("not running: row is %s", status.value if status else "missing")
            return None
    params = row.params
    generation = GenerationRequest(
        request_id=str(request_id), prompt=render_prompt(row.input),
        params=SamplingParams(max_tokens=row.max_tokens, temperature=params.get("temperature", 1.0),
                              top_p=params.get("top_p", 1.0), seed=params.get("seed"),
                              stop=tuple(params.get("stop", ())), ignore_eos=params.get("ignore_eos", False)),
        priority=ENGINE_PRIORITY[row.priority], prompt_tokens=row.input_tokens,
        messages=tuple(row.input["messages"]) if "messages" in row.input else None)
    return Claim(generation, row.time_limit_s, row.tenant_id, row.conversation_id)


def expire_if_late(session, *where) -> int:
    """queued → expired for rows matching ``where`` whose deadline has passed; returns how many."""
    table = InferenceRequest
    now = utcnow()
    result = session.execute(update(table).where(
        *where, table.status == Status.QUEUED, table.deadline_at <= now).values(
        status=Status.EXPIRED, finished_at=now, error_code="deadline_exceeded",
        error_message="Not started before its deadline; dropped instead of computing an answer too late."))
    return result.rowcount


def render_prompt(request_input: dict[str, Any]) -> str:
    """Flatten chat messages into one prompt (engines with a chat template replace this)."""
    if "prompt" in request_input:
        return request_input["prompt"]
    lines = [f"{m['role']}: {m['content']}" for m in request_input["messages"]]
    return "\n".join(lines) + "\nassistant:"


_OUTCOMES = {
    "finished": (Status.SUCCEEDED, None, None),
    "timeout": (Status.TIMED_OUT, "time_limit_exceeded",
                "Inference ran past the request's time limit and was stopped."),
    "cancel": (Status.CANCELLED, "cancelled", "Cancelled by the client while running."),
    "engine_abort": (Status.FAILED, "engine_shutdown", "The worker shut down while this ran; retry."),
}


def finish(db: Database, request_id: uuid.UUID, worker_id: str, model: str, result: RunResult):
    """running → terminal, only if this worker still owns the row: the row's tokens, or None."""
    status, code, message = _OUTCOMES[result.ended_by]
    out = result.output
    values: dict[str, Any] = dict(status=status, finished_at=db_now(), model_used=model,
                                  first_token_at=result.first_token_at, error_code=code,
                                  error_message=message)
    if out is not None:
        # PostgreSQL text cannot hold NUL, and a model may emit it.
        values.update(output_text=out.text.replace("\x00", "\ufffd"), output_tokens=out.output_tokens,
                      input_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
                      finish_reason=out.finish_reason)
    return _write_terminal(db, request_id, worker_id, values)


def fail(db: Database, request_id: uuid.UUID, worker_id: str, code: str, message: str):
    return _write_terminal(db, request_id, worker_id, dict(
        status=Status.FAILED, finished_at=db_now(), error_code=code, error_message=message))


def _write_terminal(db: Database, request_id: uuid.UUID, worker_id: str, values: dict):
    """The conditional final write; returns the row's token columns, or None if not ours."""
    table = InferenceRequest
    statement = update(table).where(
        table.id == request_id, table.status == Status.RUNNING, table.worker == worker_id
    ).values(**values).returning(table.id, table.tenant_id, table.reserved_tokens, table.input_tokens,
                                 table.output_tokens, table.started_at)

    def attempt():
        with db.session() as session:
            return session.execute(statement).one_or_none()

    ended = with_db_retries(attempt)
    if ended is None:
        log.warning("outcome %s discarded: this worker no longer owns the row", values["status"])
        return None
    log.info("%s", values["status"].value)
    return ended


# A conversation sticks to its worker this long after its last turn started.
CONVERSATION_TTL_S = 3600


def execute(db: Database, redis, runtime: EngineRuntime, request_id: uuid.UUID) -> None:
    c = claim(db, request_id, runtime.worker_id, runtime.info["device"])
    if c is None:
        return
    if c.conversation_id and runtime.node:
        try:
            redis.set(conversation_key(str(c.tenant_id), c.conversation_id), runtime.node, ex=CONVERSATION_TTL_S)
        except Exception:
            log.warning("could not record conversation affinity; the next turn may miss the prefix cache")
    try:
        result = runtime.run(c.request, c.time_limit_s)
    except Exception:
        log.exception("engine error")
        release_admission(redis, fail(db, request_id, runtime.worker_id, "engine_error",
                                      "The inference engine failed on this request."))
        return
    try:
        ended = finish(db, request_id, runtime.worker_id, runtime.info["model"], result)
    except DB_UNAVAILABLE:
        raise  # Postgres stayed unavailable through every retry; the sweep finds the overdue row
    except Exception:
        # The outcome itself cannot be stored: say so on the row rather than leave it running.
        log.exception("outcome not storable")
        ended = fail(db, request_id, runtime.worker_id, "result_not_storable",
                     "The engine's result could not be stored; retry the request.")
    release_admission(redis, ended)


def release_admission(redis, ended) -> None:
    """Give back the finished request's unused reserved tokens and its concurrency slot.

    Once only (the limiter's release is idempotent); if Redis does not answer, the sweep's
    reconciliation does it from the row.
    """
    if ended is None:
        return
    try:
        limiter_for(redis).release_row(ended)
    except Exception:
        log.warning("could not release the admission reservation; the sweep will")
