"""Flask API. `create_app(settings)` wires everything; importing builds nothing."""

from __future__ import annotations

import re
import uuid
from importlib.metadata import PackageNotFoundError, version

from flask import Flask, Response, jsonify, request

from core.observe.logs import current_call_id, current_request_id
from core.services import start_services
from core.settings import Settings
from web import admin, api, dashboard, errors, health, jobs_api, metrics, usage_api, webhooks_api
from web.bodies import Request
from web.openai import batches_api as openai_batches_api
from web.openai import chat as openai_api
from web.openai import responses_api as openai_responses_api
from web.services import EXTENSION, Services, services


def create_app(settings: Settings | None = None) -> Flask:
    svc = start_services(settings)
    settings = svc.settings
    app = Flask("sluice")
    app.request_class = Request  # a chunked body over the limit is 413 too, not a truncated one
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False
    app.extensions[EXTENSION] = svc

    errors.register_error_handlers(app)
    _bind_call_ids(app)
    app.register_blueprint(api.bp)
    app.register_blueprint(jobs_api.bp)
    app.register_blueprint(openai_api.bp)
    app.register_blueprint(openai_batches_api.bp)
    app.register_blueprint(openai_responses_api.bp)
    app.register_blueprint(webhooks_api.bp)
    app.register_blueprint(usage_api.bp)
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
            from web.openapi import build_spec

            spec = build_spec(_version(), settings)
        return jsonify(spec)

    return app


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
