"""Tenants and their API keys. Only a key's SHA-256 is stored; the key is shown once."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from datetime import datetime

from sqlalchemy import CheckConstraint, ForeignKey, String, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column, relationship

from .base import Base

KEY_PREFIX = "sk-sluice-"


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    # Admission limits: the tier's (SLUICE_TIERS), unless overridden below. NULL tier = the
    # platform's default tier (SLUICE_DEFAULT_TIER); NULL override = the tier's value.
    tier: Mapped[str | None] = mapped_column(String(32))
    tokens_per_minute: Mapped[int | None]
    requests_per_minute: Mapped[int | None]
    max_concurrent: Mapped[int | None]
    max_request_tokens: Mapped[int | None]

    keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")

    __table_args__ = tuple(
        CheckConstraint(f"{column} > 0", name=f"{column}_positive")
        for column in ("tokens_per_minute", "requests_per_minute", "max_concurrent", "max_request_tokens"))


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # The first characters of the key, to tell keys apart in listings without revealing them.
    prefix: Mapped[str] = mapped_column(String(32))
    # Keys are 256-bit random secrets, so a plain SHA-256 is as strong as a slow hash here and
    # lets authentication be one indexed lookup.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    revoked_at: Mapped[datetime | None]

    tenant: Mapped[Tenant] = relationship(back_populates="keys")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def tenant_for_key(session: Session, key: str) -> Tenant | None:
    """The tenant an active (not revoked) API key belongs to; None for any other key."""
    return session.scalar(select(Tenant).join(ApiKey, ApiKey.tenant_id == Tenant.id).where(
        ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None)))
