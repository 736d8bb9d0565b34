"""The services one Sluice app holds, built once by the app factory and typed.

Handlers, tasks and commands reach them with :func:`services`; nothing looks services up by
string. Worker processes build the same app (Celery runs inside its context), so the sweep and
the tasks share these objects too.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from celery import Celery
from flask import Flask, current_app

from models import Database
from models.lifecycle import Lifecycle
from sluice.answers import AnswerCache
from sluice.notify import Waiters
from sluice.queues import BrokerEpoch
from sluice.settings import Settings
from sluice.twins import Twins

from .admission import Admission
from .auth import RecentKeys
from .jobs import JobService
from .service import RequestService

EXTENSION = "sluice"


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
    lifecycle: Lifecycle
    requests: RequestService
    jobs: JobService
    # Keys that authenticated here a moment ago: only for refusing early (web/auth.py).
    recent_keys: RecentKeys
    # This process's subscription to request moves: what wakes `Prefer: wait` and streams.
    waiters: Waiters


def services(app: Flask | None = None) -> Services:
    """The app's services (the current app's when none is given)."""
    return (app or current_app).extensions[EXTENSION]
