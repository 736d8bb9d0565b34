"""Tenant management shared by ``sluice tenants``, ``sluice keys`` and the admin API: create,
update, disable, list; create, list and revoke keys.

A tenant's limits are its tier's (``SLUICE_TIERS``) with its own overrides on top; an override of
None goes back to the tier's value. Its file quotas (``SLUICE_FILE_QUOTAS``) are overridden the same
way. Changes apply to the tenant's next submit (or upload). Revoking a key or disabling a tenant
applies to the next call; the caller then bumps ``core.rediskeys.AUTH_EPOCH_KEY``
after the commit, so web processes also stop refusing from memory (``web/auth.py``).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from core.settings import Settings
from core.tenants.file_quotas import QUOTA_FIELDS, effective_file_quotas, most
from core.tenants.scopes import parse_scope
from core.tenants.tiers import LIMIT_FIELDS, effective_limits
from models import ApiKey, Tenant, hash_key, new_key


class TenantError(ValueError):
    """A management request that cannot be carried out; ``code`` is stable, the message says why."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def find_tenant(session: Session, ref: str) -> Tenant | None:
    """By name, or by id when ``ref`` is a UUID."""
    try:
        return session.get(Tenant, uuid.UUID(ref))
    except ValueError:
        return session.scalar(select(Tenant).where(Tenant.name == ref))


def create_tenant(session: Session, settings: Settings, name: str, tier: str | None = None,
                  overrides: dict[str, int | None] | None = None) -> Tenant:
    if not name or len(name) > 100:
        raise TenantError("A tenant name is 1 to 100 characters.", "invalid_request")
    if session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise TenantError(f"A tenant named {name!r} already exists.", "tenant_exists")
    tenant = Tenant(name=name)
    _apply(tenant, settings, {"tier": tier, **(overrides or {})}, session)
    session.add(tenant)
    session.flush()
    return tenant


def update_tenant(session: Session, settings: Settings, tenant: Tenant, changes: dict[str, Any]) -> Tenant:
    """Apply ``changes`` (``tier``, limit and file quota fields); a value of None resets it to the default."""
    _apply(tenant, settings, changes, session)
    session.flush()
    return tenant


def add_key(session: Session, tenant: Tenant, *, name: str | None = None, owner: str | None = None,
            expires_at: datetime | None = None, scope: str | None = None) -> str:
    """Create an API key for ``tenant``, for a service or a person (``name``, ``owner``; refused
    from ``expires_at`` on) that reads what its ``scope`` allows (``core/tenants/scopes.py``;
    None: ``tenant``, everything; 422 ``invalid_scope`` for an unknown one); the key is returned
    once and only its hash is stored."""
    key = new_key()
    session.add(ApiKey(tenant_id=tenant.id, prefix=key[:14], key_hash=hash_key(key), name=name, owner=owner,
                       expires_at=expires_at, scope=parse_scope(scope).value))
    return key


def set_disabled(session: Session, tenant: Tenant, disabled: bool) -> Tenant:
    """Refuse (or accept again) every key of ``tenant``; disabling twice keeps the first time."""
    if not disabled:
        tenant.disabled_at = None
    elif tenant.disabled_at is None:
        tenant.disabled_at = func.now()
    session.flush()
    return tenant


def list_keys(session: Session, tenant: Tenant) -> list[dict[str, Any]]:
    """Every key of ``tenant``, revoked ones too, oldest first."""
    return [key_view(k) for k in session.scalars(
        select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.created_at, ApiKey.id))]


def revoke_key(session: Session, ref: str, tenant: Tenant | None = None) -> tuple[ApiKey, bool]:
    """Revoke the key ``ref`` names: its id, its prefix when no other key has it, or the key itself.
    Only among ``tenant``'s keys when given. Returns the key and whether this call revoked it: a key
    revoked already keeps its first ``revoked_at``."""
    query = select(ApiKey).with_for_update()
    try:
        query = query.where(ApiKey.id == uuid.UUID(ref))
    except ValueError:
        query = query.where(or_(ApiKey.prefix == ref, ApiKey.key_hash == hash_key(ref)))
    if tenant is not None:
        query = query.where(ApiKey.tenant_id == tenant.id)
    keys = session.scalars(query.limit(2)).all()
    if not keys:
        raise TenantError(f"No API key {ref!r}: give its id, or its prefix as key listings show it.",
                          "key_not_found")
    if len(keys) > 1:
        raise TenantError(f"More than one key has the prefix {ref!r}: give the key's id instead.", "ambiguous_key")
    key = keys[0]
    if key.revoked_at is not None:
        return key, False
    key.revoked_at = func.now()
    session.flush()
    return key, True


def key_view(key: ApiKey) -> dict[str, Any]:
    return {"id": str(key.id), "prefix": key.prefix, "name": key.name, "owner": key.owner,
            "scope": key.scope or "tenant", "created_at": _iso(key.created_at), "expires_at": _iso(key.expires_at),
            "last_used_at": _iso(key.last_used_at), "revoked_at": _iso(key.revoked_at)}


def list_tenants(session: Session, settings: Settings) -> list[dict[str, Any]]:
    keys = dict(session.execute(select(ApiKey.tenant_id, func.count()).where(ApiKey.revoked_at.is_(None))
                                .group_by(ApiKey.tenant_id)).all())
    return [tenant_view(t, settings, keys.get(t.id, 0)) for t in session.scalars(select(Tenant).order_by(Tenant.name))]


def tenant_view(tenant: Tenant, settings: Settings, active_keys: int | None = None) -> dict[str, Any]:
    view = {
        "id": str(tenant.id),
        "name": tenant.name,
        "tier": tenant.tier or settings.default_tier,
        "tier_is_default": tenant.tier is None,
        "overrides": {f: getattr(tenant, f) for f in (*LIMIT_FIELDS, *QUOTA_FIELDS) if getattr(tenant, f) is not None},
        "limits": effective_limits(settings.tiers, settings.default_tier, tenant).as_dict(),
        "file_quotas": effective_file_quotas(settings.file_quotas, settings.default_tier, tenant).as_dict(),
        "created_at": _iso(tenant.created_at),
        "batch_weight": tenant.batch_weight if tenant.batch_weight is not None else 1.0,
        "reserved_share": tenant.reserved_share,
        "auto_service_tier": tenant.auto_service_tier or "default",
        "disabled": tenant.disabled_at is not None,
        "disabled_at": _iso(tenant.disabled_at),
    }
    if active_keys is not None:
        view["active_keys"] = active_keys
    return view


# What all tenants together may hold in reservations: the rest of each class is always shared.
MAX_RESERVED = 0.9


def _reserve(session: Session, tenant: Tenant, share: Any) -> None:
    """Set (or, with None, clear) ``tenant``'s reserved share, within what the others leave."""
    if share is None:
        tenant.reserved_share = None
        return
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= MAX_RESERVED:
        raise TenantError(f"reserved_share must be a number > 0 and ≤ {MAX_RESERVED:g} (null: none).",
                          "invalid_request")
    held = select(func.coalesce(func.sum(Tenant.reserved_share), 0.0))
    others = session.scalar(held.where(Tenant.id != tenant.id) if tenant.id else held)  # a new one has no id yet
    if others + share > MAX_RESERVED + 1e-9:
        raise TenantError(f"reserved_share {share:g} with the {others:g} other tenants hold would reserve more "
                          f"than {MAX_RESERVED:g} of the engines; the rest is always shared.",
                          "reservations_exceed_capacity")
    tenant.reserved_share = float(share)


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def _apply(tenant: Tenant, settings: Settings, changes: dict[str, Any], session: Session) -> None:
    unknown = set(changes) - {"tier", "batch_weight", "reserved_share", "auto_service_tier", *LIMIT_FIELDS,
                              *QUOTA_FIELDS}
    if unknown:
        raise TenantError(f"Unknown fields: {', '.join(sorted(unknown))}.", "invalid_request")
    if "tier" in changes:
        tier = changes["tier"]
        if tier is not None and tier not in settings.tiers:
            raise TenantError(f"Unknown tier {tier!r}; the tiers are {', '.join(settings.tiers)}.", "unknown_tier")
        tenant.tier = tier
    if "batch_weight" in changes:
        weight = changes["batch_weight"]
        if weight is None:
            weight = 1.0
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= 1000:
            raise TenantError("batch_weight must be a number > 0 and ≤ 1000 (null: 1).", "invalid_request")
        tenant.batch_weight = float(weight)
    if "reserved_share" in changes:
        _reserve(session, tenant, changes["reserved_share"])
    if "auto_service_tier" in changes:
        auto = changes["auto_service_tier"]
        if auto not in (None, "default", "priority"):
            raise TenantError("auto_service_tier must be default or priority (null: default).", "invalid_request")
        tenant.auto_service_tier = auto or "default"
    for name in LIMIT_FIELDS:
        if name in changes:
            value = changes[name]
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise TenantError(f"{name} must be a whole number > 0, or null for the tier's value.",
                                  "invalid_request")
            setattr(tenant, name, value)
    for name in QUOTA_FIELDS:
        if name in changes:
            value = changes[name]
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 < value <= most(name)):
                raise TenantError(f"{name} must be a whole number > 0 and ≤ {most(name)}, or null for the tier's "
                                  "value.", "invalid_request")
            setattr(tenant, name, value)
