"""Entry module for `celery -A workers.entry` (worker, beat, flower): settings → services → Celery.

No web app is built here: a worker's tasks run on the core's services alone.
"""

from core.broker.queues import WEBHOOKS_ROLE
from core.services import start_services
from workers.bootstrap import connect
from workers.celery_app import make_celery

services = start_services()
celery_app = make_celery(services)
# A webhooks worker (`sluice worker --role webhooks`) only sends HTTP: it loads no engine.
if services.settings.worker_role != WEBHOOKS_ROLE:
    connect(services)
