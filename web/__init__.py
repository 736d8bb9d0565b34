"""Flask API. `create_app(settings)` wires everything; importing builds nothing."""

from __future__ import annotations

import logging
import re
import uuid
from importlib.metadata import PackageNotFoundError, version

from flask import Flask, Response, jsonify, request

from models import Database
from models.lifecycle import Lifecycle
from sluice.answers import AnswerCache
from sluice.broker import publisher as celery_publisher
from sluice.keys import eviction_policy, redis_client
from sluice.load import QueueCounters
from sluice.logs import configure_logging, current_call_id, current_request_id
from sluice.metrics import count_end
from sluice.notify import MovePublisher, Waiters
from sluice.queues import BrokerEpoch
from sluice.settings import Settings
from sluice.twins import Twins

from . import admin, api, dashboard, errors, health, jobs_api, metrics, openai_api, openai_batches_api, webhooks_api
from .admission import Admission
from .auth import RecentKeys
from .jobs import JobService
from .ladder import Ladder, LoadReader
from .plan import Planner
from .service import RequestService
from .services import EXTENSION, Services, services
from .tokens import TokenCounters
from .webhooks import Webhooks


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    settings.require_services()
    configure_logging(settings.log_level, settings.log_format)

    app = Flask("sluice")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False
    app.extensions[EXTENSION] = build_services(settings)
    _check_eviction_policy(services(app).redis)

    errors.register_error_handlers(app)
    _bind_call_ids(app)
    app.register_blueprint(api.bp)
    app.register_blueprint(jobs_api.bp)
    app.register_blueprint(openai_api.bp)
    app.register_blueprint(openai_batches_api.bp)
    app.register_blueprint(webhooks_api.bp)
    app.register_blueprint(health.bp)
    app.register_blueprint(metrics.bp)
    if settings.admin_key:
        app.register_blueprint(admin.bp)
        app.register_blueprint(admin.load_bp)
        app.register_blueprint(dashboard.page_bp)
        app.register_blueprint(dashboard.data_bp)

    spec = None

    @app.get("/openapi.json")
    def openapi() -> Response:
        nonlocal spec
        if spec is None:
            from .openapi import build_spec

            spec = build_spec(_version(), settings)
        return jsonify(spec)

    return app


def build_services(settings: Settings) -> Services:
    db = Database()
    db.configure(settings.sqlalchemy_url, pool_size=settings.db_pool_size, max_overflow=settings.db_max_overflow)
    admission = Admission(settings)
    lifecycle = Lifecycle(db)
    # Whoever ends a request (a worker, a cancel, the sweep) gives back its unused reservation.
    lifecycle.on_end(admission.release)
    # Every end is counted where it happens, with the tokens it cost (sluice/metrics.py).
    lifecycle.on_end(count_end)
    # Every move changes its class's queue counters, which the load monitor and the promise read.
    lifecycle.on_move(QueueCounters(admission.redis, healthy=lambda: admission.redis_healthy))
    # Starts and ends are announced, waking the clients that wait or stream (sluice/notify.py).
    lifecycle.on_move(MovePublisher(admission.redis, healthy=lambda: admission.redis_healthy))
    # Web requests publish through a fail-fast app; workers and the sweep keep the patient one.
    publisher = celery_publisher(settings, fail_fast=True)
    # A request with a webhook: its start and its end become signed deliveries (web/webhooks.py).
    lifecycle.on_move(Webhooks(settings, db, publisher).moved)
    planner = Planner(settings, TokenCounters(), admission.redis, lambda: admission.redis_healthy)
    ladder = Ladder(settings, planner, LoadReader(settings, admission))
    # A request that ends settles the identical twins parked on it (sluice/twins.py).
    # Which life of the broker's data rows are published into (lost messages are found by it).
    epoch = BrokerEpoch(admission.redis)
    twins = Twins(admission.redis, lifecycle, publisher, epoch, healthy=lambda: admission.redis_healthy)
    lifecycle.on_end(twins.leader_ended)
    answers = AnswerCache(admission.redis, ttl_s=settings.cache_ttl_s, max_entries=settings.cache_max_entries,
                          max_bytes=settings.cache_max_answer_bytes, healthy=lambda: admission.redis_healthy)
    requests = RequestService(db, planner, ladder, admission, publisher, epoch, lifecycle, answers, twins)
    return Services(settings=settings, db=db, redis=redis_client(settings.redis_url),
                    publisher=publisher, broker=celery_publisher(settings, fail_fast=False), admission=admission,
                    answers=answers, lifecycle=lifecycle, twins=twins, epoch=epoch, requests=requests,
                    jobs=JobService(settings, db, requests, admission.redis),
                    recent_keys=RecentKeys(settings.auth_cache_s), waiters=Waiters(settings.redis_url))


def _check_eviction_policy(client) -> None:
    """Redis that evicts keys under memory pressure loses queued messages, limits and cancel flags;
    the sweep re-publishes lost messages, but the rest is gone. Say so at every start."""
    policy = eviction_policy(client)
    if policy not in (None, "noeviction"):
        logging.getLogger(__name__).error(
            "Redis runs with maxmemory-policy %s; Sluice needs noeviction (set it in redis.conf, or "
            "CONFIG SET maxmemory-policy noeviction)", policy)


_CLIENT_ID = re.compile(r"[A-Za-z0-9._-]+")


def _bind_call_ids(app: Flask) -> None:
    """Every HTTP call gets an id: on each log line, in error envelopes, in X-Request-Id.

    The id is always ours. A client's own X-Request-Id (letters, digits, ``._-``, at most 64)
    prefixes it, so the client's id can be found in the logs, but two calls can never share one.
    """

    @app.before_request
    def _bind() -> None:
        ours = uuid.uuid4().hex
        incoming = request.headers.get("X-Request-Id", "")
        client_id = 0 < len(incoming) <= 64 and _CLIENT_ID.fullmatch(incoming)
        current_call_id.set(f"{incoming}.{ours[:12]}" if client_id else ours)

    @app.after_request
    def _tag(response: Response) -> Response:
        if current_call_id.get() != "-":
            response.headers["X-Request-Id"] = current_call_id.get()
        return response

    @app.teardown_request
    def _unbind(exc: BaseException | None) -> None:
        current_call_id.set("-")
        current_request_id.set("-")


def _version() -> str:
    try:
        return version("sluice")
    except PackageNotFoundError:
        return "0.0.0"


__all__ = ["Services", "create_app", "services"]
