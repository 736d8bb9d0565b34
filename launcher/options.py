"""Settings as the command line loads them: a bad setting is a usage error, not a traceback.

A command run beside a `sluice up` finds that platform the way ``docker compose`` finds its
project: `sluice up` keeps a platform file (``<data_dir>/platform.json``, 0600, written while it
runs) holding the settings its processes got, the servers' URLs and passwords among them. A
command that needs Postgres and Redis, started where DATABASE_URL or REDIS_URL is not exported,
reads the file of the data folder (SLUICE_DATA_DIR or ``sluice --data-dir``, else ``.sluice`` in
the current folder); every variable in the environment still wins over the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import psutil

from core.settings import Settings, SettingsError

PLATFORM_FILE = "platform.json"
_URLS = ("DATABASE_URL", "REDIS_URL")


def load_settings() -> Settings:
    try:
        return Settings.from_env()
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None


def operator_settings() -> Settings:
    """The environment's settings; where it lacks DATABASE_URL or REDIS_URL, completed from the
    platform file of the `sluice up` running on the data folder (the environment wins)."""
    settings = load_settings()
    if all(os.environ.get(name) for name in _URLS):
        return settings
    found = read_platform_file(Path(settings.data_dir))
    if found is None:
        return settings
    environ = {**found["env"], **{k: v for k, v in os.environ.items() if v != ""}}
    try:
        return Settings.from_env(environ)
    except SettingsError as exc:
        raise click.UsageError(f"{exc} (settings from {platform_file(Path(settings.data_dir))})") from None


def service_settings() -> Settings:
    """Settings of a command that needs Postgres and Redis: both URLs must be set, or found."""
    settings = operator_settings()
    missing = [name for name, value in zip(_URLS, (settings.database_url, settings.redis_url), strict=True)
               if not value]
    if missing:
        raise click.UsageError(not_found(settings, missing))
    return settings


def not_found(settings: Settings, missing: list[str]) -> str:
    """The error of a command that found no server: both ways to give it one."""
    path = platform_file(Path(settings.data_dir))
    return (f"{' and '.join(missing)} not set, and no `sluice up` runs on data folder {path.parent} (one that "
            f"runs keeps its {PLATFORM_FILE} there). Export {'them' if len(missing) > 1 else 'it'}, or run this "
            "command in the folder where `sluice up` runs (or name its data folder: `sluice --data-dir DIR …`, or "
            "SLUICE_DATA_DIR).")


# ---------------------------------------------------------------------------- the platform file


def platform_file(data_dir: Path) -> Path:
    return Path(data_dir).resolve() / PLATFORM_FILE


def settings_env(settings: Settings) -> dict[str, str]:
    """Every setting that differs from its default, under its own variable."""
    defaults = Settings()
    env = {}
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if value is not None and value != getattr(defaults, f.name):
            env[f.metadata["env"]] = str(value)
    return env


def write_platform_file(data_dir: Path, settings: Settings, api_url: str, flower_url: str | None) -> Path:
    """Write ``<data_dir>/platform.json`` (0600, atomically): what this `sluice up` runs on, for
    the commands started beside it. It holds passwords (the URLs' and the admin key)."""
    path = platform_file(data_dir)
    doc = {"written_by": "sluice up, while it runs; removed when it stops. Holds passwords: keep it 0600.",
           "pid": os.getpid(), "pid_started": psutil.Process().create_time(),
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "data_dir": str(path.parent),
           "api_url": api_url, "flower_url": flower_url, "env": settings_env(settings)}
    tmp = path.with_name(f".{PLATFORM_FILE}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def remove_platform_file(data_dir: Path) -> None:
    """Remove the platform file this process wrote (one another process wrote stays)."""
    path = platform_file(data_dir)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def read_platform_file(data_dir: Path, warn: bool = True) -> dict[str, Any] | None:
    """The platform file of ``data_dir`` if the `sluice up` that wrote it still runs; else None.
    A file that cannot be read, or whose writer is gone, is ignored with a line on stderr."""
    path = platform_file(data_dir)
    try:
        doc = json.loads(path.read_text())
        pid, started, env = int(doc["pid"]), float(doc["pid_started"]), doc["env"]
        if not isinstance(env, Mapping) or not all(isinstance(v, str) for v in env.values()):
            raise ValueError("env is not a map of strings")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if warn:
            click.echo(f"warning: ignoring {path}: cannot read it ({exc})", err=True)
        return None
    if not _running(pid, started):
        if warn:
            click.echo(f"warning: ignoring {path}: the `sluice up` that wrote it (pid {pid}) is no longer "
                       "running", err=True)
        return None
    return doc


def _running(pid: int, started: float) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``started`` (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - started) < 1.0
    except psutil.Error:
        return False
