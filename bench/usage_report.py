"""The usage report over a month of ended requests: loading them through the rollup trigger, then
reading the month back.

    .venv/bin/python bench/usage_report.py                    # 10,000,000 requests (10-20 min)
    .venv/bin/python bench/usage_report.py --rows 200000      # a quick one
    .venv/bin/python bench/usage_report.py --keep             # leave the database for psql

A scratch database of the local Postgres (``--database``, refused if it exists already), at the
head of the migrations, with 2 tenants and 3 API keys. ``--rows`` requests, every one already
ended (mostly succeeded; some failed, cancelled, timed out or expired, with their error codes; some
cache hits), created across November 2026 in time order, over 2 models, both priorities and the 3
sources, with their prices fixed on the row (the batch discount on batch work), are loaded with
COPY, ``--chunk`` rows per statement: each statement fires the statement trigger once, which adds
its rows to ``usage_hourly`` and ``usage_outcomes`` (migration ``b4e1c7a9d3f2``). Then ANALYZE (and
a VACUUM of the two rollup tables, as autovacuum keeps them), and ``core.usage.report.usage`` is
timed (``--repeat`` runs after one warm-up, through the pool a web process uses, under its statement
timeout) for the whole month: one tenant by day with several group_by sets, by hour, and the
operator's report by tenant. Prints the median and p95 of each, EXPLAIN (ANALYZE, BUFFERS) of the
report's rollup query, the rollup tables' sizes, and checks the report's totals against a direct
sum over ``requests`` (exit status 1 when they differ). No Redis.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import psycopg
from sqlalchemy import func

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from core.settings import Settings  # noqa: E402
from core.usage import report  # noqa: E402
from core.usage.report import UsageQuery, usage  # noqa: E402
from launcher.database import create_database, drop_database, upgrade_database  # noqa: E402
from launcher.harness import with_database  # noqa: E402
from models import Database, UsageHourly  # noqa: E402

MONTH_START = datetime(2026, 11, 1, tzinfo=UTC)
MONTH_END = datetime(2026, 12, 1, tzinfo=UTC)
# USD per million tokens: input, cached input, output; batch work pays half (SLUICE_BATCH_DISCOUNT).
MODELS = {"qwen2.5-7b-instruct": ("small", ("0.1500", "0.0750", "0.6000")),
          "llama-3.1-70b-instruct": ("large", ("0.8000", "0.4000", "2.4000"))}
# Outcomes past succeeded: (share of all rows, status, error codes, whether some carry partial output).
ENDINGS = ((0.02, "failed", ("engine_error", "engine_shutdown", "worker_lost", "invalid_response_format"), False),
           (0.02, "cancelled", ("cancelled",), True),
           (0.01, "timed_out", ("time_limit_exceeded",), True),
           (0.02, "expired", ("deadline_exceeded",), False))
CACHE_HITS = 0.05  # of the succeeded
COLUMNS = ("id", "tenant_id", "api_key_id", "source", "status", "priority", "size_class", "queue",
           "model_requested", "model_used", "input", "params", "metadata", "max_tokens", "time_limit_s",
           "reserved_tokens", "price_input", "price_cached", "price_output", "input_tokens", "output_tokens",
           "cached_tokens", "finish_reason", "error_code", "cache_hit", "attempts", "worker", "created_at",
           "started_at", "finished_at")
INPUT = '{"prompt": "Summarize the attached ticket in two sentences."}'
PARAMS = '{"temperature": 0.7}'
NULL = "\\N"


def prices(model: str, batch: bool) -> tuple[str, str, str]:
    listed = MODELS[model][1]
    if not batch:
        return listed
    return tuple(str((Decimal(p) / 2).quantize(Decimal("0.0001"), ROUND_HALF_UP)) for p in listed)


def stamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()


class Rows:
    """COPY text lines of ended requests, ``total`` of them spread evenly (in creation order) over
    the month; ``keys`` are (tenant id, key id, share of the rows)."""

    def __init__(self, total: int, keys: list[tuple[uuid.UUID, uuid.UUID, float]], seed: int) -> None:
        self.total, self.rng = total, random.Random(seed)
        self.keys = [(str(t), str(k)) for t, k, _ in keys]
        self.key_weights = [w for *_, w in keys]
        self.start = MONTH_START.timestamp()
        self.span = (MONTH_END - MONTH_START).total_seconds()
        self.prices = {(m, b): prices(m, b) for m in MODELS for b in (False, True)}

    def lines(self, first: int, count: int) -> list[str]:
        rng, out = self.rng, []
        keys = rng.choices(self.keys, self.key_weights, k=count)
        for i, (tenant, key) in enumerate(keys, first):
            source = rng.choices(("api", "openai", "job"), (50, 35, 15))[0]
            batch = source == "job" or rng.random() < 0.25
            model = "qwen2.5-7b-instruct" if rng.random() < 0.8 else "llama-3.1-70b-instruct"
            size_class = MODELS[model][0]
            priority = "batch" if batch else "realtime"
            max_tokens = rng.choice((256, 512, 1024, 2048))
            input_tokens = min(int(rng.lognormvariate(6.0, 1.0)) + 1, 32000)
            created = self.start + self.span * (i + rng.random()) / self.total
            status, code, output, cached, cache_hit, attempts = "succeeded", None, None, None, False, 1
            ending = rng.random()
            for share, name, codes, partial in ENDINGS:
                if ending < share:
                    status, code = name, rng.choice(codes)
                    if partial and rng.random() < 0.5:
                        output, cached = rng.randint(1, max_tokens), 0
                    break
                ending -= share
            else:
                output = min(int(rng.lognormvariate(5.0, 0.9)) + 1, max_tokens)
                if rng.random() < CACHE_HITS:
                    cache_hit, attempts = True, 0
                else:
                    cached = int(input_tokens * rng.uniform(0.2, 0.9)) if rng.random() < 0.35 else 0
            if status == "expired":
                started, finished, attempts = None, created + (3600 if batch else 30), 0
            else:
                started = created + (0.0 if cache_hit else rng.uniform(0.05, 20.0 if batch else 2.0))
                finished = started + (0.0 if cache_hit else (output or 50) * 0.02)
            price_input, price_cached, price_output = self.prices[model, batch]
            out.append("\t".join((
                f"{rng.getrandbits(128):032x}", tenant, key, source, status, priority, size_class,
                f"{priority}.{size_class}", model, model, INPUT, PARAMS, "{}", str(max_tokens),
                "600", str(input_tokens + max_tokens), price_input, price_cached, price_output,
                str(input_tokens), NULL if output is None else str(output), NULL if cached is None else str(cached),
                NULL if output is None else ("length" if output == max_tokens else "stop"), code or NULL,
                "t" if cache_hit else "f", str(attempts), NULL if started is None or cache_hit else "worker-1",
                stamp(created), NULL if started is None else stamp(started), stamp(finished))) + "\n")
        return out


def setup(url: str) -> list[tuple[uuid.UUID, uuid.UUID, float]]:
    """Two tenants, three keys: (tenant id, key id, share of the requests)."""
    a, b = uuid.uuid4(), uuid.uuid4()
    keys = [(a, uuid.uuid4(), 0.45, "interactive"), (a, uuid.uuid4(), 0.25, "nightly"),
            (b, uuid.uuid4(), 0.30, "default")]
    with psycopg.connect(url) as conn:
        conn.execute("INSERT INTO tenants (id, name) VALUES (%s, 'bench-a'), (%s, 'bench-b')", (a, b))
        for tenant, key, _, name in keys:
            conn.execute("INSERT INTO api_keys (id, tenant_id, prefix, key_hash, name) VALUES (%s, %s, %s, %s, %s)",
                         (key, tenant, "sk-sluice-" + key.hex[:6], uuid.uuid4().hex * 2, name))
    return [(t, k, w) for t, k, w, _ in keys]


def load(url: str, rows: Rows, chunk: int) -> float:
    began = time.monotonic()
    copy_sql = f"COPY requests ({', '.join(COLUMNS)}) FROM STDIN"
    with psycopg.connect(url, autocommit=True) as conn:
        for first in range(0, rows.total, chunk):
            count = min(chunk, rows.total - first)
            at = time.monotonic()
            with conn.cursor() as cursor, cursor.copy(copy_sql) as copy:
                for block in range(first, first + count, 20_000):
                    copy.write("".join(rows.lines(block, min(20_000, first + count - block))))
            took, done = time.monotonic() - at, first + count
            print(f"  {done:>12,} rows  chunk {count:,} in {took:6.1f} s ({count / took:>9,.0f} rows/s)  "
                  f"overall {done / (time.monotonic() - began):>9,.0f} rows/s", flush=True)
    return time.monotonic() - began


def timed(db: Database, query: UsageQuery, repeat: int) -> tuple[list[float], dict]:
    """Milliseconds of the report and its JSON body, as GET /v1/usage makes them (less the key's
    lookup, one indexed read)."""
    answer = usage(db, query)  # warm: the pool's connection, the plan, the pages
    samples = []
    for _ in range(repeat):
        at = time.perf_counter()
        answer = usage(db, query)
        json.dumps(answer)
        samples.append((time.perf_counter() - at) * 1000)
    return samples, answer


def p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


def explain(db: Database, statement) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of a SQLAlchemy statement, with the driver's own parameters."""
    compiled = statement.compile(dialect=db.engine.dialect)
    with db.engine.connect() as conn:
        cursor = conn.connection.driver_connection.cursor()
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + str(compiled), compiled.params)
        return [line for (line,) in cursor.fetchall()]


def direct_totals(url: str, tenant: uuid.UUID) -> tuple[dict, float]:
    """The month's totals for ``tenant`` straight from ``requests``, counted as the trigger counts them
    (tokens only of rows with an answer, billed tokens not of cache hits)."""
    at = time.perf_counter()
    with psycopg.connect(url) as conn:
        row = conn.execute("""
            SELECT count(*), count(*) FILTER (WHERE cache_hit),
                   coalesce(sum(input_tokens) FILTER (WHERE output_tokens IS NOT NULL), 0),
                   coalesce(sum(coalesce(cached_tokens, 0)) FILTER (WHERE output_tokens IS NOT NULL), 0),
                   coalesce(sum(output_tokens), 0),
                   coalesce(sum(input_tokens + output_tokens) FILTER (WHERE output_tokens IS NOT NULL
                                                                      AND NOT cache_hit), 0),
                   coalesce(sum(cost), 0),
                   count(*) FILTER (WHERE status = 'succeeded'), count(*) FILTER (WHERE status = 'failed'),
                   count(*) FILTER (WHERE status = 'cancelled'), count(*) FILTER (WHERE status = 'timed_out'),
                   count(*) FILTER (WHERE status = 'expired')
            FROM requests
            WHERE tenant_id = %s AND created_at >= %s AND created_at < %s AND status NOT IN ('queued', 'running')""",
                           (tenant, MONTH_START, MONTH_END)).fetchone()
    names = ("requests", "cache_hits", "input_tokens", "cached_tokens", "output_tokens", "billed_tokens", "cost")
    totals = dict(zip(names, row[:7], strict=True))
    totals["statuses"] = {s: n for s, n in zip(("succeeded", "failed", "cancelled", "timed_out", "expired"),
                                               row[7:], strict=True) if n}
    return totals, time.perf_counter() - at


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--chunk", type=int, default=500_000, help="rows per COPY statement")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs of each report")
    parser.add_argument("--keep", action="store_true", help="keep the database")
    parser.add_argument("--database", default="sluice_bench_usage")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"# {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"bench/usage_report.py --rows {args.rows} --chunk {args.chunk} --repeat {args.repeat}", flush=True)
    with psycopg.connect(args.postgres) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (args.database,)).fetchone():
            print(f"database {args.database} exists already (a --keep run?); drop it or pass --database")
            return 2
    create_database(args.postgres, args.database)
    url = with_database(args.postgres, args.database)
    try:
        return run(args, url)
    finally:
        if args.keep:
            print(f"kept: {url}")
        else:
            drop_database(args.postgres, args.database)


def run(args: argparse.Namespace, url: str) -> int:
    settings = Settings(database_url=url)
    upgrade_database(settings.sqlalchemy_url)
    keys = setup(url)
    tenant = keys[0][0]
    print(f"loading {args.rows:,} ended requests of {MONTH_START:%Y-%m}, {args.chunk:,} per COPY", flush=True)
    took = load(url, Rows(args.rows, keys, args.seed), args.chunk)
    print(f"loaded {args.rows:,} rows in {took:.1f} s ({args.rows / took:,.0f} rows/s)", flush=True)
    at = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE")
        conn.execute("VACUUM (ANALYZE) usage_hourly, usage_outcomes")
        sizes = {t: conn.execute(f"SELECT count(*), pg_size_pretty(pg_total_relation_size('{t}')) FROM {t}").fetchone()
                 for t in ("requests", "usage_hourly", "usage_outcomes")}
    print(f"ANALYZE in {time.monotonic() - at:.1f} s; "
          + "; ".join(f"{t}: {n:,} rows, {size}" for t, (n, size) in sizes.items()), flush=True)

    db = Database()
    db.configure(settings.sqlalchemy_url, pool_size=settings.db_pool_size, max_overflow=settings.db_max_overflow)
    try:
        every = ("model", "priority", "key", "source")
        queries = [(f"{'tenant' if who else 'admin'}, {bucket}, {'+'.join(groups) or '-'}",
                    UsageQuery(MONTH_START, MONTH_END, bucket, groups, who))
                   for who, bucket, groups in ((tenant, "day", ()), (tenant, "day", ("model",)),
                                               (tenant, "day", every), (tenant, "hour", ()), (tenant, "hour", every),
                                               (None, "day", ("tenant",)))]
        print(f"\nusage() over {MONTH_START:%Y-%m}, {args.repeat} runs each after one warm-up (ms):")
        print(f"  {'query':<42} {'median':>8} {'p95':>8} {'buckets':>8} {'results':>8}")
        answers = {}
        for name, query in queries:
            samples, answers[name] = timed(db, query, args.repeat)
            results = sum(len(b["results"]) for b in answers[name]["data"])
            print(f"  {name:<42} {statistics.median(samples):>8.1f} {p95(samples):>8.1f} "
                  f"{len(answers[name]['data']):>8} {results:>8}", flush=True)

        main_query = queries[2][1]
        u = UsageHourly
        sums = [func.sum(getattr(u, c)).label(c) for c in report.SUMS] + [func.sum(u.cost).label("cost")]
        for title, statement in (
                ("usage_hourly (the report's main query)", report._grouped(u, main_query, *sums)),
                ("usage_outcomes (error codes and refusals, per day)", report._outcomes(main_query))):
            print(f"\nEXPLAIN (ANALYZE, BUFFERS), {title}, tenant by day, group_by model,priority,key,source:")
            print("\n".join(explain(db, statement)))
    finally:
        db.dispose()

    reported = answers[queries[0][0]]["totals"]
    direct, direct_s = direct_totals(url, tenant)
    print(f"\ntotals of tenant bench-a, {MONTH_START:%Y-%m}: report (from the rollups) vs direct sum over requests "
          f"({direct_s * 1000:.0f} ms)")
    same = True
    for name in ("requests", "cache_hits", "input_tokens", "cached_tokens", "output_tokens", "billed_tokens"):
        ok = reported[name] == direct[name]
        same &= ok
        print(f"  {name:<14} {reported[name]:>18,} {direct[name]:>18,}  {'ok' if ok else 'DIFFERENT'}")
    cost = Decimal(reported["cost_usd"])
    ok = cost == direct["cost"]
    same &= ok
    print(f"  {'cost (USD)':<14} {cost:>18} {direct['cost']:>18}  {'ok' if ok else 'DIFFERENT'}")
    ok = reported["statuses"] == direct["statuses"]
    same &= ok
    print(f"  statuses {reported['statuses']} vs {direct['statuses']}  {'ok' if ok else 'DIFFERENT'}")
    print("correct" if same else "MISMATCH: the report's totals differ from the requests they count")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
