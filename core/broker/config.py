"""The Celery configuration every process shares, and the publishing apps built from it.

Workers and beat consume with the app ``workers/celery_app.py`` builds from this config; the
web tier and the sweep only publish, through :func:`publisher`.
"""

from __future__ import annotations

from datetime import timedelta

from celery import Celery
from kombu import Queue

from core.broker.queues import ALL_REQUEST_QUEUES, MAINTENANCE_QUEUE, SWEEP_TASK, WEBHOOKS_QUEUE
from core.settings import Settings


def celery_config(settings: Settings) -> dict:
    return {
        "broker_url": settings.redis_url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            # See Settings.visibility_timeout_s for why this is far above the time limit.
            "visibility_timeout": settings.visibility_timeout_s,
            "socket_timeout": 5,
            "socket_connect_timeout": 5,
            # A free thread takes realtime before batch work (batch only uses idle capacity),
            # and takes turns between queues of one class; see workers/queue_order.py.
            "queue_order_strategy": "workers.queue_order:ClassPriorityCycle",
        },
        # The request row is the result; Celery keeps none.
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        # Ack after the task ran, so a worker that dies mid-flight loses nothing.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # Each thread takes one message at a time: a worker never hoards work it cannot start.
        "worker_prefetch_multiplier": 1,
        "task_queues": [Queue(name, routing_key=name)
                        for name in (*ALL_REQUEST_QUEUES, MAINTENANCE_QUEUE, WEBHOOKS_QUEUE)],
        "task_default_queue": MAINTENANCE_QUEUE,
        # Flower shows tasks from these events.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_hijack_root_logger": False,
        "beat_schedule": {
            "sweep-stranded-requests": {
                "task": SWEEP_TASK,
                "schedule": timedelta(seconds=settings.sweep_interval_s),
                "options": {"queue": MAINTENANCE_QUEUE, "expires": settings.sweep_interval_s},
            },
        },
        "include": ["workers.tasks", "workers.webhooks"],
    }


def publisher(settings: Settings, *, fail_fast: bool) -> Celery:
    """A Celery app that only publishes.

    ``fail_fast`` is for the web tier. With the defaults a publish to a hung Redis blocks a
    request for ~25 s (several reconnects at a 5 s socket timeout) and one to a refused port for
    ~2 s. The web tier cannot wait that long and does not need to: the row is committed first,
    and the sweep publishes rows whose publish failed. So one attempt, bounded by
    SLUICE_REDIS_TIMEOUT_S. The sweep keeps the patient defaults.
    """
    config = {k: v for k, v in celery_config(settings).items() if k not in ("beat_schedule", "include")}
    if fail_fast:
        timeout = settings.redis_timeout_s
        config["broker_transport_options"] = {**config["broker_transport_options"], "socket_timeout": timeout,
                                              "socket_connect_timeout": timeout, "max_retries": 0}
        config["broker_connection_timeout"] = timeout
        config["task_publish_retry"] = False
    app = Celery("sluice-publisher", set_as_current=False)
    app.config_from_object(config)
    return app
