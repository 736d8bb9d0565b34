"""Peak reservations: windows in which shared workers keep their capacity for realtime traffic.

An operator books one ahead of a known peak (``sluice reserve``, ``POST /v1/admin/reservations``).
Rows are the truth; the load monitor's leader reads them and makes the workers follow
(``workers/reservations.py``), so a window holds across restarts of any process.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import CheckConstraint, String, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base


class Reservation(Base):
    __tablename__ = "reservations"
    __table_args__ = (CheckConstraint("ends_at > starts_at", name="window_not_empty"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    starts_at: Mapped[datetime]
    ends_at: Mapped[datetime] = mapped_column(index=True)
    # Workers of this role pause their batch queues; None: every worker that serves both classes.
    role: Mapped[str | None] = mapped_column(String(32))
    note: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    cancelled_at: Mapped[datetime | None]

    def view(self, now: datetime) -> dict:
        state = ("cancelled" if self.cancelled_at else "active" if self.starts_at <= now < self.ends_at
                 else "ended" if now >= self.ends_at else "scheduled")
        return {"id": str(self.id), "from": self.starts_at.isoformat(), "until": self.ends_at.isoformat(),
                "role": self.role, "note": self.note, "state": state, "created_at": self.created_at.isoformat(),
                "cancelled_at": self.cancelled_at.isoformat() if self.cancelled_at else None}


def now(session: Session) -> datetime:
    """The database's clock, the one the windows are compared with."""
    return session.scalar(select(func.now()))


def current_views(session: Session) -> list[dict]:
    """``current``, as the load view and the listings show them."""
    at = now(session)
    return [r.view(at) for r in current(session)]


def current(session: Session) -> list[Reservation]:
    """Reservations not cancelled and not yet over (active or scheduled), soonest first."""
    return list(session.scalars(select(Reservation).where(
        Reservation.cancelled_at.is_(None), Reservation.ends_at > func.now()).order_by(Reservation.starts_at)))


def active(session: Session) -> list[Reservation]:
    """Reservations in force now, on the database clock."""
    return list(session.scalars(select(Reservation).where(
        Reservation.cancelled_at.is_(None), Reservation.starts_at <= func.now(), Reservation.ends_at > func.now())))


class ReservationError(ValueError):
    """A reservation that cannot be booked or cancelled; ``code`` is the API's error code."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


def book(session: Session, starts_at: datetime, ends_at: datetime, role: str | None, note: str | None,
         roles: tuple[str, ...]) -> Reservation:
    """A new reservation, checked: a non-empty window that is not over, a known worker role."""
    if starts_at.tzinfo is None or ends_at.tzinfo is None:
        raise ReservationError("Give the window's times with a timezone, e.g. 2026-12-01T18:00:00+00:00.")
    if ends_at <= starts_at:
        raise ReservationError("The window must end after it starts.")
    if ends_at <= now(session):
        raise ReservationError("The window is already over.")
    if role is not None and role not in roles:
        raise ReservationError(f"Unknown worker role {role!r}; choose one of {', '.join(roles)}.")
    reservation = Reservation(starts_at=starts_at, ends_at=ends_at, role=role, note=note)
    session.add(reservation)
    session.flush()
    return reservation


def cancel(session: Session, reservation_id: uuid.UUID) -> Reservation:
    reservation = session.get(Reservation, reservation_id, with_for_update=True)
    if reservation is None:
        raise ReservationError(f"No reservation {reservation_id}.", code="not_found")
    if reservation.cancelled_at is None:
        reservation.cancelled_at = now(session)
    return reservation
