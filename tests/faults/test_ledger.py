"""The fault suite: real web (in process), workers, beat, Postgres and Redis; a fault injected
under load; then the ledger. Every request accepted with 202 reaches exactly one terminal
status, none is computed twice (one engine run logged per request), no concurrency slot stays
held, and the platform recovers by itself (beat's sweep, a new worker), in the time printed.

Each scenario appends its line to ``$SLUICE_FAULT_REPORT`` when that is set (the table in
issue 13's note): ``make faults`` runs only this folder and prints it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import BeatProcess, WorkerProcess, make_settings, restart_redis
from sqlalchemy import select

from core.broker.queues import queue_length
from core.rediskeys import LOAD_LEVEL_KEY, inflight_key
from core.settings import Settings
from launcher.embedded import EmbeddedRedis, start_redis
from models import InferenceRequest
from web.services import services

TERMINAL = {"succeeded", "failed", "timed_out", "cancelled", "expired"}


# A message taken by a worker killed in that very instant is in no queue list and in no worker's
# record: the sweep publishes it again only after SLUICE_LOST_MESSAGE_GRACE_S (60 s by default),
# and that wait is part of a recovery. The scenarios run with 10 s so that their bounds stay short.
LOST_GRACE_S = 10
# The sweep's interval in the scenarios (beat's, ``BeatProcess``) and a loaded CI machine's slack.
SWEEP_S, SLACK_S = 1.0, 20
# Whatever a worker's death strands is running again within this bound.
DEATH_BOUND_S = LOST_GRACE_S + 3 * SWEEP_S + SLACK_S


BURST = 12  # Backlog's requests at once: enough to fill the vLLM test engine's batch


class Backlog:
    """The recovery bound of a fault that stops the worker: what a death strands runs again within
    DEATH_BOUND_S, and the backlog the outage piled up drains at the pace a full worker of this
    host serves now (on the vLLM engine or the simulated one), measured before the fault
    (BURST requests of the load's size at once), given twice that time, since the host's other
    load changes within a test. A fixed bound was 33 s: on a 2-core host shared with three other
    test processes a restarted worker took 36 to 85 s to drain ~100 to 160 queued requests,
    nothing stuck (once on the simulated engine: 41 s); idle, it drains ~20 a second. A recovery
    that waits on something (the default 60 s lost-message grace, a held slot) still overruns the
    bound."""

    PACE_SLACK = 2

    def __init__(self, application, client, max_tokens: int = 32, burst: int = BURST) -> None:
        self.application = application
        ids = []
        began = time.monotonic()
        for i in range(burst):
            answer = client.submit(prompt=f"drain {i}", max_tokens=max_tokens, ignore_eos=True)
            assert answer.status_code == 202, answer.get_json()
            ids.append(answer.get_json()["id"])
        settle(application, ids, 120, poll_s=0.1)
        self.per_s = burst / (time.monotonic() - began)
        self.open_at_fault = self.seen_at_fault = 0

    def fault(self, load: Load) -> None:
        """At the fault's end: how many accepted requests are still to run."""
        accepted = list(load.accepted)
        self.seen_at_fault = len(accepted)
        self.open_at_fault = sum(1 for s in statuses_of(self.application, accepted).values() if s not in TERMINAL)

    def bound_s(self, load: Load) -> float:
        backlog = self.open_at_fault + len(load.accepted) - self.seen_at_fault
        return round(DEATH_BOUND_S + self.PACE_SLACK * backlog / self.per_s, 1)

    def line(self, load: Load) -> dict:
        return {"backlog_at_fault": self.open_at_fault, "arrived_after": len(load.accepted) - self.seen_at_fault,
                "drain_per_s": round(self.per_s, 2)}


class FaultWorker(WorkerProcess):
    """A real worker with the scenarios' lost-message grace (its sweeps use it)."""

    def __init__(self, database_url: str, redis_url: str, tmp: Path, role: str = "all",
                 extra_env: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(database_url, redis_url, tmp, role,
                         {"SLUICE_LOST_MESSAGE_GRACE_S": str(LOST_GRACE_S), **(extra_env or {})}, **kwargs)


class Load:
    """Submits a request every ``every_s`` (on a fixed schedule: a slow submit does not lower the
    rate) from a thread until stopped; keeps every 202's id and why the others were refused.
    ``body`` adds fields to every request (a deadline, a model)."""

    def __init__(self, client, every_s: float = 0.05, max_tokens: int = 200, body: dict | None = None,
                 prefix: str = "ledger") -> None:
        self.client, self.every_s, self.max_tokens = client, every_s, max_tokens
        self.body, self.prefix = body or {}, prefix
        self.accepted: list[str] = []
        self.refused: dict[int, int] = {}
        self.reasons: dict[str, int] = {}  # "<status> <reason> <estimated_from>" of each refusal
        self.without_retry_after = 0  # 429s and 503s that did not say when to come back
        self.refusal_ms: list[float] = []  # how long each refusal took to answer
        self.sent = 0
        self._began = self._ended = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._began = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        self._ended = time.monotonic()

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(max(0.0, self._began + (n + 1) * self.every_s - time.monotonic())):
            n += 1
            sent = time.perf_counter()
            response = self.client.submit(prompt=f"{self.prefix} {n} {uuid.uuid4().hex[:6]}",
                                          max_tokens=self.max_tokens, ignore_eos=True, **self.body)
            self.sent += 1
            if response.status_code == 202:
                self.accepted.append(response.get_json()["id"])
                continue
            self.refusal_ms.append((time.perf_counter() - sent) * 1000)
            self.refused[response.status_code] = self.refused.get(response.status_code, 0) + 1
            details = (response.get_json() or {}).get("error", {}).get("details") or {}
            why = " ".join(str(x) for x in (response.status_code, details.get("reason"), details.get("estimated_from"))
                           if x)
            self.reasons[why] = self.reasons.get(why, 0) + 1
            if response.status_code in (429, 503) and "Retry-After" not in response.headers:
                self.without_retry_after += 1

    def until_refused(self, at_least_s: float, at_most_s: float = 90,
                      also: Callable[[], bool] = lambda: True) -> None:
        """Keep the load going for ``at_least_s``, then until something was refused and ``also``
        holds (at most ``at_most_s`` in all). A burst's rate is set from the drain the monitor
        states, but how long its queue takes to pass the promise depends on the rate this thread
        really reaches: on a loaded machine each submit is slower, and a fixed 10 s could end
        before the queue made any refusal due."""
        began = time.monotonic()
        self._stop.wait(at_least_s)
        while not (self.refused and also()) and time.monotonic() - began < at_most_s:
            self._stop.wait(0.2)

    @property
    def rate(self) -> float:
        """Requests sent per second (the schedule's, until the load has ended)."""
        if not self._ended:
            return 1 / self.every_s
        return self.sent / max(1e-9, self._ended - self._began)


class Keeper:
    """A process manager for one worker: ``tick`` starts a new one when the last has exited."""

    def __init__(self, start) -> None:
        self.start = start
        self._all = [start()]
        self._first = 0  # where the current test's workers begin (``begin``)

    def begin(self) -> None:
        """Count from here: the live worker is ``workers[0]``, no restarts yet. Workers of earlier
        tests stay in the keeper (``stop`` stops them) but leave ``workers`` and ``logs``."""
        self._first = len(self._all) - 1

    @property
    def workers(self) -> list:
        return self._all[self._first:]

    @property
    def restarts(self) -> int:
        return len(self.workers) - 1

    @property
    def logs(self) -> list[Path]:
        return [w.log_path for w in self.workers]

    def tick(self) -> None:
        if self._all[-1].proc.poll() is not None:
            self._all.append(self.start())

    def stop(self) -> None:
        for worker in self._all:
            worker.stop()


def settle(application, ids: list[str], timeout_s: float, tick=lambda: None, poll_s: float = 0.5) -> float:
    """Seconds until every id is terminal; fails with the stragglers' statuses after ``timeout_s``.
    ``tick`` runs on every poll (a process manager's round), every ``poll_s``."""
    began = time.monotonic()
    while True:
        tick()
        statuses = statuses_of(application, ids)
        open_ = {i: s for i, s in statuses.items() if s not in TERMINAL}
        if not open_ and len(statuses) == len(ids):
            return time.monotonic() - began
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"{len(open_)} of {len(ids)} not terminal after {timeout_s}s: "
                                 f"{sorted(set(open_.values()))}; missing rows: {len(ids) - len(statuses)}")
        time.sleep(poll_s)


def statuses_of(application, ids: list[str]) -> dict[str, str]:
    with services(application).db.session() as session:
        rows = session.execute(select(InferenceRequest.id, InferenceRequest.status).where(
            InferenceRequest.id.in_([uuid.UUID(i) for i in ids]))).all()
    return {str(r.id): r.status.value for r in rows}


def engine_runs(logs: list[Path]) -> dict[str, int]:
    """Per request id, how many engine runs reached an outcome write (``succeeded`` lines)."""
    runs: dict[str, int] = {}
    pattern = re.compile(r"req=([0-9a-f-]{36}): succeeded")
    for log in logs:
        for match in pattern.finditer(log.read_text(errors="replace")):
            runs[match.group(1)] = runs.get(match.group(1), 0) + 1
    return runs


def check_ledger(application, client, load: Load, logs: list[Path], scenario: str, fault_at: float,
                 bound_s: float, keeper: Keeper | None = None, **extra) -> dict:
    """Wait for the platform to be back to normal after the fault ended at ``fault_at`` (every
    accepted request terminal, their queues empty, the published level 0 where a monitor runs),
    write the ledger line with the measured recovery beside ``bound_s``, and check it: nothing lost
    or run twice, no slot left held, recovered within the bound. ``extra`` goes into the line."""
    recovered = recover(application, load.accepted, fault_at, bound_s + 60, keeper.tick if keeper else lambda: None)
    restarts = keeper.restarts if keeper else 0
    logs = [*logs, *(keeper.logs if keeper else [])]
    statuses = statuses_of(application, load.accepted)
    runs = engine_runs(logs)
    duplicated = sorted(i for i in load.accepted if runs.get(i, 0) > 1)
    lost = sorted(i for i in load.accepted if statuses.get(i) not in TERMINAL)
    succeeded = sum(1 for s in statuses.values() if s == "succeeded")
    tenant = _tenant_of(application, client)
    slots = services(application).redis.zcard(inflight_key(str(tenant)))
    line = {"scenario": scenario, "load_per_s": round(load.rate, 1), "accepted": len(load.accepted),
            "refused": sum(load.refused.values()), "succeeded": succeeded,
            "other_terminal": len(load.accepted) - succeeded - len(lost), "lost": len(lost),
            "duplicated": len(duplicated), "slots_left": slots, "worker_restarts": restarts, **extra,
            "recovery_bound_s": bound_s, "recovered_s": round(recovered, 1)}
    ledger(line)
    assert load.accepted, "nothing was accepted: the scenario tested nothing"
    assert not lost and not duplicated, line
    assert slots == 0, line
    assert recovered <= bound_s, f"recovered in {recovered:.1f}s, past its bound of {bound_s}s: {line}"
    return line


def ledger(line: dict) -> None:
    """Print the scenario's ledger line, and append it to $SLUICE_FAULT_REPORT when that is set."""
    print(json.dumps(line))
    if os.environ.get("SLUICE_FAULT_REPORT"):
        with open(os.environ["SLUICE_FAULT_REPORT"], "a") as fh:
            fh.write(json.dumps(line) + "\n")


def recover(application, ids: list[str], fault_at: float, timeout_s: float, tick=lambda: None) -> float:
    """Seconds from ``fault_at`` until the platform is back to normal: every id terminal, the
    queues they went through empty, and the level the monitor publishes (while one runs) 0.
    Fails with what is still off after ``timeout_s``."""
    settle(application, ids, timeout_s, tick)
    svc = services(application)
    with svc.db.session() as session:
        queues = set(session.scalars(select(InferenceRequest.queue).distinct().where(
            InferenceRequest.id.in_([uuid.UUID(i) for i in ids]))))
    while True:
        tick()
        waiting = {q: queue_length(svc.redis, q) for q in queues if q}
        level = svc.redis.hget(LOAD_LEVEL_KEY, "level")
        if not any(waiting.values()) and int(level or 0) == 0:
            return time.monotonic() - fault_at
        if time.monotonic() - fault_at > timeout_s:
            raise AssertionError(f"not back to normal {timeout_s}s after the fault: queues {waiting}, level {level}")
        time.sleep(0.25)


def _tenant_of(application, client) -> uuid.UUID:
    from models import ApiKey, hash_key

    with services(application).db.session() as session:
        return session.scalar(select(ApiKey.tenant_id).where(ApiKey.key_hash == hash_key(client.key)))


@pytest.fixture
def platform(database_url, redis_dbs, new_client, tmp_path):
    """An app, its client and a beat on a Redis database of their own; workers are the test's."""
    from web import create_app

    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url))
    client = new_client(application)
    beat = BeatProcess(database_url, redis_url, tmp_path, interval_s=1.0)
    yield application, client, redis_url
    beat.stop()
    services(application).db.dispose()
    redis_dbs.release(redis_url)


def three_workers_then_a_fourth(start, end, at_fault=lambda: None) -> tuple[list[Path], WorkerProcess, float]:
    """Start a worker, let it run 3 s, ``end`` it; three times. Then the survivor: the logs of
    all four, the survivor, and when the fault ended: the survivor serving (``at_fault`` is
    called then). Its boot (imports and engine warm-up, 3 to 10 s with the load on 2 cores) is the
    host's and the process manager's, not a recovery Sluice makes, so the bound does not count
    it."""
    logs: list[Path] = []
    for _ in range(3):
        worker = start()
        logs.append(worker.log_path)
        time.sleep(3.0)
        end(worker)
    final = start()
    fault_at = time.monotonic()
    at_fault()
    logs.append(final.log_path)
    time.sleep(2.0)
    return logs, final, fault_at


def test_workers_sigkilled_mid_batch_three_times(platform, database_url, tmp_path):
    application, client, redis_url = platform
    measuring = FaultWorker(database_url, redis_url, tmp_path)
    try:
        # The load's size, and a batch as full as the simulated engine's under that load.
        backlog = Backlog(application, client, max_tokens=200, burst=48)
    finally:
        measuring.stop()
    with Load(client, every_s=0.05) as load:
        logs, final, fault_at = three_workers_then_a_fourth(
            lambda: FaultWorker(database_url, redis_url, tmp_path), WorkerProcess.kill,
            at_fault=lambda: backlog.fault(load))
    try:
        check_ledger(application, client, load, logs, "worker SIGKILL x3", fault_at,
                     bound_s=backlog.bound_s(load), **backlog.line(load))
    finally:
        final.stop()


def test_graceful_worker_restarts_during_long_requests(platform, database_url, tmp_path):
    """Scenario 7: SIGTERM with a stop grace shorter than the requests; nothing fails or runs twice."""
    application, client, redis_url = platform
    slow = {"SLUICE_SIM_SPEED": "0.2", "SLUICE_WORKER_STOP_GRACE_S": "1"}
    with Load(client, every_s=0.1, max_tokens=300) as load:
        # stop(): SIGTERM, then it waits for the exit.
        logs, final, fault_at = three_workers_then_a_fourth(
            lambda: FaultWorker(database_url, redis_url, tmp_path, extra_env=slow), WorkerProcess.stop)
    try:
        # The three stops requeued what they could not finish: the last worker, at a fifth of the
        # speed, works through that backlog (~45 s on 2 cores).
        check_ledger(application, client, load, logs, "graceful restart (SIGTERM) x3", fault_at, bound_s=90)
        with services(application).db.session() as session:
            failed = session.scalars(select(InferenceRequest.error_code).where(
                InferenceRequest.id.in_([uuid.UUID(i) for i in load.accepted]),
                InferenceRequest.status != "succeeded")).all()
        assert not failed, failed
    finally:
        final.stop()


@pytest.fixture
def own_redis(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        server = start_redis(tmp_path / "redis-data")
    holder = {"server": server}
    yield holder
    holder["server"].stop()


def _restart(server: EmbeddedRedis, keep_data: bool) -> EmbeddedRedis:
    server.stop()
    if not keep_data:  # what a restart without persistence, or a failover to an empty replica, leaves
        for path in server.log_path.parent.iterdir():
            if path.name.startswith(("appendonly", "dump")):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    return restart_redis(server)


@pytest.mark.parametrize("keep_data", [True, False], ids=["data-kept", "data-lost"])
def test_redis_restarted_under_load(own_redis, keep_data, database_url, new_client, tmp_path):
    from web import create_app

    redis_url = own_redis["server"].url
    application = create_app(make_settings(database_url, redis_url, publish_grace_s=1))
    client = new_client(application)
    beat = BeatProcess(database_url, redis_url, tmp_path, interval_s=1.0)
    # Celery's worker may give up on a broker restart (kombu's Redis transport dies with
    # "Unrecoverable error"); a process manager (`sluice up`, compose) restarts it, and so does this.
    keeper = Keeper(lambda: FaultWorker(database_url, redis_url, tmp_path, extra_env={"SLUICE_SIM_SPEED": "0.2"}))
    try:
        with Load(client, every_s=0.05) as load:
            time.sleep(3.0)
            own_redis["server"] = _restart(own_redis["server"], keep_data)
            fault_at = time.monotonic()
            for _ in range(6):
                keeper.tick()
                time.sleep(0.5)
        scenario = f"Redis restart, data {'kept' if keep_data else 'lost'}"
        check_ledger(application, client, load, [], scenario, fault_at, bound_s=60, keeper=keeper)
    finally:
        keeper.stop()
        beat.stop()
        services(application).db.dispose()


def test_duplicate_deliveries_run_once(platform, database_url, tmp_path):
    """Scenario 6: every accepted request's message published a second time, under load."""
    from core.broker.queues import publish_request

    application, client, redis_url = platform
    svc = services(application)
    worker = FaultWorker(database_url, redis_url, tmp_path)
    try:
        with Load(client, every_s=0.05) as load:
            sent_twice: set[str] = set()
            deadline = time.monotonic() + 6.0
            while time.monotonic() < deadline:
                for request_id in [i for i in load.accepted if i not in sent_twice]:
                    publish_request(svc.broker, uuid.UUID(request_id), "realtime.small")
                    sent_twice.add(request_id)
                time.sleep(0.1)
            fault_at = time.monotonic()
        assert sent_twice
        check_ledger(application, client, load, [worker.log_path], "duplicate delivery of every message", fault_at,
                     bound_s=SLACK_S)
    finally:
        worker.stop()


def test_beat_and_monitor_away_admission_goes_on_and_recovery_resumes(platform, database_url, redis_dbs,
                                                                      new_client, tmp_path):
    """Scenario 5: with beat (and so the sweep) stopped, admission keeps answering (there is no
    load monitor either: a level that stopped being refreshed is ignored, and the promise stands on
    the live workers' own figures, so what it refuses gets 503 with Retry-After); a worker killed
    then leaves its requests running until beat returns, and the sweep requeues them."""
    from web import create_app

    redis_url = redis_dbs()  # no beat on this one until the test starts it
    application = create_app(make_settings(database_url, redis_url))
    client = new_client(application)
    first = FaultWorker(database_url, redis_url, tmp_path, extra_env={"SLUICE_SIM_SPEED": "0.2"})
    second = beat = None
    try:
        with Load(client, every_s=0.05) as load:
            time.sleep(3.0)
            first.kill()
            second = FaultWorker(database_url, redis_url, tmp_path)
            time.sleep(3.0)
        assert load.accepted and set(load.refused) <= {503} and not load.without_retry_after, load.refused
        dead_worker = first.worker_key.split(":", 2)[2]
        with services(application).db.session() as session:
            stranded = [str(i) for i in session.scalars(select(InferenceRequest.id).where(
                InferenceRequest.worker == dead_worker, InferenceRequest.status == "running"))]
        assert stranded, "the kill left nothing running: nothing to recover"
        time.sleep(5.0)  # far past the dead worker's heartbeat: only the sweep can requeue them
        assert all(s == "running" for s in statuses_of(application, stranded).values())
        beat = BeatProcess(database_url, redis_url, tmp_path, interval_s=1.0)
        fault_at = time.monotonic()
        check_ledger(application, client, load, [first.log_path, second.log_path],
                     "beat and monitor stopped, then back", fault_at, bound_s=DEATH_BOUND_S)
    finally:
        for proc in (second, beat):
            if proc is not None:
                proc.stop()
        services(application).db.dispose()
        redis_dbs.release(redis_url)


def test_postgres_restarted_under_load(redis_dbs, tmp_path):
    """Scenario 3: Postgres stops for a few seconds under load. Submits meanwhile get 503 with
    Retry-After; results computed meanwhile are written when it returns (or recomputed once)."""
    from conftest import ApiClient

    from launcher.database import create_key, upgrade_database
    from launcher.embedded import start_postgres
    from web import create_app

    postgres = start_postgres(tmp_path / "pg")
    redis_url = redis_dbs()
    worker = beat = None
    try:
        url = Settings(database_url=postgres.url).sqlalchemy_url
        upgrade_database(url)
        application = create_app(make_settings(postgres.url, redis_url))
        client = ApiClient(application, create_key(url, "fault-postgres"))
        worker = FaultWorker(postgres.url, redis_url, tmp_path, extra_env={"SLUICE_SIM_SPEED": "0.2"})
        beat = BeatProcess(postgres.url, redis_url, tmp_path, interval_s=1.0)
        with Load(client, every_s=0.05) as load:
            time.sleep(3.0)
            postgres.stop()
            time.sleep(4.0)
            postgres = start_postgres(tmp_path / "pg")
            fault_at = time.monotonic()
            time.sleep(3.0)
        assert load.refused.get(503), f"no 503 while Postgres was down: {load.refused}"
        assert set(load.refused) <= {503} and load.without_retry_after == 0, load.refused
        check_ledger(application, client, load, [worker.log_path], "Postgres restarted (4 s down)", fault_at,
                     bound_s=45)
        services(application).db.dispose()
    finally:
        for proc in (worker, beat):
            if proc is not None:
                proc.stop()
        postgres.stop()
        redis_dbs.release(redis_url)


# The engine's three ways of hanging, each injected 5 s after the first worker's engine started.
HANGS = {
    "wedged": ({"SLUICE_SIM_WEDGE_AFTER_S": "5"}, "its event loop blocks (a GPU call that never returns)"),
    "stalled": ({"SLUICE_SIM_STALL_AFTER_S": "5"}, "its loop answers but it takes no step"),
    "dead": ({"SLUICE_SIM_DIE_AFTER_S": "5"}, "it dies and says so (EngineDead)"),
}


@pytest.mark.parametrize("hang", list(HANGS))
def test_hung_request_and_hung_engine(platform, database_url, tmp_path, hang):
    """Scenario 4 and the design's hang scenario: a request that would run far past its time limit
    is aborted and ends ``timed_out``, freeing its slot; then the engine hangs in one of three
    ways, and each makes the worker exit (status 70: the watchdog, or EngineDead); once a
    process manager restarts it the sweep requeues what it was running, and it runs once."""
    application, client, redis_url = platform
    fault, how = HANGS[hang]
    starts = iter([{**fault, "SLUICE_WORKER_WATCHDOG_S": "3"}])
    keeper = Keeper(lambda: FaultWorker(database_url, redis_url, tmp_path, extra_env=next(starts, {})))
    try:
        hung = client.submit(prompt="runs far past its limit", max_tokens=4000, ignore_eos=True,
                             time_limit_s=1).get_json()["id"]
        with Load(client, every_s=0.05) as load:
            load.accepted.append(hung)
            # The fault comes 5 s after the engine started and the watchdog takes 3 s or more to
            # see it, after a worker start that takes seconds more on a loaded host: wait for the
            # exit itself (a fixed 10 s once ran out before it in a spread run).
            deadline = time.monotonic() + 90
            while keeper.restarts < 1 and time.monotonic() < deadline:
                keeper.tick()
                time.sleep(0.5)
            fault_at = time.monotonic()
        assert keeper.restarts >= 1, f"the {hang} worker did not exit"
        assert keeper.workers[0].proc.returncode == 70
        check_ledger(application, client, load, [], f"hung request + {hang} engine ({how})", fault_at,
                     bound_s=DEATH_BOUND_S, keeper=keeper)
        view = client.get(hung).get_json()
        # Aborted at its 1 s limit, long before the engine hung: it never runs again.
        assert view["status"] == "timed_out", view
        assert view["error"]["code"] == "time_limit_exceeded", view
    finally:
        keeper.stop()


def test_a_request_that_stalls_its_worker_is_failed_not_run_into_the_next(platform, database_url, tmp_path):
    """A request whose own code holds its worker's event loop (SLUICE_FAULT_POISON_PROMPT, as a
    schema that asked for an unbounded answer did) kills that worker by its watchdog, and only
    that one: the watchdog names it, the sweep fails it as ``stalled_worker`` instead of
    requeueing it, the restarted worker never sees it, and what ran beside it is requeued and runs
    once. Requeued, it would have killed every worker in turn (a crash loop)."""
    application, client, _ = platform
    env = {"SLUICE_FAULT_POISON_PROMPT": "poison pill", "SLUICE_WORKER_WATCHDOG_S": "3"}
    keeper = Keeper(lambda: FaultWorker(database_url, redis_url_of(application), tmp_path, extra_env=env))
    try:
        with Load(client, every_s=0.1, max_tokens=50) as load:
            for _ in range(4):
                keeper.tick()
                time.sleep(0.5)
            poison = client.submit(prompt="a poison pill", max_tokens=8).get_json()["id"]
            load.accepted.append(poison)
            for _ in range(60):  # the watchdog's 3 s, the exit, and a restart
                keeper.tick()
                if keeper.restarts:
                    break
                time.sleep(0.5)
            fault_at = time.monotonic()
            time.sleep(3)  # load on the restarted worker
        check_ledger(application, client, load, [], "a request that stalls its worker's loop", fault_at,
                     bound_s=DEATH_BOUND_S, keeper=keeper)
        view = client.get(poison).get_json()
        assert view["status"] == "failed" and view["error"]["code"] == "stalled_worker", view
        assert keeper.restarts == 1, "the restarted worker never ran the request that stalled the first"
        assert keeper.workers[0].proc.returncode == 70
        assert f"inside request {poison}" in keeper.workers[0].log_path.read_text()
    finally:
        keeper.stop()


def redis_url_of(application) -> str:
    return services(application).settings.redis_url
