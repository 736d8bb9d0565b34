"""Admission throughput and latency of the web tier, through gunicorn, with no engine work.

    .venv/bin/python bench/admission.py --seconds 20 --clients 16

Starts `sluice web` (gunicorn, the argv of `launcher.argv.web_argv`) against a scratch database on
the local Postgres and an empty database of the local Redis, creates a tenant whose limits never
bind, then for --seconds each, with --clients concurrent keep-alive connections, drives:

  baseline  GET /v1/requests/<id>: authentication and one row read, the cheapest
            authenticated call, so the same Flask, gunicorn and Postgres costs
  submit    POST /v1/requests with a fresh Idempotency-Key: validation, authentication, the
            idempotency lookup, the three gates (one Lua call in Redis), INSERT + COMMIT of the
            row and its key, publish to the Celery queue, enqueued_at stamp
  refuse    POST /v1/requests while the load figures say its class's queue cannot finish it
            before its deadline: 503 from the promise at arrival (no row, no quota charged)

It runs both with one client (latency without queueing: the POST - GET difference is what
admission, idempotency, the row insert and the publish add to a request) and with --clients
(throughput: admitted requests/s). It also times admission alone (the Lua gates for a tenant
already loaded, in this process) to separate the gates from the insert and the publish, and
last the refusal rate while the published load says every realtime submit must be refused.
Nothing consumes the queues; the scratch database and the Redis database are dropped at exit.

Each line also gives the web tier's CPU per call (user + system of gunicorn's master and workers
over the phase, from /proc): in a spike most calls are polls and refusals, and on a small host
what a poll costs is taken from the refusals that must come back in milliseconds. Compare commits
by running this in each checkout, one after the other, on a quiet machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from core.settings import Settings  # noqa: E402
from launcher.argv import web_argv  # noqa: E402
from launcher.database import create_key, upgrade_database  # noqa: E402
from launcher.harness import free_redis_db, scratch_database  # noqa: E402

NO_LIMIT = {"tokens_per_minute": 10**9, "requests_per_minute": 10**8, "max_concurrent": 10**8}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def drive(args: tuple) -> list[float]:
    """One client process: `threads` keep-alive connections hammering one call until `until`."""
    from concurrent.futures import ThreadPoolExecutor

    port, key, kind, request_id, threads, until = args

    def client(_: int) -> list[float]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        latencies = []
        while time.monotonic() < until:
            began = time.perf_counter()
            body = json.dumps({"prompt": "How do I keep a GPU fleet standing under load?", "max_tokens": 64})
            if kind == "submit":
                conn.request("POST", "/v1/requests", body, {**headers, "Idempotency-Key": uuid.uuid4().hex})
            elif kind == "refuse":
                conn.request("POST", "/v1/requests", body, headers)
            else:
                conn.request("GET", f"/v1/requests/{request_id}", headers=headers)
            response = conn.getresponse()
            response.read()
            elapsed = time.perf_counter() - began
            if response.status != {"submit": 202, "refuse": 503}.get(kind, 200):
                raise RuntimeError(f"{kind}: HTTP {response.status}")
            latencies.append(elapsed)
        conn.close()
        return latencies

    with ThreadPoolExecutor(threads) as pool:
        return [x for chunk in pool.map(client, range(threads)) for x in chunk]


def run_phase(port: int, key: str, kind: str, request_id: str, clients: int, procs: int, seconds: float,
              server_pid: int) -> dict:
    until = time.monotonic() + seconds
    per_proc = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    cpu_before = tree_cpu_seconds(server_pid)
    with multiprocessing.Pool(procs) as pool:
        chunks = pool.map(drive, [(port, key, kind, request_id, n, until) for n in per_proc if n])
    cpu = tree_cpu_seconds(server_pid) - cpu_before
    latencies = sorted(x for chunk in chunks for x in chunk)
    return {"requests": len(latencies), "per_s": len(latencies) / seconds, **percentiles(latencies),
            "web_cpu_ms": 1000 * cpu / len(latencies)}


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (gunicorn's master and workers)."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            cpu = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += cpu.user + cpu.system
    return total


def percentiles(latencies: list[float]) -> dict:
    q = statistics.quantiles(latencies, n=100)
    return {"p50_ms": q[49] * 1000, "p99_ms": q[98] * 1000}


def time_gates(settings: Settings, key: str, n: int) -> dict:
    """The admission step alone, in this process: one Lua call for a tenant already loaded."""
    from sqlalchemy import select

    from core.admission.gates import Admission
    from core.submit.plan import Plan
    from models import ApiKey, Database, Priority, SizeClass, Tenant, hash_key

    db = Database()
    db.configure(settings.sqlalchemy_url, pool_size=2)
    admission = Admission(settings)
    with db.session() as session:
        tenant = session.scalar(select(Tenant).join(ApiKey).where(ApiKey.key_hash == hash_key(key)))
    latencies = []
    for _ in range(n):
        plan = Plan(request_id=uuid.uuid4(), tenant_id=tenant.id, priority=Priority.REALTIME,
                    size_class=SizeClass.SMALL, queue="realtime.small", model_requested=settings.model,
                    model_routed=None, route_reason=None, input={"prompt": "x"}, params={}, meta={},
                    conversation_id=None, max_tokens=64, time_limit_s=settings.time_limit_s, input_tokens=12,
                    deadline_s=settings.realtime_deadline_s)
        began = time.perf_counter()
        admission.admit(tenant, plan)
        latencies.append(time.perf_counter() - began)
    db.dispose()
    return percentiles(sorted(latencies))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20, help="length of each phase")
    parser.add_argument("--clients", type=int, default=16, help="concurrent connections")
    parser.add_argument("--client-procs", type=int, default=2, help="client processes (threads spread over them)")
    parser.add_argument("--web-workers", type=int, default=2, help="gunicorn worker processes")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379", help="Redis server (a free db is used)")
    args = parser.parse_args()
    with scratch_database(args.postgres, "sluice_bench") as database_url:
        return measure(args, database_url)


def measure(args: argparse.Namespace, database_url: str) -> int:
    """Every phase against a web tier on ``database_url`` and a free Redis database."""
    redis_url = f"{args.redis}/{free_redis_db(args.redis, set())}"
    port = free_port()
    env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": redis_url, "SLUICE_WEB_PORT": str(port),
           "SLUICE_WEB_WORKERS": str(args.web_workers), "SLUICE_LOG_LEVEL": "WARNING",
           "SLUICE_PLATFORM_TOKENS_PER_MINUTE": "0", "SLUICE_LOAD_LEVEL_MAX_AGE_S": "3600"}
    settings = Settings.from_env(env)
    log_path = Path(tempfile.mkdtemp()) / "web.log"
    server = None
    try:
        upgrade_database(settings.sqlalchemy_url)
        key = create_key(settings.sqlalchemy_url, "bench")
        set_no_limits(settings)
        with open(log_path, "w") as log:
            server = subprocess.Popen(web_argv(settings), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        wait_ready(port, log_path)
        first = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        first.request("POST", "/v1/requests", json.dumps({"prompt": "warm up", "max_tokens": 8}),
                      {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        request_id = json.loads(first.getresponse().read())["id"]

        print(f"# {os.cpu_count()} CPUs; gunicorn {args.web_workers} workers x 8 threads; {args.clients} clients "
              f"in {args.client_procs} processes; {args.seconds:g} s per phase; Postgres + Redis local")
        run_phase(port, key, "baseline", request_id, args.clients, args.client_procs, 3, server.pid)  # warm up
        # One client: latency without queueing (what admission adds to a request). Many: throughput.
        for clients in (1, args.clients):
            procs = min(clients, args.client_procs)
            base = run_phase(port, key, "baseline", request_id, clients, procs, args.seconds, server.pid)
            sub = run_phase(port, key, "submit", request_id, clients, procs, args.seconds, server.pid)
            print(f"{clients:3d} clients  baseline GET  {base['per_s']:6.0f} req/s   p50 {base['p50_ms']:6.2f} ms   "
                  f"p99 {base['p99_ms']:6.2f} ms   web CPU {base['web_cpu_ms']:.2f} ms a call")
            print(f"{clients:3d} clients  submit   POST {sub['per_s']:6.0f} req/s   p50 {sub['p50_ms']:6.2f} ms   "
                  f"p99 {sub['p99_ms']:6.2f} ms   web CPU {sub['web_cpu_ms']:.2f} ms a call   "
                  f"({sub['requests']} admitted, all 202)")
            print(f"{clients:3d} clients  added by submit (POST - GET): p50 {sub['p50_ms'] - base['p50_ms']:+.2f} ms"
                  f"   p99 {sub['p99_ms'] - base['p99_ms']:+.2f} ms")
        gates = time_gates(settings, key, 2000)
        print(f"admission alone, in process (the Lua gates, tenant already loaded): p50 {gates['p50_ms']:.2f} ms   "
              f"p99 {gates['p99_ms']:.2f} ms")
        overload(settings, redis_url, args.seconds)
        for clients in (1, args.clients):
            ref = run_phase(port, key, "refuse", request_id, clients, min(clients, args.client_procs), args.seconds,
                            server.pid)
            print(f"{clients:3d} clients  refuse   POST {ref['per_s']:6.0f} req/s   p50 {ref['p50_ms']:6.2f} ms   "
                  f"p99 {ref['p99_ms']:6.2f} ms   web CPU {ref['web_cpu_ms']:.2f} ms a call   "
                  "(503 overloaded: the promise at arrival)")
        rows = count_rows(settings)
        print(f"rows written: {rows} (every 202 is a row; no worker ran them)")
        return 0
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
        redis.Redis.from_url(redis_url).flushdb()


def overload(settings: Settings, redis_url: str, seconds: float) -> None:
    """Publish what the load monitor would during an overload: the default realtime class has
    10^9 tokens of work queued and drains one per second, so every realtime submit is refused."""
    from core.admission.load import ClassLoad, counters_key

    client = redis.Redis.from_url(redis_url)
    model = settings.registry.default.name
    t, micros = client.time()
    ClassLoad("realtime", model, 10**9, 10**6, 10**9, 1.0, 1.0, 10**9, 0, 1, t * 1000 + micros // 1000).write(
        client, ttl_s=3 * seconds + 60)
    client.hset(counters_key("realtime", model), "queued_work", 10**9)
    client.close()


def set_no_limits(settings: Settings) -> None:
    from core.tenants.manage import find_tenant, update_tenant
    from models import Database

    db = Database()
    db.configure(settings.sqlalchemy_url, pool_size=1)
    with db.session() as session:
        update_tenant(session, settings, find_tenant(session, "bench"), NO_LIMIT)
    db.dispose()


def count_rows(settings: Settings) -> int:
    with psycopg.connect(settings.database_url) as conn:
        return conn.execute("SELECT count(*) FROM requests").fetchone()[0]


def wait_ready(port: int, log_path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"gunicorn did not become healthy; see {log_path}")


if __name__ == "__main__":
    sys.exit(main())
