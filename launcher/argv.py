"""The command lines of Sluice's processes: what `sluice <cmd>` execs and `sluice up` spawns."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from core.broker.queues import WEBHOOKS_QUEUE, WEBHOOKS_ROLE, queues_for_role
from core.settings import Settings


def worker_argv(settings: Settings, role: str, concurrency: int | None = None, name: str | None = None,
                model: str | None = None) -> list[str]:
    """argv of a Celery worker for ``role`` serving ``model``; raises ValueError for a bad pair."""
    registry = settings.registry
    spec = registry.get(model) if model else registry.default
    if spec is None:
        raise ValueError(f"model {model!r} is not in the registry ({', '.join(m.name for m in registry.models)})")
    if role not in spec.worker_roles:
        raise ValueError(f"model {spec.name!r} is not served by role {role!r} (only {', '.join(spec.worker_roles)})")
    node = name or f"{role}@{socket.gethostname()}"
    if len(node) > 56 or not node.isprintable() or " " in node:
        raise ValueError(f"node name {node!r} must be at most 56 printable characters without spaces "
                         "(it names the worker's direct queue); pass a shorter --name")
    queues = queues_for_role(role, registry.queue_suffix(spec), node, embed=spec.role == "embed")
    # `env` carries the role and model into the worker process without touching our own env.
    return ["env", f"SLUICE_WORKER_ROLE={role}", f"SLUICE_WORKER_MODEL={spec.name}",
            sys.executable, "-m", "celery", "-A", "workers.entry", *_banner(settings), "worker",
            "--pool", "threads", "--concurrency", str(concurrency or settings.worker_threads),
            "--queues", ",".join(queues), "--hostname", node,
            "--loglevel", settings.log_level, "--without-mingle", "--without-gossip"]


def webhooks_worker_argv(settings: Settings, concurrency: int | None = None, name: str | None = None) -> list[str]:
    """argv of a webhooks worker: a thread pool sending deliveries from the webhooks queue only,
    with no engine (workers/entry.py skips it for this role), so receivers never hold a GPU."""
    return ["env", f"SLUICE_WORKER_ROLE={WEBHOOKS_ROLE}", sys.executable, "-m", "celery", "-A", "workers.entry",
            *_banner(settings), "worker", "--pool", "threads",
            "--concurrency", str(concurrency or settings.webhook_concurrency),
            "--queues", WEBHOOKS_QUEUE, "--hostname", name or f"{WEBHOOKS_ROLE}@{socket.gethostname()}",
            "--loglevel", settings.log_level, "--without-mingle", "--without-gossip"]


def _banner(settings: Settings) -> list[str]:
    """Celery prints its startup banner outside logging: with JSON logs it is left out, so every
    line a worker writes is one JSON object."""
    return ["--quiet"] if settings.log_format == "json" else []


def beat_argv(settings: Settings) -> list[str]:
    schedule = Path(settings.data_dir) / "celerybeat-schedule"
    schedule.parent.mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "celery", "-A", "workers.entry", *_banner(settings), "beat",
            "--schedule", str(schedule), "--loglevel", settings.log_level]


def web_argv(settings: Settings) -> list[str]:
    # gevent: a request held open by `Prefer: wait` or a token stream costs a greenlet (kilobytes)
    # instead of a thread, so a thousand waiting clients fit in one process (docs/answers.md).
    # psycopg 3 and redis-py cooperate with its patched sockets; the CPU work of a submit
    # (tokenizing) still runs one at a time per process, as under threads with the GIL.
    concurrency = (["--worker-class", "gevent", "--worker-connections", str(settings.web_worker_connections)]
                   if settings.web_worker_class == "gevent" else
                   ["--worker-class", "gthread", "--threads", str(settings.web_threads)])
    # gunicorn's own lines (the master's, errors, the access log) in Sluice's format, with its ids.
    logger = "web.gunicorn_hooks." + ("JsonGunicornLogger" if settings.log_format == "json" else "GunicornLogger")
    return [sys.executable, "-m", "gunicorn", "--bind", f"{settings.web_host}:{settings.web_port}",
            "--workers", str(settings.web_workers), *concurrency, "--timeout", "60",
            "--config", "python:web.gunicorn_hooks",
            "--access-logfile", "-", "--log-level", settings.log_level.lower(), "--logger-class", logger,
            "web:create_app()"]


def flower_argv(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "workers.entry", "flower",
            f"--port={settings.flower_port}", f"--address={settings.flower_host}"]


def flower_env(settings: Settings) -> dict[str, str]:
    """Flower's logins go in its environment: a command line is readable by every local user."""
    return {"FLOWER_BASIC_AUTH": settings.flower_basic_auth} if settings.flower_basic_auth else {}


def flower_exposed(settings: Settings) -> bool:
    """Flower would answer beyond this host without a login."""
    return settings.flower_host not in ("127.0.0.1", "localhost", "::1") and not settings.flower_basic_auth


def monitor_argv(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", "monitor"]
