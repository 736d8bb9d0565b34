"""Hand-off: how long a queued request waits after a slot in a full engine frees.

    .venv/bin/python bench/handoff.py                 # 40 requests through a one-slot worker
    .venv/bin/python bench/handoff.py -n 80 --tokens 32 --threads 2

A worker holds at most its in-engine limit of messages (its Celery prefetch count), so while its
engine is full the next request stays in the broker until one leaves. This measures the gap
between a request's end (its row's ``finished_at``) and the start of the next one (``started_at``
of the request that took its slot), both on the database clock, with the simulated engine behind
a worker of ``--threads`` threads and ``-n`` requests submitted at once. The simulated engine's
default (H200) step curve is flat at these batches, so the worker's in-engine limit is its
threads; a slot is counted freed by the end that came ``threads`` starts earlier, so with many
threads the ends of a batch that started together free their slots at once and the later starts
of the next batch include fetching the ones before them. The gap is
queue wait nobody's estimate counts: the promise at arrival assumes a freed slot is taken at once.
Needs Postgres and Redis (local defaults or --database-url / --redis); creates and drops its own
database and takes a free Redis database. Prints the gaps' median, p90 and max in milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=40, help="requests submitted at once")
    parser.add_argument("--tokens", type=int, default=16, help="max_tokens of each (ignore_eos)")
    parser.add_argument("--threads", type=int, default=1, help="worker threads: the engine's limit")
    parser.add_argument("--sim-speed", type=float, default=0.05, help="SLUICE_SIM_SPEED (lower: slower steps)")
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379", help="Redis server (a free db is used)")
    args = parser.parse_args()

    from sqlalchemy import select

    from core.settings import Settings
    from launcher.database import create_key, upgrade_database
    from launcher.harness import WorkerProcess, free_redis_db, scratch_database
    from models import InferenceRequest
    from web import create_app, services

    with contextlib.ExitStack() as stack:
        db_url = stack.enter_context(scratch_database(args.database_url, "sluice_bench"))
        redis_url = f"{args.redis}/{free_redis_db(args.redis, set())}"
        env = {"DATABASE_URL": db_url, "REDIS_URL": redis_url, "SLUICE_ENGINE": "simulated",
               "SLUICE_SIM_SPEED": str(args.sim_speed), "SLUICE_LOG_LEVEL": "WARNING",
               "SLUICE_REALTIME_DEADLINE_S": "3600"}
        settings = Settings.from_env(env)
        upgrade_database(settings.sqlalchemy_url)
        app = create_app(settings)
        svc = services(app)
        stack.callback(svc.redis.flushdb)  # the free database this run took, lock included
        stack.callback(svc.db.dispose)
        key = create_key(settings.sqlalchemy_url, "bench")
        worker = WorkerProcess(env, redis_url, Path(tempfile.mkdtemp(prefix="sluice_handoff_")),
                               concurrency=args.threads)
        stack.callback(worker.stop)
        http = app.test_client()
        headers = {"Authorization": f"Bearer {key}"}
        ids = []
        for i in range(args.n):
            response = http.post("/v1/requests", headers=headers, json={
                "prompt": f"hand-off {i} {uuid.uuid4()}", "max_tokens": args.tokens, "ignore_eos": True,
                "deadline_s": 3600})
            assert response.status_code == 202, response.get_json()
            ids.append(uuid.UUID(response.get_json()["id"]))
        while True:
            with svc.db.session() as session:
                rows = session.execute(select(InferenceRequest.started_at, InferenceRequest.finished_at,
                                              InferenceRequest.status).where(InferenceRequest.id.in_(ids))).all()
            if all(r.status.terminal for r in rows):
                break
            time.sleep(0.2)
    ran = sorted((r for r in rows if r.started_at and r.finished_at), key=lambda r: r.started_at)
    ends = sorted(r.finished_at for r in ran)
    # Request i (from the limit on) took the slot the (i - limit)-th end freed.
    gaps = [(ran[i].started_at - ends[i - args.threads]).total_seconds() * 1000
            for i in range(args.threads, len(ran))]
    if not gaps:
        print("no request waited for a slot")
        return 1
    gaps.sort()
    print(f"{len(ran)} ran, {len(gaps)} took a freed slot; gap from an end to the next start, ms: "
          f"median {statistics.median(gaps):.0f}, p90 {gaps[int(0.9 * (len(gaps) - 1))]:.0f}, max {gaps[-1]:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
