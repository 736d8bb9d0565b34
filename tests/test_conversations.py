"""Multi-turn affinity: later turns go to the worker holding the conversation's prefix cache."""

from __future__ import annotations

from functools import partial

import pytest
from conftest import BeatProcess, WorkerProcess, make_settings

from launcher.harness import start_all, stop_all
from web.schemas import worker_tag
from web.services import services


@pytest.fixture
def two_workers(database_url, redis_dbs, new_client, tmp_path):
    from web import create_app

    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url))
    workers = start_all(*[partial(WorkerProcess, database_url, redis_url, tmp_path)] * 2)
    yield application, new_client(application), workers, redis_url
    stop_all(workers)
    services(application).redis.flushdb()
    services(application).db.dispose()


def node_of(view: dict) -> str:
    """The worker that ran it, as a tenant can tell: an opaque tag, the same for one process."""
    assert view["worker"].startswith("w-") and "@" not in view["worker"]
    return view["worker"]


def test_turns_follow_the_worker_that_served_the_first(two_workers):
    _, client, _, _ = two_workers
    first = client.wait(client.submit(prompt="turn 1", max_tokens=4, conversation_id="c-1").get_json()["id"])
    assert first["status"] == "succeeded" and first["conversation_id"] == "c-1"
    node = node_of(first)
    for turn in range(2, 6):
        view = client.wait(client.submit(prompt=f"turn {turn}", max_tokens=4, conversation_id="c-1").get_json()["id"])
        assert view["queue"] == "direct" and node_of(view) == node
    other = client.wait(client.submit(prompt="no conversation", max_tokens=4).get_json()["id"])
    assert other["queue"] == "realtime.small"



def test_turn_for_a_dead_worker_is_rerouted_to_the_shared_queue(two_workers, database_url, tmp_path):
    _, client, workers, redis_url = two_workers
    first = client.wait(client.submit(prompt="turn 1", max_tokens=4, conversation_id="c-2").get_json()["id"])
    node = node_of(first)
    victim = next(w for w in workers if worker_tag(w.worker_key.split(":", 2)[2]) == node)
    victim.kill()
    # Its node key outlives it for a few seconds: this turn is routed to the dead worker's queue.
    stranded = client.submit(prompt="turn 2", max_tokens=4, conversation_id="c-2").get_json()["id"]
    beat = BeatProcess(database_url, redis_url, tmp_path)
    try:
        view = client.wait(stranded, timeout=60)
    finally:
        beat.stop()
    assert view["status"] == "succeeded"
    # Routed to the shared queue up front, or rerouted there by the sweep: either way the survivor ran it.
    assert view["queue"] == "realtime.small" and node_of(view) != node


def test_affinity_never_puts_batch_work_on_a_realtime_worker(database_url, redis_dbs, new_client, tmp_path):
    from web import create_app

    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url))
    client = new_client(application)
    workers = [WorkerProcess(database_url, redis_url, tmp_path, role=role) for role in ("realtime", "batch")]
    role_of = {worker_tag(w.worker_key.split(":", 2)[2]): w.role for w in workers}
    try:
        first = client.wait(client.submit(prompt="turn 1", max_tokens=4, conversation_id="c-3").get_json()["id"])
        assert role_of[node_of(first)] == "realtime"
        batch_turn = client.wait(client.submit(prompt="turn 2", max_tokens=4, priority="batch",
                                               conversation_id="c-3").get_json()["id"])
        assert batch_turn["queue"] == "batch.small" and role_of[node_of(batch_turn)] == "batch"
        # The batch worker served the last turn; a realtime turn cannot follow it there either.
        realtime_turn = client.wait(client.submit(prompt="turn 3", max_tokens=4, conversation_id="c-3")
                                    .get_json()["id"])
        assert realtime_turn["queue"] == "realtime.small" and role_of[node_of(realtime_turn)] == "realtime"
    finally:
        stop_all(workers)
        services(application).redis.flushdb()
        services(application).db.dispose()
