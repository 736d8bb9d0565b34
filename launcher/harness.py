"""Real Sluice processes for tests and benchmarks: a worker, the web tier, beat, a scratch Postgres
database, a scratch Redis database.

Each starts the process an operator's command starts, in its own process group, logging to a
file, so it can be killed like a crashed node: `sluice web` itself; for a worker and beat, the
Celery command that `sluice worker` and `sluice beat` exec, built here from the same settings the
way `sluice up` builds it (the CLI's own start, ~1.7 CPU-seconds of imports on a 2-core VM, is
spared: a test run starts over a hundred workers).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis as redis_lib

from core.rediskeys import WORKER_PREFIX
from core.settings import Settings
from launcher.argv import beat_argv, worker_argv
from launcher.database import create_database, drop_database
from launcher.embedded import die_with_parent
from launcher.supervisor import child_env

ROOT = Path(__file__).resolve().parent.parent
SLUICE = [sys.executable, "-m", "launcher.cli"]


def exec_of(env: dict[str, str], argv_of: Callable[[Settings], list[str]]) -> tuple[list[str], dict[str, str]]:
    """The command a `sluice` server command would exec under ``env`` (``argv_of`` builds it from
    the settings, as the CLI does), and its environment: a `sluice up` child's, then ``env``
    itself (which may hold variables that are no setting, an engine's OMP_WAIT_POLICY say)."""
    settings = Settings.from_env({**os.environ, **env})
    return argv_of(settings), {**child_env(settings), **env}


def pin_engine(cpu: int) -> None:
    """A CPU host standing in for a GPU host: vLLM's engine on core ``cpu`` alone, every process
    started from here afterwards (web tier, workers, their frontends) on the other cores. Raises
    ValueError without that core and at least one other."""
    mine = os.sched_getaffinity(0)
    others = mine - {cpu}
    if cpu not in mine or not others:
        raise ValueError(f"--pin-engine {cpu}: needs that core and at least one other")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)  # inherited by every engine
    os.sched_setaffinity(0, others)  # and by every process started from here


def engine_affinity() -> str:
    """Where vLLM's engine processes on this host really run (their CPU affinity, as ``taskset -p``
    reads it), and this process: after ``pin_engine``, a mask inherited from a parent would defeat
    the engine's own binding."""
    import psutil

    seen = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if "VLLM" in (proc.info["name"] or "") or "EngineCore" in " ".join(proc.info["cmdline"] or []):
                seen.append(f"{proc.info['name']} {proc.pid} on {sorted(proc.cpu_affinity())}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return "; ".join(seen) + f"; this process on {sorted(os.sched_getaffinity(0))}"


def with_database(url: str, name: str) -> str:
    """``url`` pointing at database ``name`` on the same server."""
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


@contextlib.contextmanager
def scratch_database(admin_url: str, prefix: str) -> Iterator[str]:
    """A new, empty database on ``admin_url``'s server (psycopg's URL form), named
    ``<prefix>_<pid>_<random>`` so parallel runs never share one; yields its URL (same form), and
    drops it on the way out, whoever is still connected. No schema: run ``upgrade_database`` for one."""
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    create_database(admin_url, name)
    try:
        yield with_database(admin_url, name)
    finally:
        drop_database(admin_url, name)


REDIS_LOCK_KEY = "sluice:test:lock"


def free_redis_db(base: str, taken: set[int]) -> int:
    """A Redis database number that is empty now and locked for this process, so parallel runs
    do not collide; ``taken`` lists numbers this process already holds.

    The lock names its holder (``host:pid``) and never expires: a run longer than any expiry keeps
    its databases. A database whose holder on this host is gone (a killed run, which left its data
    behind) is flushed and taken; one whose holder lives, or that has data and no lock, is left."""
    me = f"{socket.gethostname()}:{os.getpid()}"
    for number in range(15, 0, -1):
        if number in taken:
            continue
        client = redis_lib.Redis.from_url(f"{base}/{number}")
        try:
            if client.dbsize() == 0 and client.set(REDIS_LOCK_KEY, me, nx=True):
                return number
            if _reclaim(client, me):
                return number
        finally:
            client.close()
    raise RuntimeError("no empty Redis database left (15 in use by live runs, or holding data with no lock)")


def _reclaim(client, me: str) -> bool:
    """Flush and lock a database whose lock's holder is gone, atomically: of two runs reclaiming
    it at once, the transaction of the second fails on the first's lock (WATCH)."""
    with client.pipeline() as pipe:
        try:
            pipe.watch(REDIS_LOCK_KEY)
            holder = pipe.get(REDIS_LOCK_KEY)
            if holder is None or not _holder_gone(holder.decode(errors="replace")):
                return False
            pipe.multi()
            pipe.flushdb()
            pipe.set(REDIS_LOCK_KEY, me)
            pipe.execute()
            return True
        except redis_lib.WatchError:
            return False


def _holder_gone(holder: str) -> bool:
    """Whether the process named ``host:pid`` by a database lock has exited (only on this host)."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class WorkerProcess:
    """A real worker, as `sluice worker` starts it; construction returns once its engine is warm."""

    def __init__(self, env: dict[str, str], redis_url: str, tmp: Path, role: str = "all",
                 ready_timeout: float = 60, model: str | None = None, concurrency: int = 64,
                 wrap: tuple[str, ...] = (), wait: bool = True) -> None:
        """``wrap``: a command the worker runs under, which must exec it in place (the fault suite's
        ``ip netns exec <host>``, so that the worker is a process of another network namespace).
        ``wait=False``: return once it is spawned; ``wait_ready()`` then waits for its warm engine
        (``start_all`` starts several at once that way)."""
        self.redis = redis_lib.Redis.from_url(redis_url, decode_responses=True)
        self.role = role
        self.log_path = tmp / f"worker-{role}-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        # Celery's node name; the worker's heartbeat key starts with it (workers/bootstrap.py).
        self.name = f"{role}-{uuid.uuid4().hex[:6]}@test"
        self._ready_timeout = ready_timeout
        self._stopping = False
        self.worker_key = ""
        argv, env = exec_of(env, lambda settings: worker_argv(settings, role, concurrency, self.name, model))
        self.proc = subprocess.Popen([*wrap, *argv], cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=tied())
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Return once the worker's engine is warm (its first heartbeat); stop it and raise if it
        exits first or takes longer than its ``ready_timeout``."""
        try:
            self.worker_key = self._wait_ready(self._ready_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited early:\n{self.log_path.read_text()[-3000:]}")
            mine = self.redis.keys(f"{WORKER_PREFIX}{self.name}/*")
            if mine:
                return mine[0]
            time.sleep(0.2)
        raise RuntimeError(f"worker not warm after {timeout}s:\n{self.log_path.read_text()[-3000:]}")

    def stats(self) -> dict:
        raw = self.redis.get(self.worker_key)
        return json.loads(raw) if raw else {}

    def wait_stats(self, predicate: Callable[[dict], bool], timeout: float = 10) -> dict:
        """Engine stats arrive with the heartbeat; wait for a snapshot that satisfies predicate."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if predicate(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the whole worker: no cleanup, no acks, exactly like an OOM kill."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.stop()

    def begin_stop(self) -> None:
        """SIGTERM the worker and return (``stop`` then waits for it, without a second SIGTERM,
        which would hand back what it runs at once)."""
        if not self._stopping and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        self._stopping = True

    def stop(self) -> None:
        # The worker itself, as `sluice up` does: vLLM's engine core shares its group and
        # would abort every request on a SIGTERM of its own.
        stop_process(self.proc, group=False, signalled=self._stopping)
        if not self._log.closed:
            self._log.close()
            self.redis.close()


class WebProcess:
    """A real `sluice web` (gunicorn, the worker class the settings choose) on a free port;
    construction returns once it answers /healthz."""

    def __init__(self, env: dict[str, str], tmp: Path, ready_timeout: float = 60) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"web-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*SLUICE, "web"], cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=tied(),
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env, "SLUICE_WEB_HOST": "127.0.0.1",
                 "SLUICE_WEB_PORT": str(self.port), "SLUICE_WEB_WORKERS": env.get("SLUICE_WEB_WORKERS", "1")})
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"web exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"web not answering after {ready_timeout}s") from None
                time.sleep(0.2)

    def stop(self) -> None:
        stop_process(self.proc, group=True)
        if not self._log.closed:
            self._log.close()


def tied() -> Callable[[], None] | None:
    """The ``preexec_fn`` that makes a child die with this process (a test run killed mid-way
    leaves no worker to take messages from the next run's Redis), where that is safe: only from
    the main thread, since the kernel signals the child when the thread that spawned it exits."""
    return die_with_parent if threading.current_thread() is threading.main_thread() else None


def start_all(*workers: Callable[..., WorkerProcess]) -> list[WorkerProcess]:
    """Start several workers at once and return them once every engine is warm: each is a
    ``WorkerProcess`` class or partial taking ``wait=False``. Engines warm side by side, not one
    after another (a vLLM worker takes ~15 s). Should one fail, every one is stopped."""
    started: list[WorkerProcess] = []
    try:
        for make in workers:
            started.append(make(wait=False))
        for worker in started:
            worker.wait_ready()
    except BaseException:
        stop_all(started)
        raise
    return started


def stop_all(workers) -> None:
    """Stop several workers at once: every one is told first, then each is waited for (a vLLM
    worker takes ~5 s to stop; one after another, N take N times that)."""
    workers = list(workers)
    for worker in workers:
        worker.begin_stop()
    for worker in workers:
        worker.stop()


def stop_process(proc: subprocess.Popen, group: bool, signalled: bool = False) -> None:
    """SIGTERM (to ``proc`` alone, or its whole group; not again if ``signalled``), then SIGKILL
    to the group after 30 s."""
    if proc.poll() is not None:
        return
    if not signalled:
        (os.killpg if group else os.kill)(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


class BeatProcess:
    """A real beat, as `sluice beat` starts it: schedules the sweep onto the maintenance queue."""

    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.log_path = tmp / f"beat-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        argv, env = exec_of(env, beat_argv)
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=tied())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        if not self._log.closed:
            self._log.close()
