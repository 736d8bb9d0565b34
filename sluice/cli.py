"""The `sluice` command line: bring the platform up, run its processes, manage keys."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import click

from .settings import Settings, SettingsError
from .tenants_cli import tenants

ROOT = Path(__file__).resolve().parent.parent


def _settings() -> Settings:
    try:
        return Settings.from_env()
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None


def _service_settings() -> Settings:
    settings = _settings()
    try:
        settings.require_services()
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    return settings


def _exec(argv: list[str]) -> None:
    """Replace this process, so signals (Ctrl-C, SIGTERM from a supervisor) reach the server."""
    sys.stdout.flush()
    os.execvp(argv[0], argv)


@click.group()
def main() -> None:
    """Sluice: a job-queue platform for LLM inference."""


main.add_command(tenants)


@main.command()
@click.option("--engine", type=click.Choice(["simulated", "vllm"]), default=None,
              help="Engine for the worker (default: SLUICE_ENGINE, else simulated).")
@click.option("--role", default="all", show_default=True, help="Role of the single worker started.")
@click.option("--no-flower", is_flag=True, help="Do not start Flower.")
@click.option("--model", "model_path", type=click.Path(exists=True, file_okay=False, resolve_path=True),
              default=None, help="Model directory to serve (weights + tokenizer); named after the directory.")
@click.option("--smoke", is_flag=True, help="Stop after the demo request; exit 0 only if it succeeded.")
def up(engine: str | None, role: str, no_flower: bool, model_path: str | None, smoke: bool) -> None:
    """Start everything: Postgres and Redis (embedded unless URLs are set), web, worker, beat, Flower."""
    from .supervisor import run_platform

    settings = _settings()
    if engine:
        settings = settings.replace(engine=engine)
    if model_path:
        settings = settings.replace(model_path=model_path, model=Path(model_path).name)
    if settings.engine == "vllm" and not settings.registry.default.path:
        raise click.UsageError("the vllm engine needs a model: --model PATH (or SLUICE_MODEL_PATH)")
    sys.exit(run_platform(settings, role=role, flower=not no_flower, smoke=smoke))


@main.command()
def migrate() -> None:
    """Upgrade the database schema to the latest revision."""
    settings = _service_settings()
    upgrade_database(settings.sqlalchemy_url)
    click.echo("database is at the latest revision")


def upgrade_database(url: str) -> None:
    from alembic import command
    from alembic.config import Config

    config = Config(str(ROOT / "alembic.ini"))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["configure_logging"] = False
    command.upgrade(config, "head")


@main.group()
def keys() -> None:
    """Manage API keys."""


@keys.command("create")
@click.option("--tenant", required=True, help="Tenant name; created if it does not exist.")
def keys_create(tenant: str) -> None:
    """Create an API key for TENANT and print it. It is shown only this once."""
    key = create_key(_service_settings().sqlalchemy_url, tenant)
    click.echo(key)


def create_key(url: str, tenant_name: str) -> str:
    from sqlalchemy import select

    from models import Database, Tenant

    from .tenants import add_key

    db = Database()
    db.configure(url, pool_size=1, max_overflow=0)
    try:
        with db.session() as session:
            tenant = session.scalar(select(Tenant).where(Tenant.name == tenant_name))
            if tenant is None:
                tenant = Tenant(name=tenant_name)
                session.add(tenant)
                session.flush()
            return add_key(session, tenant)
    finally:
        db.dispose()


@main.command()
@click.option("--role", type=click.Choice(["realtime", "batch", "large", "all"]), default="all",
              show_default=True, help="Fixes the queues this worker consumes.")
@click.option("--model", default=None, help="Registry name of the model to serve (default: the main model).")
@click.option("--gpus", default=None, help="Devices this worker owns, e.g. 0 or 0,1 (sets CUDA_VISIBLE_DEVICES).")
@click.option("--concurrency", type=int, default=None,
              help="Requests in flight (default: SLUICE_WORKER_CONCURRENCY, else the engine batch size).")
@click.option("--name", default=None, help="Node name (default ROLE@HOST); also names its direct queue.")
def worker(role: str, model: str | None, gpus: str | None, concurrency: int | None, name: str | None) -> None:
    """Run one GPU worker: one engine, many requests in flight feeding it."""
    settings = _service_settings()
    if gpus is not None:
        # Before anything can touch CUDA: the engine is imported only after exec.
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
        # Several devices for one worker means one model split across them.
        os.environ.setdefault("SLUICE_VLLM_TENSOR_PARALLEL_SIZE", str(len([g for g in gpus.split(",") if g.strip()])))
    try:
        argv = worker_argv(settings, role, concurrency, name, model)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    _exec(argv)


def worker_argv(settings: Settings, role: str, concurrency: int | None = None, name: str | None = None,
                model: str | None = None) -> list[str]:
    """argv of a Celery worker for ``role`` serving ``model``; raises ValueError for a bad pair."""
    from workers.routing import queues_for_role

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
    queues = queues_for_role(role, registry.queue_suffix(spec), node)
    # `env` carries the role and model into the worker process without touching our own env.
    return ["env", f"SLUICE_WORKER_ROLE={role}", f"SLUICE_WORKER_MODEL={spec.name}",
            sys.executable, "-m", "celery", "-A", "workers.entry", "worker",
            "--pool", "threads", "--concurrency", str(concurrency or settings.worker_threads),
            "--queues", ",".join(queues), "--hostname", node,
            "--loglevel", settings.log_level, "--without-mingle", "--without-gossip"]


@main.command()
def beat() -> None:
    """Run the scheduler (stranded-request sweep)."""
    settings = _service_settings()
    _exec(beat_argv(settings))


def beat_argv(settings: Settings) -> list[str]:
    schedule = Path(settings.data_dir) / "celerybeat-schedule"
    schedule.parent.mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "celery", "-A", "workers.entry", "beat", "--schedule", str(schedule),
            "--loglevel", settings.log_level]


@main.command()
def web() -> None:
    """Run the REST API under gunicorn."""
    _exec(web_argv(_service_settings()))


def web_argv(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "gunicorn", "--bind", f"{settings.web_host}:{settings.web_port}",
            "--workers", str(settings.web_workers), "--threads", "8", "--timeout", "60",
            "--access-logfile", "-", "web:create_app()"]


@main.command()
def flower() -> None:
    """Run Flower, the Celery queue and worker dashboard."""
    _exec(flower_argv(_service_settings()))


def flower_argv(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "workers.entry", "flower",
            f"--port={settings.flower_port}", f"--address={settings.web_host}"]


@main.command()
def sweep() -> None:
    """Run the stranded-request sweep once and print what it did."""
    from workers.entry import flask_app
    from workers.sweep import sweep as run_sweep

    with flask_app.app_context():
        report = run_sweep(flask_app.extensions["sluice.db"], flask_app.extensions["sluice.redis"],
                           flask_app.extensions["celery"], flask_app.config["SLUICE"])
    click.echo(json.dumps(report))


@main.command("config")
def show_config() -> None:
    """Print every setting, its environment variable and default (Markdown table)."""
    click.echo("| variable | default | meaning |\n|---|---|---|")
    for env, default, help_text in Settings.describe():
        click.echo(f"| `{env}` | {f'`{default}`' if default else '—'} | {help_text} |")


if __name__ == "__main__":
    main()
