"""Worker process start and stop: load the engine once, before the first task is taken.

Celery fires ``worker_init`` before the consumer starts, so a worker only takes messages once
its engine is loaded and warmed up (a cold model never sees a user's request).
"""

from __future__ import annotations

import logging
import os
import uuid

from celery.signals import task_received, worker_init, worker_shutdown
from flask import Flask

from sluice.keys import RESERVED_KEY
from sluice.settings import Settings

from .engines import load_engine
from .routing import RUN_TASK
from .runtime import EngineRuntime

log = logging.getLogger(__name__)

_state: dict[str, object] = {}


def device_label(settings: Settings) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if settings.engine == "simulated":
        return "simulated-h200"
    return f"cuda:{visible}" if visible else "cpu"


def start_runtime(app: Flask, hostname: str) -> EngineRuntime:
    settings: Settings = app.config["SLUICE"]
    worker_id = f"{hostname}/{os.getpid()}.{uuid.uuid4().hex[:6]}"
    runtime = EngineRuntime(load_engine(settings), app.extensions["sluice.redis"], worker_id,
                            heartbeat_s=settings.worker_heartbeat_s,
                            dead_after_s=settings.worker_dead_after_s,
                            cancel_poll_s=settings.cancel_poll_s)
    runtime.start()
    _state["runtime"] = runtime
    _state["device"] = device_label(settings)
    return runtime


def current_runtime() -> tuple[EngineRuntime, str]:
    try:
        return _state["runtime"], _state["device"]  # type: ignore[return-value]
    except KeyError:
        raise RuntimeError("engine runtime not started; run workers with `sluice worker`") from None


def connect(app: Flask) -> None:
    """Hook engine start/stop into this process's Celery worker lifecycle."""

    @worker_init.connect(weak=False)
    def _on_init(sender, **kwargs) -> None:
        start_runtime(app, sender.hostname)

    @task_received.connect(weak=False)
    def _on_received(request, **kwargs) -> None:
        runtime = _state.get("runtime")
        if runtime is None or request.name != RUN_TASK:
            return
        try:
            app.extensions["sluice.redis"].hset(RESERVED_KEY, request.id, runtime.worker_id)  # type: ignore[attr-defined]
        except Exception:
            log.warning("could not record reservation of %s; recovery falls back to the visibility timeout",
                        request.id)

    @worker_shutdown.connect(weak=False)
    def _on_shutdown(**kwargs) -> None:
        runtime = _state.pop("runtime", None)
        if runtime is not None:
            runtime.stop()  # type: ignore[attr-defined]
