"""The lifecycle module against real Postgres: allowed transitions, refused ones, stamps, hooks."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from types import SimpleNamespace

import pytest
from factories import request_row
from sqlalchemy import func, select, update

from models import InferenceRequest, Status
from models import lifecycle as lc
from models.lifecycle import Lifecycle, TransitionRefused


@pytest.fixture
def lifecycle(db):
    """A lifecycle whose hooks record what ended, reading the row back in a fresh session."""
    life = Lifecycle(db)
    life.seen = []

    def record(ended: lc.Ended) -> None:
        with db.session() as session:  # after commit: another session already sees the end
            life.seen.append((ended.id, ended.status, session.scalar(
                select(InferenceRequest.status).where(InferenceRequest.id == ended.id))))

    life.on_end(record)
    return life


def add_row(db, tenant_id, **values) -> uuid.UUID:
    with db.session() as session:
        row = request_row(tenant_id, **values)
        session.add(row)
    return row.id


def row_of(db, request_id) -> InferenceRequest:
    with db.session() as session:
        return session.get(InferenceRequest, request_id)


def db_clock(db):
    with db.session() as session:
        return session.scalar(select(func.clock_timestamp()))


def test_terminal_statuses_allow_no_transition():
    for status in Status:
        targets = [t for t in Status if lc.allowed(status, t)]
        assert (targets == []) == status.terminal, (status, targets)
    assert lc.allowed(Status.RUNNING, Status.QUEUED)  # requeue after a dead worker
    # Nothing finishes without running but a parked twin, whose only writer is follow_up.
    assert lc.allowed(Status.QUEUED, Status.SUCCEEDED)


def test_claim_then_finish_stamps_on_the_database_clock(db, tenant_id, lifecycle):
    rid = add_row(db, tenant_id)
    before = db_clock(db)
    claimed = lifecycle.claim(rid, "w/1", "dev0")
    assert claimed is not None and claimed.id == rid and claimed.max_tokens == 8
    assert lifecycle.claim(rid, "w/2", "dev1") is None, "a second delivery must not run it again"
    out = SimpleNamespace(text="hi", output_tokens=2, prompt_tokens=3, cached_tokens=0, finish_reason="length")
    assert lifecycle.finish(rid, "w/2", lc.SUCCEEDED, output=out) is None, "not the owner"
    ended = lifecycle.finish(rid, "w/1", lc.SUCCEEDED, model="m", output=out, first_token_after_s=3600)
    after = db_clock(db)
    assert ended is not None and ended.status == Status.SUCCEEDED and ended.output_tokens == 2
    row = row_of(db, rid)
    assert row.status == Status.SUCCEEDED and row.worker == "w/1" and row.attempts == 1
    assert before <= row.started_at <= row.finished_at <= after
    # A first token "an hour after the claim" is clamped to the end: never after finished_at.
    assert row.first_token_at == row.finished_at
    assert lifecycle.finish(rid, "w/1", lc.ENGINE_ERROR) is None, "one terminal status only"
    assert lifecycle.seen == [(rid, Status.SUCCEEDED, Status.SUCCEEDED)]


def test_a_finish_written_late_is_stamped_when_the_engine_ended(db, tenant_id, lifecycle):
    """The row's finished_at is the claim's database time plus the engine's end as the worker
    measured it: a result computed before its deadline whose write waited (a slow link, a retry)
    is not recorded as computed after it. Never later than the write itself."""
    rid = add_row(db, tenant_id)
    assert lifecycle.claim(rid, "w/1", "dev0") is not None
    time.sleep(0.3)  # the write comes well after the engine ended
    out = SimpleNamespace(text="hi", output_tokens=2, prompt_tokens=3, cached_tokens=0, finish_reason="stop")
    lifecycle.finish(rid, "w/1", lc.SUCCEEDED, output=out, first_token_after_s=0.02, finished_after_s=0.05)
    row = row_of(db, rid)
    assert row.finished_at - row.started_at == timedelta(seconds=0.05)
    assert row.first_token_at - row.started_at == timedelta(seconds=0.02)
    other = add_row(db, tenant_id)
    assert lifecycle.claim(other, "w/1", "dev0") is not None
    lifecycle.finish(other, "w/1", lc.SUCCEEDED, output=out, finished_after_s=3600)
    assert row_of(db, other).finished_at <= db_clock(db), "never after the write"


def test_claim_of_a_late_row_expires_it_instead(db, tenant_id, lifecycle):
    rid = add_row(db, tenant_id)
    with db.session() as session:
        session.execute(update(InferenceRequest).where(InferenceRequest.id == rid)
                        .values(deadline_at=func.now() - timedelta(seconds=1)))
    assert lifecycle.claim(rid, "w/1", "dev0") is None
    row = row_of(db, rid)
    assert row.status == Status.EXPIRED and row.error_code == "deadline_exceeded" and row.started_at is None
    assert lifecycle.seen == [(rid, Status.EXPIRED, Status.EXPIRED)]


def test_cancel_queued_running_and_finished(db, tenant_id, lifecycle):
    queued = add_row(db, tenant_id)
    row = lifecycle.cancel(tenant_id, queued)
    assert row.status == Status.CANCELLED and row.error_code == "cancelled"
    assert row.finished_at is not None and row.cancel_requested_at is not None
    with pytest.raises(TransitionRefused) as refused:
        lifecycle.cancel(tenant_id, queued)
    assert refused.value.status == Status.CANCELLED

    running = add_row(db, tenant_id)
    lifecycle.claim(running, "w/1", "dev0")
    flagged = lifecycle.cancel(tenant_id, running)
    assert flagged.status == Status.RUNNING and flagged.cancel_requested_at is not None
    assert lifecycle.cancel(uuid.uuid4(), running) is None, "another tenant's request does not exist"
    assert lifecycle.seen == [(queued, Status.CANCELLED, Status.CANCELLED)]


def test_expire_late_touches_only_queued_rows_past_their_deadline(db, tenant_id, lifecycle):
    late, on_time, running = (add_row(db, tenant_id) for _ in range(3))
    lifecycle.claim(running, "w/1", "dev0")
    with db.session() as session:
        session.execute(update(InferenceRequest).where(InferenceRequest.id.in_([late, running]))
                        .values(deadline_at=func.now() - timedelta(seconds=1)))
    assert lifecycle.expire_late(InferenceRequest.tenant_id == tenant_id) == 1
    assert [row_of(db, r).status for r in (late, on_time, running)] == [Status.EXPIRED, Status.QUEUED,
                                                                         Status.RUNNING]


def test_orphans_are_requeued_lost_stalled_or_cancelled(db, tenant_id, lifecycle):
    requeue, lost, cancelled, stalled = (add_row(db, tenant_id) for _ in range(4))
    for rid in (requeue, lost, cancelled, stalled):
        lifecycle.claim(rid, "w/dead", "dev0")
    with db.session() as session:
        session.execute(update(InferenceRequest).where(InferenceRequest.id == lost).values(attempts=3))
    lifecycle.cancel(tenant_id, cancelled)
    counts, requeued = lifecycle.recover_orphans(InferenceRequest.tenant_id == tenant_id, max_attempts=3, limit=10,
                                                 stalled=frozenset({stalled}))
    assert counts == {"requeued": 1, "worker_lost": 1, "cancelled_orphans": 1, "stalled_worker": 1}
    assert [r.id for r in requeued] == [requeue]
    back = row_of(db, requeue)
    assert back.status == Status.QUEUED and back.worker is None and back.started_at is None
    assert row_of(db, lost).error_code == "worker_lost" and row_of(db, cancelled).status == Status.CANCELLED
    assert row_of(db, stalled).status == Status.FAILED and row_of(db, stalled).error_code == "stalled_worker"
    assert {(r, s) for r, s, _ in lifecycle.seen} == {(lost, Status.FAILED), (cancelled, Status.CANCELLED),
                                                      (stalled, Status.FAILED)}


def test_a_failing_hook_never_undoes_the_transition(db, tenant_id):
    life = Lifecycle(db)
    calls = []

    def broken(ended: lc.Ended) -> None:
        calls.append(ended.id)
        raise RuntimeError("receiver down")

    life.on_end(broken)
    life.on_end(lambda ended: calls.append("second"))
    rid = add_row(db, tenant_id)
    assert life.cancel(tenant_id, rid).status == Status.CANCELLED
    assert calls == [rid, "second"] and row_of(db, rid).status == Status.CANCELLED
