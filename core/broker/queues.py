"""Queue names, worker roles, task names and the one way a request is published.

Queues are named ``<priority>.<size class>[.<model>]`` (the default model has no suffix). A
worker's role fixes the queues it consumes, listed in the order it should prefer them. Every
worker also consumes ``direct.<node>``, its own queue: later turns of a conversation are sent
there so they hit the prefix cache the earlier turns filled. The web tier and the sweep both
publish through :func:`publish_request`, so a request's message always looks the same.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from typing import TYPE_CHECKING

import redis
from celery import Celery
from kombu.transport.redis import PRIORITY_STEPS

from models import Priority, SizeClass
from models.lifecycle import Lifecycle

if TYPE_CHECKING:
    from core.broker.fair import FairQueues

RUN_TASK = "sluice.run_request"
SWEEP_TASK = "sluice.sweep"
MAINTENANCE_QUEUE = "maintenance"
# Webhook deliveries: their own queue and workers (`sluice worker --role webhooks`, no engine), so
# a slow or dead receiver never holds a GPU worker's thread.
DELIVER_TASK = "sluice.deliver_webhook"
WEBHOOKS_QUEUE = "webhooks"
WEBHOOKS_ROLE = "webhooks"


DIRECT_PREFIX = "direct."


def queue_name(priority: Priority, size_class: SizeClass, suffix: str = "") -> str:
    return f"{priority.value}.{size_class.value}{suffix}"


def direct_queue(node: str) -> str:
    return DIRECT_PREFIX + node


ALL_REQUEST_QUEUES = tuple(queue_name(p, s) for p in Priority for s in SizeClass)

# Realtime workers own reserved devices and never take batch work; the large worker keeps long
# contexts away from short ones; batch workers use what is left, large batch work included.
ROLES: dict[str, tuple[str, ...]] = {
    "realtime": ("realtime.small",),
    "large": ("realtime.large", "batch.large"),
    "batch": ("batch.small", "batch.large"),
    "all": ("realtime.small", "realtime.large", "batch.small", "batch.large"),
}


# A worker of an embedding model takes its embed queues whatever its role (no long contexts to
# keep apart: each input is one prefill): realtime only for a realtime one, both for the others.
EMBED_ROLES: dict[str, tuple[str, ...]] = {"realtime": ("realtime.embed",), "large": ("realtime.embed", "batch.embed"),
                                           "batch": ("batch.embed",), "all": ("realtime.embed", "batch.embed")}


def queues_for_role(role: str, suffix: str = "", node: str | None = None, embed: bool = False) -> tuple[str, ...]:
    """The queues a worker of ``role`` consumes: maintenance (one short sweep per interval, which
    must run even when request queues never drain), its own direct queue (conversation turns),
    then the role's queues for its model (``embed``: an embedding model's). workers/queue_order.py
    reads them class by class."""
    try:
        shared = tuple(q + suffix for q in (EMBED_ROLES if embed else ROLES)[role])
    except KeyError:
        raise ValueError(f"unknown worker role {role!r}; choose one of {', '.join(ROLES)}") from None
    return (MAINTENANCE_QUEUE,) + ((direct_queue(node),) if node else ()) + shared


def size_class_for(estimated_tokens: int, threshold: int) -> SizeClass:
    return SizeClass.LARGE if estimated_tokens > threshold else SizeClass.SMALL


# Each service tier's messages go to a priority list of their queue (kombu's Redis transport keeps
# one per step and a free thread reads step 0 of all its queues first, then step 3, ...), so a
# priority request is taken before default work, flex before batch, and realtime before batch
# whatever the steps (a realtime queue's class is read first at each step, workers/queue_order.py,
# and no realtime tier sits on a later step than a batch one).
MESSAGE_PRIORITY = {"priority": 0, "default": 3, "flex": 6, "batch": 9}


def message_priority(queue: str, tier: str | None = None) -> int:
    """The step a request's message is published at: its tier's, else (a row that does not say)
    its queue's class's plain tier's."""
    if tier in MESSAGE_PRIORITY:
        return MESSAGE_PRIORITY[tier]
    return MESSAGE_PRIORITY["batch" if queue.startswith("batch.") else "default"]


def publish_request(celery: Celery, request_id: uuid.UUID, queue: str, tier: str | None = None) -> None:
    """Send the run task for a committed row. Only the id travels; the task id is the row id."""
    celery.send_task(RUN_TASK, args=[str(request_id)], task_id=str(request_id), queue=queue,
                     routing_key=queue, priority=message_priority(queue, tier))


def publish_committed(lifecycle: Lifecycle, celery: Celery, rows, epoch: BrokerEpoch,
                      head: redis.Redis | None = None, fair: FairQueues | None = None) -> None:
    """Publish rows (anything with ``id`` and ``queue``) already committed as queued, then stamp
    each one's ``enqueued_at`` and the broker epoch it was published into. ``head``: the broker's
    Redis, to put each message at the head of its queue (the next one taken), not the tail: a
    batch request taken out of an engine for realtime work keeps its place in line. ``fair``: the
    fair lines (core/broker/fair.py); a row for a class queue joins its line (its ``tenant_id``,
    ``input_tokens`` and ``reserved_tokens`` place it there), and what the line lets through now
    is published, another tenant's request maybe.

    A crash between the two leaves enqueued_at NULL and the next sweep publishes again; the
    duplicate message is harmless because only one delivery can claim the row.
    """
    for row in rows:
        if head is None and fair is not None and fair.handles(row.queue):
            fair.publish(celery, fair.put([row]))
        else:
            publish_request(celery, row.id, row.queue, getattr(row, "service_tier", None))
            if head is not None:
                to_head(head, row.queue, str(row.id))
        lifecycle.stamp_enqueued(row.id, epoch.current())


# Kombu's Redis transport pushes a message on the left of its list and consumers pop from the
# right: the head of a queue is the right end. The message just published is near the left end.
_TO_HEAD = """
for _, key in ipairs(KEYS) do
  local items = redis.call('LRANGE', key, 0, tonumber(ARGV[2]) - 1)
  for _, item in ipairs(items) do
    if string.find(item, ARGV[1], 1, true) then
      redis.call('LREM', key, 1, item)
      redis.call('RPUSH', key, item)
      return 1
    end
  end
end
return 0
"""


def to_head(client: redis.Redis, queue: str, request_id: str, near: int = 1000) -> bool:
    """Move the message of ``request_id`` in ``queue`` to the head (taken next), looking among the
    ``near`` messages published last; False when it is not among them (taken already, or a
    thousand published since: it then keeps its place at the tail). Atomic: nothing is lost or
    doubled, whoever publishes or consumes meanwhile."""
    keys = queue_lists(queue)
    return bool(client.eval(_TO_HEAD, len(keys), *keys, request_id, near))


# Which life of the broker's data a message was published into. Redis that restarts without its
# data (or is flushed) loses queued messages without telling anyone; the epoch key goes with them,
# so the next process to look writes a new one, and the sweep re-publishes every queued row
# stamped with an older epoch. Losses that keep the key (a list deleted or evicted, a failover to
# a replica a little behind) are found message by message instead (``messages_queued``). An
# epoch starts with the Redis database number (``<db>.<random>``), so processes that share one
# Postgres but use different databases of one Redis (the test suite's) re-publish only their own
# rows; separate Redis servers sharing one Postgres are not supported.
EPOCH_KEY = "sluice:broker:epoch"


class BrokerEpoch:
    """The broker's current epoch, read at most once per ``cache_s`` per process.

    A row published in the second after a loss may carry the old epoch and be re-published once
    more: a duplicate message, which is harmless. When Redis does not answer, the last known
    epoch stands (the publish itself fails then, and the sweep publishes later).
    """

    def __init__(self, client: redis.Redis, cache_s: float = 1.0) -> None:
        self.client = client
        self.cache_s = cache_s
        self.prefix = f"{client.connection_pool.connection_kwargs.get('db', 0)}."
        self._value: str | None = None
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def current(self) -> str | None:
        with self._lock:
            if time.monotonic() - self._read_at < self.cache_s:
                return self._value
            try:
                value = self.client.get(EPOCH_KEY)
                if value is None:
                    self.client.set(EPOCH_KEY, self.prefix + uuid.uuid4().hex[:16], nx=True)
                    value = self.client.get(EPOCH_KEY)
            except redis.RedisError:
                return self._value
            self._value, self._read_at = value, time.monotonic()
            return value


# Kombu's Redis transport keeps a queue's messages in lists named after it (one per priority
# step, ``<queue>\x06\x16<step>``). A message a consumer took sits in its ``unacked`` hash
# until acked, or until the visibility timeout puts it back; a Sluice worker records the request
# ids it took (core/rediskeys.py: RESERVED_KEY) as it receives them.
_PRIORITY_SEP = "\x06\x16"
_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_SCAN_CHUNK = 5_000


def messages_queued(client: redis.Redis, queues: set[str]) -> set[str]:
    """Ids of the requests whose message waits in one of ``queues``.

    Reads every message (a task message carries its row's id), so it is as long as the queues.
    Messages consumers hold are not counted: one a worker took without recording it (killed in
    that instant) waits in ``unacked`` for the visibility timeout, which is as good as lost.
    """
    queued: set[str] = set()
    for queue in queues:
        for key in queue_lists(queue):
            start = 0
            while True:
                chunk = client.lrange(key, start, start + _SCAN_CHUNK - 1)
                queued.update(_ids(chunk))
                if len(chunk) < _SCAN_CHUNK:
                    break
                start += _SCAN_CHUNK
    return queued


def queue_length(client: redis.Redis, queue: str) -> int:
    """Messages waiting in ``queue`` (all its priority lists)."""
    with client.pipeline(transaction=False) as pipe:
        for key in queue_lists(queue):
            pipe.llen(key)
        return sum(pipe.execute())


def queue_lists(queue: str) -> tuple[str, ...]:
    """The Redis lists ``queue``'s messages wait in, one per priority step."""
    return tuple(_step_list(queue, step) for step in PRIORITY_STEPS)


def tier_list(queue: str, tier: str) -> str:
    """The Redis list a ``tier``'s messages on ``queue`` wait in."""
    return _step_list(queue, message_priority(queue, tier))


def _step_list(queue: str, step: int) -> str:
    return f"{queue}{_PRIORITY_SEP}{step}" if step else queue


def _ids(values) -> set[str]:
    found: set[str] = set()
    for value in values:
        data = value.encode() if isinstance(value, str) else value
        found.update(m.decode() for m in _UUID.findall(data))
    return found
