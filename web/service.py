"""Request lifecycle on the web side: submit, read, cancel. Each runs in one transaction.

Publishing happens only after the row is committed. If the publish itself fails (broker down),
the row is still accepted: it stays `queued` with no `enqueued_at`, and the sweep publishes it.
"""

from __future__ import annotations

import json
import logging
import uuid
from datetime import timedelta
from typing import Any

from celery import Celery
from sqlalchemy import select

from models import InferenceRequest, Priority, Status, utcnow
from models.session import Database
from sluice.keys import conversation_key, node_key, raise_cancel_flag
from sluice.registry import ModelSpec
from sluice.settings import Settings
from workers.routing import direct_queue, publish_committed, queue_name, size_class_for

from . import idempotency
from .admission import Admission
from .errors import Conflict, InvalidRequest, NotFound
from .tokens import ChatTemplateError, TokenCounters

log = logging.getLogger(__name__)


def submit(db: Database, celery: Celery, redis, counters: TokenCounters, settings: Settings,
           tenant_id: uuid.UUID, body: dict[str, Any], *, gates: Admission,
           idempotency_key: idempotency.Key | None = None) -> InferenceRequest:
    """Validate, admit (raises the gate's rejection), insert, commit, publish."""
    max_tokens = body.get("max_tokens", settings.default_max_tokens)
    time_limit = body.get("time_limit_s", settings.time_limit_s)
    problems: dict[str, list[str]] = {}
    if max_tokens > settings.max_output_tokens:
        problems["max_tokens"] = [f"Must be at most {settings.max_output_tokens}."]
    if time_limit > settings.time_limit_s:
        problems["time_limit_s"] = [f"Must be at most {settings.time_limit_s:g} seconds."]
    registry = settings.registry
    model = registry.get(body["model"]) if "model" in body else registry.default
    if model is None:
        served = ", ".join(m.name for m in registry.models)
        problems["model"] = [f"Unknown model {body['model']!r}; this platform serves: {served}."]
    request_input = {"messages": body["messages"]} if "messages" in body else {"prompt": body["prompt"]}
    chars = sum(len(m["content"]) for m in body["messages"]) if "messages" in body else len(body["prompt"])
    if chars > settings.max_prompt_chars:
        problems["prompt" if "prompt" in body else "messages"] = [
            f"Input is {chars} characters; at most {settings.max_prompt_chars} are accepted."]
    if problems:
        raise InvalidRequest("The request has invalid fields; see details.", details=problems)

    priority = Priority(body["priority"])
    input_tokens = _count(counters, model, request_input)
    requested, routed_reason = model, None
    if "model" not in body and input_tokens + max_tokens > model.context_tokens:
        # Too long for the default model: the smallest long-context model that holds it takes
        # it, counted with that model's own tokenizer. If none does, the largest is kept and
        # the per-request gate answers 413 with its numbers; with none configured, the default's.
        for longer in registry.long_models():
            if longer.context_tokens <= model.context_tokens:
                continue
            model, routed_reason = longer, "long_context"
            input_tokens = _count(counters, model, request_input)
            if input_tokens + max_tokens <= model.context_tokens:
                break
    reserved = input_tokens + max_tokens
    size_class = size_class_for(reserved, settings.large_threshold_tokens)
    queue = queue_name(priority, size_class, registry.queue_suffix(model))
    conversation_id = body.get("conversation_id")
    if conversation_id and gates.redis_healthy:  # with Redis away, don't spend its timeout on affinity
        queue = conversation_queue(redis, tenant_id, conversation_id, queue) or queue
    params = {k: body[k] for k in ("temperature", "top_p", "seed", "stop", "ignore_eos") if k in body}
    default_deadline = settings.realtime_deadline_s if priority == Priority.REALTIME else settings.batch_deadline_s
    deadline_s = body.get("deadline_s", default_deadline)
    row = InferenceRequest(
        id=uuid.uuid4(), tenant_id=tenant_id, status=Status.QUEUED, priority=priority,
        size_class=size_class, queue=queue, model_requested=requested.name, conversation_id=conversation_id,
        model_routed=model.name if routed_reason else None, route_reason=routed_reason,
        input=request_input, params=params, meta=body.get("metadata", {}), max_tokens=max_tokens,
        time_limit_s=float(time_limit), reserved_tokens=reserved, input_tokens=input_tokens,
        cache_hit=False, attempts=0, deadline_at=utcnow() + timedelta(seconds=deadline_s),
    )
    ticket = gates.admit(db, tenant_id, row)
    try:
        with db.session() as session:
            session.add(row)
            if idempotency_key is not None:
                idempotency_key.claim(session, row.id)
    except BaseException:
        gates.cancel(ticket)  # no row was written, so nothing stays reserved
        raise
    # Committed: from here on the request is accepted and must reach a terminal status.
    if not gates.redis_healthy:
        log.warning("request %s: Redis unreachable; the sweep will publish it", row.id)
        return row
    try:
        publish_committed(db, celery, [row])
    except Exception:
        log.warning("request %s: publish failed; the sweep will publish it", row.id, exc_info=True)
    return row


def _count(counters: TokenCounters, model: ModelSpec, request_input: dict[str, Any]) -> int:
    try:
        return counters.for_model(model).count(request_input)
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc)[:300], details={"messages": [str(exc)[:300]]}) from None


def conversation_queue(redis, tenant_id: uuid.UUID, conversation_id: str, shared_queue: str) -> str | None:
    """The direct queue of the live worker that served this conversation's last turn, if any.

    Only if that worker also consumes ``shared_queue``: affinity never moves a turn to a worker
    of another role (a batch turn onto a reserved realtime device), size class or model.
    Best effort: if Redis cannot say, the turn goes to the shared queue and only loses its
    prefix cache hit.
    """
    try:
        node = redis.get(conversation_key(str(tenant_id), conversation_id))
        owner = json.loads(redis.get(node_key(node)) or "{}") if node else {}
        if shared_queue in owner.get("queues", ()):
            return direct_queue(node)
    except Exception:
        log.warning("conversation routing unavailable; using the shared queue")
    return None


def get(db: Database, tenant_id: uuid.UUID, request_id: str) -> InferenceRequest:
    rid = _parse_id(request_id)
    with db.session() as session:
        row = session.scalar(select(InferenceRequest).where(
            InferenceRequest.id == rid, InferenceRequest.tenant_id == tenant_id))
    if row is None:
        raise NotFound(f"No request {request_id} for this API key.")
    return row


def cancel(db: Database, redis, tenant_id: uuid.UUID, request_id: str,
           gates: Admission | None = None) -> InferenceRequest:
    """Cancel a queued request outright; ask the worker of a running one to abort it."""
    rid = _parse_id(request_id)
    with db.session() as session:
        # Row lock: the worker's queued → running claim waits for this, so a request is
        # either cancelled before it starts or flagged for its worker, never neither.
        row = session.scalar(select(InferenceRequest).where(
            InferenceRequest.id == rid, InferenceRequest.tenant_id == tenant_id).with_for_update())
        if row is None:
            raise NotFound(f"No request {request_id} for this API key.")
        if row.status.terminal:
            raise Conflict(f"Request is already {row.status.value}; nothing to cancel.",
                           code="not_cancellable")
        now = utcnow()
        row.cancel_requested_at = row.cancel_requested_at or now
        if row.status == Status.QUEUED:
            row.status = Status.CANCELLED
            row.finished_at = now
            row.error_code = "cancelled"
            row.error_message = "Cancelled by the client before it started."
    if row.status == Status.CANCELLED and gates is not None:
        gates.release(row)  # it never ran: its whole reservation and its slot go back
    if row.status == Status.RUNNING:
        try:
            raise_cancel_flag(redis, str(rid), row.time_limit_s)
        except Exception:
            # The flag on the row is durable; the sweep re-raises it in Redis.
            log.warning("request %s: cancel flag not set in Redis; the sweep will retry", rid)
    return row


def _parse_id(request_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(request_id)
    except ValueError:
        raise NotFound(f"No request {request_id}: request ids are UUIDs.") from None
