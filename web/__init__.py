"""Flask API. `create_app(settings)` wires everything; importing builds nothing."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from flask import Flask, Response, jsonify

from models.session import Database
from sluice.keys import redis_client
from sluice.logs import configure_logging
from sluice.settings import Settings

from .tokens import TokenCounters


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings.from_env()
    settings.require_services()
    configure_logging(settings.log_level)

    app = Flask("sluice")
    app.config["SLUICE"] = settings
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False

    db = Database()
    db.configure(settings.sqlalchemy_url)
    app.extensions["sluice.db"] = db
    app.extensions["sluice.redis"] = redis_client(settings.redis_url)
    app.extensions["sluice.tokens"] = TokenCounters()

    from workers.celery_app import celery_init_app, celery_publisher

    celery_init_app(app)
    # Web requests publish through a fail-fast app; workers and the sweep keep the patient one.
    app.extensions["sluice.publisher"] = celery_publisher(settings)

    from .admission import Admission

    app.extensions["sluice.admission"] = Admission(settings)

    from . import admin, api, errors, health, metrics

    errors.register_error_handlers(app)
    _bind_request_ids(app)
    app.register_blueprint(api.bp)
    app.register_blueprint(health.bp)
    app.register_blueprint(metrics.bp)
    if settings.admin_key:
        app.register_blueprint(admin.bp)

    spec = None

    @app.get("/openapi.json")
    def openapi() -> Response:
        nonlocal spec
        if spec is None:
            from .openapi import build_spec

            spec = build_spec(_version())
        return jsonify(spec)

    return app


def _bind_request_ids(app: Flask) -> None:
    """Every HTTP request gets an id: on each log line, in error envelopes, in X-Request-Id."""
    import uuid

    from flask import g, request

    from sluice.logs import current_request_id

    @app.before_request
    def _bind() -> None:
        incoming = request.headers.get("X-Request-Id", "")
        g.request_id = incoming if 0 < len(incoming) <= 64 and incoming.isprintable() else uuid.uuid4().hex
        g.request_id_token = current_request_id.set(g.request_id)

    @app.after_request
    def _tag(response: Response) -> Response:
        if "request_id" in g:
            response.headers["X-Request-Id"] = g.request_id
        return response

    @app.teardown_request
    def _unbind(exc: BaseException | None) -> None:
        token = g.pop("request_id_token", None)
        if token is not None:
            current_request_id.reset(token)


def _version() -> str:
    try:
        return version("sluice")
    except PackageNotFoundError:
        return "0.0.0"


__all__ = ["create_app"]
