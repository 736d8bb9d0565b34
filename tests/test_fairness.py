"""Fair share across tenants (docs/fairness.md): a tenant's excess waits in its own place in its
class queue's fair line, so a quiet tenant's requests start in fair order beside a flooder's."""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta
from typing import NamedTuple

import pytest
from admission_support import tenant_id_of
from conftest import WorkerProcess, make_settings
from sqlalchemy import select, update
from test_promise import publish

from core.admission.load import ClassLoad, LoadLevel, class_level, class_name, write_level
from core.broker.fair import (
    RESERVED_KEY,
    FairQueues,
    line_excess,
    lines_view,
    seconds_key,
    sending_key,
    sync_reservations,
)
from core.broker.queues import messages_queued, queue_length, queue_lists
from core.rediskeys import redis_client
from core.tenants.manage import update_tenant
from models import InferenceRequest, Status, Tenant, utcnow
from web.services import services
from workers.monitor import Engines, Monitor, levels
from workers.sweep import sweep

QUEUE = "batch.small"


class Row(NamedTuple):
    id: uuid.UUID
    queue: str
    tenant_id: uuid.UUID
    service_tier: str = "batch"
    input_tokens: int = 100
    reserved_tokens: int = 164


@pytest.fixture
def left_queued():
    """Call with (application, client): what that client's tenant left queued is cancelled when
    the test ends, and its reserved share cleared. The sweep and the monitor's recount read the
    shared database: a later test's would publish or count a flood this one left, and a share
    left held counts against every later test's reservations (at most 0.9 in all)."""
    held = []
    yield lambda application, *clients: held.extend((application, c) for c in clients)
    for application, client in held:
        svc = services(application)
        tenant = tenant_id_of(application, client)
        with svc.db.session() as session:
            queued = session.scalars(select(InferenceRequest.id).where(
                InferenceRequest.tenant_id == tenant, InferenceRequest.status == Status.QUEUED)).all()
            session.execute(update(Tenant).where(Tenant.id == tenant).values(reserved_share=None))
        for request_id in queued:
            svc.lifecycle.cancel(tenant, request_id)
        sync_reservations(svc.db, svc.redis)


def snapshot(application) -> None:
    """The monitor's figures for the default model's realtime class, stamped now: a drain of 100
    tokens/s, 50 a sequence (test_promise.py's publish, without resetting the live counters, so a
    test can stamp them again before each submit: admission ignores figures older than
    SLUICE_LOAD_LEVEL_MAX_AGE_S, which a slow host can pass within one test)."""
    svc = services(application)
    seconds, micros = svc.redis.time()
    ClassLoad("realtime", svc.settings.registry.default.name, 0, 0, 0, 100.0, 50.0, 0.0, 0, 1,
              seconds * 1000 + micros // 1000).write(svc.redis, ttl_s=60)


def rows(tenant: uuid.UUID, n: int, queue: str = QUEUE, **kw) -> list[Row]:
    return [Row(uuid.uuid4(), queue, tenant, **kw) for _ in range(n)]


def consumed(fair: FairQueues, queue: str = QUEUE) -> None:
    """What the line let through was published and taken off the queue at once: no longer on its
    way (nothing is published here: the queue stays empty)."""
    fair.redis.delete(sending_key(queue))


def drain(fair: FairQueues, queue: str = QUEUE) -> list[str]:
    """Every id the line lets through, in order (each consumed at once: at depth 1, each take lets
    one more through)."""
    out = []
    consumed(fair, queue)
    while taken := fair.take(queue):
        out += [request_id for request_id, _, _ in taken]
        consumed(fair, queue)
    return out


def test_a_quiet_tenant_is_taken_next_however_much_a_flooder_queued(scratch_redis_url):
    fair = FairQueues(redis_client(scratch_redis_url), depth=1, default_model="m")
    loud, quiet = uuid.uuid4(), uuid.uuid4()
    flood = rows(loud, 50)
    first = fair.put(flood)
    assert [t[0] for t in first] == [str(flood[0].id)]  # an idle queue: straight through
    consumed(fair)
    calm = rows(quiet, 3)
    assert fair.put(calm) == [(str(calm[0].id), QUEUE, "batch")]  # next, ahead of 49 queued
    order = drain(fair)
    # Then turns: one each while both have work (the same start: either first), the flooder's rest after.
    assert set(order[:2]) == {str(flood[1].id), str(calm[1].id)}
    assert set(order[2:4]) == {str(flood[2].id), str(calm[2].id)}
    assert order[4:] == [str(r.id) for r in flood[3:]]
    assert fair.size(QUEUE) == 0 and fair.tenants(QUEUE) == {}


def test_turns_are_in_engine_time_and_by_weight_of_cost(scratch_redis_url):
    """A tenant whose requests cost four times as much gets a quarter as many turns."""
    fair = FairQueues(redis_client(scratch_redis_url), depth=1, default_model="m")
    heavy, light = uuid.uuid4(), uuid.uuid4()
    big = rows(heavy, 10, input_tokens=0, reserved_tokens=400)
    small = rows(light, 40, input_tokens=0, reserved_tokens=100)
    fair.put(big + small)  # the first big one goes straight through
    order = drain(fair)[:25]
    bigs = sum(1 for i in order if i in {str(r.id) for r in big})
    assert 4 <= bigs <= 6, order  # 1:4 in requests = 1:1 in engine time


def test_a_better_tier_is_taken_first_and_an_ended_request_leaves_the_line(scratch_redis_url):
    fair = FairQueues(redis_client(scratch_redis_url), depth=1, default_model="m")
    tenant = uuid.uuid4()
    default = rows(tenant, 5, queue="realtime.small", service_tier="default")
    fair.put(default)
    priority = rows(uuid.uuid4(), 1, queue="realtime.small", service_tier="priority")
    assert fair.put(priority) == [(str(priority[0].id), "realtime.small", "priority")]
    consumed(fair, "realtime.small")
    # Published again while in the line (the sweep, a retry): it keeps its place, no second one.
    assert fair.put(default[1:3]) == [(str(default[1].id), "realtime.small", "default")]
    assert fair.size("realtime.small") == 3
    assert fair.drop("realtime.small", str(default[3].id)) and not fair.drop("realtime.small", str(default[3].id))
    count, seconds = fair.tenants("realtime.small")[str(tenant)]
    assert count == 2 and seconds > 0
    assert drain(fair, "realtime.small") == [str(default[2].id), str(default[4].id)]


def test_a_flooders_batch_backlog_lets_another_tenants_requests_start_first(isolated, database_url, new_client,
                                                                          tmp_path, left_queued):
    """The acceptance check: 400 batch requests from one tenant, then 5 from another, all queued
    before a worker starts: the 5 start before 100 of the flooder's (in fair order: among its
    first few). The class queue holds its depth; the rest wait in its line."""
    application, flooder, redis_url = isolated
    quiet = new_client(application)
    left_queued(application, flooder)
    # Every prompt its own: identical ones in flight would be parked on their twin, off the queues.
    body = {"max_tokens": 8, "priority": "batch"}
    flood = [flooder.submit(prompt=f"summarise report {i}", **body) for i in range(400)]
    assert all(r.status_code == 202 for r in flood), flood[-1].get_json()
    calm = [quiet.submit(prompt=f"summarise memo {i}", **body).get_json()["id"] for i in range(5)]
    svc = services(application)
    assert queue_length(svc.redis, QUEUE) == svc.settings.fair_depth
    assert svc.fair.size(QUEUE) == 405 - svc.settings.fair_depth
    worker = WorkerProcess(database_url, redis_url, tmp_path, concurrency=2)
    try:
        for request_id in calm:
            assert quiet.wait(request_id)["status"] == "succeeded"
    finally:
        worker.stop()
    ids = [uuid.UUID(r.get_json()["id"]) for r in flood]
    with svc.db.session() as session:
        started = {r.id: r.started_at for r in session.execute(
            select(InferenceRequest.id, InferenceRequest.started_at).where(InferenceRequest.id.in_(ids)))}
    last_calm = max(datetime.fromisoformat(quiet.get(i).get_json()["timings"]["started_at"]) for i in calm)
    before = sum(1 for t in started.values() if t is not None and t.replace(tzinfo=last_calm.tzinfo) < last_calm)
    assert before < 20, f"{before} of the flooder's requests started before the quiet tenant's last"


def test_a_seat_that_comes_free_goes_to_the_lines_next_request_not_to_a_queued_message(isolated, database_url,
                                                                                      new_client, tmp_path,
                                                                                      left_queued):
    """Where the engines state their room, the class queue holds only their free seats' worth: with
    both seats of the engine taken by a flooder, nothing waits in the queue and the flooder's rest
    waits in the line. A quiet tenant's question then takes the next seat that comes free: of the
    flooder's requests in the line when it came, at most the one that took the other seat freed
    with its own starts before it (a queue kept at a depth of 2 would have started two first).
    The flood is queued before the worker starts (no engine states its room yet: the queue holds
    the depth, 2), so that no put races the worker's first fetches."""
    application, flooder, redis_url = isolated
    quiet = new_client(application)
    left_queued(application, flooder)
    svc = services(application)
    body = {"max_tokens": 100, "ignore_eos": True, "deadline_s": 600}
    flood = [flooder.submit(prompt=f"flood question {i}", **body).get_json()["id"] for i in range(6)]
    assert queue_length(svc.redis, "realtime.small") == svc.settings.fair_depth == 2
    worker = WorkerProcess(database_url, redis_url, tmp_path, concurrency=2, extra_env={"SLUICE_SIM_SPEED": "0.2"})
    try:
        until = time.monotonic() + 60
        while (sum(flooder.get(i).get_json()["status"] == "running" for i in flood) < 2
               or queue_length(svc.redis, "realtime.small")):
            assert time.monotonic() < until, "the engine never filled from the queue alone"
            time.sleep(0.1)
        # Both seats taken, nothing in the queue: the rest of the flood waits in the line.
        calm = quiet.submit(prompt="a quiet question", max_tokens=8, deadline_s=600).get_json()["id"]
        # What of the flood was still in the line behind it (a seat that came free in between may
        # have taken one more off the line before it came: that one goes first, as it should).
        behind = svc.fair.in_line("realtime.small") & set(flood)
        assert behind, "the flood's rest waits in the line"
        assert quiet.wait(calm)["status"] == "succeeded"
        began = datetime.fromisoformat(quiet.get(calm).get_json()["timings"]["started_at"])
        overtook = [i for i in behind if (t := flooder.get(i).get_json()["timings"]["started_at"])
                    and datetime.fromisoformat(t) < began]
        # The flood's two run the same length from the same step: both seats free together, one
        # goes to the quiet question, the other to the flood's next, and either may be consumed
        # first (each engine thread publishes what it took). Never two: the next seat comes free
        # a whole request later.
        assert len(overtook) <= 1, f"{len(overtook)} of the flooder's requests in the line started first"
    finally:
        worker.stop()


def test_a_seat_a_take_left_free_is_filled_by_its_engine_without_the_load_monitor(isolated, database_url,
                                                                                 tmp_path):
    """Every take counts what other takers let through and have not pushed yet, so a take can leave
    a free seat unfilled (a taker that died after its take, or two takers in the instant a message
    is both pushed and still marked on its way). With no load monitor and no request leaving the
    engine, no later take would come: the engine, seeing a seat free with no take for a second,
    tops its queues up itself."""
    application, client, redis_url = isolated
    svc = services(application)
    worker = WorkerProcess(database_url, redis_url, tmp_path, concurrency=2)
    try:
        queue = "realtime.small"
        seconds, micros = svc.redis.time()
        now_ms = seconds * 1000 + micros // 1000
        # Two messages a taker let through and never pushed: the engine's two seats look spoken for
        # (stamped 3 s ahead, so that they last 5 s: a slow submit still finds them).
        svc.redis.zadd(sending_key(queue), {f"3:{uuid.uuid4()}": now_ms + 3000 for _ in range(2)})
        request_id = client.submit(prompt="a question nobody tops up", max_tokens=8).get_json()["id"]
        assert request_id in svc.fair.in_line(queue), "the put's own take saw no free seat"
        # The marks lapse; nothing else takes from the line here.
        assert client.wait(request_id, timeout=20)["status"] == "succeeded"
    finally:
        worker.stop()


def test_a_request_taken_off_the_line_by_a_process_that_died_is_published_by_the_sweep(isolated, database_url,
                                                                                      tmp_path):
    """The row is the contract: taken off the line and never published (the process died between
    the two), a request is in no queue and no line, and the sweep's lost-message check publishes
    it again; what waits in the line is not published twice."""
    application, client, redis_url = isolated
    svc = services(application)
    depth = svc.settings.fair_depth
    ids = [client.submit(prompt=f"hello {i}", max_tokens=8, priority="batch").get_json()["id"] for i in range(5)]
    queued = messages_queued(svc.redis, {QUEUE}) & set(ids)
    in_line = svc.fair.in_line(QUEUE)
    assert len(queued) == depth and len(in_line) == 5 - depth and queued | in_line == set(ids)
    svc.redis.delete(*queue_lists(QUEUE))  # taken by a consumer...
    lost = {request_id for request_id, _, _ in svc.fair.take(QUEUE)}  # ...and the next by one that died
    assert len(lost) == depth and svc.fair.size(QUEUE) == 5 - 2 * depth
    with svc.db.session() as session:
        session.execute(update(InferenceRequest).where(InferenceRequest.id.in_([uuid.UUID(i) for i in ids]))
                        .values(enqueued_at=utcnow() - timedelta(seconds=svc.settings.lost_message_grace_s + 5)))
    assert sweep(svc)["lost_missing"] >= 2 * depth  # (the count is the shared database's)
    # Published again through the line: back in the queue or in the line, each once.
    queued, in_line = messages_queued(svc.redis, {QUEUE}) & set(ids), svc.fair.in_line(QUEUE) & set(ids)
    assert queued | in_line == set(ids) and not queued & in_line
    assert queue_length(svc.redis, QUEUE) == depth
    worker = WorkerProcess(database_url, redis_url, tmp_path)
    try:
        for request_id in ids:
            assert client.wait(request_id)["status"] == "succeeded"
    finally:
        worker.stop()


def test_the_promise_reads_the_wait_in_fair_order_so_a_flooder_is_refused_and_a_quiet_tenant_is_not(
        isolated_app, new_client, left_queued):
    """Requests of 1 s of engine time each (100 tokens at a drain of 100/s) from one tenant fill
    its class until its own backlog passes the 30 s deadline: it is refused, with a Retry-After
    from that backlog. Another tenant's request is admitted beside it, told a wait of the queue's
    depth only: of the flooder's line, nothing goes before it."""
    application = isolated_app(realtime_deadline_s=30.0, promise_factor=1.0)
    flooder, quiet = new_client(application), new_client(application)
    left_queued(application, flooder, quiet)
    svc = services(application)
    publish(application, queued_work=0, drain_tps=100, seq_tps=50)
    # Every prompt its own: identical ones in flight would be parked on their twin, which only the
    # tenant's gates judge (core/submit/twins.py), not the promise.
    accepted = 0
    while (answer := flooder.submit(prompt=f"flood {accepted}", max_tokens=100)).status_code == 202:
        accepted += 1
        assert accepted < 40, "the flooder's backlog never refused it"
        snapshot(application)
    assert answer.status_code == 503 and answer.get_json()["error"]["details"]["reason"] == "deadline"
    assert 26 <= accepted <= 29, accepted  # its 2 s of run and its backlog of 1 s each past 30 s
    assert int(answer.headers["Retry-After"]) >= 1
    snapshot(application)
    first = quiet.submit(prompt="a quiet question", max_tokens=100)
    assert first.status_code == 202, first.get_json()
    depth = svc.settings.fair_depth
    assert first.get_json()["estimated_wait_s"] == pytest.approx(depth, abs=0.5)
    # Its second waits for its first too (a tenant's own work is before it), still far from 30 s.
    snapshot(application)
    second = quiet.submit(prompt="another quiet question", max_tokens=100)
    assert second.status_code == 202 and second.get_json()["estimated_wait_s"] == pytest.approx(depth + 2, abs=0.5)
    assert flooder.submit(prompt="flood once more", max_tokens=100).status_code == 503


def test_a_tenant_inside_its_reserved_share_is_not_refused_for_an_overload_of_others(isolated_app, new_client,
                                                                                      left_queued):
    """A flooder fills its class to the deadline; at the shed level everyone else is refused, but
    a tenant with a reserved share is admitted while its own line drains in its deadline at that
    share (0.3 × 30 s = 9 s of engine time) and its promise holds (at the shed level, the tight
    factor: 18 s, its turns beside the flooder's included)."""

    application = isolated_app(realtime_deadline_s=30.0, promise_factor=1.0)
    flooder, reserved, plain = new_client(application), new_client(application), new_client(application)
    left_queued(application, flooder, reserved)
    svc = services(application)
    with svc.db.session() as session:
        update_tenant(session, svc.settings, session.get(Tenant, tenant_id_of(application, reserved)),
                      {"reserved_share": 0.3})
    assert sync_reservations(svc.db, svc.redis)[str(tenant_id_of(application, reserved))] == 0.3
    publish(application, queued_work=0, drain_tps=100, seq_tps=50)
    flood = 0  # every prompt its own: an identical one in flight would be parked on its twin, past the promise
    while flooder.submit(prompt=f"flood {flood}", max_tokens=100).status_code == 202:
        flood += 1
        snapshot(application)
    snapshot(application)
    write_level(svc.redis, LoadLevel.SHED, ttl_s=30)
    refused = plain.submit(prompt="plain", max_tokens=100)
    assert refused.status_code == 503 and refused.get_json()["error"]["details"]["reason"] == "shed"
    admitted = 0
    while (answer := reserved.submit(prompt=f"reserved {admitted}", max_tokens=100)).status_code == 202:
        admitted += 1
        assert admitted < 20, "a reservation with no end"
        snapshot(application)
        write_level(svc.redis, LoadLevel.SHED, ttl_s=30)
    # Each waits for the queue's depth (2 s), its tenant's line and as much of the flooder's, and
    # runs 2 s: the seventh would be due at 2 + 7 + 7 + 2 = 18 s, past the tight 18 s.
    assert admitted == 7, (admitted, answer.get_json())
    assert answer.get_json()["error"]["details"]["reason"] == "deadline"
    # Past 9 s of its own line it is outside its share: shed like the rest.
    svc.redis.hincrbyfloat(seconds_key("realtime.small"), f"default|{tenant_id_of(application, reserved)}", 3)
    snapshot(application)
    write_level(svc.redis, LoadLevel.SHED, ttl_s=30)
    outside = reserved.submit(prompt="reserved, outside its share", max_tokens=1)
    assert outside.status_code == 503 and outside.get_json()["error"]["details"]["reason"] == "shed"


def test_a_flooders_excess_raises_the_level_it_alone_is_judged_at(scratch_redis_url):
    """The monitor judges a class's level on its whole wait and, apart, on the wait of a tenant one
    turn away in the fair lines: the whole less what tenants queued past their turns (each tenant's
    turn: one request of the mean cost there, by its weight). It publishes both, and the tenants
    past their turns (loud), who alone are judged on the whole."""
    client = redis_client(scratch_redis_url)
    fair = FairQueues(client, depth=1, default_model="m")
    loud, quiet = uuid.uuid4(), uuid.uuid4()
    fair.put(rows(loud, 21, queue="realtime.small", service_tier="default"))  # one through, 20 in line
    consumed(fair, "realtime.small")
    fair.put(rows(quiet, 2, queue="realtime.small", service_tier="default"))  # its first next, one in line
    cost = fair.tenants("realtime.small")[str(quiet)][1]  # no snapshot: the line's default prices
    lines = line_excess(client, "m")
    assert lines["realtime:m"].loud == {str(loud)}
    assert lines["realtime:m"].seconds == pytest.approx(19 * cost)
    # 23 requests of that cost queued, on one engine at the same prices, against a 2 s deadline.
    monitor = Monitor(make_settings("postgresql://unused", scratch_redis_url, realtime_deadline_s=2.0), client, None)
    engine = Engines(drain_tps=1000.0, seq_tps=50.0, room=1, slot_wait_s=0.0, prefill_s_tok=0.0002, count=1)
    load = monitor._class_load("realtime", "m", {"queued_work": 23 * 64, "queued_prompt": 23 * 100}, 1, 4, None,
                               0.0, 0, engine, lines["realtime:m"])
    assert load.wait_s == pytest.approx(23 * cost, abs=1e-3) and load.level == LoadLevel.TIGHT_PROMISE
    assert load.fair_wait_s == pytest.approx(4 * cost, abs=1e-3) and load.fair_level == LoadLevel.NORMAL
    published = {k: str(v) for k, v in levels([load], lines).items()}
    assert published == {"realtime:m": "5", "realtime:m:fair": "0", f"realtime:m|{loud}": "1"}
    assert class_level(published, "realtime", "m", str(quiet)) == 0
    assert class_level(published, "realtime", "m", str(loud)) == 5
    assert class_level(published, "realtime", "m") == 5  # no tenant: the class's
    assert class_level(published, "batch", "m", str(quiet)) == 5, "batch yields to the realtime class, whole"
    # Nobody past a turn: one level, no fair one.
    calm = line_excess(client, "nobody")
    assert levels([load], calm) == {"realtime:m": 5}


def test_a_reserved_tenant_inside_its_reservation_is_not_loud(scratch_redis_url):
    """A tenant with a reserved share that queued past one turn is loud only once its own line no
    longer drains within the class's deadline at its share (admit.lua's ``inside``): a burst
    inside its reservation is judged at the fair level, the others' spike notwithstanding."""
    client = redis_client(scratch_redis_url)
    fair = FairQueues(client, depth=1, default_model="m")
    flooder, reserved = uuid.uuid4(), uuid.uuid4()
    client.hset(RESERVED_KEY, str(reserved), 0.3)
    fair.put(rows(flooder, 21, queue="realtime.small", service_tier="default"))
    consumed(fair, "realtime.small")
    fair.put(rows(reserved, 3, queue="realtime.small", service_tier="default"))  # one through, two in line
    n, held = fair.tenants("realtime.small")[str(reserved)]
    assert n == 2
    cost = held / n
    lines = line_excess(client, "m")["realtime:m"]
    assert lines.loud == {str(flooder), str(reserved)}, "past one turn"
    roomy = lines.within(held / 0.3)  # its line drains at 0.3 of the engines in time
    assert roomy.loud == {str(flooder)}
    assert roomy.seconds == pytest.approx(lines.seconds - cost), "its work past its turn leaves the excess"
    tight = lines.within(held / 0.3 * 0.9)
    assert tight.loud == lines.loud and tight.seconds == pytest.approx(lines.seconds)
    # The monitor judges it by the deadlines the class's queued requests carry (4 s here).
    monitor = Monitor(make_settings("postgresql://unused", scratch_redis_url, realtime_deadline_s=30.0), client, None)
    counters = {"queued_work": 24 * 64, "queued_prompt": 24 * 100, "queued_requests": 24,
                "queued_deadline_ms": 24 * 4000}
    excess = lines.within(monitor._deadline("realtime", counters))
    assert held <= 0.3 * 4, "its line fits at its share in 4 s"
    engine = Engines(drain_tps=1000.0, seq_tps=50.0, room=1, slot_wait_s=0.0, prefill_s_tok=0.0002, count=1)
    load = monitor._class_load("realtime", "m", counters, 1, 4, None, 0.0, 0, engine, excess)
    published = levels([load], {"realtime:m": excess})
    assert load.fair_level < load.level and f"realtime:m|{flooder}" in published
    assert f"realtime:m|{reserved}" not in published


def test_a_tenant_not_loud_is_admitted_and_degraded_at_its_classs_fair_level(isolated_app, new_client):
    """Where the monitor publishes a fair level beside the class's, the tenants it names loud are
    judged at the class's (shed here) and every other tenant at the fair one (shorter output):
    the ladder's steps and admission's gates alike, and each refusal says the level it was at."""
    application = isolated_app()
    flooder, quiet = new_client(application), new_client(application)
    name = class_name("realtime", services(application).settings.registry.default.name)
    write_level(services(application).redis, LoadLevel.SHED, ttl_s=30, classes={
        name: 6, f"{name}:fair": 2, f"{name}|{tenant_id_of(application, flooder)}": 1})
    refused = flooder.submit(prompt="more of the flood", max_tokens=1000)
    assert refused.status_code == 503
    assert refused.get_json()["error"]["details"] == {"gate": "global", "reason": "shed", "load_level": 6}
    admitted = quiet.submit(prompt="a quiet question", max_tokens=1000)
    assert admitted.status_code == 202 and admitted.headers["Sluice-Degradation"] == "shorter_output"


def test_the_lines_are_shown_tenant_by_tenant_the_ten_with_most_work_and_the_rest_as_other(scratch_redis_url):
    """What `sluice status --tenants`, GET /v1/admin/load, the dashboard and the monitor's metrics
    show: per line, tenants by engine seconds queued, a reserved tenant's share, each one's wait in
    fair order; the eleventh and later summed as ``other`` (bounded metric labels)."""
    from workers.exporter import PlatformCollector

    client = redis_client(scratch_redis_url)
    fair = FairQueues(client, depth=1, default_model="m")
    tenants = [uuid.uuid4() for _ in range(12)]
    client.hset(RESERVED_KEY, str(tenants[0]), 0.5)
    client.lpush(QUEUE, "a message")  # the queue is at its depth: all of them wait in the line
    for i, tenant in enumerate(tenants):
        assert fair.put(rows(tenant, i + 1)) == []
    [line] = lines_view(client)
    assert line["queue"] == QUEUE and len(line["tenants"]) == 11
    named = line["tenants"][:10]
    assert [r["tenant"] for r in named] == [str(t) for t in reversed(tenants[2:])]
    assert [r["requests"] for r in named] == list(range(12, 2, -1))
    other = line["tenants"][10]
    assert other["tenant"] == "other" and other["requests"] == 1 + 2  # the first two tenants
    biggest = named[0]
    # Eleven others with work beside the reserved one: its weight 11, the rest 1 each.
    assert biggest["share"] == pytest.approx(1 / 22, abs=0.001)
    assert other["share"] == pytest.approx(12 / 22, abs=0.001)
    # Its 12 requests drain beside each other tenant's turns: all of theirs (at most 11 each) and its own.
    assert biggest["wait_s"] == pytest.approx(sum(r["seconds"] for r in named) + other["seconds"], rel=0.01)
    svc = type("Svc", (), {"redis": client})()
    families = {f.name: f for f in PlatformCollector(svc)._lines()}
    samples = families["sluice_tenant_queued_requests"].samples
    assert len(samples) == 11 and {s.labels["tenant"] for s in samples} >= {"other", str(tenants[-1])}
