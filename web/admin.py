"""The admin API: tenants, their tiers, limit overrides and API keys.

Registered only when ``SLUICE_ADMIN_KEY`` is set; every call sends ``Authorization: Bearer
<admin key>``, compared in constant time. Tenants are addressed by name or id.

    GET    /admin/tenants               every tenant: tier, overrides, effective limits, active keys
    POST   /admin/tenants               {name, tier?, <limit>?, create_key?=true} → 201 (+ api_key, once)
    GET    /admin/tenants/<tenant>      one tenant
    PATCH  /admin/tenants/<tenant>      {tier?, <limit>?, disabled?}; null resets a value to the default;
                                        disabled: true refuses every key of the tenant (403)
    POST   /admin/tenants/<tenant>/keys {name?, owner?, expires_at?, scope?=tenant|own|submit}
                                        a new API key → 201 {api_key (shown once), key}
    GET    /admin/tenants/<tenant>/keys {keys: [{id, prefix, scope, created_at, last_used_at, revoked_at}]}
    DELETE /admin/tenants/<tenant>/keys/<key id>  revoke it (401 from its next call) → the key
    GET    /v1/admin/load               the load monitor's view: per class queue, drain, wait, level,
                                        steps in force, reservations and the workers paused for them
    POST   /v1/admin/reservations       {from, until, role?, note?} → 201: a peak reservation
    GET    /v1/admin/reservations       those in force or to come
    DELETE /v1/admin/reservations/<id>  cancel one (batch queues are read again within seconds)
"""

from __future__ import annotations

import functools
import hmac
import logging
from decimal import Decimal
from typing import Any

import redis
from flask import Blueprint, Response, jsonify, request
from marshmallow import Schema, fields, validate
from sqlalchemy import func, select

from core.admission.load import load_view
from core.broker.fair import lines_view, name_tenants, sync_reservations
from core.broker.queues import ROLES
from core.ids import uuid_or_404
from core.rediskeys import bump_auth_epoch
from core.submit.schemas import SafeString, StrictBoolean, StrictFloat, StrictInteger
from core.tenants.file_quotas import BIGINT_MAX
from core.tenants.manage import (
    MAX_RESERVED,
    TenantError,
    add_key,
    create_tenant,
    find_tenant,
    key_view,
    list_keys,
    list_tenants,
    revoke_key,
    set_disabled,
    tenant_view,
    update_tenant,
)
from core.tenants.scopes import SCOPES
from core.usage.budgets import PERIODS, UNITS
from core.usage.report import UsageQuery
from models import ApiKey, hash_key
from models.request import storable
from models.reservation import ReservationError, book, cancel, current_views, now
from web.bodies import json_object, validated
from web.errors import ApiError, NotFound, Unauthorized
from web.services import services
from web.usage_api import report_response

log = logging.getLogger(__name__)
INT32_MAX = 2**31 - 1

bp = Blueprint("admin", __name__, url_prefix="/admin")
# The operator's view of load lives beside the request API it describes.
load_bp = Blueprint("admin_load", __name__, url_prefix="/v1/admin")

_STATUS = {"tenant_exists": 409, "reservations_exceed_capacity": 409, "unknown_tier": 422, "invalid_request": 422,
           "key_not_found": 404}


class TenantLimitsSchema(Schema):
    """Body of PATCH /admin/tenants/<tenant>: null resets a value to the tier's."""

    tier = SafeString(allow_none=True, validate=validate.Length(min=1, max=32))
    # The columns are 32-bit integers.
    tokens_per_minute = StrictInteger(allow_none=True, validate=validate.Range(min=1, max=INT32_MAX))
    requests_per_minute = StrictInteger(allow_none=True, validate=validate.Range(min=1, max=INT32_MAX))
    max_concurrent = StrictInteger(allow_none=True, validate=validate.Range(min=1, max=INT32_MAX))
    max_request_tokens = StrictInteger(allow_none=True, validate=validate.Range(min=1, max=INT32_MAX))
    # File quotas (SLUICE_FILE_QUOTAS): stored bytes is a 64-bit column, the others 32-bit.
    max_stored_bytes = StrictInteger(allow_none=True, validate=validate.Range(min=1, max=BIGINT_MAX), metadata={
        "description": "Bytes the tenant's uploaded files may hold together (null: the tier's)."})
    max_files = StrictInteger(allow_none=True, validate=validate.Range(min=1, max=INT32_MAX),
                              metadata={"description": "Uploaded files the tenant may keep (null: the tier's)."})
    uploads_per_minute = StrictInteger(allow_none=True, validate=validate.Range(min=1, max=INT32_MAX),
                                       metadata={"description": "POST /v1/files calls per minute (null: the tier's)."})
    max_concurrent_uploads = StrictInteger(allow_none=True, validate=validate.Range(min=1, max=INT32_MAX), metadata={
        "description": "Upload bodies one web process spools for the tenant at once (null: the tier's)."})
    auto_service_tier = SafeString(allow_none=True, validate=validate.OneOf(["default", "priority"]), metadata={
        "description": "What the tenant's `service_tier: auto` buys: default, or priority (run as default, named "
                       "so, when the priority promise cannot be kept); null resets to default."})
    batch_weight = StrictFloat(allow_none=True, validate=validate.Range(min=0, max=1000, min_inclusive=False),
                               metadata={"description": "Share of batch capacity for bulk jobs against other "
                                                        "tenants', counted in tokens (default 1; null resets)."})
    reserved_share = StrictFloat(allow_none=True, validate=validate.Range(min=0, max=MAX_RESERVED,
                                                                          min_inclusive=False),
                                 metadata={"description": "The share (0 to 0.9) of each class's engine time the "
                                                          "tenant gets whenever it has work, beside tenants that "
                                                          "queue more (null: none). All tenants together hold at "
                                                          "most 0.9: past it, 409 reservations_exceed_capacity."})
    disabled = StrictBoolean(metadata={"description": "true: every key of the tenant gets 403 tenant_disabled "
                                                      "until false again."})


class TenantCreateSchema(TenantLimitsSchema):
    """Body of POST /admin/tenants."""

    name = SafeString(required=True, validate=validate.Length(min=1, max=100))
    create_key = fields.Boolean(load_default=True)

    class Meta:
        exclude = ("disabled",)  # a tenant starts enabled


@bp.before_request
@load_bp.before_request
def _require_admin_key() -> None:
    expected = services().settings.admin_key or ""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if not (expected and scheme.lower() == "bearer"
            and hmac.compare_digest(given.strip().encode(), expected.encode())):
        raise Unauthorized("The admin API needs `Authorization: Bearer <SLUICE_ADMIN_KEY>`.",
                           code="invalid_admin_key", headers={"WWW-Authenticate": 'Bearer realm="sluice-admin"'})


def _load(schema: Schema) -> dict[str, Any]:
    return validated(schema, json_object())


def _db():
    return services().db


def _settings():
    return services().settings


def _tenant_or_404(session, ref: str):
    if not storable(ref):
        raise NotFound("No such tenant.")  # no tenant has such a name, and Postgres cannot compare it
    tenant = find_tenant(session, ref)
    if tenant is None:
        raise NotFound(f"No tenant {ref!r}.")
    return tenant


def _active_keys(session, tenant) -> int:
    return session.scalar(select(func.count()).select_from(ApiKey).where(
        ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None)))


def _forget_keys() -> None:
    """After a revocation or a disable commits: web processes stop refusing from memory."""
    if not bump_auth_epoch(services().redis):
        log.warning("Redis unreachable: web processes may refuse a revoked key's submits (503) rather than "
                    "reject them (401) for up to SLUICE_AUTH_CACHE_S")


def _managed(fn):
    """Map TenantError to the error envelope."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TenantError as exc:
            raise ApiError(str(exc), code=exc.code, status=_STATUS.get(exc.code, 422)) from None
    return wrapper


@bp.get("/tenants")
def list_all() -> Response:
    with _db().session() as session:
        return jsonify(tenants=list_tenants(session, _settings()))


@bp.post("/tenants")
@_managed
def create() -> tuple[Response, int]:
    data = _load(TenantCreateSchema())
    name, make_key = data.pop("name"), data.pop("create_key")
    with _db().session() as session:
        tenant = create_tenant(session, _settings(), name, data.pop("tier", None), data)
        key = add_key(session, tenant) if make_key else None
        view = tenant_view(tenant, _settings(), 1 if key else 0)
    if data.get("reserved_share") is not None:
        _sync_reservations()
    return jsonify(**view, **({"api_key": key} if key else {})), 201


@bp.get("/tenants/<tenant_ref>")
def show(tenant_ref: str) -> Response:
    with _db().session() as session:
        tenant = _tenant_or_404(session, tenant_ref)
        return jsonify(tenant_view(tenant, _settings(), _active_keys(session, tenant)))


@bp.patch("/tenants/<tenant_ref>")
@_managed
def update(tenant_ref: str) -> Response:
    changes = _load(TenantLimitsSchema())
    disabled = changes.pop("disabled", None)
    with _db().session() as session:
        tenant = _tenant_or_404(session, tenant_ref)
        update_tenant(session, _settings(), tenant, changes)
        if disabled is not None:
            set_disabled(session, tenant, disabled)
        view = tenant_view(tenant, _settings(), _active_keys(session, tenant))
    if disabled:
        _forget_keys()
    if "reserved_share" in changes:
        _sync_reservations()
    return jsonify(view)


def _sync_reservations() -> None:
    """A reserved share changed: in force now, not at the load monitor's next copy."""
    try:
        sync_reservations(_db(), services().redis)
    except redis.RedisError:
        log.warning("reserved shares not copied to Redis; the load monitor will within seconds")


class KeyCreateSchema(Schema):
    """Body of POST /admin/tenants/<tenant>/keys (optional): who the key is for."""

    name = SafeString(allow_none=True, validate=validate.Length(min=1, max=100),
                      metadata={"description": "What the key is for: a service, a team, a person."})
    owner = SafeString(allow_none=True, validate=validate.Length(min=1, max=200),
                       metadata={"description": "Who holds it (an e-mail address, a team)."})
    expires_at = fields.AwareDateTime(allow_none=True, metadata={
        "description": "From then on the key is refused (401), like a revoked one."})
    # Checked by add_key (core/tenants/scopes.py parse_scope): 422 invalid_scope, as the CLI's check.
    scope = fields.Raw(allow_none=True, metadata={
        "enum": list(SCOPES), "description": "What the key may read: tenant (default) everything of the tenant, "
                                             "own only the requests, jobs and files it made, submit nothing."})


class BudgetSchema(Schema):
    """Body of POST /admin/tenants/<tenant>/budgets."""

    unit = SafeString(required=True, validate=validate.OneOf(UNITS),
                      metadata={"description": "tokens (input + output an engine computed) or usd (cost)."})
    amount = StrictFloat(required=True, validate=validate.Range(min=0.000001, max=1e13), metadata={
        "description": "Tokens (a whole number) or USD (to the micro-dollar)."})
    period = SafeString(required=True, validate=validate.OneOf(PERIODS),
                        metadata={"description": "day, week (from Monday), month (UTC calendar windows) or fixed "
                                                 "(starts_at to ends_at, whole hours)."})
    starts_at = fields.AwareDateTime(allow_none=True)
    ends_at = fields.AwareDateTime(allow_none=True)
    hard = StrictBoolean(load_default=False, metadata={
        "description": "true: charged at admission, requests past it get 429 budget_exhausted; false: only "
                       "budget.threshold webhooks at 50, 80 and 100 %."})
    api_key_id = fields.UUID(allow_none=True, metadata={"description": "One of the tenant's keys: its own budget."})
    webhook_url = SafeString(allow_none=True, validate=validate.Length(min=1, max=2048))


@bp.post("/tenants/<tenant_ref>/keys")
def new_api_key(tenant_ref: str) -> tuple[Response, int]:
    options = _load(KeyCreateSchema()) if request.get_data() else {}
    with _db().session() as session:
        tenant = _tenant_or_404(session, tenant_ref)
        key = add_key(session, tenant, **options)
        session.flush()
        shown = key_view(session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key))))
    return jsonify(tenant=tenant.name, api_key=key, key=shown), 201


@bp.post("/tenants/<tenant_ref>/budgets")
def new_budget(tenant_ref: str) -> tuple[Response, int]:
    data = _load(BudgetSchema())
    data["amount"] = Decimal(str(data["amount"]))
    with _db().session() as session:
        tenant = _tenant_or_404(session, tenant_ref)
    return jsonify(services().budgets.create(tenant, data, _settings().webhook_allow_list)), 201


@bp.get("/tenants/<tenant_ref>/budgets")
def budgets(tenant_ref: str) -> Response:
    with _db().session() as session:
        tenant = _tenant_or_404(session, tenant_ref)
    return jsonify({"object": "list", "data": services().budgets.views(tenant.id, services().redis)})


@bp.delete("/budgets/<budget_id>")
def delete_budget(budget_id: str) -> Response:
    services().budgets.delete(uuid_or_404(budget_id, "budget"))
    return jsonify(id=budget_id, deleted=True)


@load_bp.get("/usage")
def usage_report() -> Response:
    """Every tenant's usage (``tenant=<id>`` for one; ``group_by`` may include tenant)."""
    return report_response(UsageQuery.parse(request.args, None))


@bp.get("/tenants/<tenant_ref>/keys")
def api_keys(tenant_ref: str) -> Response:
    with _db().session() as session:
        return jsonify(keys=list_keys(session, _tenant_or_404(session, tenant_ref)))


@bp.delete("/tenants/<tenant_ref>/keys/<key_id>")
@_managed
def revoke_api_key(tenant_ref: str, key_id: str) -> Response:
    """The key, revoked; ``already_revoked`` when an earlier call did it (its revoked_at stays)."""
    uuid_or_404(key_id, "API key", hint="key ids are UUIDs", code="key_not_found")
    with _db().session() as session:
        key, revoked = revoke_key(session, key_id, _tenant_or_404(session, tenant_ref))
        view = key_view(key)
    _forget_keys()
    return jsonify(**view, already_revoked=not revoked)


@load_bp.get("/load")
def show_load() -> Response:
    """Per class, as the load monitor last published it: queue, drain, wait, level, workers;
    the peak reservations; and each class queue's fair line, tenant by tenant."""
    svc = services()
    with svc.db.session() as session:
        reservations = current_views(session)
        lines = name_tenants(session, lines_view(svc.redis))
    return jsonify({**load_view(svc.redis, svc.settings.ladder, reservations), "lines": lines})


class ReservationSchema(Schema):
    """Body of POST /v1/admin/reservations."""

    starts_at = fields.AwareDateTime(required=True, data_key="from")
    ends_at = fields.AwareDateTime(required=True, data_key="until")
    role = fields.String(load_default=None, allow_none=True, validate=validate.OneOf(sorted(ROLES)))
    note = fields.String(load_default=None, allow_none=True, validate=validate.Length(max=200))


def _reservation_error(exc: ReservationError) -> ApiError:
    if exc.code == "not_found":
        return NotFound(str(exc))
    return ApiError(str(exc), code=exc.code, status=422)


@load_bp.post("/reservations")
def book_reservation() -> tuple[Response, int]:
    data = _load(ReservationSchema())
    with _db().session() as session:
        try:
            reservation = book(session, data["starts_at"], data["ends_at"], data["role"], data["note"], tuple(ROLES))
        except ReservationError as exc:
            raise _reservation_error(exc) from None
        return jsonify(reservation.view(now(session))), 201


@load_bp.get("/reservations")
def list_reservations() -> Response:
    with _db().session() as session:
        return jsonify(reservations=current_views(session))


@load_bp.delete("/reservations/<reservation_id>")
def cancel_reservation(reservation_id: str) -> Response:
    rid = uuid_or_404(reservation_id, "reservation")
    with _db().session() as session:
        try:
            reservation = cancel(session, rid)
        except ReservationError as exc:
            raise _reservation_error(exc) from None
        return jsonify(reservation.view(now(session)))
