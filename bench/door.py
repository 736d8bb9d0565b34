"""What a poll costs the web tier: CPU milliseconds per `GET /v1/requests/<id>`, in the web
process and on the whole machine.

    .venv/bin/python bench/door.py                      # 20 s of polls from 16 clients
    .venv/bin/python bench/door.py --seconds 5 --clients 4   # a smoke run

In a spike most calls Sluice answers are polls of requests still queued or running (the overload
bench's users poll every 0.25 s), and on a small host the web tier, Postgres and Redis share a core
with the clients: whatever a poll costs is taken from the refusals that must come back in
milliseconds. This starts one real `sluice web` process (gunicorn, the default worker class) on a
scratch database of the local Postgres and a free Redis database, no worker (the polled request
stays queued, as in a spike), creates a tenant whose limits never bind and one request, and has
--clients threads poll it back to back for --seconds. CPU is read from /proc: the web process's
own (user + system) and the machine's busy time (which adds Postgres, Redis and these clients).
Compare commits by running it in each checkout, one after the other, on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import psutil  # noqa: E402
from overload import NO_LIMITS, flush_redis, free_port, interrupt, say, spawn, wait_http  # noqa: E402
from users import Http  # noqa: E402

from core.settings import Settings  # noqa: E402
from launcher.argv import web_argv  # noqa: E402
from launcher.database import upgrade_database  # noqa: E402
from launcher.harness import free_redis_db, scratch_database  # noqa: E402


def busy_seconds() -> float:
    """The machine's CPU seconds spent on anything but idling, summed over its cores."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (gunicorn's master and workers)."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            cpu = proc.cpu_times()
            total += cpu.user + cpu.system
    return total


def poll_load(api: str, key: str, request_id: str, clients: int, seconds: float) -> list[float]:
    """Every poll's latency, from ``clients`` threads polling back to back for ``seconds``."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    stop = time.monotonic() + seconds
    failures: list[str] = []

    def client(index: int) -> None:
        http = Http(api, {"Authorization": f"Bearer {key}"})
        try:
            while time.monotonic() < stop:
                began = time.monotonic()
                reply = http.call("GET", f"/v1/requests/{request_id}", timeout_s=30)
                if reply.status != 200:
                    failures.append(f"HTTP {reply.status}")
                    return
                latencies[index].append(time.monotonic() - began)
        finally:
            http.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise RuntimeError(f"polls failed: {failures[0]}")
    return [x for one in latencies for x in one]


def run(args: argparse.Namespace) -> dict:
    with contextlib.ExitStack() as exits, tempfile.TemporaryDirectory(prefix="sluice-door-") as tmp:
        database_url = exits.enter_context(scratch_database(args.postgres, "sluice_door"))
        redis_url = f"{args.redis}/{free_redis_db(args.redis, set())}"
        exits.callback(flush_redis, redis_url)
        port, admin_key = free_port(), uuid.uuid4().hex
        env = {"DATABASE_URL": database_url, "REDIS_URL": redis_url, "SLUICE_WEB_PORT": str(port),
               "SLUICE_WEB_WORKERS": "1", "SLUICE_ADMIN_KEY": admin_key, "SLUICE_LOG_LEVEL": "WARNING",
               "SLUICE_DATA_DIR": tmp, "SLUICE_ENGINE": "simulated"}
        settings = Settings.from_env(env)
        upgrade_database(settings.sqlalchemy_url)
        web = spawn(web_argv(settings), env, Path(tmp) / "web.log", exits)
        api = f"http://127.0.0.1:{port}"
        wait_http(api, "/healthz", web, Path(tmp) / "web.log", 60)
        created = Http(api, {"Authorization": f"Bearer {admin_key}"}).call(
            "POST", "/admin/tenants", {"name": "door", **NO_LIMITS}, timeout_s=30)
        if created.status != 201:
            raise RuntimeError(f"creating the tenant: HTTP {created.status} {created.doc}")
        key = created.doc["api_key"]
        submitted = Http(api, {"Authorization": f"Bearer {key}"}).call(
            "POST", "/v1/requests", {"prompt": "How long is a queue?", "max_tokens": 32, "deadline_s": 3600},
            timeout_s=30)
        if submitted.status != 202:
            raise RuntimeError(f"the request to poll: HTTP {submitted.status} {submitted.doc}")
        poll_load(api, key, submitted.doc["id"], args.clients, 2.0)  # warm: pool, prepared statements
        web_before, busy_before = tree_cpu_seconds(web.pid), busy_seconds()
        latencies = poll_load(api, key, submitted.doc["id"], args.clients, args.seconds)
        web_cpu, busy = tree_cpu_seconds(web.pid) - web_before, busy_seconds() - busy_before
    polls = len(latencies)
    latencies.sort()
    return {"polls": polls, "polls_per_s": polls / args.seconds,
            "web_cpu_ms_per_poll": 1000 * web_cpu / polls, "machine_cpu_ms_per_poll": 1000 * busy / polls,
            "latency_p50_ms": 1000 * statistics.median(latencies),
            "latency_p99_ms": 1000 * latencies[min(polls - 1, int(0.99 * polls))]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16, help="threads polling back to back")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long they poll")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379", help="Redis server (a free db is used)")
    args = parser.parse_args()
    if args.clients < 1 or args.seconds <= 0:
        parser.error("--clients must be >= 1 and --seconds > 0")
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)
    try:
        result = run(args)
    except KeyboardInterrupt:
        say("interrupted: everything this run started is stopped")
        return 130
    say(f"# {os.cpu_count()} CPUs; {args.clients} clients polling for {args.seconds:g} s; one web process")
    say("| polls/s | web CPU ms/poll | machine CPU ms/poll | latency p50 ms | p99 ms |")
    say("|---:|---:|---:|---:|---:|")
    say(f"| {result['polls_per_s']:.0f} | {result['web_cpu_ms_per_poll']:.2f} | "
        f"{result['machine_cpu_ms_per_poll']:.2f} | {result['latency_p50_ms']:.1f} | {result['latency_p99_ms']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
