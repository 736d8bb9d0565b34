"""A worker that serves realtime and batch queues takes realtime work first, from the broker on."""

from __future__ import annotations

from conftest import WorkerProcess, make_settings


def test_a_free_worker_thread_takes_realtime_before_batch(database_url, redis_dbs, new_client, tmp_path):
    from web import create_app

    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url))
    client = new_client(application)
    # Queued before any worker runs: six batch requests, then three realtime ones.
    batch = [client.submit(prompt=f"batch {i}", max_tokens=4, priority="batch").get_json()["id"] for i in range(6)]
    realtime = [client.submit(prompt=f"now {i}", max_tokens=4).get_json()["id"] for i in range(3)]
    # One thread: requests start one at a time, in the order the worker takes them.
    worker = WorkerProcess(database_url, redis_url, tmp_path, concurrency=1)
    try:
        views = {i: client.wait(i) for i in [*batch, *realtime]}
    finally:
        worker.stop()
        application.extensions["sluice.redis"].flushdb()
        application.extensions["sluice.db"].dispose()
    assert {v["status"] for v in views.values()} == {"succeeded"}
    order = sorted(views, key=lambda i: views[i]["timings"]["started_at"])
    # Round-robin consumption would alternate realtime and batch; strict preference does not.
    assert set(order[:3]) == set(realtime), [views[i]["priority"] for i in order]
