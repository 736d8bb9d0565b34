"""Token streams: what a worker's engine produced for a streaming request, on its way to the
web process that relays it as Server-Sent Events.

One Redis stream per request (``sluice:tokens:<id>``), each entry a text increment with the
output token count so far (of one choice, ``i``, when a request asks for ``n`` > 1; with the
new tokens' logprobs as JSON, ``lp``, when it asks for logprobs); an ``end`` entry closes it.
Redis holds the increments, so the engine never waits for a reader: a slow client only falls
behind, and a client that connects late still reads from the first token.
The key expires a while after the request ends.

The worker side (:class:`TokenSink`) hands increments to one thread that writes them in
pipelined batches: the engine's event loop never blocks on Redis, and a Redis that is down
loses the increments (the final event still carries the whole text from the row).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Any

import redis

from models.request import storable_text

log = logging.getLogger(__name__)
PREFIX = "sluice:tokens:"
KEEP_S = 600  # a stream outlives its request this long, for readers that fall behind
MAX_ENTRIES = 100_000  # approximate cap per stream (XADD MAXLEN ~): a runaway cannot fill Redis
_BATCH = 256


def stream_key(request_id: str) -> str:
    return PREFIX + request_id


class TokenSink:
    """A worker's writer of token increments (thread-safe; never blocks its caller)."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._queue: queue.SimpleQueue[tuple[str, dict[str, Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="token-sink", daemon=True)
        self._thread.start()

    def push(self, request_id: str, text: str, output_tokens: int, index: int = 0,
             logprobs: list[dict[str, Any]] | None = None) -> None:
        """An increment of choice ``index``: its new text, its output tokens so far, and the new
        tokens' logprobs (as a row's choices keep them) when the request asked for them."""
        # As the row keeps it (a NUL a model may write is U+FFFD there): the increments add up to
        # the stored text, which a stream's last events are checked against.
        fields: dict[str, Any] = {"t": storable_text(text), "n": output_tokens}
        if index:
            fields["i"] = index
        if logprobs is not None:
            fields["lp"] = json.dumps(logprobs, separators=(",", ":"))
        self._queue.put((request_id, fields))

    def end(self, request_id: str, ended_by: str) -> None:
        self._queue.put((request_id, {"end": ended_by}))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < _BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._flush(batch)
                    return
                batch.append(more)
            self._flush(batch)

    def _flush(self, batch: list[tuple[str, dict[str, Any]]]) -> None:
        try:
            pipe = self._redis.pipeline(transaction=False)
            for request_id, fields in batch:
                key = stream_key(request_id)
                pipe.xadd(key, fields, maxlen=MAX_ENTRIES, approximate=True)
                pipe.expire(key, KEEP_S)
            pipe.execute()
        except Exception as exc:  # the row still gets the whole output; readers catch up from it
            log.warning("token increments not written (%s): %d lost", exc, len(batch))


def read(client: redis.Redis, request_id: str, after: str, block_ms: int) -> list[tuple[str, dict[str, str]]]:
    """Entries of the request's stream after entry id ``after`` (``"0"``: from the start),
    waiting up to ``block_ms`` for the first."""
    answer = client.xread({stream_key(request_id): after}, count=512, block=block_ms)
    return answer[0][1] if answer else []
