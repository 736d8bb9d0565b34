"""The job and item lifecycle (models/job_lifecycle.py) against real Postgres: allowed and refused
transitions, what each writes, and races on one row with one winner."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from functools import partial

import pytest
from sqlalchemy import func, select, update

from core.tenants.scopes import Caller
from models import ItemStatus, Job, JobItem, JobStatus, Tenant
from models import job_lifecycle as jl
from models.lifecycle import TransitionRefused
from web.services import services


def add_job(db, tenant_id, status=JobStatus.IN_PROGRESS, items=(), **values) -> uuid.UUID:
    """A job (born ``status``, as a test may) with one item per status in ``items``, lines 1, 2, …"""
    job = Job(tenant_id=tenant_id, status=status, model="simulated-llama-8b", priority="batch", instruction="Sum.",
              summary_tokens=8, completion_window_s=3600, **values)
    with db.session() as session:
        session.add(job)
        session.flush()
        for line, item in enumerate(items, 1):
            session.add(JobItem(job_id=job.id, line=line, status=item, text=f"document {line}", requests=[]))
    return job.id


def job_of(db, job_id) -> Job:
    with db.session() as session:
        return session.get(Job, job_id)


def item_of(db, job_id, line=1) -> JobItem:
    with db.session() as session:
        return session.get(JobItem, (job_id, line))


def run(db, step):
    with db.session() as session:
        return step(session)


def race(db, first, second):
    """``first`` moves the row in an open transaction; ``second`` runs meanwhile in another thread
    and must wait on the row's lock; then ``first`` commits. (first's result, second's)."""
    results: dict[str, object] = {}
    other = threading.Thread(target=lambda: results.setdefault("second", run(db, second)))
    with db.session() as session:
        results["first"] = first(session)
        other.start()
        other.join(0.5)
        assert other.is_alive(), "the second writer did not wait on the first one's row lock"
    other.join(10)
    return results["first"], results["second"]


def test_tables_end_in_terminal_statuses_only():
    for status in JobStatus:
        assert (not jl.JOB_ALLOWED.get(status)) == status.terminal, status
    for status in ItemStatus:
        assert (not jl.ITEM_ALLOWED.get(status)) == status.terminal, status
    assert jl.job_allowed(JobStatus.VALIDATING, JobStatus.CANCELLING)  # cancellable mid-upload
    assert not jl.job_allowed(JobStatus.CANCELLING, JobStatus.EXPIRED)  # a cancel is settled, never expired
    assert not jl.job_allowed(JobStatus.VALIDATING, JobStatus.COMPLETED)
    assert jl.item_allowed(ItemStatus.RUNNING, ItemStatus.RUNNING)  # the next map-reduce stage
    assert not jl.item_allowed(ItemStatus.PENDING, ItemStatus.SUCCEEDED)  # nothing succeeds without running


def test_admit_stamps_the_window_once(db, tenant_id):
    jid = add_job(db, tenant_id, JobStatus.VALIDATING)
    assert run(db, lambda s: jl.admit(s, jid, 600, total_items=3, invalid_lines=1, input_bytes=99,
                                      estimated_tokens=42))
    job = job_of(db, jid)
    assert job.status == JobStatus.IN_PROGRESS and (job.total_items, job.invalid_lines) == (3, 1)
    assert (job.input_bytes, job.estimated_tokens) == (99, 42)
    assert job.expires_at - job.started_at == timedelta(seconds=600)
    assert not run(db, lambda s: jl.admit(s, jid, 60, total_items=0, invalid_lines=0, input_bytes=0,
                                          estimated_tokens=0)), "admitted twice"
    assert job_of(db, jid).total_items == 3


def test_settle_moves_from_the_status_read_and_stamps_ends(db, tenant_id):
    jid = add_job(db, tenant_id)
    job = job_of(db, jid)
    assert run(db, lambda s: jl.settle(s, job, JobStatus.FINALIZING))
    assert job.status == JobStatus.FINALIZING and job_of(db, jid).finished_at is None
    stale = job_of(db, jid)
    assert run(db, lambda s: jl.settle(s, job, JobStatus.FAILED))
    row = job_of(db, jid)
    assert row.status == JobStatus.FAILED and row.finished_at is not None and row.error_code == "no_item_succeeded"
    # A copy read before that move decides on a status the row no longer has: nothing is written.
    assert not run(db, lambda s: jl.settle(s, stale, JobStatus.COMPLETED))
    assert stale.status == JobStatus.FINALIZING and job_of(db, jid).status == JobStatus.FAILED
    with pytest.raises(TransitionRefused):  # an ended job never moves again
        run(db, lambda s: jl.settle(s, job, JobStatus.COMPLETED))


def test_refused_transitions_write_nothing(db, tenant_id):
    jid = add_job(db, tenant_id, items=[ItemStatus.PENDING])
    job = job_of(db, jid)
    with pytest.raises(TransitionRefused) as refused:
        run(db, lambda s: jl.settle(s, job, JobStatus.CANCELLED))  # in_progress → cancelled skips cancelling
    assert (refused.value.status, refused.value.target) == (JobStatus.IN_PROGRESS, JobStatus.CANCELLED)
    with pytest.raises(TransitionRefused):
        run(db, lambda s: jl.end(s, jid, 1, [], ItemStatus.PENDING))
    with pytest.raises(TransitionRefused):
        run(db, lambda s: jl.stop_pending(s, jid, ItemStatus.SUCCEEDED, "x", "y"))
    assert job_of(db, jid).status == JobStatus.IN_PROGRESS and item_of(db, jid).status == ItemStatus.PENDING


def test_cancel_expire_and_stale_uploads(db, tenant_id):
    cancelled, uploading, done = (add_job(db, tenant_id, s) for s in (JobStatus.IN_PROGRESS, JobStatus.VALIDATING,
                                                                      JobStatus.COMPLETED))
    read_before = job_of(db, cancelled)
    assert run(db, lambda s: jl.request_cancel(s, cancelled)) and run(db, lambda s: jl.request_cancel(s, uploading))
    assert not run(db, lambda s: jl.request_cancel(s, cancelled)), "cancelling already"
    assert not run(db, lambda s: jl.request_cancel(s, done))
    assert job_of(db, cancelled).cancel_requested_at is not None and job_of(db, done).status == JobStatus.COMPLETED

    late = job_of(db, add_job(db, tenant_id, JobStatus.FINALIZING))
    assert run(db, lambda s: jl.expire(s, late)) and late.status == JobStatus.EXPIRED
    assert job_of(db, late.id).error_code == "expired" and job_of(db, late.id).finished_at is not None
    assert not run(db, lambda s: jl.expire(s, read_before)), "cancelled since it was read"
    assert read_before.status == JobStatus.IN_PROGRESS and job_of(db, cancelled).status == JobStatus.CANCELLING
    with pytest.raises(TransitionRefused):  # a cancelling job is settled as cancelled, never expired
        run(db, lambda s: jl.expire(s, job_of(db, cancelled)))

    stale, fresh, old_running = (add_job(db, tenant_id, s) for s in (JobStatus.VALIDATING, JobStatus.VALIDATING,
                                                                     JobStatus.IN_PROGRESS))
    with db.session() as session:
        session.execute(update(Job).where(Job.id.in_([stale, old_running]))
                        .values(created_at=func.now() - timedelta(hours=2)))
    assert run(db, lambda s: jl.fail_stale_uploads(s, 3600)) >= 1
    assert job_of(db, stale).error_code == "upload_interrupted" and job_of(db, stale).status == JobStatus.FAILED
    assert job_of(db, fresh).status == JobStatus.VALIDATING and job_of(db, old_running).status == JobStatus.IN_PROGRESS


def test_an_items_stages_and_end(db, tenant_id):
    jid = add_job(db, tenant_id, items=[ItemStatus.PENDING])
    first, second = [uuid.uuid4(), uuid.uuid4()], [uuid.uuid4()]
    assert run(db, lambda s: jl.begin_stage(s, jid, 1, depth=0, previous=[], requests=first, final=False))
    assert not run(db, lambda s: jl.begin_stage(s, jid, 1, depth=0, previous=[], requests=first, final=False)), \
        "a second feeder must not start it again"
    item = item_of(db, jid)
    assert item.status == ItemStatus.RUNNING and item.chunks == 2 and item.request_count == 2 and item.started_at
    assert not run(db, lambda s: jl.begin_stage(s, jid, 1, depth=1, previous=[uuid.uuid4()], requests=second,
                                                final=True)), "not the stage it runs"
    assert run(db, lambda s: jl.begin_stage(s, jid, 1, depth=1, previous=first, requests=second, final=True,
                                            spent=jl.Spent(10, 3, 4), summarised="a\n\nb"))
    item = item_of(db, jid)
    assert (item.depth, item.final, item.requests, item.result) == (1, True, second, "a\n\nb")
    assert (item.request_count, item.input_tokens, item.cached_tokens, item.output_tokens, item.chunks) == \
        (3, 10, 3, 4, 2)
    assert not run(db, lambda s: jl.end(s, jid, 1, first, ItemStatus.SUCCEEDED)), "an old stage's end"
    assert run(db, lambda s: jl.end(s, jid, 1, second, ItemStatus.SUCCEEDED, spent=jl.Spent(5, 1, 2), result="summary",
                                    finish_reason="stop"))
    item = item_of(db, jid)
    assert item.status == ItemStatus.SUCCEEDED and item.result == "summary" and item.text is None
    assert (item.input_tokens, item.cached_tokens, item.output_tokens) == (15, 4, 6) and item.finished_at is not None
    assert not run(db, lambda s: jl.end(s, jid, 1, second, ItemStatus.FAILED, code="x")), "one end only"
    assert not run(db, lambda s: jl.fail(s, jid, 1, "internal_error", "m"))


def test_failed_stopped_and_duplicate_items(db, tenant_id):
    jid = add_job(db, tenant_id, items=[ItemStatus.PENDING, ItemStatus.RUNNING, ItemStatus.PENDING,
                                        ItemStatus.SUCCEEDED])
    assert run(db, lambda s: jl.fail(s, jid, 1, "internal_error", "logged"))
    long = "x" * 600
    assert run(db, lambda s: jl.end(s, jid, 2, [], ItemStatus.FAILED, code="engine_error", message=long))
    assert len(item_of(db, jid, 2).error_message) == 500 and item_of(db, jid, 2).text == "document 2"
    assert run(db, lambda s: jl.stop_pending(s, jid, ItemStatus.EXPIRED, "expired", "window")) == 1
    assert [item_of(db, jid, line).status for line in (1, 2, 3, 4)] == [
        ItemStatus.FAILED, ItemStatus.FAILED, ItemStatus.EXPIRED, ItemStatus.SUCCEEDED]

    dup = add_job(db, tenant_id, JobStatus.VALIDATING)
    with db.session() as session:
        for line, (status, custom_id) in enumerate([(ItemStatus.PENDING, "a"), (ItemStatus.PENDING, "b"),
                                                    (ItemStatus.PENDING, "a"), (ItemStatus.INVALID, "a")], 1):
            session.add(JobItem(job_id=dup, line=line, status=status, custom_id=custom_id, text="t", requests=[]))
    assert run(db, lambda s: jl.invalidate_duplicates(s, dup)) == [(3, "a", 1)]
    third = item_of(db, dup, 3)
    assert third.status == ItemStatus.INVALID and third.error_code == "duplicate_custom_id" and third.text is None


def test_cancel_against_settlement_has_one_winner(db, tenant_id):
    for settles_first in (True, False):
        jid = add_job(db, tenant_id)
        job = job_of(db, jid)
        settle = partial(jl.settle, job=job, target=JobStatus.COMPLETED)
        cancel = partial(jl.request_cancel, job_id=jid)
        first, second = race(db, *((settle, cancel) if settles_first else (cancel, settle)))
        assert (first, second) == (True, False)
        assert job_of(db, jid).status == (JobStatus.COMPLETED if settles_first else JobStatus.CANCELLING)
        assert (job_of(db, jid).cancel_requested_at is None) == settles_first


def test_two_feeders_start_an_item_once(db, tenant_id):
    jid = add_job(db, tenant_id, items=[ItemStatus.PENDING])
    mine, theirs = [uuid.uuid4()], [uuid.uuid4()]
    first, second = race(db, lambda s: jl.begin_stage(s, jid, 1, depth=0, previous=[], requests=mine, final=True),
                         lambda s: jl.begin_stage(s, jid, 1, depth=0, previous=[], requests=theirs, final=True))
    assert (first, second) == (True, False)
    assert item_of(db, jid).requests == mine and item_of(db, jid).request_count == 1


def test_an_item_ends_once_when_its_end_and_a_failure_race(db, tenant_id):
    jid = add_job(db, tenant_id, items=[ItemStatus.RUNNING])
    first, second = race(db, lambda s: jl.end(s, jid, 1, [], ItemStatus.SUCCEEDED, result="done"),
                         lambda s: jl.fail(s, jid, 1, "internal_error", "late"))
    assert (first, second) == (True, False)
    with db.session() as session:
        assert session.scalar(select(JobItem.error_code).where(JobItem.job_id == jid)) is None


def test_a_job_cancelled_while_its_file_is_read_keeps_the_cancel(app, db, tenant_id):
    """The admit finds the job no longer validating: its lines are dropped, the cancel stands."""
    svc = services(app)
    with db.session() as session:
        tenant = session.get(Tenant, tenant_id)

    class CancelledMidUpload:
        def __init__(self) -> None:
            self.chunks = [b'{"custom_id": "a", "text": "one document"}\n', b'{"custom_id": "b", "text": "two"}\n']

        def read(self, _size: int) -> bytes:
            if len(self.chunks) == 1:  # the first line is in the COPY: the client cancels now
                with db.session() as session:
                    job_id = session.scalar(select(Job.id).where(Job.tenant_id == tenant_id,
                                                                 Job.status == JobStatus.VALIDATING))
                svc.jobs.cancel(Caller(tenant_id), str(job_id))
            return self.chunks.pop(0) if self.chunks else b""

    view = svc.jobs.submit(tenant, svc.jobs.params({}, tenant), CancelledMidUpload())
    assert view["status"] == "cancelling" and view["counts"]["total"] == 0 and view["cancel_requested_at"]
    with db.session() as session:
        assert session.scalar(select(func.count()).select_from(JobItem).where(JobItem.job_id == view["id"])) == 0


def test_an_item_another_writer_holds_waits_for_a_later_tick_instead_of_failing(app, client, worker):
    """A job's cancel updates every item in one transaction; the feeder starting one of them then
    waits on its row lock, up to the session's lock_timeout (5 s), and gets LockNotAvailable. That
    used to fail the item as internal_error (one item lost); it is a conflict: the item stays
    pending, and the next tick starts it."""
    from core.jobs.feeder import Feeder

    lines = b'{"custom_id": "a", "text": "one document"}\n{"custom_id": "b", "text": "another one"}\n'
    upload = client.http.post("/v1/jobs", data=lines, headers={**client.headers, "Content-Type": "application/jsonl"})
    assert upload.status_code in (200, 201, 202), upload.get_json()
    job_id = uuid.UUID(upload.get_json()["id"])
    db = services(app).db

    def statuses() -> list[ItemStatus]:
        with db.session() as session:
            return list(session.scalars(select(JobItem.status).where(JobItem.job_id == job_id).order_by(JobItem.line)))

    with app.app_context():
        with db.session() as holder:  # another writer, holding every item's row
            holder.execute(select(JobItem.line).where(JobItem.job_id == job_id).with_for_update()).all()
            Feeder(services(app)).tick()
            assert statuses() == [ItemStatus.PENDING, ItemStatus.PENDING]
            holder.rollback()
        Feeder(services(app)).tick()
    assert set(statuses()) <= {ItemStatus.RUNNING, ItemStatus.SUCCEEDED}, statuses()
    client.http.post(f"/v1/jobs/{job_id}/cancel", headers=client.headers)
