"""The `sluice` command line: bring the platform up, run its processes, manage keys."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import click

from core.settings import Settings
from launcher.argv import (
    beat_argv,
    flower_argv,
    flower_env,
    flower_exposed,
    web_argv,
    webhooks_worker_argv,
    worker_argv,
)
from launcher.database import upgrade_database
from launcher.diagnose_cli import diagnose_command
from launcher.jobs_cli import jobs
from launcher.keys_cli import keys
from launcher.options import load_settings, not_found, operator_settings, service_settings, settings_env
from launcher.reserve_cli import reserve
from launcher.supervisor import run_platform
from launcher.tenants_cli import tenants
from launcher.usage_cli import budgets, usage_command
from launcher.webhooks_cli import webhooks


def _exec(argv: list[str], settings: Settings) -> None:
    """Replace this process, so signals (Ctrl-C, SIGTERM from a supervisor) reach the server.

    The server gets the settings this command resolved: what the environment lacked and the
    platform file of a running `sluice up` supplied (``launcher/options.py``) is passed on, so a
    server started beside that platform joins it; the environment's own values stay as they are."""
    sys.stdout.flush()
    os.execvpe(argv[0], argv, {**settings_env(settings), **os.environ})


@click.group()
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Data folder of `sluice up` (default: SLUICE_DATA_DIR, else .sluice in this folder). "
              "`sluice up` keeps its servers' data there; the other commands, run where DATABASE_URL and "
              "REDIS_URL are not exported, connect to the platform the `sluice up` on it runs.")
def main(data_dir: str | None) -> None:
    """Sluice: a job-queue platform for LLM inference."""
    if data_dir is not None:
        os.environ["SLUICE_DATA_DIR"] = data_dir  # every command (and what `sluice up` starts) reads it


main.add_command(tenants)
main.add_command(keys)
main.add_command(reserve)
main.add_command(jobs)
main.add_command(webhooks)
main.add_command(diagnose_command)
main.add_command(usage_command)
main.add_command(budgets)


@main.command()
@click.option("--engine", type=click.Choice(["simulated", "vllm"]), default=None,
              help="Engine for the worker (default: SLUICE_ENGINE, else simulated).")
@click.option("--role", default="all", show_default=True, help="Role of the single worker started.")
@click.option("--no-flower", is_flag=True, help="Do not start Flower.")
@click.option("--model", "model_path", type=click.Path(exists=True, file_okay=False, resolve_path=True),
              default=None, help="Model directory to serve (weights + tokenizer); named after the directory.")
@click.option("--embed-model", "embed_path", type=click.Path(exists=True, file_okay=False, resolve_path=True),
              default=None, help="Embedding model directory to serve beside it, on a worker of its own (POST "
              "/v1/embeddings); named after the directory, its dimensions read from its config.json.")
@click.option("--smoke", is_flag=True, help="Stop after the demo request; exit 0 only if it succeeded.")
def up(engine: str | None, role: str, no_flower: bool, model_path: str | None, embed_path: str | None,
       smoke: bool) -> None:
    """Start everything: Postgres and Redis (embedded unless URLs are set), web, worker, beat, Flower."""
    settings = load_settings()
    if engine:
        settings = settings.replace(engine=engine)
    if model_path:
        settings = settings.replace(model_path=model_path, model=Path(model_path).name)
    if embed_path:
        if settings.engine != "vllm":
            raise click.UsageError("--embed-model runs the model with vLLM: add --engine vllm (the simulated engine "
                                   "serves simulated-embed, random vectors, on its own)")
        if settings.models_json:
            raise click.UsageError("--embed-model with SLUICE_MODELS: list the embedding model there (role embed)")
        if Path(embed_path).name == settings.model:
            raise click.UsageError(f"--embed-model: {Path(embed_path).name!r} is the chat model's name too; serve a "
                                   "copy under another directory name")
        settings = settings.replace(embed_model=Path(embed_path).name, embed_model_path=embed_path,
                                    embed_dimensions=hidden_size(embed_path) or settings.embed_dimensions)
    if settings.engine == "vllm" and not settings.registry.default.path:
        raise click.UsageError("the vllm engine needs a model: --model PATH (or SLUICE_MODEL_PATH)")
    sys.exit(run_platform(settings, role=role, flower=not no_flower, smoke=smoke))


def hidden_size(model_path: str) -> int | None:
    """The vectors' length of the embedding model in ``model_path``: its config.json's hidden size."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("hidden_size", config.get("d_model")) if isinstance(config, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


@main.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
@click.option("--then", "program", metavar="COMMAND", default=None,
              help="Once the schema is at head, become COMMAND (with the arguments after it), e.g. "
              "`sluice migrate --then sluice web`.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def migrate(program: str | None, args: tuple[str, ...]) -> None:
    """Upgrade the database schema to the latest revision, then (--then) run a command.

    Each Procfile entry starts this way: honcho stops everything when any process exits, so a
    one-shot migrate entry cannot run beside the others. Processes that start together take
    turns on a lock; the first migrates, the rest find the schema done.
    """
    if args and program is None:
        raise click.UsageError("arguments after migrate need --then: sluice migrate --then COMMAND [ARGS]...")
    settings = service_settings()
    upgrade_database(settings.sqlalchemy_url)
    click.echo("database is at the latest revision")
    if program is not None:
        try:
            _exec([program, *args], settings)
        except FileNotFoundError:
            raise click.UsageError(f"--then: no command {program!r} on PATH") from None


@main.command()
@click.option("--role", type=click.Choice(["realtime", "batch", "large", "all", "webhooks"]), default="all",
              show_default=True, help="Fixes the queues this worker consumes; webhooks: sends webhook deliveries, "
              "with no engine.")
@click.option("--model", default=None, help="Registry name of the model to serve (default: the main model).")
@click.option("--gpus", default=None, help="Devices this worker owns, e.g. 0 or 0,1 (sets CUDA_VISIBLE_DEVICES); "
              "none in a container, which uses the device reserved for it.")
@click.option("--concurrency", type=int, default=None,
              help="Requests in flight (default: SLUICE_WORKER_CONCURRENCY, else the engine batch size).")
@click.option("--name", default=None, help="Node name (default ROLE@HOST); also names its direct queue.")
def worker(role: str, model: str | None, gpus: str | None, concurrency: int | None, name: str | None) -> None:
    """Run one GPU worker: one engine, many requests in flight feeding it (--role webhooks: a webhook
    sender instead, with no engine)."""
    from workers.bootstrap import device_env

    settings = service_settings()
    try:
        os.environ.update(device_env(gpus))  # before anything can touch CUDA: the engine loads after exec
        argv = webhooks_worker_argv(settings, concurrency, name) if role == "webhooks" else \
            worker_argv(settings, role, concurrency, name, model)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    _exec(argv, settings)


@main.command()
def beat() -> None:
    """Run the scheduler (stranded-request sweep)."""
    settings = service_settings()
    _exec(beat_argv(settings), settings)


@main.command()
def web() -> None:
    """Run the REST API under gunicorn."""
    settings = service_settings()
    # One directory of metric files for this server's processes, emptied at each start: a scrape
    # of any of them then shows the sum of all (core/observe/metrics.py).
    metrics_dir = Path(settings.data_dir) / "metrics" / f"web-{settings.web_port}"
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    _exec(web_argv(settings), settings)


@main.command()
def flower() -> None:
    """Run Flower, the Celery queue and worker dashboard."""
    settings = service_settings()
    if flower_exposed(settings):
        click.echo(f"warning: Flower listens on {settings.flower_host} with no login, and it lists every "
                   "tenant's requests; set SLUICE_FLOWER_BASIC_AUTH=user:password", err=True)
    os.environ.update(flower_env(settings))
    _exec(flower_argv(settings), settings)


@main.command()
def sweep() -> None:
    """Run the stranded-request sweep once and print what it did."""
    from core.services import start_services
    from workers.sweep import sweep as run_sweep

    report = run_sweep(start_services(service_settings()))
    click.echo(json.dumps(report))


@main.command()
def monitor() -> None:
    """Run the load monitor (queue waits and the degradation level, every second) and the bulk
    job feeder beside it; each leads through a lease of its own, so spare copies stand by."""
    import signal
    import threading

    from core.jobs.feeder import Feeder
    from core.services import start_services
    from workers.exporter import export_platform
    from workers.monitor import Monitor

    svc = start_services(service_settings())
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())

    feeder = threading.Thread(target=Feeder(svc).run, args=(stop,), name="feeder", daemon=True)
    feeder.start()
    export_platform(svc)
    Monitor(svc.settings, svc.redis, svc.db, broker=svc.broker, fair=svc.fair).run(stop)
    feeder.join(timeout=10)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--tenants", "by_tenant", is_flag=True,
              help="Also each class queue's fair line, tenant by tenant: requests, engine seconds, share, wait.")
def status(as_json: bool, by_tenant: bool) -> None:
    """Show the load per class, as the monitor last published it."""
    from core.admission.load import ClassLoad, load_view
    from core.broker.fair import lines_view, name_tenants
    from core.rediskeys import redis_client
    from models import Database
    from models.reservation import current_views

    settings = operator_settings()
    if not settings.redis_url:  # it reads the load from Redis; the reservations from Postgres, if set
        raise click.UsageError(not_found(settings, ["REDIS_URL"]))
    reservations = []
    client = redis_client(settings.redis_url)
    lines = lines_view(client) if by_tenant else []
    if settings.database_url:  # the reservations and the tenants' names live in Postgres
        db = Database()
        db.configure(settings.sqlalchemy_url, pool_size=1, max_overflow=0)
        try:
            with db.session() as session:
                reservations = current_views(session)
                name_tenants(session, lines)
        finally:
            db.dispose()
    view = load_view(client, settings.ladder, reservations)
    if by_tenant:
        view["lines"] = lines
    if as_json:
        click.echo(json.dumps(view, indent=2))
        return
    level = view["level"]
    click.echo(f"level {level if level is not None else '- (no monitor running)'}"
               f"{'; steps in force: ' + ', '.join(view['steps']) if view['steps'] else ''}")
    loads = [ClassLoad(**one) for one in view["classes"]]
    click.echo(f"{'class':32} {'queued':>7} {'tokens':>9} {'work':>8} {'drain tok/s':>11} {'seq tok/s':>9} "
               f"{'room':>5} {'wait s':>7} {'level':>5} {'fair wait s':>11} {'fair level':>10} {'workers':>7}")
    for load in loads:
        wait = "?" if load.wait_s < 0 else f"{load.wait_s:.1f}"
        fair = "?" if load.fair_wait_s < 0 else f"{load.fair_wait_s:.1f}"
        room = "?" if load.room < 0 else str(load.room)
        click.echo(f"{load.priority + ':' + load.model:32} {load.queued_requests:>7} {load.queued_tokens:>9} "
                   f"{load.queued_work:>8} {load.drain_tps:>11.0f} {load.seq_tps:>9.1f} {room:>5} {wait:>7} "
                   f"{load.level:>5} {fair:>11} {load.fair_level:>10} {load.workers:>7}")
    for one in view["reservations"]:
        click.echo(f"reservation {one['id']}: {one['state']}, {one['from']} → {one['until']}, "
                   f"role {one['role'] or 'all shared'}{', ' + one['note'] if one['note'] else ''}")
    if view["paused_for_reservations"]:
        click.echo(f"batch queues paused on: {', '.join(view['paused_for_reservations'])}")
    if by_tenant:
        click.echo(f"\n{'queue':24} {'tenant':36} {'queued':>7} {'engine s':>9} {'share':>6} {'reserved':>8} "
                   f"{'wait s':>7}")
        for line in lines:
            for row in line["tenants"]:
                reserved = "-" if row["reserved_share"] is None else f"{row['reserved_share']:g}"
                click.echo(f"{line['queue']:24} {row.get('name', row['tenant'])[:36]:36} {row['requests']:>7} "
                           f"{row['seconds']:>9.1f} {row['share']:>6.2f} {reserved:>8} {row['wait_s']:>7.1f}")
        if not lines:
            click.echo("no tenant has work waiting in a fair line")


@main.command("config")
def show_config() -> None:
    """Print every setting, its environment variable and default (Markdown table)."""
    click.echo("| variable | default | meaning |\n|---|---|---|")
    for env, default, help_text in Settings.describe():
        click.echo(f"| `{env}` | {f'`{default}`' if default else '—'} | {help_text} |")


if __name__ == "__main__":
    main()
