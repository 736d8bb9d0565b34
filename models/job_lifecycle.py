"""Every status change of a bulk job and of its items, in one place.

    job:   validating ──admit──► in_progress ──settle──► finalizing ──settle──► completed | failed
             │    │                │  │  └───settle (nothing left to run)──► completed | failed
             │    └─fail_stale─► failed   └──expire (its window passed)──► expired ◄── finalizing
             └──request_cancel──► cancelling ◄── in_progress | finalizing
                                    └──settle (nothing runs)──► cancelled

    item:  pending ──begin_stage──► running ──begin_stage──► running (its next map-reduce stage)
             │                        └──end──► succeeded | failed | cancelled | expired
             ├──stop_pending──► cancelled | expired   (its job stopped before it ran)
             ├──invalidate_duplicates──► invalid      (a custom_id an earlier line used)
             └──fail──► failed                        (the feeder's unexpected error; running too)

Each transition is one conditional ``UPDATE … WHERE status IN (<from>)`` (the allowed sources, or
the one status the caller read, when its decision rests on it), so two writers racing on a row —
the API's cancel against the feeder's settlement, a feeder that lost its lease against the next
one — can never both win. Each says whether (or which rows) it changed; nothing is written when
it did not. A transition not in :data:`JOB_ALLOWED` / :data:`ITEM_ALLOWED` raises
:class:`TransitionRefused` before touching the database: a programming error, not a race.

Every function runs in the caller's session, so a move commits with what goes with it (an
upload's items, the items a cancel stops). Stamps are ``now()``: the transaction's start, the
clock ``created_at`` uses.

Births are the one status write outside this module: a job row is inserted ``validating``
(``core/jobs/intake.py``), and the upload's items are COPYed in ``pending`` or ``invalid``
(``core/jobs/ingest.py: copy_row``). ``tests/test_state_owners.py`` fails on any other writer.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, func, text, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from models.job import ItemStatus, Job, JobItem, JobStatus
from models.lifecycle import TransitionRefused

JOB_ALLOWED: dict[JobStatus, frozenset[JobStatus]] = {
    # A job is cancellable while its file is still read: the admit then finds it no longer validating.
    JobStatus.VALIDATING: frozenset({JobStatus.IN_PROGRESS, JobStatus.FAILED, JobStatus.CANCELLING}),
    JobStatus.IN_PROGRESS: frozenset({JobStatus.FINALIZING, JobStatus.COMPLETED, JobStatus.FAILED,
                                      JobStatus.CANCELLING, JobStatus.EXPIRED}),
    JobStatus.FINALIZING: frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLING,
                                     JobStatus.EXPIRED}),
    JobStatus.CANCELLING: frozenset({JobStatus.CANCELLED}),
}

ITEM_ALLOWED: dict[ItemStatus, frozenset[ItemStatus]] = {
    ItemStatus.PENDING: frozenset({ItemStatus.RUNNING, ItemStatus.CANCELLED, ItemStatus.EXPIRED, ItemStatus.INVALID,
                                   ItemStatus.FAILED}),
    # running → running: the item's next map-reduce stage replaces the requests of the last one.
    ItemStatus.RUNNING: frozenset({ItemStatus.RUNNING, ItemStatus.SUCCEEDED, ItemStatus.FAILED, ItemStatus.CANCELLED,
                                   ItemStatus.EXPIRED}),
}

NO_ITEM_SUCCEEDED = ("no_item_succeeded", "Every item of the job failed; see /errors.")
WINDOW_PASSED = ("expired", "The completion window passed; unfinished items expired.")
UPLOAD_INTERRUPTED = ("upload_interrupted", "The upload never finished (the web process handling it stopped).")


def _refused(status: JobStatus | ItemStatus, target: JobStatus | ItemStatus) -> TransitionRefused:
    return TransitionRefused(status, target, "job" if isinstance(status, JobStatus) else "item")


def job_allowed(source: JobStatus, target: JobStatus) -> bool:
    return target in JOB_ALLOWED.get(source, ())


def item_allowed(source: ItemStatus, target: ItemStatus) -> bool:
    return target in ITEM_ALLOWED.get(source, ())


# ---------------------------------------------------------------------- jobs

def admit(session: Session, job_id: uuid.UUID, window_s: int, *, total_items: int, invalid_lines: int,
          input_bytes: int, estimated_tokens: int, estimated_finish_s: float | None = None) -> bool:
    """validating → in_progress once its file was read: its counts, and its window starts now (and
    when it is estimated to finish, if the platform could say). False when it is no longer
    validating (cancelled, or failed as a stale upload, meanwhile)."""
    return _done(session, _job(JobStatus.IN_PROGRESS, Job.id == job_id).values(
        total_items=total_items, invalid_lines=invalid_lines, input_bytes=input_bytes,
        estimated_tokens=estimated_tokens, started_at=func.now(),
        expires_at=func.now() + timedelta(seconds=window_s),
        estimated_finish_at=None if estimated_finish_s is None else func.now() + timedelta(seconds=estimated_finish_s)))


def request_cancel(session: Session, job_id: uuid.UUID) -> bool:
    """validating | in_progress | finalizing → cancelling, stamping ``cancel_requested_at``;
    False when it was cancelling or ended already."""
    return _done(session, _job(JobStatus.CANCELLING, Job.id == job_id).values(cancel_requested_at=func.now()))


def settle(session: Session, job: Job, target: JobStatus) -> bool:
    """``job.status`` (as the caller read it, which its decision rests on) → ``target``:
    finalizing, or an end (stamped; ``failed`` with ``no_item_succeeded``). On success ``job``
    (the caller's copy) shows the new status too."""
    values: dict[str, Any] = {}
    if target.terminal:
        values["finished_at"] = func.now()
    if target == JobStatus.FAILED:
        values.update(error_code=NO_ITEM_SUCCEEDED[0], error_message=NO_ITEM_SUCCEEDED[1])
    statement = _job(target, Job.id == job.id, sources=(job.status,)).values(**values)
    return _moved(job, target, _done(session, statement))


def expire(session: Session, job: Job) -> bool:
    """``job.status`` (in_progress or finalizing, as read) → expired: its window passed."""
    code, message = WINDOW_PASSED
    statement = _job(JobStatus.EXPIRED, Job.id == job.id, sources=(job.status,)).values(
        finished_at=func.now(), error_code=code, error_message=message)
    return _moved(job, JobStatus.EXPIRED, _done(session, statement))


def fail_stale_uploads(session: Session, older_than_s: float) -> int:
    """validating → failed (``upload_interrupted``) for jobs created more than ``older_than_s``
    ago: the web process reading their upload died. How many."""
    code, message = UPLOAD_INTERRUPTED
    return session.execute(_job(JobStatus.FAILED, Job.created_at < func.now() - timedelta(seconds=older_than_s),
                                sources=(JobStatus.VALIDATING,))
                           .values(finished_at=func.now(), error_code=code, error_message=message)).rowcount


# ---------------------------------------------------------------------- items

class Spent(NamedTuple):
    """The tokens an item's stage used, as the engine counted them over its requests."""

    input: int = 0
    cached: int = 0  # of input: held by the prefix cache
    output: int = 0

    @classmethod
    def of(cls, rows) -> Spent:
        return cls(*(sum(getattr(r, name) or 0 for r in rows)
                     for name in ("input_tokens", "cached_tokens", "output_tokens")))


NOTHING = Spent()


def begin_stage(session: Session, job_id: uuid.UUID, line: int, *, depth: int, previous: list[uuid.UUID],
                requests: list[uuid.UUID], final: bool, spent: Spent = NOTHING,
                summarised: str | None = None) -> bool:
    """An item's next stage, its request ids written before the requests exist: pending → running
    for its first (depth 0, no previous stage; stamps ``started_at``, ``chunks``), else running →
    running in place of the stage whose requests were ``previous`` (``summarised``: the joined
    summaries it summarises, kept in ``result`` until it ends). ``spent``: the tokens the
    previous stage used. False when the item is not there to move (another writer moved it)."""
    first = depth == 0 and not previous
    where = [JobItem.job_id == job_id, JobItem.line == line]
    if previous:
        where.append(JobItem.requests == previous)
    values: dict[str, Any] = {"requests": requests, "depth": depth, "final": final,
                              "request_count": JobItem.request_count + len(requests),
                              **_adding(spent)}
    if depth == 0:
        values.update(chunks=len(requests), started_at=func.now())
    else:
        values["result"] = summarised
    source = ItemStatus.PENDING if first else ItemStatus.RUNNING
    return _done(session, _item(ItemStatus.RUNNING, *where, sources=(source,)).values(**values))


def end(session: Session, job_id: uuid.UUID, line: int, requests: list[uuid.UUID], target: ItemStatus, *,
        spent: Spent = NOTHING, result: str | None = None, finish_reason: str | None = None,
        code: str | None = None, message: str | None = None) -> bool:
    """running → ``target`` (an end) for the item whose current stage is ``requests``: its
    outcome, the tokens the stage used, stamped; a succeeded item drops its document."""
    if not target.terminal:
        raise _refused(ItemStatus.RUNNING, target)
    return _done(session, _item(target, JobItem.job_id == job_id, JobItem.line == line, JobItem.requests == requests,
                                sources=(ItemStatus.RUNNING,)).values(
        result=result, finish_reason=finish_reason, error_code=code, error_message=(message or "")[:500] or None,
        finished_at=func.now(), **_adding(spent), text=None if target == ItemStatus.SUCCEEDED else JobItem.text))


def _adding(spent: Spent) -> dict[str, Any]:
    return {"input_tokens": JobItem.input_tokens + spent.input, "cached_tokens": JobItem.cached_tokens + spent.cached,
            "output_tokens": JobItem.output_tokens + spent.output}


def fail(session: Session, job_id: uuid.UUID, line: int, code: str, message: str) -> bool:
    """pending | running → failed: something unexpected went wrong with the item."""
    return _done(session, _item(ItemStatus.FAILED, JobItem.job_id == job_id, JobItem.line == line,
                                sources=(ItemStatus.PENDING, ItemStatus.RUNNING)).values(
        finished_at=func.now(), error_code=code, error_message=message))


def stop_pending(session: Session, job_id: uuid.UUID, target: ItemStatus, code: str, message: str) -> int:
    """pending → ``target`` (cancelled or expired) for every item of a stopping job; how many."""
    if target not in (ItemStatus.CANCELLED, ItemStatus.EXPIRED):
        raise _refused(ItemStatus.PENDING, target)
    return session.execute(_item(target, JobItem.job_id == job_id, sources=(ItemStatus.PENDING,)).values(
        finished_at=func.now(), error_code=code, error_message=message)).rowcount


def invalidate_duplicates(session: Session, job_id: uuid.UUID) -> list[tuple[int, str, int]]:
    """pending → invalid (``duplicate_custom_id``, dropping its text) for each line whose
    custom_id an earlier line of the job used; (line, custom_id, first line) of each."""
    _check(ITEM_ALLOWED, (ItemStatus.PENDING,), ItemStatus.INVALID)
    # Two statements: the repeats found in one pass over the job's lines, then updated by primary
    # key. As one UPDATE joined to the window query, the planner (no statistics yet for lines
    # loaded in this very transaction) ran the window once per line: minutes for 100,000 lines.
    repeats = session.execute(text("""
        SELECT line, first FROM (
            SELECT line, min(line) OVER (PARTITION BY custom_id) AS first
            FROM job_items WHERE job_id = :job AND status = 'pending') seen
        WHERE line <> first"""), {"job": job_id}).all()
    if not repeats:
        return []
    return [tuple(r) for r in session.execute(text("""
        UPDATE job_items i SET status = 'invalid', text = NULL, body = NULL, estimated_tokens = 0,
               error_code = 'duplicate_custom_id', error_message = 'custom_id first appears on line ' || r.first
        FROM unnest(CAST(:lines AS int[]), CAST(:firsts AS int[])) AS r(line, first)
        WHERE i.job_id = :job AND i.line = r.line AND i.status = 'pending'
        RETURNING i.line, i.custom_id, r.first"""),
        {"job": job_id, "lines": [r.line for r in repeats], "firsts": [r.first for r in repeats]})]


# ---------------------------------------------------------------------- the statements

def _check(table: dict[Any, frozenset[Any]], sources: Iterable[Any], target: Any) -> None:
    for source in sources:
        if target not in table.get(source, ()):
            raise _refused(source, target)


def _job(target: JobStatus, *where: ColumnElement[bool], sources: tuple[JobStatus, ...] | None = None):
    """``UPDATE jobs SET status = target WHERE status IN sources AND where`` (sources: every
    status ``target`` may follow)."""
    sources = sources or tuple(s for s in JOB_ALLOWED if job_allowed(s, target))
    _check(JOB_ALLOWED, sources, target)
    return update(Job).where(_status_in(Job.status, sources), *where).values(status=target)


def _item(target: ItemStatus, *where: ColumnElement[bool], sources: tuple[ItemStatus, ...]):
    _check(ITEM_ALLOWED, sources, target)
    return update(JobItem).where(_status_in(JobItem.status, sources), *where).values(status=target)


def _status_in(column, sources: tuple[Any, ...]) -> ColumnElement[bool]:
    return column == sources[0] if len(sources) == 1 else column.in_(sources)


def _done(session: Session, statement) -> bool:
    return bool(session.execute(statement).rowcount)


def _moved(job: Job, target: JobStatus, done: bool) -> bool:
    """Show a move on the caller's copy of the row, without making it a pending ORM write."""
    if done:
        set_committed_value(job, "status", target)
    return done
