"""Idempotency keys: a client's `Idempotency-Key` mapped to the request it created.

The primary key (tenant, key) is what makes a retried submit create at most one request, even
when the retries race each other: the key is inserted in the same transaction as the request
row, so of two concurrent submits with one key exactly one commits.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from sqlalchemy import ForeignKey, String, delete, func, select, tuple_
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base
from models.session import Database


class IdempotencyKey(Base):
    __tablename__ = "idempotency_keys"

    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"), index=True)
    # SHA-256 of the canonical JSON body: the same key with another body is a client bug (422).
    body_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(server_default=func.now(), index=True)


def expire_keys(db: Database, window_s: float, batch: int = 5000) -> int:
    """Delete up to ``batch`` keys older than the window (the sweep calls this)."""
    t = IdempotencyKey
    with db.session() as session:
        old = select(t.tenant_id, t.key).where(t.created_at <= func.now() - timedelta(seconds=window_s)).limit(batch)
        result = session.execute(delete(t).where(tuple_(t.tenant_id, t.key).in_(old)))
    return result.rowcount
