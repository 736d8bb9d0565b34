"""Job intake at scale: how long a big job's upload takes, and how close its statements come to
their timeouts.

    .venv/bin/python bench/intake.py                      # 1,000,000 documents of ~300 B (~300 MB)
    .venv/bin/python bench/intake.py --lines 100000       # a quick one

A real `sluice web` (gunicorn, the default settings) on a scratch database of the local Postgres
and a free Redis database; a tenant whose limits never bind. The file is written first (not
timed), then streamed to POST /v1/jobs. The web process logs, for the job it accepted, the
slowest of its COPY statements against the statement timeout every connection has, and the
duplicate check over the whole job against the budget it gets (``core/jobs/intake.py``); this
prints them with the headroom (timeout ÷ time taken). Goal (issue 24): 1M documents accepted
with at least 3× headroom against every timeout the intake runs under.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from launcher.database import create_key, upgrade_database  # noqa: E402
from launcher.harness import WebProcess, free_redis_db, scratch_database  # noqa: E402

WORDS = [f"w{i}" for i in range(2000)]
ACCEPTED = re.compile(r"job accepted: (\d+) items.*slowest COPY ([\d.]+) s of ([\d.]+) s, "
                      r"duplicate check ([\d.]+) s of ([\d.]+) s")


def write_file(path: Path, lines: int, chars: int, seed: int) -> int:
    rng = random.Random(seed)
    with open(path, "w") as out:
        for i in range(lines):
            words, size = [], 0
            while size < chars:
                word = rng.choice(WORDS)
                words.append(word)
                size += len(word) + 1
            out.write(json.dumps({"custom_id": f"doc-{i}", "text": " ".join(words)}) + "\n")
    return path.stat().st_size


def upload(port: int, key: str, path: Path) -> tuple[float, int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600, blocksize=1 << 20)
    began = time.monotonic()
    try:
        with open(path, "rb") as body:
            conn.request("POST", "/v1/jobs?summary_tokens=64&completion_window=7d", body,
                         {"Authorization": f"Bearer {key}", "Content-Type": "application/jsonl",
                          "Content-Length": str(path.stat().st_size)})
            response = conn.getresponse()
            return time.monotonic() - began, response.status, response.read()
    finally:
        conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--chars", type=int, default=300, help="characters of text per document")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(f"# {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"bench/intake.py --lines {args.lines}", flush=True)
    with contextlib.ExitStack() as exits:
        tmp = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="sluice-intake-")))
        size = write_file(tmp / "job.jsonl", args.lines, args.chars, args.seed)
        print(f"file: {args.lines:,} lines, {size / 2**20:.0f} MB", flush=True)
        database = exits.enter_context(scratch_database(args.postgres, "sluice_intake"))
        url = database.replace("postgresql://", "postgresql+psycopg://", 1)
        upgrade_database(url)
        redis_url = f"{args.redis}/{free_redis_db(args.redis, set())}"
        key = create_key(url, "intake-bench")
        with psycopg.connect(database) as conn:
            conn.execute("UPDATE tenants SET tokens_per_minute = 1000000000, requests_per_minute = 100000000, "
                         "max_concurrent = 100000000")
        web = WebProcess({"DATABASE_URL": url, "REDIS_URL": redis_url, "SLUICE_DATA_DIR": str(tmp / "data")}, tmp)
        exits.callback(web.stop)
        took, status, body = upload(web.port, key, tmp / "job.jsonl")
        print(f"POST /v1/jobs: HTTP {status} in {took:.1f} s", flush=True)
        if status != 201:
            print(body[:500].decode(errors="replace"))
            print(web.log_path.read_text()[-4000:])
            return 1
        found = ACCEPTED.search(web.log_path.read_text())
        if found is None:
            print("the web log has no 'job accepted' line")
            return 1
        items, copy_s, copy_limit, dup_s, dup_limit = found.groups()
        copy_room, dup_room = float(copy_limit) / float(copy_s), float(dup_limit) / max(float(dup_s), 1e-3)
        print(f"items {int(items):,}; slowest COPY {float(copy_s):.2f} s of {copy_limit} s ({copy_room:.1f}x "
              f"headroom); duplicate check {float(dup_s):.2f} s of {dup_limit} s ({dup_room:.1f}x headroom)")
        return 0 if min(copy_room, dup_room) >= 3 else 2


if __name__ == "__main__":
    sys.exit(main())
