"""Usage rollups and budgets.

``usage_hourly`` and ``usage_outcomes`` are kept by Postgres itself: a statement trigger on
``requests`` (migration ``b4e1c7a9d3f2``) adds every row that reaches a terminal status, in the
transaction of the move that ended it. A row ends once (the lifecycle's conditional updates), so
no retry, redelivery or second sweep can count it twice, and reading a month reads these tables,
never the request table. Refusals have no row: the web tier counts them in Redis and the sweep
writes the totals here (``kind = 'refusal'``, set, not added: writing them twice changes nothing).

An hour (a day, for error codes and refusals) is the one (UTC) its request was *created* in, the
moment a budget charges it.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, Index, Numeric, String, Text, func
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base

# The api_key_id of usage no key made (rows from before keys were recorded).
NO_KEY = uuid.UUID(int=0)


class Dimensions:
    """What a rollup row is of besides its hour or day: tenant × key × model × priority × service
    tier × source (first in the table and its primary key, after the time; the tier came later, in
    migration ``f7c2a9e4b1d6``, and sits last among them in the table)."""

    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True,
                                                 sort_order=-1)
    api_key_id: Mapped[uuid.UUID] = mapped_column(primary_key=True, sort_order=-1)
    model: Mapped[str] = mapped_column(String(128), primary_key=True, sort_order=-1)
    priority: Mapped[str] = mapped_column(String(16), primary_key=True, sort_order=-1)
    service_tier: Mapped[str] = mapped_column(String(16), primary_key=True, sort_order=-1)
    source: Mapped[str] = mapped_column(String(16), primary_key=True, sort_order=-1)


class UsageHourly(Dimensions, Base):
    __tablename__ = "usage_hourly"
    __table_args__ = (Index("ix_usage_hourly_tenant_id_hour", "tenant_id", "hour"),)

    hour: Mapped[datetime] = mapped_column(primary_key=True, sort_order=-2)  # UTC

    requests: Mapped[int] = mapped_column(BigInteger)  # ended, whatever their status
    cache_hits: Mapped[int] = mapped_column(BigInteger)
    # As the answers reported them to clients (cache hits included); nothing for a request with no answer.
    input_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    # Input + output of the requests an engine computed (not cache hits): what token budgets count.
    billed_tokens: Mapped[int] = mapped_column(BigInteger)
    cost: Mapped[Decimal] = mapped_column(Numeric(24, 10))
    # How they ended.
    succeeded: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    failed: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    timed_out: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cancelled: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    expired: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class UsageOutcome(Dimensions, Base):
    """The error codes requests ended with (``error``) and the refusals (``refusal``), by code, per
    day: a month of them stays a few thousand rows to read, however many codes each hour saw."""

    __tablename__ = "usage_outcomes"
    __table_args__ = (Index("ix_usage_outcomes_tenant_id_day", "tenant_id", "day"),)

    day: Mapped[datetime] = mapped_column(primary_key=True, sort_order=-2)  # UTC midnight

    kind: Mapped[str] = mapped_column(String(16), primary_key=True)  # error | refusal
    code: Mapped[str] = mapped_column(String(64), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)


class Budget(Base):
    """A tenant's (or one of its keys') budget in tokens or USD over a day, week, month (UTC
    calendar windows) or a fixed window. A hard one is charged at admission (core/usage/budgets.py);
    a soft one only warns, by webhook, at 50, 80 and 100 %."""

    __tablename__ = "budgets"
    __table_args__ = (
        CheckConstraint("unit IN ('tokens', 'usd')", name="unit"),
        CheckConstraint("period IN ('day', 'week', 'month', 'fixed')", name="period"),
        CheckConstraint("amount > 0", name="amount_positive"),
        CheckConstraint("(period = 'fixed') = (starts_at IS NOT NULL AND ends_at IS NOT NULL AND ends_at > starts_at)",
                        name="fixed_window"),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"))
    unit: Mapped[str] = mapped_column(String(8))  # tokens (billed tokens) | usd (cost)
    amount: Mapped[Decimal] = mapped_column(Numeric(24, 10))
    period: Mapped[str] = mapped_column(String(8))
    starts_at: Mapped[datetime | None]
    ends_at: Mapped[datetime | None]
    hard: Mapped[bool]
    webhook_url: Mapped[str | None] = mapped_column(Text)  # where budget.threshold events go
    # The window and the highest threshold (50, 80, 100) already announced in it.
    notified_window: Mapped[datetime | None]
    notified_percent: Mapped[int] = mapped_column(default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
