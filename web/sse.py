"""Token streaming over Server-Sent Events (``"stream": true`` on a submit).

Events, in order: ``accepted`` (the id and status link, at once), ``started`` (when a worker
claims it, with its queue wait), ``token`` (each text increment the engine produced, with the
output token count so far, the choice it belongs to, ``index``, and with ``logprobs`` asked, the new
tokens' logprobs), then ``done`` with the request's full view (usage, timings, the
whole output). ``requeued`` says the request is starting over on another worker (its worker
stopped or died): discard the text received so far. Comments (``: ping``) keep an idle
connection open and find out whether the client is still there.

The worker writes increments to a Redis stream (``core/delivery/streams.py``); this reads them, so
the engine never waits for a slow client. Whatever the increments missed (a cache hit, an
identical request computed once for both, a Redis hiccup) is sent as one last ``token`` per
choice before ``done``, from the row. A client that leaves before ``done`` has abandoned its request:
it is cancelled unless it detached (``web/waits.py``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from flask import Response, stream_with_context

from core.delivery import streams
from core.submit.schemas import RequestViewSchema, worker_tag
from core.tenants.scopes import Caller
from models import InferenceRequest
from models.request import Status
from web.services import Services
from web.waits import abandon, client_gone

log = logging.getLogger(__name__)
READ_BLOCK_MS = 500  # one wait for increments; between waits the connection and the row are checked
END_GRACE_S = 3.0  # after the row ended, how long the last increments may take to arrive
_view = RequestViewSchema()


def response(svc: Services, row: InferenceRequest, accepted: dict[str, Any], headers: dict[str, str]) -> Response:
    headers = {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return Response(stream_with_context(_events(svc, row, accepted)), 200, headers,
                    mimetype="text/event-stream")


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'), default=str)}\n\n"


def _events(svc: Services, row: InferenceRequest, accepted: dict[str, Any]) -> Iterator[str]:
    yield _event("accepted", accepted)
    moves = relay(svc, row)
    try:
        for kind, value in moves:
            if kind == "started":
                yield _event("started", {"queue_wait_s": value.queue_wait_s, "worker": worker_tag(value.worker)})
            elif kind == "token":
                token = {"text": value.text, "output_tokens": value.output_tokens, "index": value.index}
                if value.logprobs is not None:
                    token["logprobs"] = value.logprobs
                yield _event("token", token)
            elif kind == "requeued":
                yield _event("requeued", {"reason": value})
            elif kind == "ping":
                yield ": ping\n\n"
            else:
                yield _event("done", _view.dump(value))
    finally:
        moves.close()  # a client that left mid-stream: the relay abandons its request


def relay(svc: Services, row: InferenceRequest) -> Iterator[tuple[str, Any]]:
    """What a stream of ``row`` tells its client, in order, as ``(kind, value)``: ``started`` (the
    row), ``token`` ((text, output tokens so far)), ``requeued`` (why: discard the text so far),
    ``ping`` (nothing new for a while), and last ``done`` (the ended row, or its state when the
    stream ran out of time). Every way of streaming (this module's events, the OpenAI chunks of
    ``web/openai/chat.py``) renders these.

    A client found gone, or one that closes this generator before ``done``, has abandoned its
    request (``web/waits.py``); the generator then ends without ``done``.
    """
    settings = svc.settings
    rid, source = str(row.id), str(row.follows_id or row.id)  # a twin reads its leader's tokens
    began = last_sent = time.monotonic()
    sent: dict[int, _Sent] = {}  # per choice: what was streamed of it
    cursor = "0"
    started = finished = False
    ended_at: float | None = None
    try:
        with svc.waiters.watch(rid) as watch:
            row = svc.requests.get(Caller(row.tenant_id), rid)
            while time.monotonic() - began < settings.stream_max_s:
                if not started and row.started_at is not None:
                    started = True
                    yield "started", row
                if row.status.terminal:
                    ended_at = ended_at or time.monotonic()
                    if finished or row.started_at is None or time.monotonic() - ended_at > END_GRACE_S:
                        break
                if row.status == Status.QUEUED:
                    moved = svc.waiters.wait(watch, min(settings.stream_idle_ping_s, 1.0))
                else:
                    for entry_id, fields in _read(svc, source, cursor):
                        cursor = entry_id
                        if "end" in fields:
                            finished = fields["end"] != "shutdown"
                            if not finished:
                                sent.clear()
                                yield "requeued", "its worker stopped; it starts over"
                            continue
                        index, count = int(fields.get("i", 0)), int(fields["n"])
                        if count < sent.get(index, _Sent()).count:  # a second run after a lost worker
                            sent.clear()
                            yield "requeued", "its worker was lost; it starts over"
                        logprobs = json.loads(fields["lp"]) if "lp" in fields else None
                        sent[index] = sent.get(index, _Sent()).add(fields["t"], count, logprobs)
                        last_sent = time.monotonic()
                        yield "token", Increment(fields["t"], count, index, logprobs)
                    moved = svc.waiters.wait(watch, 0)
                if client_gone():
                    abandon(svc, row, "stream")
                    return
                if moved:
                    row = svc.requests.get(Caller(row.tenant_id), rid)
                if time.monotonic() - last_sent >= settings.stream_idle_ping_s:
                    last_sent = time.monotonic()
                    yield "ping", None
            row = svc.requests.get(Caller(row.tenant_id), rid)
        yield from _rest(row, sent)
        yield "done", row
    except GeneratorExit:  # the client closed the stream before `done`
        abandon(svc, row, "stream")
        raise


class Increment(NamedTuple):
    """A ``token`` move: choice ``index``'s new text, its output tokens so far, and the new
    tokens' logprobs (as a row's choices keep them; None when the request asked for none)."""

    text: str
    output_tokens: int
    index: int = 0
    logprobs: list[dict[str, Any]] | None = None


class _Sent(NamedTuple):
    text: str = ""
    count: int = 0
    logprobs: int = 0

    def add(self, text: str, count: int, logprobs: list[Any] | None) -> _Sent:
        return _Sent(self.text + text, count, self.logprobs + len(logprobs or ()))


def _rest(row: InferenceRequest, sent: dict[int, _Sent]) -> Iterator[tuple[str, Increment]]:
    """What the increments missed of each choice (a cache hit, an identical request computed once
    for both, a Redis hiccup), from the ended row."""
    stored = row.choices or [{"text": row.output_text or "", "output_tokens": row.output_tokens or 0,
                              "logprobs": None}]
    for index, choice in enumerate(stored):
        had = sent.get(index, _Sent())
        text, logprobs = choice.get("text") or "", choice.get("logprobs")
        more_text = text[len(had.text):] if text.startswith(had.text) else ""
        more_logprobs = None if logprobs is None else logprobs[had.logprobs:]
        if more_text or more_logprobs:
            yield "token", Increment(more_text, choice.get("output_tokens") or 0, index, more_logprobs)


def _read(svc: Services, request_id: str, cursor: str) -> list[tuple[str, dict[str, str]]]:
    try:
        return streams.read(svc.redis, request_id, cursor, READ_BLOCK_MS)
    except Exception:  # Redis away: no increments; the row's final text still comes with `done`
        log.warning("token stream unreadable; the text will come with the final event", exc_info=True)
        time.sleep(READ_BLOCK_MS / 1000)
        return []
