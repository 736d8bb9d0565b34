"""OpenAI's Responses API, for the SDK's ``client.responses``: thin handlers over
``core/openai/responses.py``. Errors take OpenAI's shape (``web/openai/errors.py``, registered on
this blueprint by ``web/openai/__init__.py``).

    POST   /v1/responses                    create: answered when done, streamed as typed events
                                            (stream), or at once, queued (background)
    GET    /v1/responses/<id>               the Response object (poll a background one)
    POST   /v1/responses/<id>/cancel        cancel a background response
    DELETE /v1/responses/<id>               delete it (running: cancelled); it reads as gone
    GET    /v1/responses/<id>/input_items   its own input items (?limit=, ?order=, ?after=)

A response is a request row, submitted as ``/v1/chat/completions`` submits one
(``web/openai/chat.py _submit``): the same admission, headers, idempotency and refusals. A
foreground call's deadline is its client's patience, as on chat; a background one's is the body's
``deadline_s`` (a Sluice extension, with ``webhook_url`` and ``webhook_events``), else its tier's:
nobody waits on its connection, and leaving does not cancel it.
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Iterator
from typing import Any

from flask import Blueprint, Response, jsonify, request, stream_with_context
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert

from core.errors import InvalidRequest, NotFound
from core.openai import responses
from core.tenants.scopes import Caller
from models import InferenceRequest, Status, StoredResponse, utcnow
from models.request import redaction
from web import waits
from web.api import refusals_charged
from web.auth import authenticate, authenticate_caller
from web.bodies import list_page, page_limit
from web.errors import ApiError
from web.openai import chat
from web.services import Services, services
from web.sse import relay

bp = Blueprint("openai_responses", __name__, url_prefix="/v1")
CANCEL_WAIT_S = 5.0  # how long a cancel waits for the worker to abort a running response


@bp.post("/responses")
def create_response() -> Response | tuple[Response, int, dict[str, str]]:
    svc = services()
    tenant = authenticate(svc.db, svc.recent_keys)
    with refusals_charged(tenant):
        body = chat.opened_body(svc, tenant)
        previous = _previous(svc, Caller.of(tenant), body.get("previous_response_id"))
        turn = responses.Turn(body, [] if previous is None else responses.history(*previous))
    background, store = turn.background, turn.store
    # A stored response's turns are one conversation: each runs where the last one's prefix is cached.
    if previous and previous[0].conversation_id:
        turn.extension["conversation_id"] = previous[0].conversation_id
    elif store:
        turn.extension["conversation_id"] = f"resp_{uuid.uuid4().hex}"
    if background and body.get("stream"):
        turn.extension["detach"] = True  # a background stream's client may leave: the response goes on
    held: list[InferenceRequest] = []
    try:
        _, row, headers = chat._submit(svc, tenant, responses.RESPONSES_URL, body, held=held,
                                       translate=turn.native, patient=not background)
    except ApiError as exc:  # what the native checks say of chat's fields, said of this route's
        responses.renamed(exc)
        raise
    values = {"request_id": row.id, "previous_id": previous[0].id if previous else None,
              "turn_from": turn.turn_from, "instructions_at": turn.instructions_at, "background": background,
              "fields": {"max_output_tokens": body.get("max_output_tokens"), "store": store}}
    stored = StoredResponse(**values)
    if store:  # before it is published: whoever learns of its end can read it back
        with svc.db.session() as session:  # a replayed idempotent call's was stored the first time
            session.execute(insert(StoredResponse).values(**values).on_conflict_do_nothing())
            session.commit()
    for unpublished in held:
        svc.requests.publish(unpublished)
    if body.get("stream"):
        return Response(stream_with_context(_events(svc, row, stored)), 200,
                        {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                        mimetype="text/event-stream")
    if background:
        return jsonify(responses.response(row, stored)), 200, headers
    row = chat._until_ended(svc, tenant, row)
    if row.status == Status.SUCCEEDED:
        return jsonify(responses.response(row, stored)), 200, headers
    if not row.status.terminal:
        chat._cancel(svc, tenant, [row])
        raise ApiError("The request did not end within its deadline; it was cancelled.",
                       code="wait_timeout", status=504, headers={**headers, **chat.NO_RETRY})
    raise responses.renamed(chat._ended(row, headers))


@bp.get("/responses/<response_id>")
def get_response(response_id: str) -> Response:
    svc = services()
    if "stream" in request.args:
        raise InvalidRequest("A stored response is read whole; stream it when you create it (stream: true).",
                             details={"stream": ["Not served on GET."]})
    row, stored = _read(svc, authenticate_caller(svc.db, svc.recent_keys), response_id)
    return jsonify(responses.response(row, stored))


@bp.post("/responses/<response_id>/cancel")
def cancel_response(response_id: str) -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys)
    row, stored = _read(svc, caller, response_id)
    if not stored.background:
        raise InvalidRequest("Only a background response can be cancelled; a foreground one is cancelled by "
                             "closing its connection.", details={"background": ["This response is not one."]})
    return jsonify(responses.response(_stopped(svc, caller, row), stored))


@bp.delete("/responses/<response_id>")
def delete_response(response_id: str) -> Response:
    """Gone: it reads as 404 and cannot be continued; one still running is cancelled first. Its
    text is redacted from its request row (what the retention sweep does to old rows), once the
    row has ended; its accounting stays."""
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys)
    row, stored = _read(svc, caller, response_id)
    row = _stopped(svc, caller, row)
    with svc.db.session() as session:
        session.get(StoredResponse, row.id).deleted_at = utcnow()
        # Ended only: an end written later would bring text back.
        session.execute(redaction(InferenceRequest.id == row.id, InferenceRequest.finished_at.is_not(None)))
        session.commit()
    return jsonify({"id": response_id, "object": "response", "deleted": True})


@bp.get("/responses/<response_id>/input_items")
def list_input_items(response_id: str) -> Response:
    svc = services()
    row, stored = _read(svc, authenticate_caller(svc.db, svc.recent_keys), response_id)
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order is asc or desc.", details={"order": ["asc or desc."]})
    items = responses.input_items(row, stored)
    items = items if order == "asc" else items[::-1]
    after = request.args.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest(f"No input item {after[:80]!r} in this response.", details={"after": ["Unknown."]})
        items = items[ids.index(after) + 1:]
    limit = page_limit()
    return list_page(items[:limit + 1], limit, openai=True)


def _stopped(svc: Services, caller: Caller, row: InferenceRequest) -> InferenceRequest:
    """``row`` cancelled if it had not ended (one that ended meanwhile keeps its answer), as it is
    once its worker has aborted it (at most ``CANCEL_WAIT_S``)."""
    if row.status.terminal:
        return row
    try:
        row = svc.requests.cancel(caller, str(row.id))
    except ApiError:
        pass  # it ended meanwhile
    return waits.until_ended(svc, caller.tenant_id, row, CANCEL_WAIT_S)


def _read(svc: Services, caller: Caller, response_id: str) -> tuple[InferenceRequest, StoredResponse]:
    """The response ``caller`` sees (its key's scope), not deleted; else 404."""
    found = _stored(svc, responses.parse_id(response_id),
                    caller.sees(InferenceRequest.tenant_id, InferenceRequest.api_key_id, "responses"))
    if found is None:  # another key's (an `own` key), or none: the same 404
        raise NotFound(f"No response {response_id[:80]!r}.", code="response_not_found")
    return found


def _previous(svc: Services, caller: Caller, previous_id: Any) -> tuple[InferenceRequest, StoredResponse] | None:
    """The response a body continues (``previous_response_id``): one its key made, or its
    tenant's for a key scoped ``tenant``; 400 naming the field when there is none."""
    if previous_id is None:
        return None
    if not isinstance(previous_id, str):
        raise InvalidRequest("previous_response_id is a response's id (resp_…).",
                             details={"previous_response_id": ["A string."]})
    try:
        found = _stored(svc, responses.parse_id(previous_id),
                        caller.uses(InferenceRequest.tenant_id, InferenceRequest.api_key_id))
    except NotFound:
        found = None
    if found is None:
        raise InvalidRequest(f"No stored response {previous_id[:80]!r} to continue.", code="invalid_request",
                             details={"previous_response_id": ["Not found (or not stored, or deleted)."]})
    return found


def _stored(svc: Services, rid: uuid.UUID, visible: Any) -> tuple[InferenceRequest, StoredResponse] | None:
    """The request row ``visible`` lets its caller see, and its response, unless deleted; else None."""
    with svc.db.session() as session:
        found = session.execute(select(InferenceRequest, StoredResponse).join(
            StoredResponse, StoredResponse.request_id == InferenceRequest.id).where(
            InferenceRequest.id == rid, visible, StoredResponse.deleted_at.is_(None))).first()
        session.expunge_all()
    return None if found is None else (found[0], found[1])


def _data(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), default=str)}\n\n"


def _events(svc: Services, row: InferenceRequest, stored: StoredResponse) -> Iterator[str]:
    """The stream's typed events, in OpenAI's order: created, in_progress; the message item and its
    text part added, a delta per increment, their done events; each function call added whole
    (its arguments in one delta); completed (incomplete, failed). An answer that may be tool calls
    is not relayed token by token (its JSON is no text): its items come whole at the end."""
    number = itertools.count()
    calls = bool(row.input.get("tools")) and row.params.get("tool_choice") != "none"
    item = responses.message_item(row, None, "in_progress")

    def event(kind: str, **fields: Any) -> str:
        return _data({"type": kind, "sequence_number": next(number), **fields})

    yield event("response.created", response=responses.response(row, stored, "queued", []))
    yield event("response.in_progress", response=responses.response(row, stored, "in_progress", []))
    text, opened = "", False
    moves = relay(svc, row)
    try:
        for kind, value in moves:
            if kind == "token" and not calls and value.text:
                if not opened:
                    opened = True
                    yield event("response.output_item.added", output_index=0, item=item)
                    yield event("response.content_part.added", item_id=item["id"], output_index=0, content_index=0,
                                part=responses.text_part(""))
                text += value.text
                yield event("response.output_text.delta", item_id=item["id"], output_index=0, content_index=0,
                            delta=value.text, logprobs=[])
            elif kind == "ping":
                yield ": ping\n\n"
            elif kind == "requeued":
                message = (f"The response had to start over on another worker ({value}), which a stream cannot "
                           "show; " + ("it goes on: GET it." if stored.background else
                                       "it was cancelled. Send it again."))
                yield event("error", code="requeued", message=message, param=None)
                return
            elif kind == "done":
                yield from _last(value, stored, event, opened, text)
    finally:
        moves.close()  # a client that left mid-stream: the relay abandons its request (unless detached)


def _last(row: InferenceRequest, stored: StoredResponse, event, opened: bool, text: str) -> Iterator[str]:
    """The done events of what was streamed (``opened``: its message item was added, ``text`` sent),
    the items that come whole, and the response's end."""
    if row.status != Status.SUCCEEDED:
        failed = responses.response(row, stored, "failed" if row.status.terminal else "in_progress")
        if not row.status.terminal:
            failed["error"] = {"code": "stream_timeout", "message": "The stream ran past SLUICE_STREAM_MAX_S; the "
                               "response goes on: GET it."}
        yield event("response.failed", response=failed)
        return
    items = responses.output_items(row)
    for index, item in enumerate(items):
        if item["type"] == "message":
            part = item["content"][0]
            if not opened:
                yield event("response.output_item.added", output_index=index, item={**item, "content": [],
                                                                                     "status": "in_progress"})
                yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                            part=responses.text_part(""))
            if len(part["text"]) > len(text) and part["text"].startswith(text):  # what the increments missed
                yield event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                            delta=part["text"][len(text):], logprobs=[])
            yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=[])
            yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part)
        else:
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                 "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"], name=item["name"])
        yield event("response.output_item.done", output_index=index, item=item)
    final = responses.response(row, stored, output=items)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
