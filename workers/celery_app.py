"""Celery wired to the core: one app per process, carrying that process's services.

A worker builds no web app: its tasks use the domain's services (``core/services.py``), which
the app carries (``SluiceCelery.services``) and every task reaches as ``self.services``.
"""

from __future__ import annotations

import functools
import inspect

from celery import Celery, Task

from core.broker.config import celery_config
from core.observe.logs import log_context
from core.services import Services


class SluiceTask(Task):
    """Base of every Sluice task: its process's services, and its ids on every log line.

    ``call=`` is the task id; ``req=`` is the request row the task is about, for every task
    whose first parameter is ``request_id`` (the run task's id is that row's id too).
    """

    def __call__(self, *args: object, **kwargs: object) -> object:
        with log_context(call=self.request.id or "-", request=self._request_id(args, kwargs)):
            return self.run(*args, **kwargs)

    @property
    def services(self) -> Services:
        return self.app.services

    @functools.cached_property
    def _first_parameter(self) -> str | None:
        """Read once per task, not on every call: tasks are singletons of their app."""
        return next(iter(inspect.signature(self.run).parameters), None)

    def _request_id(self, args: tuple, kwargs: dict) -> str:
        if "request_id" in kwargs:
            return str(kwargs["request_id"])
        return str(args[0]) if self._first_parameter == "request_id" and args else "-"


class SluiceCelery(Celery):
    """A Celery app that carries the services its tasks run with."""

    def __init__(self, services: Services) -> None:
        super().__init__("sluice", task_cls=SluiceTask)
        self.services = services
        self.config_from_object(celery_config(services.settings))


def make_celery(services: Services) -> SluiceCelery:
    celery_app = SluiceCelery(services)
    celery_app.set_default()
    return celery_app
