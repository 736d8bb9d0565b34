"""The REST API: thin handlers that authenticate, parse, call the request service and render."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from flask import Blueprint, Response, jsonify, request, url_for

from core.observe import submit_metrics
from core.submit import idempotency, ladder, listing
from core.submit.plan import SERVICE_TIER_HEADER, tier_of, with_patience
from models import InferenceRequest
from web import prefer, sse, waits
from web.auth import authenticate, authenticate_caller, bearer_key
from web.bodies import BODY_REFUSALS, json_object, large, list_page, page_limit, validated
from web.errors import ApiError
from web.schemas import AcceptedSchema, RequestViewSchema, SubmitRequestSchema
from web.services import services

log = logging.getLogger(__name__)
bp = Blueprint("api", __name__, url_prefix="/v1")
ESTIMATED_WAIT_HEADER = "Sluice-Estimated-Wait"
CACHE_HEADER = "Sluice-Cache"
_submit_schema = SubmitRequestSchema()
_accepted_schema = AcceptedSchema()
_view_schema = RequestViewSchema()


@bp.post("/requests")
def submit_request() -> Response | tuple[Response, int, dict[str, str]]:
    svc = services()
    # A key seen a moment ago may be refused by the global gate without asking Postgres (a
    # spike's commonest answer; web/auth.py); anything accepted is authenticated afresh below.
    api_key = bearer_key()
    tenant = svc.recent_keys.tenant(api_key)
    fresh = tenant is None
    if fresh:
        tenant = authenticate(svc.db, svc.recent_keys)
    asked: dict[str, str] = {}  # the tier asked for, which a refusal names too
    try:
        body = json_object()
        if large(request.content_length):
            svc.admission.refuse_over_limits(tenant)
        data = validated(_submit_schema, body)
        asked = {SERVICE_TIER_HEADER: tier_of(data).value}
        data = with_patience(data, prefer.patience_seconds(request.headers.getlist("Prefer")),
                             svc.settings.priority_deadline_s if asked[SERVICE_TIER_HEADER] == "priority"
                             else svc.settings.realtime_deadline_s)
        key = idempotency.key_from(request.headers.get(idempotency.HEADER), tenant.id, body,
                                   svc.settings.idempotency_window_s)
        plan = None
        if not fresh:
            if key is None:
                plan = svc.requests.prepare(tenant, data)
                svc.requests.refuse_early(tenant, plan)
            tenant, fresh = authenticate(svc.db, svc.recent_keys), True
        accepted = svc.requests.submit(tenant, data, key, plan)
    except ApiError as exc:
        if exc.status in (401, 403):
            raise
        spend_refused(tenant, exc)
        if not fresh and not svc.recent_keys.confirm(api_key, svc.admission.redis):
            # Refused on a remembered key, and keys may have been revoked since (the epoch moved, or
            # Redis did not say): a revoked key gets 401 instead, a disabled tenant 403, a live key this.
            tenant = authenticate(svc.db, svc.recent_keys)
        add_quotas(exc, tenant)
        exc.headers = {**exc.headers, **asked}  # a copy: an error may have been raised with a shared dict
        raise
    row = accepted.row
    due = None if accepted.estimated_finish_s is None else time.monotonic() + accepted.estimated_finish_s
    status_url = _status_url(row)
    headers = {"Location": status_url, **accepted.headers, SERVICE_TIER_HEADER: row.service_tier,
               **({"Idempotent-Replayed": "true"} if accepted.replayed else {})}
    if accepted.estimated_wait_s is not None:
        headers[ESTIMATED_WAIT_HEADER] = f"{accepted.estimated_wait_s:.3f}"
    if accepted.degradation:
        headers[ladder.HEADER] = ",".join(accepted.degradation)
        for step in accepted.degradation:
            submit_metrics.DEGRADED.labels(step).inc()
    if accepted.cache_hit:
        headers[CACHE_HEADER] = "hit"
    body = _accepted_schema.dump({"id": row.id, "status": row.status.value, "status_url": status_url,
                                  "priority": row.priority.value, "service_tier": row.service_tier,
                                  "size_class": row.size_class.value,
                                  "estimated_wait_s": accepted.estimated_wait_s})
    if row.params.get("stream"):
        return sse.response(svc, row, body, headers)
    waits.remember_poller(svc, row)
    wait_s = _preferred_wait(headers)
    if wait_s:
        row = waits.until_ended(svc, tenant.id, row, wait_s)
        if row.status.terminal:
            return jsonify(_view_schema.dump(row)), 200, headers
    return jsonify(body), 202, {**headers, **poll_hint(due)}


def poll_hint(due: float | None) -> dict[str, str]:
    """When a 202's answer is due, as admission predicted it (its queue wait plus its own output at
    the speed a sequence gets in the engines): polling before then only costs calls. Retry-After in
    whole seconds rounded down, so it never points past the prediction; retry-after-ms exact. None
    without a prediction (no fresh figures from the monitor, or a twin parked on another request)."""
    if due is None:
        return {}
    left_ms = max(0, int((due - time.monotonic()) * 1000))
    return {"Retry-After": str(left_ms // 1000), "retry-after-ms": str(left_ms)}


@bp.get("/requests")
def list_requests() -> Response:
    """The tenant's requests (a key scoped ``own``: its own), newest first: filters and cursor in
    core/submit/listing.py."""
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys)
    limit = page_limit()
    rows = listing.list_requests(svc.db, caller, limit + 1, request.args.get("before"),
                                 listing.RequestFilter.parse(request.args))
    return list_page(rows, limit, _view_schema.dump)


@bp.get("/requests/<request_id>")
def get_request(request_id: str) -> tuple[Response, int, dict[str, str]]:
    svc = services()
    with svc.db.session() as session:  # the commonest call of all: one transaction for key and row
        caller = authenticate_caller(svc.db, svc.recent_keys, session)
        row = svc.requests.get(caller, request_id, session)
    waits.polled(svc, row)
    headers: dict[str, str] = {}
    wait_s = _preferred_wait(headers)
    if wait_s:
        row = waits.until_ended(svc, caller.tenant_id, row, wait_s)
    return jsonify(_view_schema.dump(row)), 200, headers


def _preferred_wait(headers: dict[str, str]) -> int:
    """Seconds this call may hold the connection (``Prefer: wait``, clamped to the maximum);
    0 without that preference. What was applied goes into ``headers``."""
    asked = prefer.wait_seconds(request.headers.getlist("Prefer"))
    if asked is None:
        return 0
    wait_s = min(asked, int(services().settings.wait_max_s))
    headers.update(prefer.applied(wait_s))
    return wait_s


@bp.post("/requests/<request_id>/cancel")
def cancel_request(request_id: str) -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys)
    return jsonify(_view_schema.dump(svc.requests.cancel(caller, request_id)))


def spend_refused(tenant, exc: ApiError) -> None:
    """A body refused after it was read spends one request of the tenant's rate (``BODY_REFUSALS``)."""
    if exc.status in BODY_REFUSALS:
        services().admission.spend_refused(tenant, "too_large" if exc.status == 413 else "invalid",
                                           counted=exc.code == "request_too_large")


@contextlib.contextmanager
def refusals_charged(tenant) -> Iterator[None]:
    """A refusal raised inside, once the tenant is known, spends its request (``spend_refused``)
    and carries its quotas (``add_quotas``), as every submit route's refusals do."""
    try:
        yield
    except ApiError as exc:
        spend_refused(tenant, exc)
        add_quotas(exc, tenant)
        raise


def add_quotas(exc: ApiError, tenant) -> None:
    """Every answer after authentication carries the tenant's quotas; a gate's refusal has them already."""
    if "x-ratelimit-limit-tokens" not in exc.headers:
        try:
            exc.headers.update(services().admission.headers(tenant))
        except Exception:  # the refusal matters more than the quota report
            log.warning("could not compute rate limit headers", exc_info=True)


def _status_url(row: InferenceRequest) -> str:
    settings = services().settings
    if settings.public_url:
        return f"{settings.public_url.rstrip('/')}/v1/requests/{row.id}"
    # A Host header is the client's to choose: reflected only when it names this service.
    allowed = {h.strip().lower() for h in settings.allowed_hosts.split(",") if h.strip()}
    return url_for("api.get_request", request_id=str(row.id), _external=_host_name(request.host) in allowed)


def _host_name(host: str) -> str:
    """The name in a Host header, without its port (``[::1]:8000`` → ``::1``)."""
    if host.startswith("["):
        return host[1:host.find("]")].lower()
    return host.split(":", 1)[0].lower()
