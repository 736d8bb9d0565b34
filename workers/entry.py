"""Entry module for `celery -A workers.entry` (worker, beat, flower)."""

from web import create_app

from .bootstrap import connect
from .celery_app import celery_init_app

flask_app = create_app()
celery_app = celery_init_app(flask_app)
connect(flask_app)
