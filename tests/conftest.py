"""Fixtures: a fresh Postgres database and Redis database per test session, real worker processes.

Postgres and Redis are real servers: TEST_DATABASE_URL / TEST_REDIS_URL if set, else the local
ones on their default ports (what .ci/run starts when none answer). Each session creates its
own database and uses its own Redis database numbers, so runs never see each other's rows or
queues. Tests are isolated by tenant: every test gets a new tenant and API key, so a worker
shared by the whole session can keep running between tests.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis as redis_lib

from core.settings import Settings
from launcher import harness
from launcher.database import create_key, upgrade_database
from web.services import services

ROOT = Path(__file__).resolve().parent.parent
LOCAL_DB_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379"
# TEST_SERVICES=embedded: behave as on a bare machine even where local servers run.
FORCE_EMBEDDED = os.environ.get("TEST_SERVICES") == "embedded"
# Set by pytest-xdist in each of its processes (gw0, gw1, ...) when the suite runs in parallel.
PARALLEL = bool(os.environ.get("PYTEST_XDIST_WORKER"))
# Seconds each test took in a measured run (see pytest_collection_modifyitems); refreshed with
# SLUICE_TEST_DURATIONS_OUT=tests/durations.json make test.
DURATIONS_FILE = Path(__file__).with_name("durations.json")
TERMINAL = {"succeeded", "failed", "timed_out", "cancelled", "expired", "rejected"}
# Every vLLM engine the tests start: its OpenMP threads sleep when they wait instead of spinning.
# A test's engine shares two cores with the platform, the load and (spread) three other test
# processes; spinning there burned half its CPU. tests/test_vllm_engine.py beside two CPU hogs
# on a 2-core Intel Xeon: 188 s and 211 CPU-seconds with libgomp's default spin, 110 s and 111
# CPU-seconds with PASSIVE (2026-12-06).
ENGINE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
# Fixtures of the admission tests (isolated apps on one shared, flushed Redis database).
pytest_plugins = ("admission_support",)

# Settings every test process shares: short heartbeats so dead workers are found in seconds.
TEST_ENV = {
    "SLUICE_WORKER_HEARTBEAT_S": "0.5",
    "SLUICE_WORKER_DEAD_AFTER_S": "3",
    "SLUICE_PUBLISH_GRACE_S": "1",
    "SLUICE_LARGE_THRESHOLD_TOKENS": "1024",
    "SLUICE_CANCEL_POLL_S": "0.2",
    "SLUICE_LOG_LEVEL": "INFO",
    # Requests other tests leave queued share one database, and the sweep is global: with the
    # 30 s default they would expire under a later test's sweep and skew its counts.
    "SLUICE_REALTIME_DEADLINE_S": "300",
    # A web tier's Redis call past this falls to the local floor. The tests' Redis shares two
    # cores with four test processes and their engines: in a spread run one call took longer than
    # the 0.25 s default, and the floor refused a batch request of a test about batching
    # (test_vllm_engine's two full workers). The floor's own tests stop or freeze their Redis.
    "SLUICE_REDIS_TIMEOUT_S": "1",
    # Many workers and monitors run at once here: no metrics endpoints unless a test asks for one.
    "SLUICE_WORKER_METRICS_PORT": "0",
    "SLUICE_MONITOR_METRICS_PORT": "0",
}


def _shares_module_state(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture its own module defines with a scope wider than one test
    (a worker started once for the whole module, say): such tests must run in one process."""
    module_id = item.nodeid.split("::", 1)[0]
    for defs in item._fixtureinfo.name2fixturedefs.values():
        for fixturedef in defs:
            if fixturedef.scope in ("module", "class", "package") and fixturedef.baseid == module_id:
                return True
    return False


def _unit(item: pytest.Item) -> str:
    """What must run in the same process as ``item``, one test after another: every test of the
    real engine (two engines at once on two cores starve each other's deadlines, and the fault
    scenarios' too), the module where tests share its fixtures, else the test alone."""
    if item.get_closest_marker("vllm"):
        return "vllm"
    return item.nodeid.split("::", 1)[0] if _shares_module_state(item) else item.nodeid


def _spread(config: pytest.Config) -> str | None:
    """In a process of a spread run, the file that names each test's unit; else None."""
    return getattr(config, "workerinput", {}).get("sluice_units")


_UNITS = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") == "loadscope" and not hasattr(config, "workerinput"):
        config.stash[_UNITS] = Path(tempfile.mkdtemp(prefix="sluice-units-")) / "units.json"


def pytest_unconfigure(config: pytest.Config) -> None:
    if _UNITS in config.stash:
        shutil.rmtree(config.stash[_UNITS].parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """(xdist, in the controller) Tells each process where to write the units it collects."""
    if _UNITS in node.config.stash:
        node.workerinput["sluice_units"] = str(node.config.stash[_UNITS])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """How `make test TEST_PROCS=4` spreads the suite (pytest-xdist, ``--dist loadscope``).

    A unit runs in one process (``_unit``: the vLLM tests, a module whose tests share a fixture,
    else one test). The processes name the units as they collect (a file, since
    only they see the fixtures; xdist's own ``loadgroup`` cannot carry them under pytest 9, whose
    node ids no longer take its suffix), and hand them out in the order collected: longest first
    (pytest_collection_modifyitems), so that no long unit starts last and runs alone at the end."""
    if _UNITS not in config.stash:
        return None
    from xdist.scheduler import LoadScopeScheduling

    path = config.stash[_UNITS]

    class ByUnit(LoadScopeScheduling):
        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:
                self.units = json.loads(path.read_text())
            return self.units.get(nodeid, nodeid)

    return ByUnit(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a spread run: each test's unit, written for the controller, and the units longest first,
    by the seconds in durations.json (a test missing from it counts one second)."""
    out = _spread(config)
    if out is None:
        return
    durations = json.loads(DURATIONS_FILE.read_text()) if DURATIONS_FILE.exists() else {}
    unit_of = {item.nodeid: _unit(item) for item in items}
    weight: dict[str, float] = {}
    for nodeid, unit in unit_of.items():
        weight[unit] = weight.get(unit, 0.0) + float(durations.get(nodeid, 1.0))
    position = {item.nodeid: index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-weight[unit_of[item.nodeid]], unit_of[item.nodeid], position[item.nodeid]))
    partial = Path(f"{out}.{os.getpid()}")
    partial.write_text(json.dumps(unit_of))
    os.replace(partial, out)  # every process collects the same tests: whichever writes last, the same file


_DURATIONS: dict[str, float] = {}
_CPU: dict[str, float] = {}
_TICKS = os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / _TICKS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    """In a serial run that records durations, also the machine's busy CPU seconds per test: what
    a parallel run has to fit on the cores."""
    recording = os.environ.get("SLUICE_TEST_DURATIONS_OUT") and not PARALLEL
    before = _machine_busy_s() if recording else 0.0
    yield
    if recording:
        _CPU[item.nodeid] = _machine_busy_s() - before


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Sums each test's setup, call and teardown seconds, for SLUICE_TEST_DURATIONS_OUT."""
    if os.environ.get("SLUICE_TEST_DURATIONS_OUT"):
        _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("SLUICE_TEST_DURATIONS_OUT")
    if out and _DURATIONS and not PARALLEL:  # the controller (or a serial run) has every report
        Path(out).write_text(json.dumps({k: round(v, 2) for k, v in sorted(_DURATIONS.items())}, indent=0) + "\n")
        if _CPU:
            Path(out).with_suffix(".cpu.json").write_text(
                json.dumps({k: round(v, 2) for k, v in sorted(_CPU.items())}, indent=0) + "\n")


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="session")
def admin_db_url(tmp_path_factory) -> Iterator[str]:
    """TEST_DATABASE_URL, else the local server, else an embedded one for this session."""
    if os.environ.get("TEST_DATABASE_URL"):
        yield os.environ["TEST_DATABASE_URL"]
    elif _answers(5432) and not FORCE_EMBEDDED:
        yield LOCAL_DB_URL
    else:
        from launcher.embedded import start_postgres

        server = start_postgres(tmp_path_factory.mktemp("embedded"))
        yield server.url
        server.stop()


@pytest.fixture(scope="session")
def redis_base(tmp_path_factory) -> Iterator[str]:
    """TEST_REDIS_URL, else the local server, else an embedded one (all without a db number).

    A parallel run gives each of its processes a redis-server of its own (the machine's binary
    where there is one): a server has 15 database numbers to hand out, and four processes, each
    with its session databases and its modules' own, would run out of them on one server."""
    if os.environ.get("TEST_REDIS_URL"):
        yield os.environ["TEST_REDIS_URL"].rstrip("/")
    elif _answers(6379) and not FORCE_EMBEDDED and not PARALLEL:
        yield LOCAL_REDIS_URL
    else:
        from launcher.embedded import start_redis

        server = start_redis(tmp_path_factory.mktemp("embedded"), server=shutil.which("redis-server"))
        yield server.url.rsplit("/", 1)[0]
        # The move listeners of the session's apps (threads that live as long as the process) lose
        # their subscription with the server: expected here, not a warning worth printing after
        # the run's summary (where pytest's log capture is already closed).
        logging.getLogger("core.delivery.notify").setLevel(logging.ERROR)
        server.stop()


@pytest.fixture(scope="session")
def database_url(admin_db_url) -> Iterator[str]:
    with harness.scratch_database(admin_db_url, "sluice_test") as url:
        upgrade_database(Settings(database_url=url).sqlalchemy_url)
        yield url


class RedisDbs:
    """Hands out empty Redis database URLs (there are only 15); ``release`` returns one.

    A database taken without ``keep`` is the module's: whatever takes it, the module's end hands it
    back (``release_module``). Module fixtures used to flush theirs and keep the number, and a run
    of the whole suite ran out of numbers two thirds of the way through."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.taken: set[int] = set()
        self.module: set[int] = set()

    def __call__(self, keep: bool = False) -> str:
        number = harness.free_redis_db(self.base, self.taken)
        self.taken.add(number)
        if not keep:
            self.module.add(number)
        return f"{self.base}/{number}"

    def release(self, url: str) -> None:
        """Flush the database and give its number back; a second release of it does nothing (the
        number may be another run's by then)."""
        number = int(url.rsplit("/", 1)[1])
        if number not in self.taken:
            return
        client = redis_lib.Redis.from_url(url)
        client.flushdb()
        client.close()
        self.taken.discard(number)
        self.module.discard(number)

    def release_module(self) -> None:
        for number in list(self.module):
            self.release(f"{self.base}/{number}")


_REDIS_DBS: list[RedisDbs] = []


@pytest.fixture(scope="session")
def redis_dbs(redis_base) -> Iterator[RedisDbs]:
    """Hands out fresh Redis database URLs; flushes them at the end."""
    dbs = RedisDbs(redis_base)
    _REDIS_DBS.append(dbs)
    yield dbs
    for number in list(dbs.taken):
        dbs.release(f"{redis_base}/{number}")
    _REDIS_DBS.remove(dbs)


@pytest.fixture(scope="module", autouse=True)
def _module_redis_dbs() -> Iterator[None]:
    """Hands back, at the end of each module, every database the module took (set up first, so
    torn down after the module's own fixtures have stopped their workers)."""
    yield
    for dbs in _REDIS_DBS:
        dbs.release_module()


@pytest.fixture
def scratch_redis_url(redis_dbs) -> Iterator[str]:
    """A Redis database for this test alone, emptied and handed back after it."""
    url = redis_dbs()
    yield url
    redis_dbs.release(url)


@pytest.fixture(scope="session")
def redis_url(redis_dbs) -> str:
    return redis_dbs(keep=True)


def make_settings(database_url: str, redis_url: str, env: dict[str, str] | None = None, **overrides) -> Settings:
    env = {**TEST_ENV, "DATABASE_URL": database_url, "REDIS_URL": redis_url, **(env or {})}
    return Settings.from_env(env, **overrides)


def service_env(database_url: str, redis_url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**TEST_ENV, "DATABASE_URL": database_url, "REDIS_URL": redis_url, **(extra or {})}


class WorkerProcess(harness.WorkerProcess):
    """A real `sluice worker` (Celery, thread pool, simulated engine unless told) with the tests' settings."""

    def __init__(self, database_url: str, redis_url: str, tmp: Path, role: str = "all",
                 extra_env: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(service_env(database_url, redis_url, extra_env), redis_url, tmp, role=role, **kwargs)


class BeatProcess(harness.BeatProcess):
    def __init__(self, database_url: str, redis_url: str, tmp: Path, interval_s: float = 1.0) -> None:
        super().__init__(service_env(database_url, redis_url, {"SLUICE_SWEEP_INTERVAL_S": str(interval_s),
                                                               "SLUICE_DATA_DIR": str(tmp / "beat-data")}), tmp)


def assert_alive(*workers: harness.WorkerProcess) -> None:
    """Fail now, with its log's tail, if a worker a module shares died in an earlier test (nothing
    restarts it there): each test after it would otherwise wait out its deadline."""
    for worker in workers:
        assert worker.proc.poll() is None, (f"worker exited {worker.proc.returncode}:\n"
                                            + worker.log_path.read_text()[-2000:])


@pytest.fixture(scope="session")
def worker(database_url, redis_url, tmp_path_factory) -> Iterator[WorkerProcess]:
    proc = WorkerProcess(database_url, redis_url, tmp_path_factory.mktemp("worker"))
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def app(database_url, redis_url):
    from web import create_app

    application = create_app(make_settings(database_url, redis_url))
    yield application
    services(application).db.dispose()


@pytest.fixture
def db(app):
    """The session app's database."""
    return services(app).db


@pytest.fixture
def tenant_id(db) -> uuid.UUID:
    """A new tenant's id, for tests that write rows straight through a state owner."""
    from models import Tenant

    with db.session() as session:
        tenant = Tenant(name=f"owner-{uuid.uuid4().hex[:8]}")
        session.add(tenant)
        session.flush()
        return tenant.id


def admitted_once_idle(client, worker, monitor, within_s: float = 10.0):
    """The response to a default request submitted once ``worker`` has nothing in flight and
    ``monitor`` published that; retried until one is accepted or ``within_s`` passed (no idle
    lock-out: a platform that went idle lets the next default request in)."""
    began = time.monotonic()
    while True:
        worker.wait_stats(lambda s: s.get("in_flight") == 0)
        monitor.tick()
        response = client.submit(prompt="hello there")
        if response.status_code == 202 or time.monotonic() - began > within_s:
            return response
        time.sleep(0.5)


def wait_until_running(up: subprocess.Popen, log_path: Path, timeout_s: float = 240) -> None:
    """Until `sluice up` (its output in ``log_path``) says it is running; fails if it stops."""
    deadline = time.monotonic() + timeout_s
    while "Sluice is running." not in log_path.read_text():
        assert up.poll() is None, f"sluice up stopped:\n{log_path.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"sluice up not running:\n{log_path.read_text()[-4000:]}"
        time.sleep(0.5)


def sse_events(chunks) -> list[tuple[str, dict]]:
    """Parse a Server-Sent Events byte stream into (event, data) pairs, comments dropped."""
    events, buffer = [], b""
    for chunk in chunks:
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            fields = dict(line.split(": ", 1) for line in block.decode().splitlines() if not line.startswith(":"))
            if fields:
                events.append((fields["event"], json.loads(fields["data"])))
    return events


class ApiClient:
    """The HTTP API as a tenant sees it, through Flask's test client (full WSGI stack)."""

    def __init__(self, app, key: str) -> None:
        self.http = app.test_client()
        self.key = key
        self.headers = {"Authorization": f"Bearer {key}"}

    def submit(self, **body):
        return self.http.post("/v1/requests", json=body, headers=self.headers)

    def get(self, request_id: str):
        return self.http.get(f"/v1/requests/{request_id}", headers=self.headers)

    def cancel(self, request_id: str):
        return self.http.post(f"/v1/requests/{request_id}/cancel", headers=self.headers)

    def wait(self, request_id: str, statuses=TERMINAL, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            view = self.get(request_id).get_json()
            if view["status"] in statuses:
                return view
            if time.monotonic() > deadline:
                raise AssertionError(f"request {request_id} still {view['status']} after {timeout}s")
            time.sleep(0.05)


@pytest.fixture
def new_client(app, database_url) -> Callable[..., ApiClient]:
    def make(application=None) -> ApiClient:
        key = create_key(Settings(database_url=database_url).sqlalchemy_url, f"tenant-{uuid.uuid4().hex[:10]}")
        return ApiClient(application or app, key)

    return make


@pytest.fixture
def client(new_client) -> ApiClient:
    return new_client()


@pytest.fixture(autouse=True)
def _no_outbound_network(monkeypatch):
    """Fail a test that tries to reach anything but this machine."""
    real_connect = socket.socket.connect

    def guarded(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and not (host.startswith(("127.", "::1", "/", "localhost")) or host == "0.0.0.0"):
            raise AssertionError(f"test tried to connect to {address!r}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


@pytest.fixture
def isolated(database_url, redis_dbs, new_client):
    """An app on a Redis database of its own, with no worker consuming it yet: the test decides
    exactly which worker runs (or does not run) what."""
    from web import create_app

    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url))
    client = new_client(application)
    yield application, client, redis_url
    services(application).db.dispose()
    redis_dbs.release(redis_url)  # flushed, and free for the next test: there are only 15


def restart_redis(server):
    """Start an embedded redis-server again on the same port and data folder (so URLs hold)."""
    from launcher.embedded import EmbeddedRedis, _wait_pong, redis_executable, write_redis_conf

    directory = server.log_path.parent
    with server.log_path.open("ab") as log:
        proc = subprocess.Popen([str(redis_executable()), str(write_redis_conf(directory, urlsplit(server.url).port))],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    again = EmbeddedRedis(url=server.url, process=proc, log_path=server.log_path)
    assert _wait_pong(again, 20), "redis-server did not come back"
    return again


@contextlib.contextmanager
def feeder_running(app) -> Iterator[None]:
    """The bulk job feeder (core/jobs/feeder.py) of ``app``, in a thread, as `sluice monitor` runs it."""
    from core.jobs.feeder import Feeder

    stop = threading.Event()

    def feed() -> None:
        with app.app_context():
            Feeder(services(app)).run(stop)

    thread = threading.Thread(target=feed, name="feeder", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
