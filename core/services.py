"""The services every Sluice process holds, built once from the settings and typed.

``build_services(settings)`` wires the domain: the request lifecycle and its hooks, admission,
the submit pipeline, jobs, the publishing Celery apps. The web app keeps one under
``app.extensions`` (``web/services.py``); a worker process keeps one on its Celery app
(``workers/celery_app.py``). Nothing looks services up by string.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis
from celery import Celery

from core.admission.gates import Admission
from core.admission.load import QueueCounters
from core.broker.config import publisher as celery_publisher
from core.broker.fair import FairQueues, LineDrops
from core.broker.queues import BrokerEpoch, publish_committed
from core.broker.republish import Republisher
from core.delivery.notify import MovePublisher, Waiters
from core.delivery.webhooks import Webhooks
from core.jobs.service import JobService
from core.observe.logs import configure_logging
from core.observe.metrics import count_end
from core.rediskeys import eviction_policy, redis_client
from core.settings import Settings
from core.submit.answers import AnswerCache
from core.submit.ladder import Ladder, LoadReader
from core.submit.plan import Planner
from core.submit.service import RequestService
from core.submit.tokens import TokenCounters
from core.submit.twins import Twins
from core.tenants.recent_keys import RecentKeys
from core.usage.budgets import Budgets
from models import Database
from models.lifecycle import Lifecycle


@dataclass(frozen=True)
class Services:
    settings: Settings
    db: Database
    # The patient client (2 s timeouts): health checks, workers, the sweep.
    redis: redis.Redis
    # Publishing apps: web requests fail fast (the sweep catches up); the sweep is patient.
    publisher: Celery
    broker: Celery
    admission: Admission
    answers: AnswerCache
    twins: Twins
    epoch: BrokerEpoch
    # The fair lines in front of the class queues: tenants take turns in engine time (core/broker/fair.py).
    fair: FairQueues
    lifecycle: Lifecycle
    requests: RequestService
    jobs: JobService
    # Webhook deliveries: recording, publishing, listing, redelivery (also the lifecycle's on_move hook).
    webhooks: Webhooks
    # Keys that authenticated here a moment ago: only for refusing early (web/auth.py).
    recent_keys: RecentKeys
    # This process's subscription to request moves: what wakes `Prefer: wait` and streams.
    waiters: Waiters
    # Budgets: read by admission, listed and managed by the API, warned of by the sweep.
    budgets: Budgets


def build_services(settings: Settings) -> Services:
    db = Database()
    db.configure(settings.sqlalchemy_url, pool_size=settings.db_pool_size, max_overflow=settings.db_max_overflow)
    budgets = Budgets(db)
    admission = Admission(settings, budgets)
    lifecycle = Lifecycle(db)
    # Whoever ends a request (a worker, a cancel, the sweep) gives back its unused reservation.
    lifecycle.on_end(admission.release)
    # Every end is counted where it happens, with the tokens it cost (core/observe/metrics.py).
    lifecycle.on_end(count_end)
    # Every move changes its class's queue counters, which the load monitor and the promise read.
    lifecycle.on_move(QueueCounters(admission.redis, healthy=lambda: admission.redis_healthy))
    # Starts and ends are announced, waking the clients that wait or stream (core/delivery/notify.py).
    lifecycle.on_move(MovePublisher(admission.redis, healthy=lambda: admission.redis_healthy))
    # Web requests publish through a fail-fast app; workers and the sweep keep the patient one.
    publisher = celery_publisher(settings, fail_fast=True)
    # A request with a webhook: its start and its end become signed deliveries (core/delivery/webhooks.py).
    webhooks = Webhooks(settings, db, publisher, admission.redis)
    lifecycle.on_move(webhooks.moved)
    planner = Planner(settings, TokenCounters(), admission.redis, lambda: admission.redis_healthy)
    ladder = Ladder(settings, planner, LoadReader(settings, admission))
    # A request that ends settles the identical twins parked on it (core/submit/twins.py).
    # Which life of the broker's data rows are published into (lost messages are found by it).
    epoch = BrokerEpoch(admission.redis)
    # A tenant's excess waits in its place in a fair line, not in everybody's queue; one that ends
    # there (cancelled, expired) leaves it.
    fair = FairQueues(admission.redis, settings.fair_depth, settings.registry.default.name)
    lifecycle.on_move(LineDrops(fair, healthy=lambda: admission.redis_healthy))
    # What a failed publish left unpublished is tried again from this process within a second,
    # long before the sweep's grace (core/broker/republish.py).
    republisher = Republisher(lambda rows: publish_committed(lifecycle, publisher, rows, epoch, fair=fair),
                              give_up_s=settings.publish_grace_s)
    twins = Twins(admission.redis, lifecycle, publisher, epoch, healthy=lambda: admission.redis_healthy,
                  republisher=republisher, fair=fair)
    lifecycle.on_end(twins.leader_ended)
    answers = AnswerCache(admission.redis, ttl_s=settings.cache_ttl_s, max_entries=settings.cache_max_entries,
                          max_bytes=settings.cache_max_answer_bytes, healthy=lambda: admission.redis_healthy,
                          shared_tenants=settings.cache_shared_tenants)
    requests = RequestService(db, planner, ladder, admission, publisher, epoch, lifecycle, answers, twins,
                              republisher, fair)
    return Services(settings=settings, db=db, redis=redis_client(settings.redis_url),
                    publisher=publisher, broker=celery_publisher(settings, fail_fast=False), admission=admission,
                    answers=answers, lifecycle=lifecycle, twins=twins, epoch=epoch, fair=fair, requests=requests,
                    jobs=JobService(settings, db, requests, admission.redis), webhooks=webhooks,
                    recent_keys=RecentKeys(settings.auth_cache_s), waiters=Waiters(settings.redis_url),
                    budgets=budgets)


def start_services(settings: Settings | None = None) -> Services:
    """A process's services from its settings (the environment's when none are given): settings
    validated, logging configured, services built, Redis's eviction policy checked."""
    settings = settings or Settings.from_env()
    settings.require_services()
    configure_logging(settings.log_level, settings.log_format)
    built = build_services(settings)
    _check_eviction_policy(built.redis)
    return built


def _check_eviction_policy(client) -> None:
    """Redis that evicts keys under memory pressure loses queued messages, limits and cancel flags;
    the sweep re-publishes lost messages, but the rest is gone. Say so at every start."""
    policy = eviction_policy(client)
    if policy not in (None, "noeviction"):
        logging.getLogger(__name__).error(
            "Redis runs with maxmemory-policy %s; Sluice needs noeviction (set it in redis.conf, or "
            "CONFIG SET maxmemory-policy noeviction)", policy)
