"""Publishing again, from the process that committed them, rows whose first publish failed.

The web tier publishes through a fail-fast Celery app (``core/broker/config.py publisher``): one
attempt, bounded by ``SLUICE_REDIS_TIMEOUT_S`` (0.25 s by default). A Redis that answers late
once, or restarts, leaves the rows committed meanwhile unpublished. The sweep publishes them, but
only once they are ``SLUICE_PUBLISH_GRACE_S`` old (30 s by default, past the default realtime
deadline): a blip of a quarter of a second would cost an accepted question its answer.

So the process keeps what it could not publish and tries again on its own, soon: one thread,
started on the first failure, with a short backoff. It is an optimisation only. The row stays the
contract: a process that dies with rows here, a row older than the grace (the sweep's by then) or
one over the cap is published by the sweep as before. A row published twice (here and by the
sweep) is harmless, as is a row cancelled meanwhile: only one delivery can claim a queued row.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

FIRST_RETRY_S = 0.1
MAX_BACKOFF_S = 2.0
MAX_ROWS = 10_000
# Kept at least this long whatever the sweep's grace: a second publish (here and by the sweep) is
# harmless, and a short grace (the tests') must not turn this off.
KEEP_AT_LEAST_S = 30.0


@dataclass(frozen=True)
class Unpublished:
    id: uuid.UUID
    queue: str
    since: float  # monotonic: when it was committed and not published


class Republisher:
    """Rows this process committed but could not publish, published again by one background
    thread. ``publish(rows)`` publishes and stamps rows (anything with ``id`` and ``queue``) and
    raises on failure; ``give_up_s``: a row older than this (or than ``KEEP_AT_LEAST_S``) is left to
    the sweep."""

    def __init__(self, publish: Callable[[list[Unpublished]], None], give_up_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._publish, self._give_up_s, self._clock = publish, max(give_up_s, KEEP_AT_LEAST_S), clock
        self._rows: dict[uuid.UUID, Unpublished] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.published = 0  # rows this process published on a later try (for tests and logs)

    def pending(self) -> int:
        with self._lock:
            return len(self._rows)

    def add(self, rows) -> None:
        """Keep ``rows`` (``id`` and ``queue``) to publish again; starts the thread on first use.
        Never blocks and never raises: past the cap the sweep has them."""
        rows, now = list(rows), self._clock()
        with self._lock:
            idle = not self._rows  # else the thread is backing off: a new failure does not hurry it
            kept = rows[:max(0, MAX_ROWS - len(self._rows))]
            for row in kept:
                self._rows[row.id] = Unpublished(row.id, row.queue, now)
            if len(kept) < len(rows):
                log.warning("%d unpublished rows over this process's cap; the sweep will publish them",
                            len(rows) - len(kept))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="republisher", daemon=True)
                self._thread.start()
        if idle:
            self._wake.set()

    def _run(self) -> None:
        delay, failing = FIRST_RETRY_S, False
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            time.sleep(FIRST_RETRY_S)  # a burst's failures arrive together: publish them in one go
            cutoff = self._clock() - self._give_up_s
            with self._lock:
                stale = [r for r in self._rows.values() if r.since < cutoff]
                for row in stale:
                    del self._rows[row.id]
                batch = list(self._rows.values())
            if stale:
                log.warning("%d unpublished rows left to the sweep (older than %.0fs)", len(stale), self._give_up_s)
            if not batch:
                delay, failing = MAX_BACKOFF_S, False  # idle: wait to be woken
                continue
            done = 0
            try:
                for row in batch:
                    self._publish([row])
                    done += 1
            except Exception as exc:
                if not failing:  # once per outage, not once per try
                    log.warning("publishing again failed (%s); %d rows wait, retrying every %.0fs at most",
                                type(exc).__name__, len(batch) - done, MAX_BACKOFF_S)
                delay, failing = min(MAX_BACKOFF_S, delay * 2), True
            else:
                delay, failing = FIRST_RETRY_S, False
            with self._lock:
                for row in batch[:done]:
                    self._rows.pop(row.id, None)
                self.published += done
            if done:
                log.info("published %d rows on a later try", done)
