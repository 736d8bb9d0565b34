"""Bulk jobs: upload time, memory, job throughput against the engine's capacity, realtime beside a job.

    .venv/bin/python bench/bulk.py --out bulk.json             # the full run, simulated engine
    .venv/bin/python bench/bulk.py --skip-huge --run-s 120     # without the 1M-document job
    .venv/bin/python bench/bulk.py --scale 0.05                # a smoke run, ~1 min (numbers mean nothing)

It runs the real processes (gunicorn web via `sluice web`, one `sluice worker --role all` with
--seqs threads, beat, and `sluice monitor`, which runs the load monitor and the job feeder) on a
scratch database of the local Postgres and a free Redis database, with a tenant whose limits
never bind (bench/overload.py's start); everything is stopped and dropped at exit, Ctrl-C
included. The engine is the simulated one at --sim-speed. Two JSONL files of
``{"custom_id", "text"}`` lines are written under a temporary directory first (not timed):
--docs-large lines of ~2.5 KB (100k: ~256 MB) and --docs-huge lines of ~300 B (1M: ~300 MB),
prose-like text from a Zipf vocabulary, every document its own mix of sentences (the table gives
gzip's ratio on the first 8 MB, for what a compressor makes of it). Then, in order:

  realtime alone   realtime questions (--rt-tokens, ignore_eos, deadline_s --rt-timeout) at a
                   steady --rt-rate for --run-s, each polled every --rt-poll s: latency = submit
                   to terminal
  capacity         the same worker fed directly: POST /v1/requests batch requests shaped like
                   the job's (the job's instruction + a document of the running job's size,
                   max_tokens --summary-tokens), --inflight kept outstanding (the feeder's bound
                   per worker, SLUICE_JOB_INFLIGHT_PER_WORKER), for --run-s
  accept large     POST /v1/jobs with the large file streamed from disk: seconds to the 201; the
                   job is cancelled at once (unless --skip-huge: then it is the running job)
  accept huge      the same with the huge file
  run              the job runs for --run-s while realtime questions arrive as above; then the
                   job is cancelled (nobody waits for a million summaries)

(--scale multiplies the document counts and --run-s.) Rates are taken over the steady window of
a phase: after its first --warmup share. Job throughput is the slope of the job's done items and
output tokens (GET /v1/jobs/<id> every --job-poll s); capacity is the output tokens of the
requests that finished in the window; "engine" figures are the worker's own generated-token
counter (its heartbeat, realtime included). Realtime p50/p99 are over the questions sent in the
steady window. Once a second (five times during the uploads, which can be short) the Redis
server's used_memory (INFO memory: the whole server, other databases included) and the web
tier's RSS (the gunicorn master and its workers, from /proc) are sampled; the table gives the
peaks while the running job uploads and while it runs, and the baseline before the uploads.

The defaults (sim speed 0.1, 16 worker threads of which a quarter are kept for realtime, 64-token
summaries) give a batch capacity near 230 output tokens/s, so the engine, not the two cores'
Python, is what the job and realtime share; the full run takes about 17 minutes.

Goal (the bulk jobs issue): realtime p50 and p99 with the job <= 1.2 x without it (bulk work only
uses what realtime leaves).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from overload import interrupt, listening_pids, rss_bytes, say, start  # noqa: E402
from users import TERMINAL, Attempt, Http, SluiceFront, question_prompt  # noqa: E402

from core.settings import Settings  # noqa: E402

# Mean text length per document (a sentence's overshoot, multibyte letters and the JSON around it
# come on top): lines of ~2.5 KB and ~300 B.
LARGE_CHARS, HUGE_CHARS = 2340, 180
UPLOAD_BLOCK = 1 << 20
MB = 1e6


# ------------------------------------------------------------------------ the files


class Corpus:
    """Prose-like documents: sentences of words drawn from a Zipf vocabulary of invented words,
    each document its own random run of sentences (none repeats another, none is filler)."""

    SYLLABLES = ("ka", "lo", "mi", "ter", "an", "vel", "dor", "si", "qua", "ne", "bra", "ul", "fen", "gor", "pi",
                 "sto", "rem", "ja", "wil", "tha", "cor", "zu", "ment", "ion", "ré", "mü", "ald", "ost", "ing", "ve")

    def __init__(self, seed: int, words: int = 20_000, sentences: int = 50_000) -> None:
        self.rng = random.Random(seed)
        rng = self.rng
        vocab = ["".join(rng.choices(self.SYLLABLES, k=rng.choice((1, 2, 2, 3, 3, 4)))) for _ in range(words)]
        cumulative = list(itertools.accumulate(1 / (rank + 1) for rank in range(words)))
        self.sentences = []
        for _ in range(sentences):
            chosen = rng.choices(vocab, cum_weights=cumulative, k=rng.randint(6, 22))
            if rng.random() < 0.2:
                chosen.insert(rng.randrange(len(chosen)), str(rng.randint(2, 9999)))
            self.sentences.append(" ".join(chosen).capitalize() + rng.choice(".....?;"))

    def text(self, number: int, tag: str, mean_chars: int) -> str:
        target = int(mean_chars * self.rng.uniform(0.5, 1.5))
        parts, size = [f"Document {tag}-{number}."], 0
        while size < target:
            sentence = self.rng.choice(self.sentences)
            parts.append(sentence)
            size += len(sentence) + 1
        return " ".join(parts)

    def write(self, path: Path, docs: int, tag: str, mean_chars: int) -> dict:
        """A JSONL job file of ``docs`` lines; its size and gzip's ratio on its first 8 MB."""
        with open(path, "w", encoding="utf-8", buffering=UPLOAD_BLOCK) as out:
            for i in range(docs):
                line = {"custom_id": f"{tag}-{i}", "text": self.text(i, tag, mean_chars)}
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
        with open(path, "rb") as raw:
            head = raw.read(8 << 20)
        return {"path": str(path), "docs": docs, "bytes": path.stat().st_size,
                "gzip_ratio": len(head) / max(1, len(zlib.compress(head, 6)))}


# ------------------------------------------------------------------------ meters


class Meters:
    """Once a second: the Redis server's used_memory, the web tier's RSS, the platform's level.
    Every sample carries the phase it was taken in."""

    def __init__(self, front: SluiceFront, redis_url: str) -> None:
        self.front = front
        self.redis = redis.Redis.from_url(redis_url)
        self.port = str(urlsplit(front.api).port)
        self.phase = "start"
        self.interval_s = 1.0
        self._web_pids: list[int] = []
        self._found_at = float("-inf")
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="meters")

    def __enter__(self) -> Meters:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.redis.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.samples.append(self.sample(load=self.interval_s >= 1.0))

    def sample(self, load: bool = True) -> dict:
        out: dict = {"t": time.time(), "phase": self.phase, "web_rss": self.web_rss()}
        with contextlib.suppress(redis.RedisError):
            out["redis_used"] = int(self.redis.info("memory")["used_memory"])
        if not load:  # the level is not asked for while an upload is timed
            return out
        with contextlib.suppress(OSError, http.client.HTTPException, ValueError, KeyError):
            load = self.front.sample()
            out.update(level=load["level"], batch_queued_tokens=load["batch_queued_tokens"])
        return out

    def web_rss(self) -> int:
        """Bytes resident, summed over the gunicorn master and workers of this run."""
        if time.monotonic() - self._found_at > 10:
            self._web_pids, self._found_at = listening_pids(int(self.port)), time.monotonic()
        total, gone = rss_bytes(self._web_pids)
        if gone:
            self._found_at = float("-inf")  # one exited (a worker restarted): look again next time
        return total

    def peak(self, phase: str, name: str) -> int | None:
        return max((s[name] for s in self.samples if s["phase"] == phase and name in s), default=None)

    def max_level(self, phase: str) -> int | None:
        return max((s.get("level") or 0 for s in self.samples if s["phase"] == phase), default=None)


# ------------------------------------------------------------------------ the load


class Realtime:
    """Realtime questions at a steady rate (one every 1/rate s, each a thread that polls its
    request to a terminal status), from start() until stop()."""

    def __init__(self, front: SluiceFront, rate: float, first: int) -> None:
        self.front, self.rate, self.first = front, rate, first
        self.attempts: list[Attempt] = []
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._clock = threading.Thread(target=self._arrivals, daemon=True, name="realtime")

    def start(self) -> Realtime:
        self._clock.start()
        return self

    def _arrivals(self) -> None:
        began, number = time.monotonic(), 0
        while not self._stop.wait(max(0.0, began + number / self.rate - time.monotonic())):
            attempt = Attempt("realtime", time.time())
            self.attempts.append(attempt)
            prompt = question_prompt(self.first + number)
            thread = threading.Thread(target=self.front.ask, args=(attempt, prompt), daemon=True)
            thread.start()
            self._threads.append(thread)
            number += 1

    def stop(self, wait_s: float) -> list[Attempt]:
        """Stop the arrivals; wait up to ``wait_s`` for the questions in flight."""
        self._stop.set()
        self._clock.join()
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return self.attempts


def latency(attempts: list[Attempt], since: float) -> dict:
    """p50/p99 of the answered questions sent from ``since`` (wall clock), and how many were not."""
    window = [a for a in attempts if a.sent >= since]
    answered = sorted(a.latency_s for a in window if a.outcome == "answered")
    cuts = statistics.quantiles(answered, n=100, method="inclusive") if len(answered) >= 2 else answered * 99
    return {"sent": len(window), "answered": len(answered), "not_answered": len(window) - len(answered),
            "p50_s": cuts[49] if cuts else None, "p99_s": cuts[98] if cuts else None}


def engine_tokens(front: SluiceFront) -> tuple[float, int] | None:
    """(when, generated tokens) summed over the warm workers, from their last heartbeats."""
    with contextlib.suppress(OSError, http.client.HTTPException, KeyError, TypeError):
        workers = Http(front.api).call("GET", "/readyz", timeout_s=10).doc["workers"]
        if workers:
            return (time.time() - max(w["heartbeat_age_s"] for w in workers),
                    sum(int(w["generated_tokens"]) for w in workers))
    return None


def engine_rate(first: tuple[float, int] | None, last: tuple[float, int] | None) -> float | None:
    if first is None or last is None or last[0] - first[0] < 1.0:  # the same heartbeat: no figure
        return None
    return (last[1] - first[1]) / (last[0] - first[0])


def capacity(front: SluiceFront, args: argparse.Namespace, docs: Iterator[str], seconds: float) -> dict:
    """Batch requests shaped like the job's, --inflight outstanding, for ``seconds``: output
    tokens and requests finished per second in the steady window."""
    client = Http(front.api, {"Authorization": f"Bearer {front.key}"})
    outstanding: deque[str] = deque()
    finished: list[dict] = []
    submitted = refused = 0
    began = time.time()
    steady, end = began + args.warmup * seconds, began + seconds
    marks: list = [None, None]

    def poll(request_id: str) -> bool:
        reply = client.call("GET", f"/v1/requests/{request_id}", timeout_s=30)
        if reply.status == 200 and reply.doc.get("status") in TERMINAL:
            finished.append(reply.doc)
            return True
        return False

    while time.time() < end:
        if marks[0] is None and time.time() >= steady:
            marks[0] = engine_tokens(front)
        while len(outstanding) < args.inflight and time.time() < end:
            body = {"prompt": f"{args.instruction}\n\n{next(docs)}", "max_tokens": args.summary_tokens,
                    "priority": "batch", "temperature": 0.0, "deadline_s": 86400}
            reply = client.call("POST", "/v1/requests", body, timeout_s=30)
            if reply.status == 202:
                outstanding.append(reply.doc["id"])
                submitted += 1
            else:
                refused += 1
                time.sleep(min(5.0, reply.retry_after_s()))
                break
        # Batch work runs in arrival order, so only the oldest can have ended: poll those.
        for request_id in list(outstanding)[:args.seqs]:
            if poll(request_id):
                outstanding.remove(request_id)
        time.sleep(max(0.0, min(1.0, end - time.time())))
    marks[1] = engine_tokens(front)
    for request_id in list(outstanding):  # one last look, then stop what is left
        if not poll(request_id):
            client.call("POST", f"/v1/requests/{request_id}/cancel", {}, timeout_s=30)
    client.close()
    ended = [(datetime.fromisoformat(v["timings"]["finished_at"]).timestamp(), v) for v in finished
             if v["status"] == "succeeded" and v.get("timings", {}).get("finished_at")]
    window = [v for at, v in ended if steady <= at <= end]
    span = end - steady
    return {"seconds": seconds, "submitted": submitted, "refused": refused,
            "succeeded": len(ended), "requests_per_s": len(window) / span,
            "tokens_per_s": sum(v["usage"]["output_tokens"] or 0 for v in window) / span,
            "engine_tokens_per_s": engine_rate(*marks)}


def upload(front: SluiceFront, path: Path, args: argparse.Namespace) -> tuple[float, dict]:
    """POST /v1/jobs with the file streamed from disk: (seconds to the answer, the job's view)."""
    url = urlsplit(front.api)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=3600, blocksize=UPLOAD_BLOCK)
    headers = {"Authorization": f"Bearer {front.key}", "Content-Type": "application/jsonl",
               "Content-Length": str(path.stat().st_size)}
    began = time.monotonic()
    try:
        with open(path, "rb") as body:
            conn.request("POST", f"/v1/jobs?summary_tokens={args.summary_tokens}", body, headers)
            response = conn.getresponse()
            raw = response.read()
    finally:
        conn.close()
    took = time.monotonic() - began
    if response.status != 201:
        raise RuntimeError(f"the upload of {path.name} answered HTTP {response.status}: {raw[:500]!r}")
    return took, json.loads(raw)


def cancel_job(front: SluiceFront, job_id: str, wait_s: float = 600) -> dict:
    """Cancel, then wait for the job to reach cancelled; the seconds each took."""
    client = Http(front.api, {"Authorization": f"Bearer {front.key}"})
    began = time.monotonic()
    reply = client.call("POST", f"/v1/jobs/{job_id}/cancel", {}, timeout_s=wait_s)
    answered = time.monotonic() - began
    view = reply.doc
    while view.get("status") not in ("cancelled", "completed", "failed", "expired"):
        if time.monotonic() - began > wait_s:
            break
        time.sleep(1.0)
        view = client.call("GET", f"/v1/jobs/{job_id}", timeout_s=60).doc
    client.close()
    return {"cancel_call_s": answered, "until_cancelled_s": time.monotonic() - began, "status": view.get("status")}


def run_job(front: SluiceFront, args: argparse.Namespace, job_id: str, seconds: float) -> dict:
    """Realtime questions beside the running job for ``seconds``; the job's progress every
    --job-poll s. Then the questions in flight finish and the job is cancelled."""
    client = Http(front.api, {"Authorization": f"Bearer {front.key}"})
    began = time.time()
    steady, end = began + args.warmup * seconds, began + seconds
    realtime = Realtime(front, args.rt_rate, first=10**6).start()
    polls: list[dict] = []
    marks: list = [None, None]
    while True:
        now = time.time()
        if marks[0] is None and now >= steady:
            marks[0] = engine_tokens(front)
        called = time.monotonic()
        view = client.call("GET", f"/v1/jobs/{job_id}", timeout_s=120).doc
        polls.append({"t": now, "call_s": time.monotonic() - called, "status": view["status"], "done": view["done"],
                      "output_tokens": view["tokens"]["output"], "rate_items_per_s": view["rate_items_per_s"],
                      "eta_s": view["eta_s"]})
        if now >= end:
            break
        time.sleep(max(0.0, min(args.job_poll, end - time.time())))
    marks[1] = engine_tokens(front)
    attempts = realtime.stop(args.rt_timeout + 5)
    client.close()
    window = [p for p in polls if p["t"] >= steady] or polls[-1:]
    first, last = window[0], polls[-1]
    span = max(1e-9, last["t"] - first["t"])
    calls = sorted(p["call_s"] for p in polls)
    return {"seconds": seconds, "done": last["done"], "items_per_s": (last["done"] - first["done"]) / span,
            "tokens_per_s": (last["output_tokens"] - first["output_tokens"]) / span,
            "api_rate_items_per_s": last["rate_items_per_s"], "engine_tokens_per_s": engine_rate(*marks),
            "job_get_p50_s": statistics.median(calls), "job_get_max_s": calls[-1],
            "realtime": latency(attempts, steady), "polls": polls}


# ------------------------------------------------------------------------ report


def fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def mb(value: int | None) -> str:
    return "-" if value is None else f"{value / MB:.1f} MB"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(r: dict) -> list[str]:
    m, files, cap, run = r["machine"], r["files"], r["capacity"], r["run"]
    base, with_job = r["realtime_alone"], run["realtime"]
    rows = [("machine", f"{m['cores']} cores, load average {m['loadavg']} at start, {m['memory_gb']:.0f} GB RAM"),
            ("command", f"`{r['command']}`"),
            ("engine", f"simulated, speed {r['config']['sim_speed']:g}, {r['config']['seqs']} worker threads; "
                       f"summaries of {r['config']['summary_tokens']} tokens; steady window: after the first "
                       f"{100 * r['config']['warmup']:.0f}% of {r['config']['run_s']:.0f} s")]
    for name, up in r["uploads"].items():
        f = files[name]
        rows.append((f"accept {f['docs']:,} docs ({f['bytes'] / MB:.0f} MB, gzip {f['gzip_ratio']:.1f}x)",
                     f"{up['seconds']:.1f} s ({f['bytes'] / MB / up['seconds']:.1f} MB/s, "
                     f"{f['docs'] / up['seconds']:,.0f} docs/s)"
                     + (f"; cancel {up['cancel']['cancel_call_s']:.1f} s, cancelled after "
                        f"{up['cancel']['until_cancelled_s']:.1f} s" if "cancel" in up else "")))
    mem = r["memory"]
    rows += [("Redis used_memory: baseline / upload peak / run peak",
              f"{mb(mem['redis_baseline'])} / {mb(mem['redis_upload_peak'])} / {mb(mem['redis_run_peak'])}"),
             ("web tier RSS (gunicorn, summed): baseline / upload peak / run peak",
              f"{mb(mem['web_baseline'])} / {mb(mem['web_upload_peak'])} / {mb(mem['web_run_peak'])}"),
             ("Postgres database size after the uploads", mb(mem.get("database_bytes"))),
             ("engine batch capacity (POST /v1/requests, "
              f"{r['config']['inflight']} outstanding)",
              f"{cap['tokens_per_s']:.1f} output tok/s, {cap['requests_per_s']:.2f} req/s "
              f"(engine counter {fmt(cap['engine_tokens_per_s'], '.1f')} tok/s)"),
             (f"job throughput ({r['run_job']}, steady)",
              f"{run['tokens_per_s']:.1f} output tok/s, {run['items_per_s']:.2f} items/s = "
              f"{fmt(r['job_vs_capacity'], '.0%')} of capacity (engine counter, realtime included: "
              f"{fmt(run['engine_tokens_per_s'], '.1f')} tok/s); {run['done']:,} items done in "
              f"{run['seconds']:.0f} s"),
             ("GET /v1/jobs/<id> while it runs: p50 / max",
              f"{run['job_get_p50_s'] * 1000:.0f} / {run['job_get_max_s'] * 1000:.0f} ms"),
             ("max degradation level: capacity / run", f"{r['levels']['capacity']} / {r['levels']['run']}")]
    for label, lat in (("realtime alone", base), ("realtime beside the job", with_job)):
        rows.append((f"{label}: p50 / p99 ({r['config']['rt_rate']:g}/s, {r['config']['rt_tokens']} tokens)",
                     f"{fmt(lat['p50_s'], '.2f', ' s')} / {fmt(lat['p99_s'], '.2f', ' s')} "
                     f"({lat['answered']} answered, {lat['not_answered']} not)"))
    g = r["goal"]
    rows.append(("realtime with / without the job: p50, p99 (goal <= 1.2)",
                 f"{fmt(g['p50_ratio'])}, {fmt(g['p99_ratio'])}: {'met' if g['met'] else 'MISSED'}"))
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]


# ------------------------------------------------------------------------ main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs-large", type=int, default=100_000, help="documents of ~2.5 KB in the large job")
    parser.add_argument("--docs-huge", type=int, default=1_000_000, help="documents of ~300 B in the huge job")
    parser.add_argument("--skip-huge", action="store_true", help="no huge job: the large one is the running job")
    parser.add_argument("--run-s", type=float, default=300.0,
                        help="seconds of each measured phase: realtime alone, capacity, the job running")
    parser.add_argument("--warmup", type=float, default=0.25, help="share of a phase left out of its rates")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the document counts and --run-s")
    parser.add_argument("--sim-speed", type=float, default=0.1, help="SLUICE_SIM_SPEED")
    parser.add_argument("--seqs", type=int, default=16, help="the worker's threads (the sim's batch bound)")
    parser.add_argument("--summary-tokens", type=int, default=64, help="the job's summary_tokens")
    parser.add_argument("--inflight", type=int, default=None,
                        help="batch requests kept outstanding when measuring capacity "
                             "(default: SLUICE_JOB_INFLIGHT_PER_WORKER, the feeder's bound)")
    parser.add_argument("--rt-rate", type=float, default=1.0, help="realtime questions per second")
    parser.add_argument("--rt-tokens", type=int, default=32, help="realtime max_tokens")
    parser.add_argument("--rt-poll", type=float, default=0.1, help="realtime requests are polled this often, s")
    parser.add_argument("--rt-timeout", type=float, default=60.0, help="a realtime question gives up after, s")
    parser.add_argument("--job-poll", type=float, default=5.0, help="GET /v1/jobs/<id> this often while it runs, s")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--tmp", type=Path, default=None, help="where the job files go (default: the system temp)")
    parser.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379", help="Redis server (a free db is used)")
    args = parser.parse_args()
    settings = Settings()
    args.inflight = args.inflight or settings.job_inflight_per_worker
    args.instruction = settings.job_instruction
    args.run_s *= args.scale
    args.docs_large = max(10, round(args.docs_large * args.scale))
    args.docs_huge = max(10, round(args.docs_huge * args.scale))
    # What bench/overload.py's start reads: the engine, the worker, and its users' front.
    args.engine, args.poll, args.slo = "sim", args.rt_poll, args.rt_timeout
    args.batch_tokens, args.batch_deadline = args.summary_tokens, 86400.0
    return args


def database_bytes(postgres: str) -> int | None:
    """Size of this run's scratch database (overload.start_sluice names it after our pid)."""
    with contextlib.suppress(psycopg.Error), psycopg.connect(postgres, autocommit=True) as conn:
        row = conn.execute("SELECT sum(pg_database_size(datname)) FROM pg_database WHERE datname LIKE %s",
                           (f"sluice_overload_{os.getpid()}_%",)).fetchone()
        return int(row[0]) if row and row[0] is not None else None
    return None


def measure(args: argparse.Namespace, tmp: Path, exits: contextlib.ExitStack) -> dict:
    corpus = Corpus(args.seed)
    say(f"writing the job files under {tmp}")
    files = {"large": corpus.write(tmp / "large.jsonl", args.docs_large, "large", LARGE_CHARS)}
    if not args.skip_huge:
        files["huge"] = corpus.write(tmp / "huge.jsonl", args.docs_huge, "huge", HUGE_CHARS)
    for name, f in files.items():
        say(f"  {name}: {f['docs']:,} docs, {f['bytes'] / MB:.1f} MB, gzip {f['gzip_ratio']:.1f}x")
    running = "large" if args.skip_huge else "huge"
    say("starting Sluice")
    front = start(args, "sluice", exits)
    meters = exits.enter_context(Meters(front, args.redis))
    result: dict = {"files": files, "run_job": running, "uploads": {}}

    meters.phase = "realtime"
    say(f"realtime alone: {args.rt_rate:g}/s for {args.run_s:.0f} s")
    began = time.time()
    realtime = Realtime(front, args.rt_rate, first=0).start()
    time.sleep(args.run_s)
    result["realtime_alone"] = latency(realtime.stop(args.rt_timeout + 5), began + args.warmup * args.run_s)

    meters.phase = "capacity"
    say(f"capacity: {args.inflight} batch requests outstanding for {args.run_s:.0f} s")
    mean = HUGE_CHARS if running == "huge" else LARGE_CHARS
    docs = (corpus.text(i, "capacity", mean) for i in range(10**9))
    result["capacity"] = capacity(front, args, docs, args.run_s)
    time.sleep(3)  # what was cancelled leaves the engine

    baseline = meters.sample()
    meters.interval_s = 0.2  # an upload can take only seconds
    job_id = None
    for name in files:
        meters.phase = f"upload-{name}"
        say(f"accepting the {name} job ({files[name]['bytes'] / MB:.0f} MB)")
        seconds, view = upload(front, Path(files[name]["path"]), args)
        job_id = view["id"]
        result["uploads"][name] = {"seconds": seconds, "items": view["counts"]["total"], "status": view["status"]}
        say(f"  {seconds:.1f} s, {view['counts']['total']:,} items, {view['status']}")
        if name != running:
            meters.phase = f"cancel-{name}"
            result["uploads"][name]["cancel"] = cancel_job(front, job_id)
    upload_phase, meters.interval_s = f"upload-{running}", 1.0
    result["memory_after_uploads"] = database_bytes(args.postgres)

    meters.phase = "run"
    say(f"the {running} job runs for {args.run_s:.0f} s beside realtime at {args.rt_rate:g}/s")
    result["run"] = run_job(front, args, job_id, args.run_s)
    meters.phase = f"cancel-{running}"
    result["run"]["cancel"] = cancel_job(front, job_id)
    say(f"  cancelled: {result['run']['cancel']}")

    result["memory"] = {"redis_baseline": baseline.get("redis_used"), "web_baseline": baseline["web_rss"],
                        "redis_upload_peak": meters.peak(upload_phase, "redis_used"),
                        "web_upload_peak": meters.peak(upload_phase, "web_rss"),
                        "redis_run_peak": meters.peak("run", "redis_used"),
                        "web_run_peak": meters.peak("run", "web_rss"),
                        "database_bytes": result.pop("memory_after_uploads")}
    result["levels"] = {"capacity": meters.max_level("capacity"), "run": meters.max_level("run")}
    result["samples"] = meters.samples
    return result


def main() -> int:
    args = parse_args()
    for signum in (signal.SIGINT, signal.SIGTERM):  # unwind like Ctrl-C: stop and drop everything
        signal.signal(signum, interrupt)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "bench/bulk.py", *sys.argv[1:]])
    say(f"# {os.cpu_count()} CPUs, load average {load}; {command}")
    try:
        with contextlib.ExitStack() as exits:
            tmp = Path(exits.enter_context(tempfile.TemporaryDirectory(prefix="sluice-bulk-", dir=args.tmp)))
            result = measure(args, tmp, exits)
            say("stopping Sluice")
    except KeyboardInterrupt:
        say("interrupted: everything this run started is stopped")
        return 130
    result["machine"] = {"cores": os.cpu_count(), "loadavg": load, "memory_gb": memory_gb}
    result["command"] = command
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result["job_vs_capacity"] = ratio(result["run"]["tokens_per_s"], result["capacity"]["tokens_per_s"])
    base, with_job = result["realtime_alone"], result["run"]["realtime"]
    p50, p99 = ratio(with_job["p50_s"], base["p50_s"]), ratio(with_job["p99_s"], base["p99_s"])
    result["goal"] = {"p50_ratio": p50, "p99_ratio": p99,
                      "met": p50 is not None and p99 is not None and p50 <= 1.2 and p99 <= 1.2}
    say("\n### bulk jobs (simulated engine)\n")
    for line in table(result):
        say(line)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        say(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
