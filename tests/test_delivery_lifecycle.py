"""The webhook delivery lifecycle (models/delivery_lifecycle.py) against real Postgres: claims,
outcomes, redelivery, abandonment, refused transitions and races with one winner."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update
from test_job_lifecycle import add_job, race, run

from models import Delivery, DeliveryStatus
from models import delivery_lifecycle as dl

D = DeliveryStatus


def add_delivery(db, tenant_id, status=D.PENDING, retry_for=timedelta(hours=1), **values) -> uuid.UUID:
    """A delivery of a job's progress event (a birth with any status, as a test may), due now."""
    job_id = add_job(db, tenant_id)
    with db.session() as session:
        row = Delivery(tenant_id=tenant_id, job_id=job_id, event="job.progress", url="https://example.com/hook",
                       payload={"type": "job.progress"}, status=status, retry_until=func.now() + retry_for, **values)
        session.add(row)
        session.flush()
        return row.id


def row_of(db, delivery_id) -> Delivery:
    with db.session() as session:
        return session.get(Delivery, delivery_id)


def seconds_until_next_attempt(db, delivery_id) -> float:
    with db.session() as session:
        return session.scalar(select(func.extract("epoch", Delivery.next_attempt_at - func.now()))
                              .where(Delivery.id == delivery_id))


def test_every_delivery_can_be_sent_again_and_nothing_else_leaves_an_end():
    assert all(dl.allowed(s, D.PENDING) for s in D)
    assert not dl.allowed(D.SUCCEEDED, D.FAILED) and not dl.allowed(D.FAILED, D.SUCCEEDED)
    with pytest.raises(dl.TransitionRefused):
        dl._transition(D.FAILED, sources=(D.SUCCEEDED,))


def test_claim_takes_one_attempt_of_a_due_pending_delivery(db, tenant_id):
    did = add_delivery(db, tenant_id)
    claimed = run(db, lambda s: dl.claim(s, did, 1.0, 90.0))
    assert claimed is not None and claimed.attempts == 1 and claimed.url == "https://example.com/hook"
    assert 80 < seconds_until_next_attempt(db, did) <= 90
    assert run(db, lambda s: dl.claim(s, did, 1.0, 90.0)) is None, "a duplicate message finds nothing due"
    ended = add_delivery(db, tenant_id, D.FAILED)
    assert run(db, lambda s: dl.claim(s, ended, 1.0, 90.0)) is None
    assert row_of(db, did).status == D.PENDING and row_of(db, ended).attempts == 0


def test_outcomes_of_an_attempt(db, tenant_id):
    sent, guarded, retried, given_up = (add_delivery(db, tenant_id) for _ in range(4))
    assert run(db, lambda s: dl.record(s, sent, status_code=204, error=None)) == D.SUCCEEDED
    assert run(db, lambda s: dl.record(s, guarded, status_code=None, error="refused", final=True)) == D.FAILED
    assert run(db, lambda s: dl.record(s, retried, status_code=500, error="HTTP 500", retry_in_s=30)) == D.PENDING
    assert run(db, lambda s: dl.record(s, given_up, status_code=500, error="HTTP 500", retry_in_s=7200)) == D.FAILED
    assert row_of(db, sent).finished_at is not None and row_of(db, sent).last_status_code == 204
    assert row_of(db, guarded).finished_at is not None and row_of(db, guarded).last_error == "refused"
    assert row_of(db, retried).finished_at is None and 25 < seconds_until_next_attempt(db, retried) <= 30
    assert row_of(db, given_up).finished_at is not None and row_of(db, given_up).last_status_code == 500
    # An end stands: a later attempt's outcome is not recorded over it.
    assert run(db, lambda s: dl.record(s, sent, status_code=500, error="HTTP 500", retry_in_s=5)) is None
    assert row_of(db, sent).status == D.SUCCEEDED and row_of(db, sent).last_status_code == 204


def test_redeliver_any_status_with_a_new_window(db, tenant_id):
    did = add_delivery(db, tenant_id, D.FAILED, retry_for=timedelta(seconds=-5), finished_at=func.now())
    assert run(db, lambda s: dl.redeliver(s, did, uuid.uuid4(), 3600)) is None, "another tenant's"
    row = run(db, lambda s: dl.redeliver(s, did, tenant_id, 3600))
    assert row.status == D.PENDING and row.finished_at is None and row.id == did
    assert seconds_until_next_attempt(db, did) <= 0
    with db.session() as session:
        assert session.scalar(select(Delivery.retry_until > func.now() + timedelta(minutes=59))
                              .where(Delivery.id == did))
    assert run(db, lambda s: dl.redeliver(s, did, None, 3600)).status == D.PENDING, "the operator's: any tenant"


def test_abandon_only_pending_deliveries_past_their_window(db, tenant_id):
    late, running, ended = (add_delivery(db, tenant_id, s, retry_for=timedelta(seconds=-1))
                            for s in (D.PENDING, D.PENDING, D.SUCCEEDED))
    on_time = add_delivery(db, tenant_id)
    with db.session() as session:
        session.execute(update(Delivery).where(Delivery.id.in_([late, ended, on_time]))
                        .values(next_attempt_at=func.now() - timedelta(minutes=1)))
        session.execute(update(Delivery).where(Delivery.id == running)  # an attempt holds it
                        .values(next_attempt_at=func.now() + timedelta(minutes=1)))
    assert run(db, lambda s: dl.abandon(s, 1.0)) >= 1
    assert row_of(db, late).status == D.FAILED and "No attempt" in row_of(db, late).last_error
    assert [row_of(db, d).status for d in (running, ended, on_time)] == [D.PENDING, D.SUCCEEDED, D.PENDING]


def test_overlapping_attempts_record_one_end(db, tenant_id):
    did = add_delivery(db, tenant_id)
    first, second = race(db, lambda s: dl.record(s, did, status_code=200, error=None),
                         lambda s: dl.record(s, did, status_code=None, error="timeout", retry_in_s=5))
    assert (first, second) == (D.SUCCEEDED, None)
    assert row_of(db, did).status == D.SUCCEEDED and row_of(db, did).last_error is None


def test_two_workers_claim_one_attempt(db, tenant_id):
    did = add_delivery(db, tenant_id)
    first, second = race(db, lambda s: dl.claim(s, did, 1.0, 90.0), lambda s: dl.claim(s, did, 1.0, 90.0))
    assert first is not None and second is None and row_of(db, did).attempts == 1


def test_abandon_and_a_late_attempt_have_one_winner(db, tenant_id):
    did = add_delivery(db, tenant_id, retry_for=timedelta(seconds=-1))
    with db.session() as session:
        session.execute(update(Delivery).where(Delivery.id == did)
                        .values(next_attempt_at=func.now() - timedelta(minutes=1)))
    first, second = race(db, lambda s: dl.abandon(s, 1.0),
                         lambda s: dl.record(s, did, status_code=200, error=None))
    assert first >= 1 and second is None and row_of(db, did).status == D.FAILED
