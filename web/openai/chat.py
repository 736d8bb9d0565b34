"""The OpenAI-compatible front door: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/embeddings``, ``GET /v1/models``, so the official SDKs (``base_url=http://host:8000/v1``,
``api_key=`` a Sluice key) get Sluice's admission, queues, degradation and limits unchanged.

Each call is an ordinary request row: the body is translated (``core/openai/shapes.py``) and
submitted through ``RequestService.submit`` like a native one, ``Idempotency-Key`` included, and
the row's id comes back in ``Sluice-Request-Id``. A non-streaming call holds its connection
until the row ends (``web/waits.py until_ended``), at most its deadline plus a grace; a
streaming one relays the engine's increments (``web/sse.py relay``) as OpenAI chunks. A
client that leaves either way cancels its request, so its deadline is its patience
(``web/openai/patience.py``: ``x-stainless-read-timeout``, ``Prefer: wait``); every answer says
the deadline taken (``Sluice-Deadline-S``, ``Sluice-Deadline-Source``) and the tier that serves
it (``Sluice-Service-Tier``, as the body's ``service_tier``).

Errors use OpenAI's shape (``web/openai/errors.py``, registered on this blueprint by
``web/openai/__init__.py``), with the same status and headers as natively (429/503 keep
``Retry-After``, ``retry-after-ms`` and the x-ratelimit-* headers the SDK's backoff reads),
except that a body OpenAI would call invalid is 400, not 422. A request that was admitted and
then ended without an answer (failed, expired, cancelled, out of time) answers
``x-should-retry: false``: the SDK's automatic retry would only spend the same GPU time again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

from flask import Blueprint, Response, jsonify, request, stream_with_context

from core.fleet.workers import live_workers
from core.observe import submit_metrics
from core.openai import shapes
from core.submit import idempotency, ladder
from core.submit.plan import SERVICE_TIER_HEADER, tier_of
from core.tenants.scopes import Caller
from models import InferenceRequest, Source, Status, Tenant
from web import waits
from web.api import refusals_charged
from web.auth import authenticate
from web.bodies import json_object, large
from web.errors import ApiError
from web.openai import patience
from web.openai.errors import error_body
from web.services import Services, services
from web.sse import relay

log = logging.getLogger(__name__)
bp = Blueprint("openai", __name__, url_prefix="/v1")
REQUEST_ID_HEADER = "Sluice-Request-Id"
NO_RETRY = {"x-should-retry": "false"}  # read by the OpenAI SDKs before their own retry rules
WAIT_GRACE_S = 5.0  # past its deadline a request is being expired: how long to wait for that
MAX_PROMPTS = 64  # a list of prompts on /v1/completions: one request row each


@bp.post("/chat/completions")
def chat_completions() -> Response | tuple[Response, int, dict[str, str]]:
    return _create(shapes.CHAT_URL)


@bp.post("/completions")
def completions() -> Response | tuple[Response, int, dict[str, str]]:
    return _create(shapes.COMPLETIONS_URL)


@bp.post("/embeddings")
def embeddings() -> Response | tuple[Response, int, dict[str, str]]:
    return _create(shapes.EMBEDDINGS_URL)


@bp.get("/models")
def list_models() -> Response:
    svc = services()
    authenticate(svc.db, svc.recent_keys)
    return jsonify(object="list", data=_models(svc))


def _models(svc: Services) -> list[dict[str, Any]]:
    """The registry's models with how many live warm workers serve each (0: it would wait)."""
    try:
        workers = live_workers(svc.redis, svc.settings.worker_heartbeat_s)
    except Exception:  # the list is still true without Redis; only the counts are unknown
        log.warning("could not read worker heartbeats for /v1/models", exc_info=True)
        workers = None
    return [{"id": model.name, "object": "model", "created": 0, "owned_by": "sluice",
             "sluice": {"role": model.role, "context_tokens": model.context_tokens,
                        "warm_workers": None if workers is None else
                        sum(1 for w in workers if w.get("model") == model.name)}}
            for model in svc.settings.registry.models]


def opened_body(svc: Services, tenant: Tenant) -> dict[str, Any]:
    """The call's JSON body, once its size is within the tenant's limits (a large one is checked
    against them before it is parsed further)."""
    body = json_object()
    if large(request.content_length):
        svc.admission.refuse_over_limits(tenant)
    return body


def _create(url: str) -> Response | tuple[Response, int, dict[str, str]]:
    svc = services()
    tenant = authenticate(svc.db, svc.recent_keys)
    with refusals_charged(tenant):
        body = opened_body(svc, tenant)
    prompts = body.get("prompt") if url == shapes.COMPLETIONS_URL else None
    if isinstance(prompts, list) and len(prompts) == 1:
        body = {**body, "prompt": prompts[0]}  # one prompt in a list is that prompt
    elif isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts):
        return _create_many(svc, tenant, body, prompts)
    asked, row, headers = _submit(svc, tenant, url, body)
    chat = url == shapes.CHAT_URL
    if asked.get("stream"):
        include_usage = bool((asked.get("stream_options") or {}).get("include_usage"))
        return Response(stream_with_context(_chunks(svc, row, chat, include_usage, bool(asked.get("echo")))), 200,
                        {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                        mimetype="text/event-stream")
    row = _until_ended(svc, tenant, row)
    if row.status == Status.SUCCEEDED:
        if url == shapes.EMBEDDINGS_URL:
            return jsonify(shapes.embedding_answer(row, asked.get("encoding_format", "float"))), 200, headers
        return jsonify(shapes.completion(row, chat, bool(asked.get("echo")))), 200, headers
    if not row.status.terminal:  # past its deadline yet not expired (a stuck sweep): give it up
        try:
            svc.requests.cancel(Caller(tenant.id), str(row.id))
        except ApiError:
            pass  # it ended meanwhile; either way this call has no answer to give
        raise ApiError("The request did not end within its deadline; it was cancelled.",
                       code="wait_timeout", status=504, headers={**headers, **NO_RETRY})
    raise _ended(row, headers)


def _create_many(svc: Services, tenant: Tenant, body: dict[str, Any],
                 prompts: list[str]) -> tuple[Response, int, dict[str, str]]:
    """A list of prompts on /v1/completions: one request row per prompt (each priced, queued and
    answered on its own), all admitted or none (a refusal cancels those already admitted), one
    answer whose choices are every prompt's in order (prompt i's choice j at index i × n + j)."""
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(f"At most {MAX_PROMPTS} prompts in one call; send the rest in another.",
                       code="invalid_request", status=400, details={"prompt": [f"At most {MAX_PROMPTS}."]})
    if body.get("stream"):
        raise ApiError("A list of prompts cannot stream: send one streaming call per prompt.",
                       code="invalid_request", status=400, details={"prompt": ["One string, to stream."]})
    made: list[tuple[dict[str, Any], InferenceRequest, dict[str, str]]] = []
    unpublished: list[InferenceRequest] = []
    try:
        for i, prompt in enumerate(prompts):
            made.append(_submit(svc, tenant, shapes.COMPLETIONS_URL, {**body, "prompt": prompt}, f"#{i}",
                                held=unpublished))
    except Exception:  # a refusal, or the request store failing midway: none of them runs
        _cancel(svc, tenant, [row for _, row, _ in made])
        raise
    # Published once every prompt is admitted: a refusal partway used to find the first ones already
    # answered (and billed) by a fast engine, for a call that answers with an error.
    for row in unpublished:
        svc.requests.publish(row)
    rows = [_until_ended(svc, tenant, row) for _, row, _headers in made]
    headers = {**made[0][2], "Sluice-Request-Ids": ",".join(str(row.id) for row in rows)}
    failed = next((row for row in rows if row.status != Status.SUCCEEDED), None)
    if failed is not None:
        _cancel(svc, tenant, rows)
        raise _ended(failed, headers) if failed.status.terminal else ApiError(
            "A request did not end within its deadline; every request of the call was cancelled.",
            code="wait_timeout", status=504, headers={**headers, **NO_RETRY})
    echo = bool(made[0][0].get("echo"))
    choices = [choice for row in rows for choice in shapes.row_choices(row, False, echo)]
    answer = shapes.completion(rows[0], False, echo)
    answer["choices"] = [{**choice, "index": i} for i, choice in enumerate(choices)]
    answer["usage"] = shapes.token_usage(*(sum(getattr(row, name) or 0 for row in rows)
                                           for name in ("input_tokens", "output_tokens", "cached_tokens")))
    answer["sluice"]["request_ids"] = [str(row.id) for row in rows]
    return jsonify(answer), 200, headers


def _until_ended(svc: Services, tenant: Tenant, row: InferenceRequest) -> InferenceRequest:
    """The row once it ended, or as it is when its deadline (plus a grace) has passed."""
    deadline_s = ((row.deadline_at - row.created_at).total_seconds()
                  if row.deadline_at and row.created_at else svc.settings.stream_max_s)
    return waits.until_ended(svc, tenant.id, row, min(deadline_s + WAIT_GRACE_S, svc.settings.stream_max_s))


def _cancel(svc: Services, tenant: Tenant, rows: list[InferenceRequest]) -> None:
    for row in rows:
        try:
            svc.requests.cancel(Caller(tenant.id), str(row.id))
        except ApiError:
            pass  # it ended meanwhile


def _submit(svc: Services, tenant: Tenant, url: str, body: dict[str, Any], key_suffix: str = "",
            held: list[InferenceRequest] | None = None,
            translate: Callable[[str], tuple[dict[str, Any], dict[str, Any]]] | None = None,
            patient: bool = True) -> tuple[dict[str, Any], InferenceRequest, dict[str, str]]:
    """Validate, translate and submit the body with its client's patience as its deadline; the
    OpenAI fields, the row and the answer's headers (a refusal's carry the deadline and tier too).
    ``key_suffix``: the prompt's place in a list, which its idempotency key carries. ``held``: an
    admitted row is not published but appended there, for the caller to publish. ``translate``:
    the route's own check and mapping (given the default model), else ``shapes.to_native_for``;
    ``patient`` False: nobody waits on the connection (a background response), so the body's
    deadline, else its tier's, stands."""
    called: dict[str, str] = {}
    with refusals_charged(tenant):  # as on the native route: quotas on every answer
        try:
            default = svc.settings.registry.default.name
            asked, data = translate(default) if translate else shapes.to_native_for(url, body, default)
            if patient:
                given = patience.deadline(request.headers, tier_of(data), bool(data.get("stream")), svc.settings)
                called, data = given.headers(), given.applied(data)
            called = {**called, SERVICE_TIER_HEADER: tier_of(data).value}  # (auto: as default)
            header = request.headers.get(idempotency.HEADER)
            key = idempotency.key_from(header[:250] + key_suffix if header and key_suffix else header, tenant.id,
                                       body, svc.settings.idempotency_window_s)
            accepted = svc.requests.submit(tenant, data, key, source=Source.OPENAI, publish=held is None)
        except ApiError as exc:
            exc.headers = {**exc.headers, **called}  # a copy: an error may have been raised with a shared dict
            raise
    row = accepted.row
    if accepted.unpublished:  # only when ``held`` asked for it
        held.append(row)
    headers = {REQUEST_ID_HEADER: str(row.id), **accepted.headers, **called,
               SERVICE_TIER_HEADER: row.service_tier}
    if accepted.replayed:
        headers["Idempotent-Replayed"] = "true"
    if row.degradation_step:
        headers[ladder.HEADER] = row.degradation_step
    for step in accepted.degradation:
        submit_metrics.DEGRADED.labels(step).inc()
    return asked, row, headers


def _ended(row: InferenceRequest, headers: dict[str, str]) -> ApiError:
    """The error a row that ended without an answer is reported as (never retried by the SDK)."""
    if row.error_code == "invalid_response_format":  # the request's constraint, not the platform, failed it
        return ApiError("The engine cannot decode under this request's response_format or tools; see details.",
                        code=row.error_code, status=400, details={"response_format": [row.error_message or ""]},
                        headers={**headers, **NO_RETRY})
    if row.error_code == "engine_refused":  # a limit of the model the request went past
        return ApiError(row.error_message or "The engine refused this request.", code=row.error_code,
                        status=400, headers={**headers, **NO_RETRY})
    status = shapes.ENDED.get(row.status.value, 500)
    message = f"The request ended {row.status.value}" + (f": {row.error_message}" if row.error_message else ".")
    return ApiError(message, code=row.error_code or row.status.value, status=status,
                    headers={**headers, **NO_RETRY})


def _data(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), default=str)}\n\n"


def _chunks(svc: Services, row: InferenceRequest, chat: bool, include_usage: bool, echo: bool) -> Iterator[str]:
    """The stream: a first chunk of each choice at once, one per increment (of its choice,
    ``index``, with its tokens' logprobs when asked), each choice's finish, usage if asked, [DONE].

    An answer that may be tool calls is not relayed token by token (its JSON is no message
    content): the calls come whole in one chunk at the end, as OpenAI's stream may send them.
    OpenAI's stream cannot take text back, so a request that starts over on another worker
    (``requeued``) ends the stream with an error and is cancelled; so is one whose client left."""
    n = int(row.params.get("n") or 1)
    offsets = [len(row.input["prompt"]) if echo else 0] * n  # completions' text_offset, per choice
    for index in range(n):
        yield _data(shapes.chunk(row, chat, first=True, index=index))
        if echo:
            yield _data(shapes.chunk(row, chat, text=row.input["prompt"], index=index))
    calls = chat and bool(row.input.get("tools")) and row.params.get("tool_choice") != "none"
    moves = relay(svc, row)
    try:
        for kind, value in moves:
            if kind == "token":
                if not calls and value.index < n:
                    logprobs = (None if value.logprobs is None else
                                shapes.chunk_logprobs(value.logprobs, chat, offsets[value.index]))
                    offsets[value.index] += len(value.text)
                    yield _data(shapes.chunk(row, chat, text=value.text, index=value.index, logprobs=logprobs))
            elif kind == "ping":
                yield ": ping\n\n"
            elif kind == "requeued":  # ending here closes the relay, which cancels the request
                yield _data(error_body(f"The request had to start over on another worker ({value}), which a "
                                       "stream cannot show; it was cancelled. Send it again.", 500, "requeued"))
                return
            elif kind == "done":
                yield from _last_chunks(value, chat, include_usage, calls)
    finally:
        moves.close()  # a client that left mid-stream: the relay abandons its request


def _last_chunks(row: InferenceRequest, chat: bool, include_usage: bool, calls: bool) -> Iterator[str]:
    if row.status == Status.SUCCEEDED:
        for choice in shapes.row_choices(row, chat):
            if calls:  # what the model wrote: the calls, or the text it answered with instead
                message = choice["message"]
                yield _data(shapes.chunk(row, chat, text=message["content"], calls=message.get("tool_calls"),
                                         index=choice["index"], logprobs=choice["logprobs"]))
            yield _data(shapes.chunk(row, chat, finish=choice["finish_reason"], index=choice["index"]))
        if include_usage:
            yield _data(shapes.usage_chunk(row, chat))
        yield "data: [DONE]\n\n"
    else:
        error = _ended(row, {}) if row.status.terminal else ApiError(
            "The stream ran past SLUICE_STREAM_MAX_S; the request goes on, see Sluice-Request-Id.",
            code="stream_timeout", status=504)
        yield _data(error_body(error.message, error.status, error.code))
