"""The webhooks API: thin handlers over ``core/delivery/webhooks.py``. A tenant sees only its own.

    GET  /v1/webhooks/deliveries                   newest first (?request_id=, ?job_id=, ?status=,
                                                   ?limit=, ?before=<delivery id>)
    GET  /v1/webhooks/deliveries/<id>              one delivery: attempts, last answer, next attempt
    POST /v1/webhooks/deliveries/<id>/redeliver    send it again now (same webhook-id and body)
    POST /v1/webhooks/secret/rotate                a new signing secret, shown once; the previous
                                                   one signs too for SLUICE_WEBHOOK_ROTATION_GRACE_S
                                                   (409 rotation_in_progress until that ends)

Redeliveries and rotations share a per-tenant limit, SLUICE_WEBHOOK_ACTIONS_PER_MINUTE (429).
The tenant's webhooks are the whole tenant's: every route here takes a key scoped ``tenant`` (a
key scoped ``own`` or ``submit`` gets 403 ``key_scope``, ``core/tenants/scopes.py``).
"""

from __future__ import annotations

import uuid

from flask import Blueprint, Response, jsonify, request
from marshmallow import Schema, fields

from core.ids import uuid_or_404
from core.submit.schemas import SafeString
from core.tenants.scopes import Caller
from models import Delivery, DeliveryStatus
from web.auth import authenticate_caller
from web.bodies import list_page, whole_number
from web.errors import InvalidRequest
from web.services import services

bp = Blueprint("webhooks", __name__, url_prefix="/v1/webhooks")


class DeliveryViewSchema(Schema):
    """A webhook delivery as the API shows it: never its payload (it may hold outputs)."""

    id = fields.UUID(metadata={"description": "The `webhook-id` header it is sent with, on every attempt."})
    object = SafeString(metadata={"enum": ["webhook_delivery"]})
    event = SafeString(metadata={"enum": ["request.started", "request.completed", "job.started", "job.progress",
                                          "job.completed", "budget.threshold"]})
    url = SafeString()
    request_id = fields.UUID(allow_none=True)
    job_id = fields.UUID(allow_none=True)
    budget_id = fields.UUID(allow_none=True)
    status = SafeString(metadata={"enum": [s.value for s in DeliveryStatus]})
    attempts = fields.Integer()
    last_status_code = fields.Integer(allow_none=True, metadata={"description": "The receiver's last answer; "
                                                                                 "null: none (yet)."})
    last_error = SafeString(allow_none=True, metadata={
        "description": "Why the last attempt failed: `HTTP <code>`, a connection error, or `refused (<reason>)` "
                       "when the SSRF guard refused the URL or a redirect (loopback, private, metadata, …)."})
    created_at = fields.DateTime()
    next_attempt_at = fields.DateTime(allow_none=True, metadata={"description": "While pending; else null."})
    retry_until = fields.DateTime(metadata={"description": "Attempts stop after this."})
    finished_at = fields.DateTime(allow_none=True)


class DeliveryListSchema(Schema):
    object = SafeString(metadata={"enum": ["list"]})
    data = fields.List(fields.Nested(DeliveryViewSchema))
    has_more = fields.Boolean(metadata={"description": "Older ones exist: ask with before=next_before."})
    next_before = SafeString(allow_none=True)


class SecretSchema(Schema):
    secret = SafeString(metadata={"description": "The new signing secret (`whsec_…`); never shown again."})
    previous_valid_until = fields.DateTime(allow_none=True, metadata={
        "description": "The previous secret also signs until then (a second signature); null: there was none."})


_view = DeliveryViewSchema()


def view(row: Delivery) -> dict:
    pending = row.status == DeliveryStatus.PENDING
    return _view.dump({"id": row.id, "object": "webhook_delivery", "event": row.event, "url": row.url,
                       "request_id": row.request_id, "job_id": row.job_id, "status": row.status.value,
                       "attempts": row.attempts, "last_status_code": row.last_status_code,
                       "last_error": row.last_error, "created_at": row.created_at,
                       "next_attempt_at": row.next_attempt_at if pending else None,
                       "retry_until": row.retry_until, "finished_at": row.finished_at})


@bp.get("/deliveries")
def list_deliveries() -> Response:
    svc = services()
    caller = _tenant_key(svc)
    args, problems = request.args, {}
    limit = whole_number(args.get("limit", "20"), 1, 100)
    if limit is None:
        problems["limit"] = ["A whole number from 1 to 100."]
    ids = {name: _uuid(args.get(name), name, problems) for name in ("request_id", "job_id", "before")}
    status = args.get("status")
    if status is not None and status not in {s.value for s in DeliveryStatus}:
        problems["status"] = [f"One of {', '.join(s.value for s in DeliveryStatus)}."]
    if problems:
        raise InvalidRequest("Invalid query parameters; see details.", details=problems)
    rows = svc.webhooks.list(caller.tenant_id, limit + 1, request_id=ids["request_id"], job_id=ids["job_id"],
                             status=DeliveryStatus(status) if status else None, before=ids["before"])
    return list_page(rows, limit, view)


@bp.get("/deliveries/<delivery_id>")
def get_delivery(delivery_id: str) -> Response:
    svc = services()
    caller = _tenant_key(svc)
    return jsonify(view(svc.webhooks.get(caller.tenant_id, _path_id(delivery_id))))


@bp.post("/deliveries/<delivery_id>/redeliver")
def redeliver(delivery_id: str) -> tuple[Response, int]:
    svc = services()
    caller = _tenant_key(svc)
    return jsonify(view(svc.webhooks.redeliver(caller.tenant_id, _path_id(delivery_id)))), 202


@bp.post("/secret/rotate")
def rotate_secret() -> tuple[Response, int]:
    svc = services()
    caller = _tenant_key(svc)
    secret, previous_until = svc.webhooks.rotate(caller.tenant_id)
    return jsonify(SecretSchema().dump({"secret": secret, "previous_valid_until": previous_until})), 201


def _tenant_key(svc) -> Caller:
    """The caller, when its key is scoped ``tenant``: webhooks are the whole tenant's."""
    return authenticate_caller(svc.db, svc.recent_keys).whole_tenant("webhook deliveries and the signing secret")


def _uuid(raw: str | None, name: str, problems: dict[str, list[str]]) -> uuid.UUID | None:
    if raw is None:
        return None
    try:
        return uuid.UUID(raw)
    except ValueError:
        problems[name] = ["Must be a UUID."]
        return None


def _path_id(raw: str) -> uuid.UUID:
    return uuid_or_404(raw, "webhook delivery", hint="delivery ids are UUIDs")
