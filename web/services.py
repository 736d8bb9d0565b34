"""Where a Flask app keeps its :class:`~core.services.Services`: handlers reach them with
:func:`services`."""

from __future__ import annotations

from flask import Flask, current_app

from core.services import Services

EXTENSION = "sluice"


def services(app: Flask | None = None) -> Services:
    """The app's services (the current app's when none is given)."""
    return (app or current_app).extensions[EXTENSION]
