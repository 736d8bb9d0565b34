"""A worker that serves realtime and batch queues takes realtime work first, from the broker on,
and takes turns between queues of the same class."""

from __future__ import annotations

import time

from conftest import WorkerProcess, make_settings

from web.services import services
from workers.queue_order import ClassPriorityCycle


def test_a_free_worker_thread_takes_realtime_before_batch(database_url, redis_dbs, new_client, tmp_path):
    from web import create_app

    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url))
    client = new_client(application)
    # Queued before any worker runs: six batch requests, then three small and three large
    # realtime ones (the tests' large threshold is 1,024 tokens).
    batch = [client.submit(prompt=f"batch {i}", max_tokens=4, priority="batch").get_json()["id"] for i in range(6)]
    small = [client.submit(prompt=f"now {i}", max_tokens=4).get_json()["id"] for i in range(3)]
    large = [client.submit(prompt="abcd" * 1100, max_tokens=4).get_json()["id"] for _ in range(3)]
    # One thread: requests start one at a time, in the order the worker takes them.
    worker = WorkerProcess(database_url, redis_url, tmp_path, concurrency=1)
    try:
        views = {i: client.wait(i) for i in [*batch, *small, *large]}
    finally:
        worker.stop()
        services(application).redis.flushdb()
        services(application).db.dispose()
    assert {v["status"] for v in views.values()} == {"succeeded"}
    order = sorted(views, key=lambda i: views[i]["timings"]["started_at"])
    taken = [(views[i]["queue"], views[i]["timings"]["started_at"]) for i in order]
    # Strict between classes: all realtime work before any batch work ...
    assert set(order[:6]) == {*small, *large}, taken
    # ... and turns within a class: small and large realtime alternate, neither starves.
    assert [views[i]["size_class"] for i in order[:6]] == ["small", "large"] * 3, taken


def test_the_cycle_is_strict_between_classes_and_round_robin_within_one():
    queues = ["maintenance", "direct.w@h", "realtime.small", "realtime.large", "batch.small", "batch.large"]
    cycle = ClassPriorityCycle()
    cycle.update(reversed(queues))  # kombu adds queues one by one; the class order wins anyway
    assert cycle.consume(6)[:2] == ["maintenance", "direct.w@h"]
    cycle.update(queues)
    cycle.rotate("realtime.small")
    assert cycle.consume(6) == ["maintenance", "direct.w@h", "realtime.large", "realtime.small",
                                "batch.small", "batch.large"]
    cycle.rotate("batch.small")
    cycle.rotate("maintenance")
    assert cycle.consume(6) == ["maintenance", "direct.w@h", "realtime.large", "realtime.small",
                                "batch.large", "batch.small"]
    assert cycle.rotate("not-consumed") == "not-consumed" and len(cycle.consume(10)) == 6


def test_batch_work_never_holds_the_threads_kept_for_realtime(database_url, scratch_redis_url, new_client, tmp_path):
    """Four threads, two kept for realtime: four long batch requests get two threads, the other
    two wait in the queue, and a realtime request arriving behind them runs at once."""
    from web import create_app

    application = create_app(make_settings(database_url, scratch_redis_url))
    client = new_client(application)
    worker = WorkerProcess(database_url, scratch_redis_url, tmp_path, concurrency=4,
                           extra_env={"SLUICE_WORKER_REALTIME_THREADS": "2"})
    try:
        batch = [client.submit(prompt=f"long batch {i}", max_tokens=4000, ignore_eos=True, priority="batch")
                 .get_json()["id"] for i in range(4)]
        deadline = time.monotonic() + 30
        while sum(client.get(i).get_json()["status"] == "running" for i in batch) < 2:
            assert time.monotonic() < deadline, "batch work never started"
            time.sleep(0.1)
        time.sleep(1.0)  # time for a third batch request to start, were it allowed to
        statuses = sorted(client.get(i).get_json()["status"] for i in batch)
        assert statuses == ["queued", "queued", "running", "running"], statuses
        urgent = client.wait(client.submit(prompt="urgent", max_tokens=8).get_json()["id"], timeout=30)
        assert urgent["status"] == "succeeded"
        assert urgent["timings"]["queue_wait_s"] < 1.0, urgent["timings"]
        assert sorted(client.get(i).get_json()["status"] for i in batch) == statuses, "batch still waiting"
        for request_id in batch:
            client.cancel(request_id)
        assert {client.wait(i, timeout=30)["status"] for i in batch} == {"cancelled"}
    finally:
        worker.stop()
        services(application).redis.flushdb()
        services(application).db.dispose()


def test_fewer_batch_requests_start_while_realtime_runs():
    """Batch slots shrink to `beside` while a realtime request runs; those held already go on."""
    from workers.bootstrap import BatchSlots, batch_slots

    busy = False
    slots = BatchSlots(4, beside=1, realtime_busy=lambda: busy)
    assert slots.try_take() and slots.try_take()  # no realtime: up to the limit
    busy = True
    assert not slots.try_take()  # two run already, beside allows one
    slots.give_back()
    slots.give_back()
    assert slots.try_take() and not slots.try_take()
    busy = False
    assert slots.try_take() and slots.try_take() and slots.try_take() and not slots.try_take()

    settings = make_settings("postgresql://x@127.0.0.1/x", "redis://127.0.0.1:6379/0")
    shared = batch_slots(settings, 64, ["realtime.small", "batch.small"])
    assert (shared.limit, shared.beside) == (48, 24)
    assert batch_slots(settings, 64, ["batch.small"]).beside == 64  # a batch-only worker: no realtime to yield to


def test_a_request_handed_back_at_the_head_of_its_queue_is_taken_next(database_url, redis_dbs, new_client, tmp_path):
    """What a preempted batch request gets: published again at the head of its queue, so the one
    worker thread takes it before the requests queued after it first came."""
    import uuid
    from types import SimpleNamespace

    from core.broker.queues import publish_committed, to_head
    from web import create_app

    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url))
    client = new_client(application)
    svc = services(application)
    ids = [client.submit(prompt=f"batch {i}", max_tokens=4, priority="batch").get_json()["id"] for i in range(4)]
    assert not to_head(svc.redis, "batch.small", str(uuid.uuid4())), "a message not there is not moved"
    # The last one queued, published again at the head (its first message stays: only one
    # delivery can claim the row, the other finds it taken).
    publish_committed(svc.lifecycle, svc.broker, [SimpleNamespace(id=uuid.UUID(ids[-1]), queue="batch.small")],
                      svc.epoch, head=svc.redis)
    worker = WorkerProcess(database_url, redis_url, tmp_path, concurrency=1)
    try:
        views = {i: client.wait(i) for i in ids}
    finally:
        worker.stop()
        svc.redis.flushdb()
        svc.db.dispose()
    assert {v["status"] for v in views.values()} == {"succeeded"}
    order = sorted(ids, key=lambda i: views[i]["timings"]["started_at"])
    assert order == [ids[-1], *ids[:-1]], order
