"""Identical requests in flight are computed once.

A request the hot answer cache may answer (``core/submit/answers.py``: a deterministic one, or any at
the ``cached_answer`` level) and that misses it tries to become its twins' *leader*: one Redis
key per answer key names the request computing that answer. A twin that arrives while the
leader is queued or running is *parked*: its row is committed (so nothing accepted is lost) with
``follows_id`` set to the leader, and it is never published. When the leader ends, its end hook
(:meth:`Twins.leader_ended`, in whichever process ended it) settles every twin parked on it: a
succeeded leader hands them its answer (``cache_hit``; no engine ran for them), any other end
un-parks them into plain queued requests, published like any other. A retry storm of one
question therefore costs one inference.

Redis only says who leads and which leaders have followers; Postgres holds the truth. A twin
that parked just after its leader's hook ran settles itself (:meth:`Twins.settle` right after
its insert: the conditional updates let exactly one of the two act), and the sweep settles the
twins of ended leaders whose hook never ran (a worker killed between its commit and the hook).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import redis
from celery import Celery

from core.broker.fair import FairQueues
from core.broker.queues import BrokerEpoch, publish_committed
from core.broker.republish import Republisher
from core.submit.answers import ANSWER_PREFIX
from models.lifecycle import Lifecycle, Moved

log = logging.getLogger(__name__)

LEADER_PREFIX = "sluice:twin:"  # + answer digest → the id of the request computing it
FOLLOWED_PREFIX = "sluice:followed:"  # + leader id → set while twins may be parked on it
MAX_TTL_S = 86_400

# Delete the leader key only if it still names this request (a later leader may own it now).
_FORGET = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Twins:
    def __init__(self, client: redis.Redis, lifecycle: Lifecycle, publisher: Celery, epoch: BrokerEpoch,
                 healthy: Callable[[], bool] = lambda: True, republisher: Republisher | None = None,
                 fair: FairQueues | None = None) -> None:
        self.redis = client
        self.fair = fair
        self.republisher = republisher
        self.lifecycle = lifecycle
        self.publisher = publisher
        self.epoch = epoch
        self.healthy = healthy
        self._forget = client.register_script(_FORGET)

    def lead(self, answer_key: str, request_id: uuid.UUID, ttl_s: float) -> uuid.UUID | None:
        """Make ``request_id`` the computation of ``answer_key``; None when it now leads (or
        Redis cannot say), else the id of the request already computing that answer."""
        if not self.healthy():
            return None
        key = _leader_key(answer_key)
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(key, str(request_id), nx=True, ex=_ttl(ttl_s))
                pipe.get(key)
                created, holder = pipe.execute()
        except redis.RedisError as exc:
            log.warning("twin lookup failed (%s); computing it", type(exc).__name__)
            return None
        if created or holder is None or holder == str(request_id):
            return None
        return uuid.UUID(holder)

    def forget(self, answer_key: str, request_id: uuid.UUID) -> None:
        """``request_id`` no longer computes ``answer_key`` (refused, or ended)."""
        try:
            self._forget(keys=[_leader_key(answer_key)], args=[str(request_id)])
        except redis.RedisError as exc:  # the key expires on its own
            log.warning("twin key not cleared (%s)", type(exc).__name__)

    def park_on(self, leader_id: uuid.UUID, ttl_s: float) -> None:
        """Mark ``leader_id`` as followed, before a twin's row is inserted, so its end hook looks."""
        try:
            self.redis.set(FOLLOWED_PREFIX + str(leader_id), 1, ex=_ttl(ttl_s))
        except redis.RedisError as exc:  # the hook then asks Postgres anyway
            log.warning("followed mark not set (%s)", type(exc).__name__)

    def leader_ended(self, moved: Moved) -> None:
        """The lifecycle end hook: settle the twins parked on the request that just ended."""
        if moved.follows is not None:
            return  # a twin never leads
        mark = FOLLOWED_PREFIX + str(moved.id)
        if self.healthy():
            try:
                if not self.redis.exists(mark):
                    return  # nobody parked on it: no query on the common path
            except redis.RedisError:
                pass  # cannot tell: ask Postgres
        self.settle(moved.id)
        try:
            self.redis.delete(mark)
        except redis.RedisError:
            pass

    def settle(self, leader_id: uuid.UUID) -> int:
        """Settle the twins of ``leader_id`` if it has ended (see ``Lifecycle.follow_up``);
        publishes the un-parked ones. How many were un-parked."""
        unparked = self.lifecycle.follow_up(leader_id)
        try:
            publish_committed(self.lifecycle, self.publisher, unparked, self.epoch, fair=self.fair)
        except Exception as exc:
            log.warning("un-parked twins not published (%s); publishing them again shortly", type(exc).__name__)
            if self.republisher is not None:
                self.republisher.add(unparked)
        return len(unparked)


def _leader_key(answer_key: str) -> str:
    return LEADER_PREFIX + answer_key.removeprefix(ANSWER_PREFIX)


def _ttl(ttl_s: float) -> int:
    return max(1, min(MAX_TTL_S, int(ttl_s) + 1))
