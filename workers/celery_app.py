"""Celery wired the Flask way: one app per Flask app, every task run inside the app context."""

from __future__ import annotations

import functools
import inspect
from typing import ClassVar

from celery import Celery, Task
from flask import Flask

from sluice.broker import celery_config
from sluice.logs import log_context
from web.services import Services, services


class SluiceTask(Task):
    """Base of every Sluice task: runs in the Flask app context with its ids on every log line.

    ``call=`` is the task id; ``req=`` is the request row the task is about, for every task
    whose first parameter is ``request_id`` (the run task's id is that row's id too).
    """

    flask_app: ClassVar[Flask]

    def __call__(self, *args: object, **kwargs: object) -> object:
        with self.flask_app.app_context(), log_context(call=self.request.id or "-",
                                                       request=self._request_id(args, kwargs)):
            return self.run(*args, **kwargs)

    @property
    def services(self) -> Services:
        return services(self.flask_app)

    @functools.cached_property
    def _first_parameter(self) -> str | None:
        """Read once per task, not on every call: tasks are singletons of their app."""
        return next(iter(inspect.signature(self.run).parameters), None)

    def _request_id(self, args: tuple, kwargs: dict) -> str:
        if "request_id" in kwargs:
            return str(kwargs["request_id"])
        return str(args[0]) if self._first_parameter == "request_id" and args else "-"


def celery_init_app(app: Flask) -> Celery:
    task_cls = type("FlaskSluiceTask", (SluiceTask,), {"flask_app": app})
    celery_app = Celery(app.name, task_cls=task_cls)
    celery_app.config_from_object(celery_config(services(app).settings))
    celery_app.set_default()
    return celery_app
