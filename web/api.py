"""The REST API: thin handlers that parse, call the service and render."""

from __future__ import annotations

import logging
from typing import Any

from flask import Blueprint, Response, current_app, g, jsonify, request, url_for

from models import InferenceRequest

from . import idempotency, service
from .auth import authenticate
from .bodies import json_object, validated
from .schemas import SubmitRequestSchema

log = logging.getLogger(__name__)
bp = Blueprint("api", __name__, url_prefix="/v1")
_submit_schema = SubmitRequestSchema()


def _ext(name: str) -> Any:
    return current_app.extensions[name]


@bp.post("/requests")
def submit_request() -> tuple[Response, int, dict[str, str]]:
    tenant_id = g.tenant_id = authenticate(_ext("sluice.db"))
    body = json_object()
    data = validated(_submit_schema, body)
    settings, gates = current_app.config["SLUICE"], _ext("sluice.admission")
    key = idempotency.key_from(request.headers.get(idempotency.HEADER), tenant_id, body,
                               settings.idempotency_window_s)
    row, replayed = idempotency.submit_once(_ext("sluice.db"), key, lambda: service.submit(
        _ext("sluice.db"), _ext("sluice.publisher"), gates.redis, _ext("sluice.tokens"), settings, tenant_id,
        data, gates=gates, idempotency_key=key))
    status_url = _status_url(row)
    headers = {"Location": status_url, **({"Idempotent-Replayed": "true"} if replayed else {})}
    return (jsonify(id=str(row.id), status=row.status.value, status_url=status_url,
                    priority=row.priority.value, size_class=row.size_class.value),
            202, headers)


@bp.after_request
def _ratelimit_headers(response: Response) -> Response:
    """Every answer to a submit after authentication carries the tenant's x-ratelimit-* headers."""
    if request.endpoint == "api.submit_request" and "x-ratelimit-limit-tokens" not in response.headers:
        headers = g.get("ratelimit_headers")
        if headers is None and g.get("tenant_id") is not None:
            try:
                headers = _ext("sluice.admission").headers(_ext("sluice.db"), g.tenant_id)
            except Exception:
                log.warning("could not compute rate limit headers", exc_info=True)
        response.headers.update(headers or {})
    return response


@bp.get("/requests/<request_id>")
def get_request(request_id: str) -> Response:
    tenant_id = authenticate(_ext("sluice.db"))
    return jsonify(render(service.get(_ext("sluice.db"), tenant_id, request_id)))


@bp.post("/requests/<request_id>/cancel")
def cancel_request(request_id: str) -> Response:
    tenant_id = authenticate(_ext("sluice.db"))
    gates = _ext("sluice.admission")
    row = service.cancel(_ext("sluice.db"), gates.redis, tenant_id, request_id, gates)
    return jsonify(render(row))


def _status_url(row: InferenceRequest) -> str:
    base = current_app.config["SLUICE"].public_url
    if base:
        return f"{base.rstrip('/')}/v1/requests/{row.id}"
    return url_for("api.get_request", request_id=str(row.id), _external=True)


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


def render(row: InferenceRequest) -> dict[str, Any]:
    ttft = ((row.first_token_at - row.started_at).total_seconds()
            if row.first_token_at and row.started_at else None)
    done = row.status.value == "succeeded" or row.output_text is not None
    return {
        "id": str(row.id),
        "status": row.status.value,
        "priority": row.priority.value,
        "size_class": row.size_class.value,
        "queue": row.queue,
        "model": row.model_requested,
        "model_used": row.model_used,
        "model_routed": row.model_routed,
        "route_reason": row.route_reason,
        "max_tokens": row.max_tokens,
        "time_limit_s": row.time_limit_s,
        "output": {"text": row.output_text or "", "finish_reason": row.finish_reason} if done else None,
        "usage": {"input_tokens": row.input_tokens, "output_tokens": row.output_tokens,
                  "cached_tokens": row.cached_tokens, "reserved_tokens": row.reserved_tokens},
        "timings": {"created_at": _iso(row.created_at), "enqueued_at": _iso(row.enqueued_at),
                    "started_at": _iso(row.started_at), "first_token_at": _iso(row.first_token_at),
                    "finished_at": _iso(row.finished_at), "queue_wait_s": row.queue_wait_s,
                    "inference_s": row.inference_s, "time_to_first_token_s": ttft},
        "error": {"code": row.error_code, "message": row.error_message} if row.error_code else None,
        "cancel_requested": row.cancel_requested_at is not None,
        "attempts": row.attempts,
        "worker": row.worker,
        "metadata": row.meta,
        "conversation_id": row.conversation_id,
    }
