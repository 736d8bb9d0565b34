"""Peak reservations, carried out: shared workers stop reading batch queues during a window.

The load monitor's leader calls :meth:`BatchPause.apply` on its tick with the live workers'
heartbeats and the reservations in force (``models/reservation.py``, read from Postgres every
``READ_EVERY_S``). A worker that serves both realtime and batch queues and matches a
reservation's role is told, through Celery's remote control, to cancel its batch consumers; when
no reservation covers it any more it is told to add them back. Batch work it had already started
runs on to its end: taken work is not thrown away.

Level-triggered, so restarts do not matter: which workers this platform paused is kept in Redis
(``PAUSED_KEY``), so a monitor that starts (or takes over) mid-window resumes them after it; a
worker that restarts mid-window comes back reading all its queues, shows up as not paused, and
is paused again at the next tick. A worker counts as paused (or resumed) only once it answered
the command: a broadcast is lost on a worker whose remote-control consumer is not listening yet
(its heartbeat starts with its engine, before Celery's consumer), so an unanswered command is
sent again, at most every ``RETRY_S`` per worker.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import redis
from celery import Celery

from core.rediskeys import PAUSED_KEY
from models.reservation import active
from models.session import Database

log = logging.getLogger(__name__)

READ_EVERY_S = 5.0
REPLY_TIMEOUT_S = 0.5  # per command; a worker that does not answer is asked again later
RETRY_S = 2.0


def batch_queues(worker: dict) -> list[str]:
    return [q for q in worker.get("queues", ()) if q.startswith("batch.")]


def shared(worker: dict) -> bool:
    """Serves both classes: the workers a reservation pauses."""
    return bool(batch_queues(worker)) and any(q.startswith("realtime.") for q in worker.get("queues", ()))


class BatchPause:
    def __init__(self, client: redis.Redis, db: Database, control: Celery,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.redis = client
        self.db = db
        self.control = control.control
        self.clock = clock
        self._in_force: list[str | None] = []  # roles of the reservations in force (None: every shared worker)
        self._read_at = float("-inf")
        self._unanswered: dict[str, float] = {}  # worker id -> when a command it did not answer was sent

    def in_force(self) -> list[str | None]:
        """Roles of the reservations in force, re-read from Postgres every READ_EVERY_S; the last
        known while Postgres does not answer."""
        if self.clock() - self._read_at >= READ_EVERY_S:
            try:
                with self.db.session() as session:
                    self._in_force = [r.role for r in active(session)]
                self._read_at = self.clock()
            except Exception as exc:
                log.warning("reservations not read (%s); keeping the last known", type(exc).__name__)
        return self._in_force

    def apply(self, workers: list[dict]) -> set[str]:
        """Pause or resume each live worker's batch queues as the reservations say; the ids of
        the workers paused now."""
        roles = self.in_force()
        paused = {k: json.loads(v) for k, v in self.redis.hgetall(PAUSED_KEY).items()}
        live = {w["worker"]: w for w in workers}
        for worker in workers:
            wid = worker["worker"]
            wanted = shared(worker) and any(role in (None, worker.get("role")) for role in roles)
            if wanted != (wid in paused) and self.clock() - self._unanswered.get(wid, float("-inf")) < RETRY_S:
                continue  # asked a moment ago and got no answer: not on every tick
            if wanted and wid not in paused:
                queues = batch_queues(worker)
                if not self._send(wid, "cancel_consumer", worker["node"], queues):
                    continue
                self.redis.hset(PAUSED_KEY, wid, json.dumps({"node": worker["node"], "queues": queues}))
                paused[wid] = {"node": worker["node"], "queues": queues}
                log.info("reservation in force: %s stops reading %s", worker["node"], ", ".join(queues))
            elif not wanted and wid in paused:
                if not self._send(wid, "add_consumer", worker["node"], paused[wid]["queues"]):
                    continue
                self.redis.hdel(PAUSED_KEY, wid)
                del paused[wid]
                log.info("reservation over: %s reads %s again", worker["node"], ", ".join(batch_queues(worker)))
        for wid in set(self._unanswered) - set(live):
            del self._unanswered[wid]
        for wid in set(paused) - set(live):  # gone: a restarted worker reads all its queues again
            self.redis.hdel(PAUSED_KEY, wid)
            del paused[wid]
        return set(paused)

    def _send(self, wid: str, command: str, node: str, queues: list[str]) -> bool:
        """Send ``command`` for each queue to ``node``; whether the node answered every one."""
        for queue in queues:
            replies = getattr(self.control, command)(queue, destination=[node], reply=True, timeout=REPLY_TIMEOUT_S)
            if not any(node in reply for reply in replies or ()):
                self._unanswered[wid] = self.clock()
                log.warning("%s did not answer %s %s; asking again at a later tick", node, command, queue)
                return False
        self._unanswered.pop(wid, None)
        return True

