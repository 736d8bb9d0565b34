"""The REST API: thin handlers that authenticate, parse, call the request service and render."""

from __future__ import annotations

import logging

from flask import Blueprint, Response, jsonify, request, url_for

from models import InferenceRequest

from . import idempotency, ladder
from .auth import authenticate, bearer_key
from .bodies import json_object, validated
from .errors import ApiError
from .schemas import AcceptedSchema, RequestViewSchema, SubmitRequestSchema
from .services import services

log = logging.getLogger(__name__)
bp = Blueprint("api", __name__, url_prefix="/v1")
ESTIMATED_WAIT_HEADER = "Sluice-Estimated-Wait"
CACHE_HEADER = "Sluice-Cache"
_submit_schema = SubmitRequestSchema()
_accepted_schema = AcceptedSchema()
_view_schema = RequestViewSchema()


@bp.post("/requests")
def submit_request() -> tuple[Response, int, dict[str, str]]:
    svc = services()
    # A key seen a moment ago may be refused by the global gate without asking Postgres (a
    # spike's commonest answer); anything accepted is authenticated afresh below.
    tenant = svc.recent_keys.tenant(bearer_key())
    fresh = tenant is None
    if fresh:
        tenant = authenticate(svc.db, svc.recent_keys)
    try:
        body = json_object()
        data = validated(_submit_schema, body)
        key = idempotency.key_from(request.headers.get(idempotency.HEADER), tenant.id, body,
                                   svc.settings.idempotency_window_s)
        plan = None
        if not fresh:
            if key is None:
                plan = svc.requests.prepare(tenant, data)
                svc.requests.refuse_early(tenant, plan)
            tenant = authenticate(svc.db, svc.recent_keys)
        accepted = svc.requests.submit(tenant, data, key, plan)
    except ApiError as exc:
        # Every answer after authentication carries the tenant's quotas; a gate's refusal has them already.
        if exc.status != 401 and "x-ratelimit-limit-tokens" not in exc.headers:
            try:
                exc.headers.update(svc.admission.headers(tenant))
            except Exception:  # the refusal matters more than the quota report
                log.warning("could not compute rate limit headers", exc_info=True)
        raise
    row = accepted.row
    status_url = _status_url(row)
    headers = {"Location": status_url, **accepted.headers,
               **({"Idempotent-Replayed": "true"} if accepted.replayed else {})}
    if accepted.estimated_wait_s is not None:
        headers[ESTIMATED_WAIT_HEADER] = f"{accepted.estimated_wait_s:.3f}"
    if accepted.degradation:
        headers[ladder.HEADER] = ",".join(accepted.degradation)
    if accepted.cache_hit:
        headers[CACHE_HEADER] = "hit"
    body = _accepted_schema.dump({"id": row.id, "status": row.status.value, "status_url": status_url,
                                  "priority": row.priority.value, "size_class": row.size_class.value,
                                  "estimated_wait_s": accepted.estimated_wait_s})
    return jsonify(body), 202, headers


@bp.get("/requests/<request_id>")
def get_request(request_id: str) -> Response:
    svc = services()
    tenant = authenticate(svc.db, svc.recent_keys)
    return jsonify(_view_schema.dump(svc.requests.get(tenant.id, request_id)))


@bp.post("/requests/<request_id>/cancel")
def cancel_request(request_id: str) -> Response:
    svc = services()
    tenant = authenticate(svc.db, svc.recent_keys)
    return jsonify(_view_schema.dump(svc.requests.cancel(tenant.id, request_id)))


def _status_url(row: InferenceRequest) -> str:
    base = services().settings.public_url
    if base:
        return f"{base.rstrip('/')}/v1/requests/{row.id}"
    return url_for("api.get_request", request_id=str(row.id), _external=True)
