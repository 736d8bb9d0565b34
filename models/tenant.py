"""Tenants and their API keys. Only a key's SHA-256 is stored; the key is shown once."""

from __future__ import annotations

import enum
import hashlib
import secrets
import uuid
from datetime import datetime, timedelta

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, String, func, or_, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column, relationship

from models.base import Base

KEY_PREFIX = "sk-sluice-"
# A key's last_used_at is written at most this often, so authentication stays one read.
LAST_USED_EVERY = timedelta(seconds=60)


class KeyScope(enum.StrEnum):
    """What a key may read of its tenant's (the rule itself: ``core/tenants/scopes.py``)."""

    TENANT = "tenant"  # everything of its tenant: every key made before scopes existed
    OWN = "own"  # submit; read, list and cancel only what this key made
    SUBMIT = "submit"  # submit only: no read, list, cancel or usage


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
    # File quotas: the tier's (SLUICE_FILE_QUOTAS), unless overridden here; NULL = the tier's value.
    max_stored_bytes: Mapped[int | None] = mapped_column(BigInteger)
    max_files: Mapped[int | None]
    uploads_per_minute: Mapped[int | None]
    max_concurrent_uploads: Mapped[int | None]
    # Set: every key of the tenant is refused (403 tenant_disabled) until it is cleared.
    disabled_at: Mapped[datetime | None]
    # Its share of batch capacity for bulk jobs, against the other tenants with jobs running
    # (counted in tokens, core/jobs/scheduling.py): 2 gets twice what 1 gets.
    batch_weight: Mapped[float] = mapped_column(default=1.0, server_default="1")
    # The share (0 to 1) of each class's engine time it gets whenever it has work queued, beside
    # the tenants that queue more (core/broker/fair.py); NULL: an equal turn with the rest.
    reserved_share: Mapped[float | None]
    # What its requests' `service_tier: auto` asks for (docs/tiers.md): default, or priority, which
    # runs as default (named on the row and in a header) when the priority promise cannot be kept.
    auto_service_tier: Mapped[str] = mapped_column(String(16), default="default", server_default="default")
    # Signs its webhooks (Standard Webhooks, ``whsec_…``); shown once, when made. After a rotation
    # the previous secret signs too, until previous_until, so receivers can switch without a gap.
    webhook_secret: Mapped[str | None] = mapped_column(String(64))
    webhook_previous_secret: Mapped[str | None] = mapped_column(String(64))
    webhook_previous_until: Mapped[datetime | None]

    keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")

    # Not a column: the id of the key this tenant was authenticated by in this call (set by
    # tenant_for_key), so what the call creates is that key's usage. None for an operator's lookup.
    via_key = None  # uuid.UUID | None; unannotated, so the mapper leaves it alone
    # Not a column either: that key's scope (KeyScope's value), which says what the call may read.
    via_scope = KeyScope.TENANT.value

    __table_args__ = tuple(
        CheckConstraint(f"{column} > 0", name=f"{column}_positive")
        for column in ("tokens_per_minute", "requests_per_minute", "max_concurrent", "max_request_tokens",
                       "batch_weight", "max_stored_bytes", "max_files", "uploads_per_minute",
                       "max_concurrent_uploads")) + (
        CheckConstraint("auto_service_tier IN ('default', 'priority')", name="auto_service_tier"),
        CheckConstraint("reserved_share > 0 AND reserved_share < 1", name="reserved_share"))


class ApiKey(Base):
    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint("scope IN ('tenant', 'own', 'submit')", name="scope"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # The first characters of the key, to tell keys apart in listings without revealing them.
    prefix: Mapped[str] = mapped_column(String(32))
    # Keys are 256-bit random secrets, so a plain SHA-256 is as strong as a slow hash here and
    # lets authentication be one indexed lookup.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    revoked_at: Mapped[datetime | None]
    # Stamped by authentication at most once a minute (LAST_USED_EVERY): up to a minute stale.
    last_used_at: Mapped[datetime | None]
    # For people: what the key is for and who holds it (shown in listings and usage), and when it
    # stops working by itself (refused as expired from then on, like a revoked key).
    name: Mapped[str | None] = mapped_column(String(100))
    owner: Mapped[str | None] = mapped_column(String(200))
    expires_at: Mapped[datetime | None]
    # What it may read (KeyScope); keys made before scopes read the whole tenant, as they always did.
    scope: Mapped[str] = mapped_column(String(16), default=KeyScope.TENANT, server_default=KeyScope.TENANT.value)

    tenant: Mapped[Tenant] = relationship(back_populates="keys")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def tenant_for_key(session: Session, key: str) -> Tenant | None:
    """The tenant an active (not revoked, not expired) API key belongs to, disabled or not, with
    ``via_key`` set to the key's id and ``via_scope`` to its scope; None for any other key.

    Stamps the key's ``last_used_at`` when the last stamp is over a minute old: the lookup itself
    says whether it is, so most calls cost this one query.
    """
    due = or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < func.now() - LAST_USED_EVERY)
    row = session.execute(select(Tenant, ApiKey.id, ApiKey.scope, due).join(
        ApiKey, ApiKey.tenant_id == Tenant.id).where(
        ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None),
        or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > func.now()))).first()
    if row is None:
        return None
    tenant, key_id, scope, stamp = row
    tenant.via_key = key_id
    tenant.via_scope = scope
    if stamp:
        # ``due`` again: of concurrent calls that all saw an old stamp, one writes it.
        session.execute(update(ApiKey).where(ApiKey.id == key_id, due).values(last_used_at=func.now()))
    return tenant
