"""Entry module for `celery -A workers.entry` (worker, beat, flower)."""

from web import create_app

from .bootstrap import connect

flask_app = create_app()
celery_app = flask_app.extensions["celery"]
connect(flask_app)
