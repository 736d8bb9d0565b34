"""Every status change of a webhook delivery, in one place.

    pending ──claim──► pending (an attempt taken: attempts + 1, next_attempt_at past its lease)
       ├──record──► succeeded (2xx) | failed (refused by the SSRF guard, or past its retry window)
       │              | pending (the next attempt is due after its backoff)
       └──abandon──► failed (no attempt reached it within its retry window)
    succeeded | failed | pending ──redeliver──► pending (a new retry window, due now)

Each transition is one conditional ``UPDATE … WHERE status IN (<allowed from>)``: an attempt's
outcome is recorded only on a delivery still pending, so when two attempts overlap (a
redelivery while one runs) the first end recorded stands. Each says whether it changed the
row (or returns what it changed); nothing is written when it did not. Stamps are ``now()``.

A delivery is born ``pending`` (``core/delivery/webhooks.py: Webhooks.record`` inserts it): the
one status write outside this module. ``tests/test_state_owners.py`` fails on any other writer.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import ColumnElement, Row, case, func, update
from sqlalchemy.orm import Session

from models.delivery import Delivery, DeliveryStatus
from models.lifecycle import TransitionRefused

ALLOWED: dict[DeliveryStatus, frozenset[DeliveryStatus]] = {
    # pending → pending: an attempt taken, a retry scheduled, or a redelivery of one still pending.
    DeliveryStatus.PENDING: frozenset({DeliveryStatus.PENDING, DeliveryStatus.SUCCEEDED, DeliveryStatus.FAILED}),
    DeliveryStatus.SUCCEEDED: frozenset({DeliveryStatus.PENDING}),
    DeliveryStatus.FAILED: frozenset({DeliveryStatus.PENDING}),
}

NOT_ATTEMPTED = "No attempt was made within the retry window (is a webhooks worker running?)"


def allowed(source: DeliveryStatus, target: DeliveryStatus) -> bool:
    return target in ALLOWED.get(source, ())


def claim(session: Session, delivery_id: uuid.UUID, early_s: float, lease_s: float) -> Row[Any] | None:
    """Take an attempt of a pending delivery due within ``early_s``: attempts + 1, and its next
    attempt pushed ``lease_s`` ahead, so a duplicate message finds nothing due and a dead
    worker's attempt is found overdue. (url, payload, attempts, tenant_id), or None."""
    return session.execute(_transition(DeliveryStatus.PENDING, Delivery.id == delivery_id,
                                       Delivery.next_attempt_at <= func.now() + timedelta(seconds=early_s),
                                       sources=(DeliveryStatus.PENDING,))
                           .values(attempts=Delivery.attempts + 1,
                                   next_attempt_at=func.now() + timedelta(seconds=lease_s))
                           .returning(Delivery.url, Delivery.payload, Delivery.attempts, Delivery.tenant_id)
                           ).one_or_none()


def record(session: Session, delivery_id: uuid.UUID, *, status_code: int | None, error: str | None,
           final: bool = False, retry_in_s: float = 0.0) -> DeliveryStatus | None:
    """An attempt's outcome on a pending delivery: ``error`` None → succeeded; ``final`` (retrying
    cannot help) → failed; else pending again, due in ``retry_in_s``, or failed when that falls
    past its retry window. The status it moved to; None when it was no longer pending."""
    if error is None:
        target, values = DeliveryStatus.SUCCEEDED, {"finished_at": func.now()}
    elif final:
        target, values = DeliveryStatus.FAILED, {"finished_at": func.now()}
    else:
        next_at = func.now() + timedelta(seconds=retry_in_s)
        gives_up = next_at > Delivery.retry_until
        target, values = DeliveryStatus.PENDING, {
            "status": case((gives_up, DeliveryStatus.FAILED.value), else_=DeliveryStatus.PENDING.value),
            "next_attempt_at": next_at, "finished_at": case((gives_up, func.now()), else_=None)}
        _check((DeliveryStatus.PENDING,), DeliveryStatus.FAILED)
    status = session.scalar(_transition(target, Delivery.id == delivery_id, sources=(DeliveryStatus.PENDING,))
                            .values(last_status_code=status_code, last_error=error, **values)
                            .returning(Delivery.status))
    return None if status is None else DeliveryStatus(status)


def redeliver(session: Session, delivery_id: uuid.UUID, tenant_id: uuid.UUID | None,
              retry_for_s: float) -> Delivery | None:
    """Any status → pending, due now, with a new retry window (the tenant's delivery only,
    unless ``tenant_id`` is None: the operator's). The row after it, or None if there is none."""
    owned = [Delivery.tenant_id == tenant_id] if tenant_id is not None else []
    return session.scalar(_transition(DeliveryStatus.PENDING, Delivery.id == delivery_id, *owned).values(
        next_attempt_at=func.now(), finished_at=None, retry_until=func.now() + timedelta(seconds=retry_for_s))
        .returning(Delivery).execution_options(populate_existing=True))


def abandon(session: Session, grace_s: float) -> int:
    """pending → failed for deliveries whose retry window closed with no attempt due for more than
    ``grace_s`` (their message lost, no webhooks worker running); how many."""
    return session.execute(_transition(
        DeliveryStatus.FAILED, Delivery.retry_until < func.now(),
        Delivery.next_attempt_at < func.now() - timedelta(seconds=grace_s), sources=(DeliveryStatus.PENDING,))
        .values(finished_at=func.now(), last_error=func.coalesce(Delivery.last_error, NOT_ATTEMPTED))).rowcount


def _check(sources: tuple[DeliveryStatus, ...], target: DeliveryStatus) -> None:
    for source in sources:
        if not allowed(source, target):
            raise TransitionRefused(source, target, "delivery")


def _transition(target: DeliveryStatus, *where: ColumnElement[bool],
                sources: tuple[DeliveryStatus, ...] | None = None):
    """``UPDATE webhook_deliveries SET status = target WHERE status IN sources AND where``
    (sources: every status ``target`` may follow)."""
    sources = sources or tuple(s for s in ALLOWED if allowed(s, target))
    _check(sources, target)
    status = Delivery.status == sources[0] if len(sources) == 1 else Delivery.status.in_(sources)
    return update(Delivery).where(status, *where).values(status=target)

