"""Settings as the command line loads them: a bad setting is a usage error, not a traceback."""

from __future__ import annotations

import click

from core.settings import Settings, SettingsError


def load_settings() -> Settings:
    try:
        return Settings.from_env()
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None


def service_settings() -> Settings:
    """Settings of a command that needs Postgres and Redis: both URLs must be set."""
    settings = load_settings()
    try:
        settings.require_services()
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    return settings
