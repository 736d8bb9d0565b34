"""Request moves through Redis pub/sub: a client waiting on a request is woken by its move,
never by re-reading Postgres in a loop.

Every committed transition to running or to an end publishes ``"<id> <status>"`` on one
channel (:class:`MovePublisher`, a lifecycle ``on_move`` hook, in whichever process made the
move: a worker, the sweep, a cancel). Each web process holds one subscription to it, shared by
all its waiters (:class:`Waiters`): a thousand waits cost one Redis connection, not a thousand.

Pub/sub delivers at most once: a message sent while the subscription reconnects is gone. So a
:class:`Watch` knows whether the subscription stayed up since it began; when it did not, the
waiter re-reads its row once (and while Redis is down, every few seconds: the local floor).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from models.lifecycle import Moved
from models.request import Status

log = logging.getLogger(__name__)
CHANNEL = "sluice:moves"
RECONNECT_S = 1.0
DOWN_RECHECK_S = 3.0  # while the subscription is down, a waiter re-reads its row this often


class MovePublisher:
    """Lifecycle hook: announce a request's start and its end (other moves wake nobody)."""

    def __init__(self, client: redis.Redis, healthy: Callable[[], bool] = lambda: True) -> None:
        self._redis = client
        self._healthy = healthy

    def __call__(self, moved: Moved) -> None:
        if moved.status != Status.RUNNING and not moved.status.terminal:
            return
        if not self._healthy():
            return  # waiters fall back to re-reading their row while Redis is away
        self._redis.publish(CHANNEL, f"{moved.id} {moved.status.value}")


class Watch:
    """One waiter's view of one request: the statuses announced for it since it began."""

    def __init__(self, generation: int) -> None:
        self.event = threading.Event()
        self.status: str | None = None
        self.generation = generation


class Waiters:
    """The web process's subscription to request moves and the waits it wakes.

    The listening thread starts with the first watch (after gunicorn forked this process).
    """

    def __init__(self, redis_url: str) -> None:
        self._url = redis_url
        self._lock = threading.Lock()
        self._watches: dict[str, set[Watch]] = {}
        self._thread: threading.Thread | None = None
        self._up = False
        self._generation = 0  # +1 each time the subscription (re)starts: messages may be lost

    @contextmanager
    def watch(self, request_id: str) -> Iterator[Watch]:
        """Register before reading the row, so a move between the read and the wait is seen."""
        self._ensure_listening()
        with self._lock:
            one = Watch(self._generation if self._up else -1)
            self._watches.setdefault(request_id, set()).add(one)
        try:
            yield one
        finally:
            with self._lock:
                mine = self._watches.get(request_id)
                if mine is not None:
                    mine.discard(one)
                    if not mine:
                        del self._watches[request_id]

    def wait(self, one: Watch, timeout_s: float) -> bool:
        """Block until a move is announced for the watched request or ``timeout_s`` passes.

        True when the caller should read the row: a move came, or moves may have been missed
        (the subscription was down or restarted since the watch began)."""
        if not self._trusted(one):
            timeout_s = min(timeout_s, DOWN_RECHECK_S)
        if one.event.wait(max(0.0, timeout_s)):
            one.event.clear()
            return True
        if not self._trusted(one):
            with self._lock:
                one.generation = self._generation if self._up else -1
            return True
        return False

    def _trusted(self, one: Watch) -> bool:
        with self._lock:
            return self._up and one.generation == self._generation

    @property
    def listening(self) -> bool:
        return self._up

    def _ensure_listening(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._listen, name="move-listener", daemon=True)
            self._thread.start()

    def _listen(self) -> None:
        while True:
            client = redis.Redis.from_url(self._url, socket_connect_timeout=2.0, health_check_interval=30,
                                          decode_responses=True)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(CHANNEL)
                with self._lock:
                    self._up, self._generation = True, self._generation + 1
                for message in pubsub.listen():
                    self._dispatch(message.get("data"))
            except Exception as exc:  # Redis restarted or unreachable: retry, waiters re-read rows
                log.warning("request move subscription lost (%s); retrying in %.0fs", exc, RECONNECT_S)
            finally:
                with self._lock:
                    self._up = False
                for watches in self._snapshot():
                    watches.event.set()  # wake everyone: they re-read their rows
                pubsub.close()
                client.close()
            time.sleep(RECONNECT_S)

    def _snapshot(self) -> list[Watch]:
        with self._lock:
            return [one for watches in self._watches.values() for one in watches]

    def _dispatch(self, data: object) -> None:
        if not isinstance(data, str) or " " not in data:
            return
        request_id, status = data.split(" ", 1)
        with self._lock:
            watches = list(self._watches.get(request_id, ()))
        for one in watches:
            one.status = status
            one.event.set()
