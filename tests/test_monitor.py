"""The load monitor: queue counters, drain, waits and levels, against real workers and Redis."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from conftest import ApiClient, WorkerProcess, make_settings
from sqlalchemy import func, select

from core.admission.load import (
    SNAPSHOT_PREFIX,
    ClassLoad,
    LoadLevel,
    capacity_entry,
    counters_key,
    decode_drain,
    write_level,
)
from core.rediskeys import LOAD_LEVEL_KEY
from launcher.harness import stop_all
from models import InferenceRequest, Priority, Status
from web.services import services
from workers.monitor import Engines, LevelPolicy, Monitor, engines, with_realtime_share


def test_levels_rise_at_once_and_fall_one_step_per_calm_hold():
    policy = LevelPolicy(up=(0.25, 0.5, 0.75, 1.0, 1.5), down_factor=0.5, hold_s=10)
    assert policy.step(0.1, now=0) == 0
    assert policy.step(0.8, now=1) == 3  # straight to the level the ratio calls for
    assert policy.step(2.0, now=2) == 5
    assert policy.step(0.9, now=3) == 5, "below level 5's threshold, but not below 0.5 × it"
    assert policy.step(0.3, now=4) == 5  # calm from here (0.3 < 0.5 × 1.5) ...
    assert policy.step(0.3, now=13) == 5  # ... but not for 10 s yet
    assert policy.step(0.3, now=14) == 4  # one step down
    assert policy.step(0.3, now=15) == 4, "the next step waits a full hold again"
    assert policy.step(0.3, now=24) == 3
    assert policy.step(1.2, now=25) == 4, "a new rise is immediate"


@pytest.fixture
def slow_stack(database_url, scratch_redis_url, new_client, tmp_path):
    """An app and its own Redis database, whose realtime deadline is 5 s; workers started on demand
    run the simulated engine at a fifth of H200 speed with two threads each."""
    from web import create_app

    application = create_app(make_settings(database_url, scratch_redis_url, realtime_deadline_s=5.0))
    workers: list[WorkerProcess] = []

    def start_worker() -> WorkerProcess:
        worker = WorkerProcess(database_url, scratch_redis_url, tmp_path, concurrency=2,
                               extra_env={"SLUICE_SIM_SPEED": "0.2", "SLUICE_REALTIME_DEADLINE_S": "5"})
        workers.append(worker)
        return worker

    yield application, new_client(application), start_worker
    stop_all(workers)
    services(application).db.dispose()


def submit_many(client: ApiClient, n: int, max_tokens: int = 50) -> list[str]:
    def one(i: int) -> str:
        response = ApiClient(client.http.application, client.key).submit(
            prompt=f"question {i}", max_tokens=max_tokens, ignore_eos=True, deadline_s=600)
        assert response.status_code == 202, response.get_json()
        return response.get_json()["id"]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def realtime(loads: list[ClassLoad]) -> ClassLoad:
    return next(load for load in loads if load.priority == "realtime")


def test_counters_follow_each_request_through_the_lifecycle(slow_stack):
    application, client, _ = slow_stack
    redis = services(application).redis
    model = services(application).settings.registry.default.name
    key = counters_key(Priority.REALTIME, model)
    ids = submit_many(client, 3, max_tokens=20)
    counters = redis.hgetall(key)
    reserved = sum(client.get(i).get_json()["usage"]["reserved_tokens"] for i in ids)
    assert int(counters["queued_requests"]) == 3 and int(counters["queued_tokens"]) == reserved
    assert int(counters["queued_work"]) == 3 * 20  # their max_tokens
    client.cancel(ids[0])
    assert int(redis.hget(key, "queued_requests")) == 2
    # The monitor's recount sets the counters to what Postgres holds queued (the test database
    # also holds other tests' queued rows, so compare with a count of its own). A twin parked on
    # a request in flight is queued but never published, so it is no queued work: not counted.
    redis.hset(key, mapping={"queued_requests": 99, "queued_tokens": 99999})
    Monitor(services(application).settings, redis, services(application).db).recount()
    with services(application).db.session() as session:
        queued = session.execute(select(func.count(), func.sum(InferenceRequest.reserved_tokens)).where(
            InferenceRequest.status == Status.QUEUED, InferenceRequest.priority == Priority.REALTIME,
            InferenceRequest.model_routed.is_(None), InferenceRequest.model_requested == model,
            InferenceRequest.follows_id.is_(None))).one()
    assert (int(redis.hget(key, "queued_requests")), int(redis.hget(key, "queued_tokens"))) == tuple(queued)


def test_past_capacity_the_wait_and_level_rise_then_fall_with_hysteresis(slow_stack):
    application, client, start_worker = slow_stack
    svc = services(application)
    start_worker()
    monitor = Monitor(svc.settings, svc.redis, svc.db, policy=LevelPolicy(hold_s=1.0))
    ids = submit_many(client, 40)
    seen: list[ClassLoad] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        load = realtime(monitor.tick())
        seen.append(load)
        if load.queued_requests == 0 and load.level == 0 and len(seen) > 5:
            break
        time.sleep(0.5)
    peak = max(seen, key=lambda load: load.level)
    # ~2 sequences × ~46 tokens/s each drain ~90 tokens of work per second: 40 × 50 tokens wait
    # ~20 s, four times the 5 s realtime deadline, so the top level; the estimate is in range.
    assert peak.level == LoadLevel.SHED, [(s.queued_tokens, s.wait_s, s.level) for s in seen]
    measured = [s for s in seen if s.drain_tps > 0]
    assert measured and 20 < measured[0].drain_tps < 400, measured[0]
    assert all(s.seq_tps > 0 for s in measured[1:])
    levels = [s.level for s in seen[seen.index(peak):]]
    assert levels[-1] == 0 and levels == sorted(levels, reverse=True), levels
    assert len(set(levels)) > 2, "the level steps down, not straight to normal"
    assert int(svc.redis.hget(LOAD_LEVEL_KEY, "level")) == 0
    assert all(client.wait(i)["status"] == "succeeded" for i in ids)


def contribution(worker: WorkerProcess) -> float:
    """What one governed worker adds to its class's drain: what its limit decodes a second, its
    prompts' prefill priced apart."""
    return worker.stats().get("decode_tps", 0.0)


def steady_tick(monitor: Monitor, workers: list[WorkerProcess]) -> tuple[ClassLoad, float]:
    """A tick during which no worker's heartbeat changed what it contributes (limits adapt while
    the queue is backlogged), with the sum of those contributions."""
    for _ in range(50):
        before = [contribution(w) for w in workers]
        load = realtime(monitor.tick())
        if all(before) and [contribution(w) for w in workers] == before:
            return load, sum(before)
        time.sleep(0.2)
    raise AssertionError("the workers' heartbeats never held still across a tick")


def test_a_killed_workers_capacity_leaves_the_estimate_at_the_next_tick(slow_stack):
    application, client, start_worker = slow_stack
    svc = services(application)
    first, second = start_worker(), start_worker()
    monitor = Monitor(svc.settings, svc.redis, svc.db)
    submit_many(client, 60)
    # Not a ratio of two ticks: each worker's limit adapts while the queue is backlogged, so the
    # survivor may take more in; the drain is exactly what the live workers' heartbeats say.
    both, expected = steady_tick(monitor, [first, second])
    assert both.workers == 2 and both.drain_tps == pytest.approx(expected, abs=0.15)
    second.kill()
    time.sleep(2.5 * svc.settings.worker_heartbeat_s + 0.2)  # silent for longer than live workers are
    after, expected = steady_tick(monitor, [first])
    assert after.workers == 1
    assert after.drain_tps == pytest.approx(expected, abs=0.15), (both, after)
    # In engine time: the queued output at the decode drain, the queued prompts at their price
    # (linear in their tokens, and in their squares for their attention).
    prefill_s = (after.queued_prompt * after.prefill_s_tok + after.queued_prompt_sq * after.prefill_s_tok2
                 + after.backlog_s) / after.engines
    slot_s = after.slot_wait_s if after.room == 0 else 0.0
    assert after.wait_s == pytest.approx(after.queued_work / after.drain_tps + prefill_s + slot_s, rel=0.01, abs=0.002)
    first.stop()


def test_one_monitor_leads_and_another_takes_over_when_it_stops(app):
    svc = services(app)
    first, second = (Monitor(svc.settings, svc.redis, svc.db) for _ in range(2))
    svc.redis.delete("sluice:monitor:leader")
    assert first.lead() and not second.lead()
    assert first.lead(), "the leader keeps its lease"
    svc.redis.pexpire("sluice:monitor:leader", 1)  # the leader died: its lease runs out
    time.sleep(0.05)
    assert second.lead() and not first.lead()
    svc.redis.delete("sluice:monitor:leader")


def test_the_operator_sees_the_classes_the_monitor_publishes(database_url, redis_url, worker):
    from web import create_app

    application = create_app(make_settings(database_url, redis_url, admin_key="an-admin-key-of-16+"))
    svc = services(application)
    admin = {"Authorization": "Bearer an-admin-key-of-16+"}
    http = application.test_client()
    svc.redis.delete(LOAD_LEVEL_KEY)
    assert http.get("/v1/admin/load", headers=admin).get_json()["level"] is None
    assert http.get("/v1/admin/load").status_code == 401
    Monitor(svc.settings, svc.redis, svc.db).tick()
    view = http.get("/v1/admin/load", headers=admin).get_json()
    assert view["level"] == 0 and view["monitor"] == "running" and view["steps"] == []
    assert {c["priority"] for c in view["classes"]} >= {"realtime"}
    assert all(set(c) >= {"queued_work", "drain_tps", "wait_s", "level", "workers"} for c in view["classes"])
    write_level(svc.redis, LoadLevel.SHORTER_OUTPUT)
    assert http.get("/v1/admin/load", headers=admin).get_json()["steps"] == ["light_model", "shorter_output"]
    # The session's other tests share this Redis: leave them no load figures to act on.
    svc.redis.delete(LOAD_LEVEL_KEY, *svc.redis.scan_iter(match=SNAPSHOT_PREFIX + "*"))
    svc.db.dispose()


def test_a_tiers_share_of_the_engines_counts_its_prompts():
    """What the tier ahead (and a class) claimed is stated as a share of the engines' time: its
    output at the drain and its prompts at the prefill prices, so prompts as long as real ones
    hold what they cost for the default tier, not only what their output does."""
    monitor = Monitor(make_settings("postgresql://unused", "redis://unused"), redis.Redis(), None)  # never called
    engine = Engines(drain_tps=100.0, seq_tps=10.0, room=0, slot_wait_s=0.0, prefill_s_tok=0.001,
                     prefill_s_tok2=1e-7, count=2)

    def tick(t: float, **counters: int):
        return monitor._class_load("realtime", "m", counters, 1, 4, None, t, 0, engine)

    tick(0.0)
    # Over 10 s: 200 output tokens (20/s: 0.2 of the drain) and 10 prompts of 1,000 tokens
    # (10 × (1 s + 0.1 s) of prefill, on two engines: 5.5 s of 10), of the tier ahead.
    load = tick(10.0, claimed_work=300, ahead_claimed_work=200, claimed_prompt=10_000, claimed_prompt_sq=10 ** 7,
                ahead_claimed_prompt=10_000, ahead_claimed_prompt_sq=10 ** 7)
    assert load.ahead_tps == 20.0
    assert load.ahead_share == pytest.approx(0.2 + 0.55)
    assert load.claimed_share == pytest.approx(0.3 + 0.55)
    batch = ClassLoad("batch", "m", 0, 0, 0, 100.0, 10.0, 0.0, 0, 1, 0)
    assert with_realtime_share([load, batch])[1].realtime_share == load.claimed_share


def test_a_batch_class_drains_only_the_seats_batch_work_may_hold(database_url, scratch_redis_url, tmp_path):
    """A worker that serves realtime too keeps threads for it (workers/bootstrap.py BatchSlots):
    its batch class drains what the seats batch work may hold decode, not its whole limit (64
    seats, 48 of them batch's, by default). The heartbeat states those seats; the monitor and the
    capacity entries price the batch class by them, the realtime class by the whole limit."""
    beat = {"limit_seq_tps": 10.0, "decode_tps": 80.0, "engine_limit": 8, "batch_seats": 4.5}
    assert engines([beat], "batch").drain_tps == pytest.approx(45.0)
    assert engines([beat], "realtime").drain_tps == pytest.approx(80.0)
    assert float(capacity_entry(beat, 0, batch=True).split()[1]) == pytest.approx(45.0)
    assert float(capacity_entry(beat, 0).split()[1]) == pytest.approx(80.0)
    assert decode_drain({**beat, "batch_seats": 20}, batch=True) == pytest.approx(80.0), "never past the limit"

    from web import create_app

    application = create_app(make_settings(database_url, scratch_redis_url))
    svc = services(application)
    model = svc.settings.registry.default.name
    # Eight threads: two kept for realtime, six for batch.
    worker = WorkerProcess(database_url, scratch_redis_url, tmp_path, concurrency=8)
    try:
        beat = worker.wait_stats(lambda s: "batch_seats" in s and s.get("limit_seq_tps"))
        assert beat["batch_seats"] == 6 and beat["engine_limit"] == 8, beat
        loads = {load.priority: load for load in Monitor(svc.settings, svc.redis, svc.db).tick()
                 if load.model == model}
        assert loads["batch"].drain_tps == pytest.approx(loads["realtime"].drain_tps * 6 / 8, rel=0.05)
    finally:
        worker.stop()
        svc.db.dispose()


def test_a_jobs_estimate_reads_the_busy_drain_of_a_backlog_that_lasted():
    """The drain a class was measured to take while busy (``busy_tps``: what a bulk job's estimate
    reads) comes from BUSY_MIN_S of backlog or more, counted from FILL_S after each began and
    faded over BUSY_TAU_S: a 2 s one in which threads held long documents and few were claimed
    moves the drain the promise uses, not the estimate, and the burst that fills the engines' free
    slots as a backlog begins is no drain."""
    monitor = Monitor(make_settings("postgresql://unused", "redis://unused"), redis.Redis(), None)  # never called

    def tick(t: float, claimed: int, queued: int = 50):
        return monitor._class_load("batch", "m", {"claimed_work": claimed, "queued_work": queued}, 1, 4, None, t, 0)

    tick(-1.0, 0, queued=0)  # idle: the backlog below is seen to begin
    claimed = 0
    for t in range(0, 9):  # 8 s of backlog at 100 tokens a second, after 1,000 claimed in its first second
        load = tick(float(t), claimed)
        claimed += 1100 if t == 0 else 100
    assert load.busy_tps == pytest.approx(100.0), "the fill is not counted"
    assert load.drain_tps > 200, "the promise's drain counts it (a backlog just begun is measured at once)"
    tick(9.0, claimed, queued=0)  # the queue ran dry: a new backlog begins
    for t in range(10, 13):  # 2 s in which 10 tokens a second were claimed
        load = tick(float(t), claimed)
        claimed += 10
    assert load.drain_tps == pytest.approx(10.0), "the drain follows the latest backlog"
    assert load.busy_tps == pytest.approx(100.0), "the estimate keeps the one that lasted"
    for t in range(13, 18):  # it goes on at 10 tokens a second: the busy drain fades toward it
        load = tick(float(t), claimed)
        claimed += 10
    assert 10.0 < load.busy_tps < 100.0
    for t in range(18, 200):
        load = tick(float(t), claimed)
        claimed += 10
    assert load.busy_tps == pytest.approx(10.0, rel=0.01)
