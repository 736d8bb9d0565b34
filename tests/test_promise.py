"""The promise at arrival: a request its class's queue cannot finish by its deadline is refused
at once with a computed Retry-After; one that can is told its estimated wait."""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager

import pytest
from sqlalchemy import event, func, update
from test_api_errors import assert_envelope as envelope

from core.admission.load import ClassLoad, LoadLevel, capacity_key, counters_key, room_key, write_level
from core.errors import ApiError
from core.rediskeys import LOAD_LEVEL_KEY
from core.submit.schemas import SubmitRequestSchema
from models import ApiKey, Priority
from models.tenant import hash_key, tenant_for_key
from web.services import services

pytestmark = pytest.mark.usefixtures("worker")


def publish(app, *, queued_work: int, drain_tps: float, seq_tps: float, priority: str = "realtime",
            room: int = -1, slot_wait_s: float = 0.0) -> None:
    """What the load monitor would publish for the default model's class, and its live counter."""
    svc = services(app)
    model = svc.settings.registry.default.name
    seconds, micros = svc.redis.time()
    ClassLoad(priority, model, queued_work, 1, queued_work, drain_tps, seq_tps, queued_work / drain_tps, 0, 1,
              seconds * 1000 + micros // 1000, room=room, slot_wait_s=slot_wait_s).write(svc.redis, ttl_s=30)
    svc.redis.hset(counters_key(priority, model), "queued_work", queued_work)


def test_a_request_that_cannot_finish_in_time_is_refused_at_once(promising):
    application, client = promising
    # 5,000 tokens of work ahead drain in 50 s at 100 tokens/s: past the 30 s realtime deadline.
    publish(application, queued_work=5000, drain_tps=100, seq_tps=50)
    began = time.perf_counter()
    response = client.submit(prompt="late", max_tokens=100)
    elapsed = time.perf_counter() - began
    error = envelope(response, 503, "overloaded")
    assert error["details"] == {"gate": "global", "reason": "deadline", "load_level": 0, "estimated_wait_s": 50.0,
                                "estimated_from": "monitor", "estimated_run_s": 2.0}
    # Retry when the queue has drained by the excess: 50 s wait + 2 s of its own − 30 s.
    assert int(response.headers["Retry-After"]) == math.ceil(50 + 100 / 50 - 30) == 22
    standard = services(application).settings.tiers["standard"]
    assert response.headers["x-ratelimit-remaining-requests"] == str(standard.requests_per_minute), "charged nothing"
    assert elapsed < 1.0  # refused in milliseconds (timing goals live in bench/; this only catches a hang)


def test_the_deadline_counts_from_planning_and_the_retry_after_from_a_whole_one(promising):
    """Time the web tier spent on a submit since planning it comes out of its deadline: the
    promise judges the rest and the row keeps the rest; a retry brings a whole deadline again."""
    application, client = promising
    svc = services(application)
    with svc.db.session() as session:
        tenant = tenant_for_key(session, client.key)
    body = SubmitRequestSchema().load({"prompt": "spent", "max_tokens": 100, "deadline_s": 30})
    # 1,000 tokens ahead at 100/s and its own 2 s: 12 s of 30, but 25 of them went by since planning.
    publish(application, queued_work=1000, drain_tps=100, seq_tps=50)
    late = dataclasses.replace(svc.requests.prepare(tenant, body), received=time.monotonic() - 25)
    with pytest.raises(ApiError) as refused:
        svc.requests.submit(tenant, body, None, late)
    assert refused.value.status == 503 and refused.value.code == "overloaded"
    assert refused.value.headers["Retry-After"] == "1", "12 s fit a whole deadline: retry at once"
    # 10 s went by: 12 s fit the 20 left, and the row's deadline is 20 s after its creation.
    early = dataclasses.replace(svc.requests.prepare(tenant, body), received=time.monotonic() - 10)
    row = svc.requests.submit(tenant, body, None, early).row
    left = (row.deadline_at - row.created_at).total_seconds()
    assert 19.0 < left <= 20.0, left

def test_a_longer_deadline_or_a_shorter_answer_is_accepted_with_its_wait(promising):
    application, client = promising
    publish(application, queued_work=5000, drain_tps=100, seq_tps=50)
    accepted = client.submit(prompt="patient", max_tokens=100, deadline_s=60)
    assert accepted.status_code == 202, accepted.get_json()
    assert accepted.get_json()["estimated_wait_s"] == 50.0
    assert float(accepted.headers["Sluice-Estimated-Wait"]) == 50.0
    publish(application, queued_work=500, drain_tps=100, seq_tps=50)
    quick = client.submit(prompt="quick", max_tokens=100)
    assert quick.status_code == 202 and quick.get_json()["estimated_wait_s"] == 5.0


def test_a_202_says_when_its_answer_is_due(promising):
    """A client that polls learns when to come back: its queue wait plus its own output."""
    application, client = promising
    # 500 tokens ahead at 100/s, then its 100 at 40/s: due 7.5 s after admission.
    publish(application, queued_work=500, drain_tps=100, seq_tps=40)
    accepted = client.submit(prompt="when", max_tokens=100)
    assert accepted.status_code == 202, accepted.get_json()
    due_ms = int(accepted.headers["retry-after-ms"])
    assert 7000 < due_ms <= 7500, due_ms
    assert accepted.headers["Retry-After"] == str(due_ms // 1000), "whole seconds, never past the prediction"


def test_an_empty_queue_with_room_in_an_engine_refuses_nothing_on_the_deadline_ground(promising):
    application, client = promising
    # Speeds learned under an overload (3.65 tokens/s a sequence) would promise 8000 tokens in
    # 2,192 s: past any deadline. With nothing queued and room in an engine the request starts now.
    publish(application, queued_work=0, drain_tps=100, seq_tps=3.65, room=3)
    assert client.submit(prompt="hello there", max_tokens=8000).status_code == 202
    # The same figures with the engines full: the estimate stands, and refuses.
    publish(application, queued_work=0, drain_tps=100, seq_tps=3.65, room=0, slot_wait_s=2.0)
    refused = client.submit(prompt="hello there", max_tokens=8000)
    assert envelope(refused, 503, "overloaded")["details"]["reason"] == "deadline"


def test_the_engines_live_room_outranks_the_snapshots(promising):
    """Workers write their room whenever a request enters or leaves an engine; the monitor's
    snapshot carries it from heartbeats, seconds old. Admission believes the workers."""
    application, client = promising
    svc = services(application)
    key = room_key("realtime", svc.settings.registry.default.name)
    try:
        # The snapshot (a heartbeat ago) says an engine has room; both engines just filled up.
        publish(application, queued_work=0, drain_tps=100, seq_tps=3.65, room=3, slot_wait_s=2.0)
        svc.redis.hset(key, mapping={"worker-a": 0, "worker-b": 0})
        refused = client.submit(prompt="hello there", max_tokens=8000)
        assert envelope(refused, 503, "overloaded")["details"]["estimated_wait_s"] == 2.0, "a slot's wait"
        # One of them has room again, which the snapshot does not know yet.
        publish(application, queued_work=0, drain_tps=100, seq_tps=3.65, room=0, slot_wait_s=2.0)
        svc.redis.hset(key, "worker-b", 1)
        assert client.submit(prompt="hello there", max_tokens=8000).status_code == 202
    finally:
        svc.redis.delete(key)


def test_full_engines_add_the_wait_for_a_slot_to_the_promise(promising):
    application, client = promising
    # 1,000 tokens queued at 100 tokens/s: 10 s; 100 tokens at 10 tokens/s: 10 s; 20 s < 30 s.
    publish(application, queued_work=1000, drain_tps=100, seq_tps=10, room=0, slot_wait_s=5.0)
    accepted = client.submit(prompt="fits", max_tokens=100)
    assert accepted.status_code == 202 and accepted.get_json()["estimated_wait_s"] == 15.0
    # A slot 15 s away makes it 10 + 15 + 10 = 35 s: past the deadline by 5 s.
    publish(application, queued_work=1000, drain_tps=100, seq_tps=10, room=0, slot_wait_s=15.0)
    refused = client.submit(prompt="does not fit", max_tokens=100)
    assert envelope(refused, 503, "overloaded")["details"]["estimated_wait_s"] == 25.0
    assert int(refused.headers["Retry-After"]) == 5


def test_without_the_monitor_the_live_workers_figures_keep_the_promise(promising):
    """Issue 21, defect 2: with the monitor away (no snapshot) the promise stands on the capacity
    the live workers' heartbeats state; a worker whose heartbeat stopped counts no more; with
    neither, nothing is promised and nothing refused on that ground."""
    application, client = promising
    svc = services(application)
    model = svc.settings.registry.default.name
    accepted = client.submit(prompt="no figures", max_tokens=8000)
    assert accepted.status_code == 202
    assert accepted.get_json()["estimated_wait_s"] is None and "Sluice-Estimated-Wait" not in accepted.headers
    assert "Retry-After" not in accepted.headers, "no prediction, no hint"

    seconds, micros = svc.redis.time()
    now_ms = seconds * 1000 + micros // 1000
    capacity, room = capacity_key("realtime", model), room_key("realtime", model)
    try:
        # Two engines drain 50 tokens/s each (10 and 12 tokens/s a sequence); both are full.
        svc.redis.hset(capacity, mapping={"w1": f"{now_ms} 50 10 0", "w2": f"{now_ms} 50 12 0"})
        svc.redis.hset(room, mapping={"w1": 0, "w2": 0})
        svc.redis.hset(counters_key("realtime", model), "queued_work", 4000)
        # 4,000 tokens at 100 tokens/s: 40 s, then 100 tokens at the slower sequence's 10 tokens/s.
        refused = client.submit(prompt="a burst with the monitor dead", max_tokens=100)
        details = envelope(refused, 503, "overloaded")["details"]
        assert details == {"gate": "global", "reason": "deadline", "load_level": 0, "estimated_wait_s": 40.0,
                           "estimated_from": "workers", "estimated_run_s": 10.0}
        assert int(refused.headers["Retry-After"]) == 40 + 10 - 30
        # w2 stopped beating a minute ago: only w1's 50 tokens/s are left, the wait doubles.
        svc.redis.hset(capacity, "w2", f"{now_ms - 60_000} 50 12 0")
        refused = client.submit(prompt="fewer workers", max_tokens=100)
        assert envelope(refused, 503, "overloaded")["details"]["estimated_wait_s"] == 80.0
        # 900 tokens queued: 18 s, and 10 s of its own, inside the 30 s deadline.
        svc.redis.hset(counters_key("realtime", model), "queued_work", 900)
        fits = client.submit(prompt="fits", max_tokens=100)
        assert fits.status_code == 202 and fits.get_json()["estimated_wait_s"] == 18.0
        # Nothing queued and room in the live engine: it starts now, whatever its length.
        svc.redis.hset(counters_key("realtime", model), "queued_work", 0)
        svc.redis.hset(room, "w1", 2)
        assert client.submit(prompt="starts now", max_tokens=8000).status_code == 202
    finally:
        svc.redis.delete(capacity, room)


@pytest.fixture
def own_worker(database_url, scratch_redis_url, new_client, tmp_path):
    """An app and a worker on a Redis database of their own: its class's queue is empty, whatever
    other tests left queued on the session's (the promise, on the worker's own figures while no
    monitor runs, would judge a request by that queue)."""
    from conftest import WorkerProcess, make_settings

    from web import create_app

    application = create_app(make_settings(database_url, scratch_redis_url))
    worker = WorkerProcess(database_url, scratch_redis_url, tmp_path)
    yield new_client(application), worker
    worker.stop()
    services(application).db.dispose()


def test_a_running_request_past_its_deadline_is_aborted_as_expired(database_url, scratch_redis_url, new_client,
                                                                   tmp_path):
    """Admitted on what the engine measured (16 tokens fit 1.5 s many times over), then the host
    starves the engine (every step takes 5 s from the moment the request reaches it): the request
    runs into its deadline and is aborted there, its KV freed."""
    from conftest import WorkerProcess, make_settings

    from web import create_app

    env = {"SLUICE_SIM_STARVE_AFTER_S": "0"}
    application = create_app(make_settings(database_url, scratch_redis_url, env))
    worker = WorkerProcess(database_url, scratch_redis_url, tmp_path, extra_env=env)
    try:
        client = new_client(application)
        worker.wait_stats(lambda s: "engine_limit" in s)
        accepted = client.submit(prompt="starved on its way", max_tokens=16, ignore_eos=True, deadline_s=1.5)
        assert accepted.status_code == 202, accepted.get_json()
        view = client.wait(accepted.get_json()["id"], timeout=30)
        assert view["status"] == "expired" and view["error"]["code"] == "deadline_exceeded", view
        assert view["timings"]["started_at"] is not None and view["usage"]["output_tokens"] < 16
        assert worker.wait_stats(lambda s: s["kv_used_tokens"] == 0)["kv_used_tokens"] == 0, "KV not freed"
    finally:
        worker.stop()
        services(application).db.dispose()


def test_a_request_whose_own_length_cannot_fit_is_refused_even_at_an_idle_engine(own_worker):
    """8,000 tokens cannot be decoded in 1.5 s at the speed the idle engine states live: refused at
    once, not admitted to run into its deadline."""
    client, worker = own_worker
    worker.wait_stats(lambda s: "engine_limit" in s)
    refused = client.submit(prompt="too long for its deadline", max_tokens=8000, deadline_s=1.5)
    error = envelope(refused, 503, "overloaded")
    assert error["details"]["reason"] == "deadline" and error["details"]["estimated_run_s"] > 1.5, error
    # No queue to wait out: the refusal says the request alone is too long, and what would fit.
    assert "even with nothing queued" in error["message"], error["message"]
    assert f"at least {math.ceil(error['details']['estimated_run_s'])} s" in error["message"]


def test_a_prompt_is_priced_by_its_length_and_by_its_square(promising):
    """Attention makes a long prompt dearer than its tokens one by one: the engines state a price
    per prompt token and one per token squared, and the promise prices a queued prompt of P
    tokens, and the request's own, at P × the first + P² × the second."""
    application, client = promising
    svc = services(application)
    model = svc.settings.registry.default
    seconds, micros = svc.redis.time()
    # One 1,000-token prompt queued, at 1 ms a token and 1 µs a token squared: 1 s + 1 s ahead.
    ClassLoad("realtime", model.name, 0, 1, 0, 100.0, 50.0, 2.0, 0, 1, seconds * 1000 + micros // 1000, room=0,
              queued_prompt=1000, queued_prompt_sq=1000**2, prefill_s_tok=0.001, prefill_s_tok2=1e-6,
              engines=1).write(svc.redis, ttl_s=30)
    svc.redis.hset(counters_key("realtime", model.name),
                   mapping={"queued_work": 0, "queued_prompt": 1000, "queued_prompt_sq": 1000**2})
    prompt = "a long question about the documents " * 80
    tokens = svc.requests.planner.counters.for_model(model).count({"prompt": prompt})
    refused = client.submit(prompt=prompt, max_tokens=100, deadline_s=2)
    details = envelope(refused, 503, "overloaded")["details"]
    assert details["estimated_wait_s"] == 2.0
    # Its own: its prompt at both prices, then 100 tokens at 50 a second.
    assert details["estimated_run_s"] == pytest.approx(tokens * 0.001 + tokens**2 * 1e-6 + 2.0, abs=0.002)
    assert tokens**2 * 1e-6 > 0.5, "the square's share is there to see"


def test_batch_work_is_promised_against_its_own_queue(promising):
    application, client = promising
    publish(application, queued_work=10**9, drain_tps=1, seq_tps=1, priority=Priority.BATCH.value)
    assert client.submit(prompt="realtime is not behind batch", max_tokens=8).status_code == 202
    error = envelope(client.submit(prompt="batch", max_tokens=8, priority="batch"), 503, "overloaded")
    assert error["details"]["reason"] == "deadline"


@contextmanager
def statements(application):
    """The SQL statements the app's database engine runs inside the block."""
    seen: list[str] = []

    def record(conn, cursor, statement, *args):
        seen.append(statement)

    engine = services(application).db.engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def test_a_known_key_is_refused_without_reading_postgres(promising):
    application, client = promising
    assert client.submit(prompt="authenticates the key", max_tokens=8).status_code == 202
    publish(application, queued_work=5000, drain_tps=100, seq_tps=50)
    with statements(application) as seen:
        envelope(client.submit(prompt="late", max_tokens=100), 503, "overloaded")
    assert seen == [], "the refusal asked Postgres"
    # What passes the gate is authenticated afresh, and an unknown key is never refused early.
    publish(application, queued_work=0, drain_tps=100, seq_tps=50)
    with statements(application) as seen:
        assert client.submit(prompt="in time", max_tokens=8).status_code == 202
    assert any("api_keys" in s for s in seen)
    stranger = application.test_client().post("/v1/requests", json={"prompt": "x"},
                                              headers={"Authorization": "Bearer sk-nobody"})
    envelope(stranger, 401)


def test_a_revoked_key_gets_nothing_accepted_from_the_recent_keys(promising):
    application, client = promising
    assert client.submit(prompt="authenticates the key", max_tokens=8).status_code == 202
    with services(application).db.session() as session:
        session.execute(update(ApiKey).where(ApiKey.key_hash == hash_key(client.key)).values(revoked_at=func.now()))
    envelope(client.submit(prompt="after revocation", max_tokens=8), 401)


def test_an_idempotent_retry_gets_its_original_back_during_an_overload(promising):
    application, client = promising
    headers = {**client.headers, "Idempotency-Key": "retry-in-a-spike"}
    first = client.http.post("/v1/requests", json={"prompt": "q", "max_tokens": 100}, headers=headers)
    assert first.status_code == 202
    publish(application, queued_work=5000, drain_tps=100, seq_tps=50)
    retry = client.http.post("/v1/requests", json={"prompt": "q", "max_tokens": 100}, headers=headers)
    assert retry.status_code == 202 and retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_json()["id"] == first.get_json()["id"]


def test_the_tight_promise_level_keeps_a_margin(promising):
    application, client = promising
    redis = services(application).redis
    # 24 s of queue + 2 s of its own: inside the 30 s deadline, outside 0.6 × 30 = 18 s.
    publish(application, queued_work=2400, drain_tps=100, seq_tps=50)
    write_level(redis, LoadLevel.REJECT_BATCH, ttl_s=30)
    assert client.submit(prompt="fits", max_tokens=100).status_code == 202
    publish(application, queued_work=2400, drain_tps=100, seq_tps=50)  # without the one just accepted
    write_level(redis, LoadLevel.TIGHT_PROMISE, ttl_s=30)
    refused = client.submit(prompt="fits, but not with the margin", max_tokens=100)
    assert envelope(refused, 503, "overloaded")["details"]["reason"] == "deadline"
    assert refused.headers["Retry-After"] == str(math.ceil(26 - 0.6 * 30)) == "8"
    redis.delete(LOAD_LEVEL_KEY)


def test_the_promise_keeps_its_margin(isolated_app, new_client):
    application = isolated_app(realtime_deadline_s=30.0)  # and the shipped SLUICE_PROMISE_FACTOR, 0.8
    client = new_client(application)
    # 23 s of queue + 2 s of its own = 25 s: inside the deadline, but not inside 0.8 × 30 = 24 s.
    publish(application, queued_work=2300, drain_tps=100, seq_tps=50)
    refused = client.submit(prompt="would finish, barely", max_tokens=100)
    assert envelope(refused, 503, "overloaded")["details"]["reason"] == "deadline"
    assert refused.headers["Retry-After"] == "1"
    publish(application, queued_work=2000, drain_tps=100, seq_tps=50)  # 22 s: inside the margin
    assert client.submit(prompt="in time with room to spare", max_tokens=100).status_code == 202


def test_a_waiting_clients_patience_is_its_deadline(promising):
    application, client = promising
    # 500 tokens ahead at 100 tokens/s: 5 s of queue + 2 s of its own = 7 s, inside the 30 s default.
    publish(application, queued_work=500, drain_tps=100, seq_tps=50)
    waiting = {**client.headers, "Prefer": "wait=3"}
    # A client that waits 3 s is gone before 7 s: refused now, not computed for nobody.
    refused = client.http.post("/v1/requests", json={"prompt": "q", "max_tokens": 100}, headers=waiting)
    assert envelope(refused, 503, "overloaded")["details"]["reason"] == "deadline"
    assert refused.headers["Retry-After"] == str(math.ceil(7 - 3)) == "4"
    # Its own deadline wins over its patience; a batch request's patience is not a realtime promise.
    named = client.http.post("/v1/requests", json={"prompt": "q", "max_tokens": 100, "deadline_s": 60},
                             headers=waiting)
    assert named.status_code in (200, 202), named.get_json()
    batch = client.http.post("/v1/requests", json={"prompt": "q", "max_tokens": 100, "priority": "batch"},
                             headers=waiting)
    assert batch.status_code in (200, 202), batch.get_json()
    # Without the wait, the same request is judged by the class default and accepted.
    publish(application, queued_work=500, drain_tps=100, seq_tps=50)
    patient = client.http.post("/v1/requests", json={"prompt": "q", "max_tokens": 100}, headers=client.headers)
    assert patient.status_code == 202, patient.get_json()
