"""Entry module for `celery -A workers.entry` (worker, beat, flower)."""

from sluice.queues import WEBHOOKS_ROLE
from web import create_app, services

from .bootstrap import connect
from .celery_app import celery_init_app

flask_app = create_app()
celery_app = celery_init_app(flask_app)
# A webhooks worker (`sluice worker --role webhooks`) only sends HTTP: it loads no engine.
if services(flask_app).settings.worker_role != WEBHOOKS_ROLE:
    connect(flask_app)
