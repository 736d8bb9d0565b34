"""A thousand clients waiting at once: what `Prefer: wait` costs the web tier, per worker class.

    .venv/bin/python bench/waits.py --out waits.json           # gevent and gthread, 1,000 waits each
    .venv/bin/python bench/waits.py --classes gevent --clients 100   # a smoke run

For each gunicorn worker class (SLUICE_WEB_WORKER_CLASS) it starts the real processes (`sluice
web` with its default two processes, one `sluice worker --role all` on the simulated engine at
--sim-speed, beat and the monitor) on a scratch database of the local Postgres and a free Redis
database, with a tenant whose limits never bind and the ladder off (so every client gets the
answer it asked for). Then --clients clients arrive at --rate a second, each opening a
connection, sending one `POST /v1/requests` (--tokens output tokens, ignore_eos, deadline
--deadline s) with `Prefer: wait=60` and waiting for the answer on it; the requests last long
enough that nearly all of them wait at the same time (the table gives the peak). (All of them in
one instant measures something else: a thousand submits' CPU on two cores, and the database pool
they queue for, which answers 503 past SLUICE_DB_POOL_SIZE + overflow and its timeout.)
Meanwhile /healthz is asked every --health-every s on a connection of its own, and the web
tier's RSS (the gunicorn master and workers) is sampled every second.

Per class the table gives: answers that came back 200 (ended within the wait) and how long the
whole crowd took; the web tier's RSS before and at its peak; p50/p99 of the extra latency a wait
adds, i.e. the client's time from sending to the answer minus the request's own life on the
server (its row's finished_at - created_at: queue wait plus inference), which includes getting
the submit through a web tier that a thousand clients reached at the same instant, and the part
of it from the row's end to the client holding the answer (the notification's cost); p50/p99 of
/healthz while the crowd waits. gthread's threads (SLUICE_WEB_THREADS per process) are the number of waits it
can hold: the rest wait in the listen backlog, and so does /healthz.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from overload import (  # noqa: E402
    NO_LIMITS,
    flush_redis,
    free_port,
    interrupt,
    listening_pids,
    rss_bytes,
    say,
    spawn,
    wait_http,
)
from users import Http  # noqa: E402

from core.settings import Settings  # noqa: E402
from launcher.argv import monitor_argv, web_argv  # noqa: E402
from launcher.database import upgrade_database  # noqa: E402
from launcher.harness import BeatProcess, WorkerProcess, free_redis_db, scratch_database  # noqa: E402


def start(args: argparse.Namespace, worker_class: str, exits: contextlib.ExitStack, tmp: Path) -> tuple[str, str]:
    """The platform with ``worker_class`` web processes; returns its URL and a tenant's key."""
    database_url = exits.enter_context(scratch_database(args.postgres, "sluice_waits"))
    redis_url = f"{args.redis}/{free_redis_db(args.redis, set())}"
    exits.callback(flush_redis, redis_url)
    port, admin_key = free_port(), uuid.uuid4().hex
    env = {"DATABASE_URL": database_url, "REDIS_URL": redis_url,
           "SLUICE_WEB_PORT": str(port), "SLUICE_ADMIN_KEY": admin_key, "SLUICE_LOG_LEVEL": "WARNING",
           "SLUICE_DATA_DIR": str(tmp), "SLUICE_LADDER_STEPS": "none", "SLUICE_ENGINE": "simulated",
           "SLUICE_SIM_SPEED": str(args.sim_speed), "SLUICE_WEB_WORKER_CLASS": worker_class}
    settings = Settings.from_env(env)
    upgrade_database(settings.sqlalchemy_url)
    web = spawn(web_argv(settings), env, tmp / "web.log", exits)
    worker = WorkerProcess(env, redis_url, tmp, ready_timeout=120)
    exits.callback(worker.stop)
    beat = BeatProcess(env, tmp)
    exits.callback(beat.stop)
    spawn(monitor_argv(settings), env, tmp / "monitor.log", exits)
    api = f"http://127.0.0.1:{port}"
    wait_http(api, "/healthz", web, tmp / "web.log", 60)
    created = Http(api, {"Authorization": f"Bearer {admin_key}"}).call(
        "POST", "/admin/tenants", {"name": "bench", **NO_LIMITS}, timeout_s=30)
    if created.status != 201:
        raise RuntimeError(f"creating the tenant: HTTP {created.status} {created.doc}")
    return api, created.doc["api_key"]


async def one_wait(port: int, key: str, body: dict, timeout_s: float) -> dict:
    """One client: connect, POST with `Prefer: wait=60`, read the whole answer."""
    payload = json.dumps(body).encode()
    head = (f"POST /v1/requests HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nPrefer: wait=60\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n").encode()
    began = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout_s)
        writer.write(head + payload)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout_s - (time.monotonic() - began))
        writer.close()
    except (OSError, TimeoutError) as exc:
        return {"status": None, "error": type(exc).__name__}
    elapsed, received = time.monotonic() - began, time.time()
    header, _, content = raw.partition(b"\r\n\r\n")
    status = int(header.split(b" ", 2)[1]) if header else None
    doc = json.loads(content) if content.startswith(b"{") else {}
    return {"status": status, "elapsed_s": elapsed, "received": received, "doc": doc}


async def crowd(port: int, key: str, args: argparse.Namespace) -> list[dict]:
    """--clients waits, arriving at --rate a second; each answer notes how many were waiting then."""
    body = {"prompt": "Summarise the incident report in one line.", "max_tokens": args.tokens,
            "ignore_eos": True, "deadline_s": args.deadline}
    waiting = 0

    async def client(delay: float) -> dict:
        nonlocal waiting
        await asyncio.sleep(delay)
        waiting += 1
        try:
            return {**await one_wait(port, key, body, args.timeout), "waiting": waiting}
        finally:
            waiting -= 1

    return await asyncio.gather(*(client(i / args.rate) for i in range(args.clients)))


def server_life_s(doc: dict) -> float | None:
    timings = doc.get("timings") or {}
    if not timings.get("finished_at"):
        return None
    return (datetime.fromisoformat(timings["finished_at"]) - datetime.fromisoformat(timings["created_at"])
            ).total_seconds()


def wake_s(answer: dict) -> float | None:
    """From the row's end (the database's clock, this host) to the client holding the answer."""
    finished = (answer["doc"].get("timings") or {}).get("finished_at")
    return answer["received"] - datetime.fromisoformat(finished).timestamp() if finished else None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def measure(args: argparse.Namespace, worker_class: str) -> dict:
    with contextlib.ExitStack() as exits:
        tmp = Path(tempfile.mkdtemp(prefix=f"waits-{worker_class}-"))
        api, key = start(args, worker_class, exits, tmp)
        port = int(api.rsplit(":", 1)[1])
        pids = listening_pids(port)
        rss_before = rss_bytes(pids)[0]
        stop, rss, health = threading.Event(), [rss_before], []

        def meter() -> None:
            probe = Http(api)
            next_rss = 0.0
            while not stop.wait(args.health_every):
                began = time.monotonic()
                with contextlib.suppress(OSError, TimeoutError):
                    if probe.call("GET", "/healthz", timeout_s=60).status == 200:
                        health.append(time.monotonic() - began)
                if time.monotonic() >= next_rss:
                    rss.append(rss_bytes(pids)[0])
                    next_rss = time.monotonic() + 1.0

        thread = threading.Thread(target=meter, daemon=True)
        thread.start()
        began = time.monotonic()
        answers = asyncio.run(crowd(port, key, args))
        took = time.monotonic() - began
        stop.set()
        thread.join(70)
        done = [a for a in answers if a["status"] == 200]
        extra = [a["elapsed_s"] - life for a in done if (life := server_life_s(a["doc"])) is not None]
        wake = [w for a in done if (w := wake_s(a)) is not None]
        result = {"class": worker_class, "clients": args.clients, "took_s": took,
                  "answered_200": sum(a["status"] == 200 for a in answers),
                  "answered_202": sum(a["status"] == 202 for a in answers),
                  "failed": sum(a["status"] not in (200, 202) for a in answers),
                  "failures": dict(collections.Counter(str(a["status"] or a["error"]) for a in answers
                                                       if a["status"] not in (200, 202))),
                  "peak_waiting": max(a["waiting"] for a in answers),
                  "rss_before": rss_before, "rss_peak": max(rss),
                  "extra_p50_s": pct(extra, 50), "extra_p99_s": pct(extra, 99),
                  "wake_p50_s": pct(wake, 50), "wake_p99_s": pct(wake, 99),
                  "health_n": len(health), "health_p50_s": pct(health, 50), "health_p99_s": pct(health, 99)}
        say(f"  {worker_class}: {json.dumps(result)}")
        return result


def table(results: list[dict]) -> list[str]:
    def f(value: float | None, spec: str = ".3f") -> str:
        return "—" if value is None else format(value, spec)

    lines = ["| worker class | 200 / 202 / failed | waiting at once (peak) | crowd took | web RSS before → peak "
             "| extra latency p50 / p99 | of which end → answer p50 / p99 | /healthz p50 / p99 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['class']} | {r['answered_200']} / {r['answered_202']} / {r['failed']} | "
                     f"{r['peak_waiting']} | "
                     f"{f(r['took_s'], '.1f')} s | {r['rss_before'] / 1e6:.0f} → {r['rss_peak'] / 1e6:.0f} MB | "
                     f"{f(r['extra_p50_s'])} / {f(r['extra_p99_s'])} s | "
                     f"{f(r['wake_p50_s'])} / {f(r['wake_p99_s'])} s | "
                     f"{f(r['health_p50_s'])} / {f(r['health_p99_s'])} s |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default="gevent,gthread")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=100.0, help="clients arriving per second")
    parser.add_argument("--tokens", type=int, default=200, help="output tokens per request")
    parser.add_argument("--sim-speed", type=float, default=0.2, help="simulated engine speed (1.0 = an H200)")
    parser.add_argument("--deadline", type=float, default=600.0, help="deadline_s of each request")
    parser.add_argument("--timeout", type=float, default=300.0, help="a client gives up after this long, s")
    parser.add_argument("--health-every", type=float, default=0.1, help="/healthz is asked this often, s")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, interrupt)
    results = [measure(args, worker_class) for worker_class in args.classes.split(",")]
    say("\n".join(table(results)))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                       indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
