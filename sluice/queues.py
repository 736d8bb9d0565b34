"""Queue names, worker roles, task names and the one way a request is published.

Queues are named ``<priority>.<size class>[.<model>]`` (the default model has no suffix). A
worker's role fixes the queues it consumes, listed in the order it should prefer them. Every
worker also consumes ``direct.<node>``, its own queue: later turns of a conversation are sent
there so they hit the prefix cache the earlier turns filled. The web tier and the sweep both
publish through :func:`publish_request`, so a request's message always looks the same.
"""

from __future__ import annotations

import uuid

from celery import Celery

from models import Priority, SizeClass
from models.lifecycle import Lifecycle

RUN_TASK = "sluice.run_request"
SWEEP_TASK = "sluice.sweep"
MAINTENANCE_QUEUE = "maintenance"


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


def queues_for_role(role: str, suffix: str = "", node: str | None = None) -> tuple[str, ...]:
    """The queues a worker of ``role`` consumes: maintenance (one short sweep per interval, which
    must run even when request queues never drain), its own direct queue (conversation turns),
    then the role's queues for its model. workers/queue_order.py reads them class by class."""
    try:
        shared = tuple(q + suffix for q in ROLES[role])
    except KeyError:
        raise ValueError(f"unknown worker role {role!r}; choose one of {', '.join(ROLES)}") from None
    return (MAINTENANCE_QUEUE,) + ((direct_queue(node),) if node else ()) + shared


def size_class_for(estimated_tokens: int, threshold: int) -> SizeClass:
    return SizeClass.LARGE if estimated_tokens > threshold else SizeClass.SMALL


def publish_request(celery: Celery, request_id: uuid.UUID, queue: str) -> None:
    """Send the run task for a committed row. Only the id travels; the task id is the row id."""
    celery.send_task(RUN_TASK, args=[str(request_id)], task_id=str(request_id), queue=queue,
                     routing_key=queue)


def publish_committed(lifecycle: Lifecycle, celery: Celery, rows) -> None:
    """Publish rows (anything with ``id`` and ``queue``) already committed as queued, then stamp
    each one's ``enqueued_at``.

    A crash between the two leaves enqueued_at NULL and the next sweep publishes again; the
    duplicate message is harmless because only one delivery can claim the row.
    """
    for row in rows:
        publish_request(celery, row.id, row.queue)
        lifecycle.stamp_enqueued(row.id)
