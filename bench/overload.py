"""Overload: impatient realtime users and patient batch work, at the knee and at 3x it.

    .venv/bin/python bench/overload.py --engine sim                     # every Sluice setup, short prompts
    .venv/bin/python bench/overload.py --engine vllm --mix chat         # and vLLM's own server beside them
    # a smoke run (its numbers mean nothing)
    .venv/bin/python bench/overload.py --engine sim --scale 0.1 --knee 2 --mix chat --setups sluice,sluice-openai
    # the promise on a compute-bound engine: the 94M model, vLLM's engine alone on core 0, each mix
    # (short, chat, summarise, long) through each door, beside vLLM's own server
    .venv/bin/python bench/overload.py --engine vllm --shape 92m --pin-engine 0 --seqs 64 --rt-tokens 32 \
        --batch-tokens 128 --mix summarise --setups vllm-server,sluice,sluice-defaults,sluice-openai
    .venv/bin/python bench/overload.py --engine sim --sim-profile cpu --sim-speed 0.25 --seqs 64  # its model

Prompts (bench/prompts.py) come in mixes of lengths in the model's own tokens (--mix; the
simulated engine has no model, so the tiny Llama's tokenizer measures its prompts, and Sluice is
given the same tokenizer to count them): each question's length is drawn uniformly (seeded by
--seed and its number, so every setup gets the same prompts) and its text is seeded varied words,
which only the chat mixes' shared ~50-token system preamble lets a prefix cache reuse:

  short      questions of a few dozen tokens, batch reports of a few hundred (the first runs')
  chat       realtime 100-400 tokens, preamble included; batch documents 200-600
  summarise  batch documents 800-3,000 tokens; realtime 100-200
  long       as chat, with 15% of realtime prompts 3,000-4,000 tokens

A range longer than the model's context leaves beside the longest answer is cut, and the run says
so; the engines' context (vLLM's --max-model-len, SLUICE_MAX_CONTEXT_TOKENS) is set to hold the
mix's longest prompt and answer (at least 2,048 tokens). The run prints the p50/p90/max prompt
tokens of the mix's first prompts at its start, and of the prompts each setup sent in its table.

Users (bench/users.py) arrive open loop (Poisson). A realtime user asks a question (--rt-tokens
out), waits at most --slo seconds (the client timeout), and when the page hangs asks
again, up to --retries times; a refused user (429/503, with Retry-After) does not. A Sluice user
who polls first comes back when its 202 says the answer is due (retry-after-ms; not with
--ignore-poll-hints), then every --poll s; when it gives up it just stops polling (closes the
page; nothing is cancelled); one that waits on the connection hangs up (which cancels its
request). Batch jobs (--batch-tokens, priority batch) arrive at a steady rate, wait as long as
it takes and resubmit after Retry-After. Each setup runs, on fresh processes:

  warm    realtime at 0.8 x the knee, 60 s
  spike   3 x the knee, 120 s
  after   0.8 x the knee, 60 s

(--scale multiplies every duration.) Setups, all on one engine (--engine), one per door:

  sluice             Sluice as shipped; users state their patience: deadline_s = SLO (batch: --batch-deadline)
  sluice-defaults    the same platform, no deadline_s sent: users wait on the connection for up to
                     their patience (Prefer: wait=SLO, which Sluice takes as the deadline) and hang up
  sluice-openai      the same platform through its OpenAI door with the official openai SDK, as an
                     application calls it: completions.create(..., timeout=SLO) (the SDK sends it as
                     x-stainless-read-timeout; its own retries off, the user's are --retries); batch
                     jobs are service_tier "flex" calls with timeout --batch-deadline
  sluice-ladder-off  deadline_s sent, SLUICE_LADDER_STEPS=none (no degradation step in force; the
                     promise at admission still refuses what cannot finish in time)
  vllm-server        vLLM's own OpenAI server alone (--engine vllm only), --scheduling-policy priority,
                     realtime priority 0, batch 1 (lower runs first); its users cannot state patience,
                     and closing the connection on timeout is how it learns nobody waits

Sluice setups run the real processes (gunicorn web, one `sluice worker --role all`, beat and the
load monitor, whose figures admission uses) on a scratch database of the local Postgres and a free
Redis database, with a tenant whose limits never bind; everything is stopped and dropped at exit,
Ctrl-C included. Engines: `sim` is the simulated engine at --sim-speed, its batch bounded by the
worker's --seqs threads; `vllm` is vLLM on this CPU with the tiny random Llama of tests/tiny_model.py
and max_num_seqs --seqs, in Sluice's worker and in vLLM's server alike. On a small CPU host the
clients, the web tier (which every poll, each --poll seconds, costs), Postgres, Redis and the
engine share the cores; the defaults put the sim's knee near 2.5 questions/s so that 3x of it
stays within what two cores serve.

The knee is the rate the engine serves within SLO. Unless --knee is given it is searched first,
on --knee-setup (vllm-server for --engine vllm, else sluice-ladder-off: the engine behind the
thinnest front), beside the batch load the phases bring at that rate (each step's batch work is
stopped at its end): steps of --knee-step seconds from --knee-start requests/s,
x1.5 until fewer than --knee-target of the questions are answered within SLO, then --knee-refine
geometric bisections. A step is judged on the questions of its second half, once a queue had
time to build; short steps (a few SLOs) still overstate the knee. The knee is the highest rate
that passed; the realtime rate the engine sustains there is that half's answers within SLO per
second (with --knee given, the rate itself). The batch rate defaults to --batch-share of the
knee's realtime tokens/s (output tokens: a mix's batch documents bring their prefill on top).

Per setup and phase (a question belongs to the phase it arrived in; its first attempt decides it):
  within SLO     answered before the client timeout
  refused fast   429/503 in < 100 ms; refused slow: later than that
  late           the user gave up (timeout, or the platform said expired/timed_out, or a 504)
  accepted, then late  of the questions not refused (the platform promised them), the share that
                 came late: the promise's own figure (per phase, and per setup over the run)
  failed         any other error
  retries        the extra attempts of users whose page hung
  batch tok/s    batch output tokens generated in the phase (each request's tokens spread evenly
                 over its running time; vllm-server: over send → answer)
  wasted         output tokens generated for answers nobody was still waiting for, as a share of
                 all output tokens generated in the phase. Sluice: every token of a realtime attempt
                 whose user gave up (rows read back at the end). vllm-server: /metrics
                 generation_tokens minus the tokens delivered (to users in time, and batch)
  (--json only) refusal latency p50/p90; Sluice: queue wait and inference p50 of the first attempts
                 answered in time and of the late ones, and how the late ones' rows ended
  peak queue     Sluice: queued tokens, realtime/batch, from GET /v1/admin/load once a second;
                 vllm-server: requests waiting (vllm:num_requests_waiting), it has no token figure

Goals (issues 8 and 34), judged per setup: at 3x, >= 99% of questions answered within SLO or refused
fast, in the spike and in the minute after; answers within SLO per second in the spike >= 90% of
the knee's; accepted, then expired or late <= 1% of what was accepted; < 1% of generated tokens
wasted; batch tokens still generated during the spike.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from prompts import MIXES, Prompts, clamp, context_tokens, describe, lengths, longest  # noqa: E402
from users import (  # noqa: E402
    Arrivals,
    Http,
    OpenAIFront,
    Question,
    SluiceFront,
    VllmFront,
    batch_job,
    realtime_user,
)

from core.settings import Settings  # noqa: E402
from launcher.argv import monitor_argv, web_argv  # noqa: E402
from launcher.database import upgrade_database  # noqa: E402
from launcher.harness import BeatProcess, WorkerProcess, free_redis_db, pin_engine, scratch_database  # noqa: E402

SETUPS = ("sluice", "sluice-defaults", "sluice-openai", "sluice-ladder-off", "vllm-server")
PHASES = (("warm", 0.8, 60.0), ("spike", 3.0, 120.0), ("after", 0.8, 60.0))
NO_LIMITS = {"tokens_per_minute": 10**9, "requests_per_minute": 10**8, "max_concurrent": 10**8}
# Per engine: the batch size, the realtime and batch output lengths.
DEFAULTS = {"sim": {"seqs": 4, "rt_tokens": 32, "batch_tokens": 256},
            "vllm": {"seqs": 4, "rt_tokens": 128, "batch_tokens": 512}}
MODEL_NAME = "tiny-llama"
VLLM_FLAGS = {"dtype": "float32", "max-num-batched-tokens": "2048"}  # and --max-model-len: max_model_len()
MIN_MODEL_LEN = 2048
PROMPT_SAMPLE = 200  # prompts of each kind whose lengths are printed before the run
KV_BYTES = {"tiny": 128 * 2**20, "92m": 2**30}  # the 94M model's KV is 72 KiB a token
READY_S = {"sim": 120.0, "vllm": 900.0}

say = functools.partial(print, flush=True)


# ------------------------------------------------------------------------ the servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(argv: list[str], env: dict[str, str], log: Path, exits: contextlib.ExitStack) -> subprocess.Popen:
    """A child in its own process group, logging to ``log``, stopped (group and all) at exit."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    exits.callback(stop_group, proc)
    return proc


def stop_group(proc: subprocess.Popen) -> None:
    for signum, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_http(api: str, path: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until GET ``path`` answers 200; RuntimeError if ``proc`` exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    client = Http(api)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(proc.args[:4])} exited with {proc.returncode}; see {log}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if client.call("GET", path, timeout_s=2).status == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{api}{path} not answering after {timeout_s:.0f}s; see {log}")


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The Sluice settings that choose and size the engine, the same for every Sluice setup."""
    if args.engine == "sim":
        # With the tokenizer the prompts were measured with, Sluice counts the same prompt tokens.
        tokenizer = getattr(args, "tokenizer_dir", None)
        return {"SLUICE_ENGINE": "simulated", "SLUICE_SIM_SPEED": str(args.sim_speed),
                "SLUICE_SIM_PROFILE": args.sim_profile, **({"SLUICE_MODEL_PATH": str(tokenizer)} if tokenizer else {})}
    return {"SLUICE_ENGINE": "vllm", "SLUICE_MODEL": MODEL_NAME, "SLUICE_MODEL_PATH": str(args.model),
            "SLUICE_MAX_CONTEXT_TOKENS": str(args.max_model_len), "SLUICE_VLLM_ENFORCE_EAGER": "1",
            "SLUICE_VLLM_DTYPE": VLLM_FLAGS["dtype"], "SLUICE_VLLM_MAX_NUM_SEQS": str(args.seqs),
            "SLUICE_VLLM_MAX_NUM_BATCHED_TOKENS": VLLM_FLAGS["max-num-batched-tokens"],
            "SLUICE_VLLM_KV_CACHE_BYTES": str(args.kv_bytes)}


def start_sluice(args: argparse.Namespace, setup: str, exits: contextlib.ExitStack, tmp: Path) -> SluiceFront:
    """Web, one worker, beat and the monitor on a scratch database and Redis db; its users' front."""
    database_url = exits.enter_context(scratch_database(args.postgres, "sluice_overload"))
    redis_url = f"{args.redis}/{free_redis_db(args.redis, set())}"
    exits.callback(flush_redis, redis_url)
    port, admin_key = free_port(), uuid.uuid4().hex
    ladder = "none" if setup == "sluice-ladder-off" else Settings().ladder_steps  # "": unset, i.e. every step
    env = {"DATABASE_URL": database_url, "REDIS_URL": redis_url,
           "SLUICE_WEB_PORT": str(port), "SLUICE_ADMIN_KEY": admin_key,
           "SLUICE_LOG_LEVEL": os.environ.get("SLUICE_BENCH_LOG_LEVEL", "WARNING"),
           "SLUICE_DATA_DIR": str(tmp), "SLUICE_LADDER_STEPS": ladder,
           "SLUICE_WORKER_CONCURRENCY": str(args.seqs), **engine_env(args)}
    settings = Settings.from_env(env)
    upgrade_database(settings.sqlalchemy_url)
    web_log = tmp / "web.log"
    web = spawn(web_argv(settings), env, web_log, exits)
    worker = WorkerProcess(env, redis_url, tmp, ready_timeout=READY_S[args.engine], concurrency=args.seqs)
    exits.callback(worker.stop)
    beat = BeatProcess(env, tmp)
    exits.callback(beat.stop)
    spawn(monitor_argv(settings), env, tmp / "monitor.log", exits)
    api = f"http://127.0.0.1:{port}"
    wait_http(api, "/healthz", web, web_log, 60)
    created = Http(api, {"Authorization": f"Bearer {admin_key}"}).call(
        "POST", "/admin/tenants", {"name": "bench", **NO_LIMITS}, timeout_s=30)
    if created.status != 201:
        raise RuntimeError(f"creating the tenant: HTTP {created.status} {created.doc}")
    users = {"slo_s": args.slo, "rt_tokens": args.rt_tokens, "batch_tokens": args.batch_tokens,
             "batch_deadline_s": args.batch_deadline, "poll_s": args.poll, "database_url": database_url,
             "follow_hints": not args.ignore_poll_hints}
    if setup == "sluice-openai":
        front = OpenAIFront(api, created.doc["api_key"], admin_key, model=settings.model, **users)
    else:
        front = SluiceFront(api, created.doc["api_key"], admin_key, deadline=setup != "sluice-defaults", **users)
    deadline = time.monotonic() + 30
    while front.sample()["level"] is None:  # admission promises nothing until the monitor publishes
        if time.monotonic() > deadline:
            raise RuntimeError(f"the load monitor published nothing in 30 s; see {tmp / 'monitor.log'}")
        time.sleep(0.5)
    front.logs = [worker.log_path]  # where the sweep (it runs on the worker) says what it requeued
    say(f"  {setup}: web {api}, worker {worker.worker_key}")
    return front


def start_vllm_server(args: argparse.Namespace, exits: contextlib.ExitStack, tmp: Path) -> VllmFront:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--scheduling-policy", "priority", "--max-num-seqs", str(args.seqs), "--enforce-eager",
            "--enable-prefix-caching", *(x for k, v in VLLM_FLAGS.items() for x in (f"--{k}", v)),
            "--max-model-len", str(args.max_model_len),
            "--kv-cache-memory-bytes", str(args.kv_bytes)]
    log = tmp / "vllm-server.log"
    server = spawn(argv, {}, log, exits)
    api = f"http://127.0.0.1:{port}"
    wait_http(api, "/health", server, log, READY_S["vllm"])
    say(f"  vllm-server: {api}")
    return VllmFront(api, MODEL_NAME, slo_s=args.slo, rt_tokens=args.rt_tokens, batch_tokens=args.batch_tokens)


def engine_cpus() -> str:
    """The CPUs the threads of each vLLM engine process may run on (`taskset -p` of each thread):
    an inherited mask would silently defeat VLLM_CPU_OMP_THREADS_BIND. vLLM's server runs the
    model in a `VLLM::Worker` child of its `VLLM::EngineCore`; a Sluice worker runs it inside the
    engine core (one process less). Linux cuts a process name at 15 characters."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if not comm.startswith(("VLLM::EngineCor", "VLLM::Worker")):
                continue
            lists: dict[str, int] = {}
            for task in os.listdir(f"/proc/{pid}/task"):
                status = Path(f"/proc/{pid}/task/{task}/status").read_text()
                cpus = next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list:"))
                lists[cpus] = lists.get(cpus, 0) + 1
            found.append(f"{pid} {comm}: " + ", ".join(f"{n} threads on CPU {c}" for c, n in sorted(lists.items())))
    return "; ".join(found)


def flush_redis(url: str) -> None:
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()


def listening_pids(port: int) -> list[int]:
    """Processes holding the listening socket of ``port``: a gunicorn master and its workers
    (gunicorn retitles its processes, so they are found by the socket they share)."""
    hex_port = f"{port:04X}"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if fields[1].endswith(":" + hex_port) and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                pids.append(int(pid))
    return pids


def rss_bytes(pids: list[int]) -> tuple[int, bool]:
    """Resident bytes summed over ``pids``, and whether any of them has exited."""
    total, gone = 0, False
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            gone = True
            continue
        total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    return total, gone


# ------------------------------------------------------------------------ the load


@dataclass
class Window:
    name: str
    rate: float
    start: float  # wall clock
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Run:
    """What one run of phases produced: the questions, the phase windows, the load samples."""

    questions: list[Question] = field(default_factory=list)
    batch: list[Question] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)  # once a second, with "t"
    marks: list[dict] = field(default_factory=list)  # at each window's start and end, and after the drain
    ended: float = 0.0


def sample(front: SluiceFront | VllmFront) -> dict:
    try:
        return {"t": time.time(), **front.sample()}
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return {"t": time.time()}


def run_load(front: SluiceFront | VllmFront, args: argparse.Namespace, prompts: Prompts,
             phases: list[tuple[str, float, float]], batch_rate: float, first: int,
             drain_s: float | None = None) -> Run:
    """Realtime arrivals phase by phase, batch arrivals throughout; then wait for the users, give
    batch work ``drain_s`` (default --drain) seconds to finish, and stop what is left of it."""
    drain_s = args.drain if drain_s is None else drain_s
    run = Run()
    done = threading.Event()

    def sampler() -> None:
        while not done.wait(1.0):
            run.samples.append(sample(front))

    threading.Thread(target=sampler, daemon=True).start()
    users, jobs = Arrivals(args.seed + first, first), Arrivals(args.seed + first + 1, first)
    stop_arrivals, cut = threading.Event(), threading.Event()
    phase = [phases[0][0]]

    def user(number: int) -> None:
        question = Question(number, "realtime", phase[0], time.time())
        run.questions.append(question)
        prompt = prompts.realtime(number)
        question.prompt_tokens = prompt.tokens
        realtime_user(front, question, prompt.text, args.retries)

    def job(number: int) -> None:
        question = Question(number, "batch", phase[0], time.time())
        run.batch.append(question)
        prompt = prompts.batch(number)
        question.prompt_tokens = prompt.tokens
        batch_job(front, question, prompt.text, cut)

    total_s = sum(seconds for _, _, seconds in phases)
    feeder = threading.Thread(target=jobs.run, args=(batch_rate, total_s, job, stop_arrivals), daemon=True)
    if batch_rate > 0:
        feeder.start()
    for name, rate, seconds in phases:
        phase[0] = name
        start = time.time()
        run.marks.append(sample(front))
        users.run(rate, seconds, user)
        run.windows.append(Window(name, rate, start, time.time()))
        run.marks.append(sample(front))
    stop_arrivals.set()
    if batch_rate > 0:
        feeder.join()
    users.join((1 + args.retries) * (args.slo + 5) + 30)
    left = jobs.join(drain_s)
    if left and drain_s > 0:
        say(f"    {left} batch jobs still waiting after the {drain_s:.0f} s drain; stopping them")
    cut.set()
    front.cut()
    jobs.join(30)
    done.set()
    run.ended = time.time()
    run.marks.append(sample(front))
    return run


# ------------------------------------------------------------------------ accounting


def spread(tokens: float, start: float, end: float, windows: list[Window]) -> dict[str, float]:
    """``tokens`` produced evenly over [start, end], split by window; the rest under "outside"."""
    shares: dict[str, float] = {}
    if end <= start:
        for w in windows:
            if w.start <= start < w.end:
                return {w.name: tokens}
        return {"outside": tokens}
    for w in windows:
        overlap = min(end, w.end) - max(start, w.start)
        if overlap > 0:
            shares[w.name] = tokens * overlap / (end - start)
    shares["outside"] = tokens - sum(shares.values())
    return shares


def when(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso).timestamp() if iso else None


def sluice_tokens(front: SluiceFront, run: Run) -> dict[str, Counter]:
    """Per window: output tokens generated, wasted (realtime attempts whose user gave up) and batch.

    Rows still queued or running are cancelled first (their users left long ago; batch work was
    already cut), so every row is read in its final state with the tokens it really generated.
    A submit whose answer never reached its client (a waiting user who hung up first) is found by
    its tag: its row's tokens are waste like any other late attempt's."""
    every = [a for q in run.questions + run.batch for a in q.attempts]
    found = front.ids_by_tag([a.tag for a in every if not a.request_id])
    for attempt in every:
        attempt.request_id = attempt.request_id or found.get(attempt.tag)
    attempts = [a for a in every if a.request_id]
    views = front.rows([a.request_id for a in attempts])
    open_ids = [i for i, v in views.items() if v.get("status") in ("queued", "running")]
    for request_id in open_ids:
        front.cancel(request_id)
    deadline = time.monotonic() + 15
    while open_ids and time.monotonic() < deadline:
        time.sleep(1)
        views.update(front.rows(open_ids))
        open_ids = [i for i in open_ids if views[i].get("status") in ("queued", "running")]
    generated, wasted, batch = Counter(), Counter(), Counter()
    for attempt in attempts:
        view = views.get(attempt.request_id) or {}
        timings = view.get("timings") or {}
        attempt.row_status = view.get("status")
        attempt.queue_wait_s, attempt.inference_s = timings.get("queue_wait_s"), timings.get("inference_s")
        tokens = (view.get("usage") or {}).get("output_tokens") or 0
        started, finished = when(timings.get("started_at")), when(timings.get("finished_at"))
        if view.get("cache_hit") or not tokens or started is None:
            continue  # no engine ran, or it generated nothing
        shares = spread(tokens, started, finished or run.ended, run.windows)
        generated.update(shares)
        if attempt.kind == "batch":
            batch.update(shares)
        elif attempt.outcome != "answered":
            wasted.update(shares)
    return {"generated": generated, "wasted": wasted, "batch": batch}


def vllm_tokens(run: Run) -> dict[str, Counter]:
    """Per window: generated from the server's counter, delivered from what the users received;
    wasted is the difference (tokens of requests aborted or answered after their user left)."""
    counter = [m.get("generated_tokens") for m in run.marks]
    if None in counter:
        raise RuntimeError("vLLM's /metrics did not answer at a phase boundary")
    generated = Counter({w.name: counter[2 * i + 1] - counter[2 * i] for i, w in enumerate(run.windows)})
    generated["outside"] = counter[-1] - counter[-2] + sum(counter[2 * i] - counter[2 * i - 1]
                                                             for i in range(1, len(run.windows)))
    delivered, batch = Counter(), Counter()
    for question in run.questions + run.batch:
        for attempt in question.attempts:
            if attempt.outcome == "answered" and attempt.tokens:
                shares = spread(attempt.tokens, attempt.sent, attempt.ended, run.windows)
                delivered.update(shares)
                if attempt.kind == "batch":
                    batch.update(shares)
    wasted = Counter({k: max(0.0, generated[k] - delivered[k]) for k in generated})
    return {"generated": generated, "wasted": wasted, "batch": batch}


def summarise(run: Run, tokens: dict[str, Counter] | None) -> list[dict]:
    """One row per window: the realtime outcomes, batch throughput, waste and the queue's peak."""
    rows = []
    for w in run.windows:
        questions = [q for q in run.questions if q.phase == w.name]
        outcomes = Counter(q.outcome for q in questions)
        asked = len(questions)
        answered = [q.attempts[0].latency_s for q in questions if q.outcome == "within_slo"]
        # Accepted: not refused (the promise was made); of those, the ones that came too late.
        accepted = asked - outcomes["refused_fast"] - outcomes["refused_slow"] - outcomes["pending"]
        refusals = [q.attempts[0].latency_s for q in questions if q.outcome.startswith("refused")]
        peak = [s for s in run.samples if w.start <= s["t"] < w.end]
        row = {"phase": w.name, "rate": w.rate, "seconds": round(w.seconds, 1), "asked": asked,
               **{k: outcomes[k] for k in ("within_slo", "refused_fast", "refused_slow", "late", "failed",
                                           "pending")},
               "accepted": accepted, "accepted_late_pct": 100 * outcomes["late"] / accepted if accepted else 0.0,
               "retries": sum(q.retries for q in questions),
               "answered_on_retry": sum(1 for q in questions if q.retries and q.attempts[-1].outcome == "answered"),
               "within_slo_per_s": outcomes["within_slo"] / w.seconds,
               "latency_p50_s": statistics.median(answered) if answered else None,
               "latency_max_s": max(answered) if answered else None,
               "refusal_latency_p50_s": _quantile(refusals, 0.5), "refusal_latency_p90_s": _quantile(refusals, 0.9),
               # Sluice: where the time of admitted first attempts went, answered in time or late,
               # and how the late ones' rows ended (why the promise was not kept).
               "answered_queue_wait_p50_s": _first_p50(questions, "within_slo", "queue_wait_s"),
               "answered_inference_p50_s": _first_p50(questions, "within_slo", "inference_s"),
               "late_queue_wait_p50_s": _first_p50(questions, "late", "queue_wait_s"),
               "late_inference_p50_s": _first_p50(questions, "late", "inference_s"),
               "late_rows": dict(Counter(q.attempts[0].row_status or "no row" for q in questions
                                         if q.outcome == "late")),
               "refusal_codes": dict(Counter(q.attempts[0].code for q in questions
                                             if q.outcome.startswith("refused"))),
               "lost_submits": sum(1 for q in questions for a in q.attempts
                                   if a.outcome == "late" and a.request_id is None),
               "batch_jobs": sum(1 for q in run.batch if q.phase == w.name),
               "batch_refusals": sum(1 for q in run.batch for a in q.attempts
                                     if a.outcome == "refused" and w.start <= a.sent < w.end),
               "peak_realtime_queued_tokens": max((s.get("realtime_queued_tokens", 0) for s in peak), default=None),
               "peak_batch_queued_tokens": max((s.get("batch_queued_tokens", 0) for s in peak), default=None),
               "peak_waiting_requests": max((s.get("waiting", 0) for s in peak), default=None),
               "max_level": max((s.get("level") or 0 for s in peak), default=None)}
        if tokens is not None:
            generated, wasted = tokens["generated"][w.name], tokens["wasted"][w.name]
            row.update(batch_tokens_per_s=tokens["batch"][w.name] / w.seconds, generated_tokens=round(generated),
                       wasted_tokens=round(wasted), wasted_pct=100 * wasted / generated if generated else 0.0)
        rows.append(row)
    return rows


def _first_p50(questions: list[Question], outcome: str, name: str) -> float | None:
    """The median of a timing (``name``, read back from the rows) of the first attempts of the
    questions that ended ``outcome``."""
    return _quantile([v for q in questions if q.outcome == outcome
                      for v in [getattr(q.attempts[0], name)] if v is not None], 0.5)


def _quantile(values: list[float], q: float) -> float | None:
    """The q-quantile of ``values`` (nearest rank), None for none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def totals(tokens: dict[str, Counter]) -> dict:
    generated, wasted = sum(tokens["generated"].values()), sum(tokens["wasted"].values())
    return {"generated_tokens": round(generated), "wasted_tokens": round(wasted),
            "wasted_pct": 100 * wasted / generated if generated else 0.0}


# ------------------------------------------------------------------------ knee and setups


def batch_rate_at(args: argparse.Namespace, rate: float) -> float:
    """Batch jobs per second beside ``rate`` realtime questions a second."""
    if args.batch_rate is not None:
        return args.batch_rate
    return args.batch_share * rate * args.rt_tokens / args.batch_tokens


def find_knee(front: SluiceFront | VllmFront, args: argparse.Namespace, prompts: Prompts) -> dict:
    """The highest realtime rate at which --knee-target of questions are answered within SLO,
    beside the batch load the phases bring at that rate (without it, the warm phase's 0.8 x plus
    its batch was past what vLLM's own server could serve): x1.5 steps up to the first failure
    (halving while the start fails), then bisection. Each step's batch work is stopped at its end.

    A step is judged on the questions of its second half: an open-loop queue past the knee grows
    with time, and the first half gives it time to. Steps of only a few SLOs still overstate it."""
    half_s = args.knee_step * args.scale / 2
    rate, passed, failed, steps, bisections = args.knee_start, None, None, [], 0
    while len(steps) < args.knee_max_steps:
        run = run_load(front, args, prompts, [("ramp", rate, half_s), ("knee", rate, half_s)],
                       batch_rate_at(args, rate), first=(len(steps) + 1) * 10**6, drain_s=0.0)
        row = summarise(run, None)[1]
        share = row["within_slo"] / row["asked"] if row["asked"] else 0.0
        steps.append({**row, "share_within_slo": share})
        ok = row["asked"] > 0 and share >= args.knee_target
        say(f"  knee step {len(steps)}: {rate:.2f}/s, {row['asked']} asked, {100 * share:.1f}% within SLO "
            f"-> {'pass' if ok else 'fail'}")
        if ok and (passed is None or rate > passed["rate"]):
            passed = steps[-1]
        if not ok and (failed is None or rate < failed["rate"]):
            failed = steps[-1]
        if failed is None:
            rate *= 1.5
        elif passed is None:
            rate /= 2
        elif bisections < args.knee_refine:
            bisections += 1
            rate = math.sqrt(passed["rate"] * failed["rate"])
        else:
            break
        time.sleep(args.slo)  # let what the last step left behind expire or finish
    if passed is None:
        raise SystemExit(f"no rate down to {rate:.3f}/s had {100 * args.knee_target:.0f}% within SLO")
    return {"rate": passed["rate"], "goodput": passed["within_slo_per_s"], "steps": steps}


def start(args: argparse.Namespace, setup: str, exits: contextlib.ExitStack) -> SluiceFront | VllmFront:
    """The setup's processes, stopped when ``exits`` closes; their logs are kept only if it fails
    (or SLUICE_BENCH_KEEP_LOGS is set), at SLUICE_BENCH_LOG_LEVEL (WARNING unless set)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"overload-{setup}-"))

    def logs(exc_type: type | None, *_: object) -> bool:  # runs last, once every process stopped
        if exc_type is None and not os.environ.get("SLUICE_BENCH_KEEP_LOGS"):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            say(f"  {setup}: logs kept in {tmp}")
        return False

    exits.push(logs)
    if setup == "vllm-server":
        return start_vllm_server(args, exits, tmp)
    return start_sluice(args, setup, exits, tmp)


# The sweep's line for a running request whose worker it found dead (its heartbeat older than
# SLUICE_WORKER_DEAD_AFTER_S): under load, a live worker declared dead is a bug of its own.
DECLARED_DEAD = "requeued: its worker died while running it"


def declared_dead(front: SluiceFront | VllmFront) -> int | None:
    """Requests the sweep has taken back from a worker it found dead so far (None: not Sluice)."""
    logs = getattr(front, "logs", None)
    if logs is None:
        return None
    return sum(path.read_text(errors="replace").count(DECLARED_DEAD) for path in logs if path.exists())


def run_setup(front: SluiceFront | VllmFront, args: argparse.Namespace, knee: dict, prompts: Prompts) -> dict:
    phases = [(name, factor * knee["rate"], seconds * args.scale) for name, factor, seconds in PHASES]
    batch_rate = batch_rate_at(args, knee["rate"])
    say(f"  phases {', '.join(f'{n} {r:.2f}/s x {s:.0f}s' for n, r, s in phases)}; batch {batch_rate:.3f} jobs/s")
    dead_before = declared_dead(front)
    run = run_load(front, args, prompts, phases, batch_rate, first=0)
    dead = None if dead_before is None else declared_dead(front) - dead_before
    tokens = vllm_tokens(run) if isinstance(front, VllmFront) else sluice_tokens(front, run)
    rows, total = summarise(run, tokens), totals(tokens)
    questions = [{"number": q.number, "kind": q.kind, "phase": q.phase, "arrived": q.arrived, "outcome": q.outcome,
                  "prompt_tokens": q.prompt_tokens, "attempts": [asdict(a) for a in q.attempts]}
                 for q in run.questions + run.batch]
    sent = {"realtime": lengths([q.prompt_tokens for q in run.questions if q.prompt_tokens is not None]),
            "batch": lengths([q.prompt_tokens for q in run.batch if q.prompt_tokens is not None])}
    return {"batch_rate": batch_rate, "prompt_tokens": sent, "phases": rows, "totals": total, "declared_dead": dead,
            "goals": goals(rows, total, knee), "samples": run.samples, "questions": questions}


def goals(rows: list[dict], total: dict, knee: dict) -> dict:
    by = {r["phase"]: r for r in rows}

    def kept(row: dict) -> float:  # within SLO or refused fast
        return 100 * (row["within_slo"] + row["refused_fast"]) / row["asked"] if row["asked"] else 100.0

    spike, after = by["spike"], by["after"]
    accepted, late = sum(r["accepted"] for r in rows), sum(r["late"] for r in rows)
    accepted_late = 100 * late / accepted if accepted else 0.0
    return {"spike_kept_pct": kept(spike), "after_kept_pct": kept(after),
            "accepted": accepted, "accepted_late": late, "accepted_late_pct": accepted_late,
            "accepted_late_met": accepted_late <= 1,
            "kept_met": kept(spike) >= 99 and kept(after) >= 99,
            "spike_goodput_vs_knee": spike["within_slo_per_s"] / knee["goodput"] if knee["goodput"] else None,
            "goodput_met": spike["within_slo_per_s"] >= 0.9 * knee["goodput"],
            "wasted_pct": total["wasted_pct"], "wasted_met": total["wasted_pct"] < 1,
            "spike_batch_tokens_per_s": spike["batch_tokens_per_s"], "batch_met": spike["batch_tokens_per_s"] > 0}


# ------------------------------------------------------------------------ report


def pct(n: int, of: int) -> str:
    return f"{100 * n / of:.1f}%" if of else "-"


def sent_lengths(results: dict[str, dict], kind: str) -> dict:
    """The prompt lengths of ``kind`` sent in every setup, together."""
    return lengths([q["prompt_tokens"] for result in results.values() for q in result.get("questions", ())
                    if q["kind"] == kind and q["prompt_tokens"] is not None])


def table(args: argparse.Namespace, knee: dict, results: dict[str, dict]) -> None:
    say(f"\n### {args.engine}, {args.mix} mix: SLO {args.slo:g} s, knee {knee['rate']:.2f} questions/s "
        f"({knee['goodput']:.2f} answered within SLO per s), retries {args.retries}, "
        f"realtime {args.rt_tokens} / batch {args.batch_tokens} tokens out, {args.seqs} seqs\n")
    say(f"Prompts sent (tokens of the model's tokenizer): realtime {describe(sent_lengths(results, 'realtime'))}; "
        f"batch {describe(sent_lengths(results, 'batch'))}\n")
    say("| setup | phase | rate/s | asked | within SLO | refused fast | refused slow | late | failed | retries "
        "| accepted, then late | within SLO/s | batch tok/s | wasted | peak queue |")
    say("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for setup, result in results.items():
        if "error" in result:
            say(f"| {setup} | - | failed to run: {result['error']} |")
            continue
        for r in result["phases"]:
            n = r["asked"]
            if setup == "vllm-server":
                peak = f"{r['peak_waiting_requests'] or 0:.0f} req"
            else:
                peak = f"{r['peak_realtime_queued_tokens'] or 0} / {r['peak_batch_queued_tokens'] or 0}"
            say(f"| {setup} | {r['phase']} | {r['rate']:.2f} | {n} | {pct(r['within_slo'], n)} "
                f"| {pct(r['refused_fast'], n)} | {pct(r['refused_slow'], n)} | {pct(r['late'], n)} "
                f"| {pct(r['failed'] + r['pending'], n)} | {r['retries']} | {pct(r['late'], r['accepted'])} "
                f"| {r['within_slo_per_s']:.2f} | {r['batch_tokens_per_s']:.0f} | {r['wasted_pct']:.1f}% | {peak} |")
    say("\npeak queue: Sluice realtime / batch queued tokens; vllm-server requests waiting. "
        "wasted: share of the phase's generated output tokens. accepted, then late: of the questions not "
        "refused, the share that expired or came too late.\n")
    for setup, result in results.items():
        if "error" in result:
            continue
        g, sent = result["goals"], result["prompt_tokens"]
        ratio = g["spike_goodput_vs_knee"]
        say(f"{setup} (prompts: realtime {describe(sent['realtime'])}; batch {describe(sent['batch'])}):")
        say(f"  accepted, then expired or late: {g['accepted_late']} of {g['accepted']} accepted, "
            f"{g['accepted_late_pct']:.1f}% (<= 1%: {mark(g['accepted_late_met'])})")
        say(f"  within SLO or refused fast {g['spike_kept_pct']:.1f}% in the spike, "
            f"{g['after_kept_pct']:.1f}% after (>= 99%: {mark(g['kept_met'])}); "
            f"spike answers within SLO/s = {'-' if ratio is None else f'{ratio:.2f}'} x knee "
            f"(>= 0.90: {mark(g['goodput_met'])}); wasted {g['wasted_pct']:.2f}% (< 1%: {mark(g['wasted_met'])}); "
            f"batch in the spike {g['spike_batch_tokens_per_s']:.0f} tok/s (> 0: {mark(g['batch_met'])})")
        if result.get("declared_dead") is not None:
            say(f"  requests requeued from a worker the sweep declared dead: {result['declared_dead']} "
                f"(0: {mark(result['declared_dead'] == 0)})")


def mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


# ------------------------------------------------------------------------ main


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (``argv``: these instead, as bench/tiers.py and bench/windows.py
    start their stack)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--mix", choices=tuple(MIXES), default="short",
                        help="prompt lengths in the model's tokens: "
                             + "; ".join(f"{m.name}: {m.summary}" for m in MIXES.values()).replace("%", "%%"))
    parser.add_argument("--setups", default=None,
                        help=f"comma-separated, from {', '.join(SETUPS)} (default: every sluice one, "
                             "plus vllm-server with --engine vllm)")
    parser.add_argument("--slo", type=float, default=5.0, help="realtime SLO = client timeout = deadline_s, seconds")
    parser.add_argument("--retries", type=int, default=2, help="times a user whose page hung asks again")
    parser.add_argument("--poll", type=float, default=0.25, help="Sluice users poll their request this often, s")
    parser.add_argument("--ignore-poll-hints", action="store_true",
                        help="Sluice users poll every --poll s from the start, instead of first coming back when "
                             "the 202's retry-after-ms says the answer is due")
    parser.add_argument("--knee", type=float, default=None, help="knee rate, questions/s (skips the search)")
    parser.add_argument("--knee-setup", choices=SETUPS, default=None,
                        help="setup the knee is searched on (default: vllm-server for vllm, else sluice-ladder-off)")
    parser.add_argument("--knee-start", type=float, default=1.0, help="first rate of the knee search, per s")
    parser.add_argument("--knee-step", type=float, default=30.0, help="seconds per knee step (before --scale)")
    parser.add_argument("--knee-target", type=float, default=0.95, help="share answered within SLO at the knee")
    parser.add_argument("--knee-refine", type=int, default=2, help="bisection steps after the first failure")
    parser.add_argument("--knee-max-steps", type=int, default=12)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every phase and knee step duration")
    parser.add_argument("--drain", type=float, default=60.0, help="seconds batch work may finish after the phases")
    parser.add_argument("--seqs", type=int, default=None,
                        help="engine batch size: the sim worker's threads, vLLM's max_num_seqs (default: 4)")
    parser.add_argument("--sim-speed", type=float, default=0.1, help="SLUICE_SIM_SPEED for --engine sim")
    parser.add_argument("--rt-tokens", type=int, default=None, help="realtime max_tokens (default: sim 32, vllm 128)")
    parser.add_argument("--batch-tokens", type=int, default=None, help="batch max_tokens (default: sim 256, vllm 512)")
    parser.add_argument("--batch-rate", type=float, default=None, help="batch jobs per s (overrides --batch-share)")
    parser.add_argument("--batch-share", type=float, default=0.25,
                        help="batch output tokens offered, as a share of the knee's realtime tokens/s")
    parser.add_argument("--batch-deadline", type=float, default=3600.0, help="deadline_s of batch jobs, when sent")
    parser.add_argument("--sim-profile", choices=("h200", "cpu"), default="h200",
                        help="SLUICE_SIM_PROFILE for --engine sim (cpu: compute-bound, docs/calibration.md)")
    parser.add_argument("--model", type=Path, default=None, help="--engine vllm: model directory (default: built)")
    parser.add_argument("--shape", choices=("tiny", "92m"), default="tiny",
                        help="--engine vllm without --model: the random Llama tests/tiny_model.py builds")
    parser.add_argument("--kv-bytes", type=int, default=None,
                        help="--engine vllm: KV cache bytes, both servers (default: 128 MiB tiny, 1 GiB 92m)")
    parser.add_argument("--pin-engine", type=int, metavar="CPU", default=None,
                        help="CPU hosts: vLLM's compute threads on this core, everything else on the others "
                             "(the analogue of a GPU host); the engine processes' CPU lists are reported")
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None, help="write every figure and sample here")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379", help="Redis server (a free db is used)")
    args = parser.parse_args(argv)
    if args.kv_bytes is None:
        args.kv_bytes = KV_BYTES[args.shape]
    for name, value in DEFAULTS[args.engine].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    default_setups = ("sluice,sluice-defaults,sluice-openai,sluice-ladder-off"
                      + (",vllm-server" if args.engine == "vllm" else ""))
    args.setups = [s.strip() for s in (args.setups or default_setups).split(",") if s.strip()]
    unknown = set(args.setups) - set(SETUPS)
    if unknown:
        parser.error(f"--setups: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SETUPS)}")
    args.knee_setup = args.knee_setup or ("vllm-server" if args.engine == "vllm" else "sluice-ladder-off")
    if args.engine != "vllm" and "vllm-server" in args.setups + [args.knee_setup]:
        parser.error("vllm-server runs only with --engine vllm")
    if "sluice-openai" in args.setups + [args.knee_setup] and importlib.util.find_spec("openai") is None:
        parser.error("sluice-openai needs the openai package (the dev extra)")
    return args


def prompt_source(args: argparse.Namespace) -> tuple[Prompts, list[str]]:
    """The mix's prompts in the tokens of ``args.tokenizer_dir``, cut to what the context leaves
    beside the longest answer (with a sentence saying so), and ``args.max_model_len``: the
    context the engines are given (vLLM's --max-model-len, SLUICE_MAX_CONTEXT_TOKENS), enough
    for the longest prompt and answer, at least MIN_MODEL_LEN as before there were mixes (the
    simulated engine: Sluice's SLUICE_MAX_CONTEXT_TOKENS, which the prompts are cut to fit)."""
    context = context_tokens(args.tokenizer_dir) or MIN_MODEL_LEN
    if args.engine == "sim":
        context = min(context, Settings().max_context_tokens)
    answer = max(args.rt_tokens, args.batch_tokens)
    mix, notes = clamp(MIXES[args.mix], context - answer)
    needed = (longest(mix) or 0) + answer
    # The simulated engine keeps Sluice's own context setting; vLLM gets what the mix needs.
    args.max_model_len = context if args.engine == "sim" else min(
        context, max(MIN_MODEL_LEN, 1024 * math.ceil(needed / 1024)))
    return Prompts(mix, args.tokenizer_dir, args.seed), notes


def prepare(args: argparse.Namespace) -> tuple[Prompts, list[str]]:
    """What every bench on this stack sets up first (this one, bench/tiers.py, bench/windows.py):
    the model (``--engine vllm`` without ``--model``: the tiny random Llama, built once), the
    tokenizer its prompts are counted in (the simulated engine has no model: the tiny one's), the
    engine pinned (``--pin-engine``), and the mix's prompts (``prompt_source``)."""
    from tiny_model import cached_model

    if args.engine == "vllm" and args.model is None:
        args.model = cached_model(ROOT / ".cache", args.shape)
    args.tokenizer_dir = args.model if args.engine == "vllm" else cached_model(ROOT / ".cache", "tiny")
    if args.pin_engine is not None:
        try:
            pin_engine(args.pin_engine)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    return prompt_source(args)


def main() -> int:
    args = parse_args()
    prompts, notes = prepare(args)
    sample = {kind: lengths([getattr(prompts, kind)(n).tokens for n in range(PROMPT_SAMPLE)])
              for kind in ("realtime", "batch")}
    # SIGTERM unwinds like Ctrl-C, so every process is stopped and every database dropped (SIGINT
    # too, explicitly: a shell starts background jobs with it ignored).
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)
    order = sorted(args.setups, key=lambda s: s != args.knee_setup)  # reuse the knee's server for its run
    knee = {"rate": args.knee, "goodput": args.knee, "steps": []} if args.knee else None
    say(f"# {os.cpu_count()} CPUs; engine {args.engine}; setups {', '.join(order)}; SLO {args.slo:g} s; "
        f"scale {args.scale:g}; context {args.max_model_len} tokens")
    say(f"# {args.mix} mix ({prompts.mix.summary}); the first {PROMPT_SAMPLE} prompts of each kind, in tokens: "
        f"realtime {describe(sample['realtime'])}; batch {describe(sample['batch'])}")
    for note in notes:
        say(f"# {note}")
    results: dict[str, dict] = {}
    try:
        if knee is None and args.knee_setup not in order:
            with contextlib.ExitStack() as exits:
                say(f"knee search on {args.knee_setup}")
                knee = find_knee(start(args, args.knee_setup, exits), args, prompts)
        for setup in order:
            say(f"{setup}: starting")
            try:
                with contextlib.ExitStack() as exits:
                    front = start(args, setup, exits)
                    if args.engine == "vllm":
                        say(f"  engine processes' CPUs: {engine_cpus() or 'none found'}")
                    if knee is None:
                        say(f"knee search on {setup}")
                        knee = find_knee(front, args, prompts)
                        time.sleep(args.slo)
                    say(f"  knee {knee['rate']:.2f}/s ({knee['goodput']:.2f} within SLO/s)")
                    results[setup] = run_setup(front, args, knee, prompts)
                    say(f"{setup}: done; stopping it")
            except (RuntimeError, OSError) as exc:
                if knee is None:
                    raise
                say(f"{setup}: FAILED: {exc}")
                results[setup] = {"error": str(exc).splitlines()[0]}
    except KeyboardInterrupt:
        say("interrupted: everything this run started is stopped")
        return 130
    table(args, knee, results)
    if args.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"}
        mix = {"name": args.mix, "summary": prompts.mix.summary, "first_prompts": sample, "notes": notes,
               "sent": {kind: sent_lengths(results, kind) for kind in ("realtime", "batch")}}
        args.json.write_text(json.dumps({"config": config, "mix": mix, "knee": knee, "results": results}, indent=1))
        say(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
