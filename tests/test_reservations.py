"""Peak reservations: shared workers stop reading batch queues during a window and read them
again after it, whichever scheduler (monitor) process was running at either end."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from conftest import WorkerProcess, make_settings
from test_api_errors import assert_envelope

from web.services import services
from workers.monitor import Monitor

ADMIN = "an-admin-key-of-16+"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture
def reserving(database_url, scratch_redis_url, new_client):
    from web import create_app

    application = create_app(make_settings(database_url, scratch_redis_url, admin_key=ADMIN))
    created = []

    def book(**window) -> dict:
        response = application.test_client().post("/v1/admin/reservations", json=window, headers=HEADERS)
        assert response.status_code == 201, response.get_json()
        created.append(response.get_json()["id"])
        return response.get_json()

    yield application, new_client(application), book
    # The database is shared with other tests' monitors: leave no window behind.
    for reservation_id in created:
        application.test_client().delete(f"/v1/admin/reservations/{reservation_id}", headers=HEADERS)
    services(application).db.dispose()


def iso(seconds_from_now: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds_from_now)).isoformat()


def monitor(application) -> Monitor:
    """A fresh scheduler: it knows only what Postgres and Redis hold."""
    svc = services(application)
    return Monitor(svc.settings, svc.redis, svc.db, broker=svc.broker)


def load(application) -> dict:
    return application.test_client().get("/v1/admin/load", headers=HEADERS).get_json()


def test_a_window_pauses_batch_on_shared_workers_and_resumes_after_a_scheduler_restart(
        reserving, database_url, scratch_redis_url, tmp_path):
    application, client, book = reserving
    worker = WorkerProcess(database_url, scratch_redis_url, tmp_path, concurrency=2)  # role all: both classes
    try:
        # Long enough that a loaded machine still checks the batch request inside the window.
        window = book(**{"from": iso(-1), "until": iso(20), "note": "launch"})
        assert window["state"] == "active" and window["role"] is None
        # A worker counts as paused once it answered the command (within 0.5 s), and a worker whose
        # remote-control consumer is not listening yet, or is slow on a loaded machine, is asked
        # again at a later tick: tick until it answered, not once.
        deadline = time.monotonic() + 60
        while True:
            monitor(application).tick()
            view = load(application)
            if view["paused_for_reservations"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert [r["id"] for r in view["reservations"]] == [window["id"]]
        assert len(view["paused_for_reservations"]) == 1
        batch_class = next(c for c in view["classes"] if c["priority"] == "batch")
        realtime_class = next(c for c in view["classes"] if c["priority"] == "realtime")
        assert batch_class["workers"] == 0 and realtime_class["workers"] == 1, "a paused worker serves no batch"
        # The remote-control command reaches the worker in its own time (seconds on a loaded
        # machine; lost when its consumer is not listening yet, and then sent again at a later
        # tick, as the scheduler ticks on): wait until the worker itself says it reads no batch queue.
        node = worker.wait_stats(lambda s: "node" in s)["node"]
        control = services(application).broker.control
        deadline = time.monotonic() + 60
        while True:
            queues = (control.inspect(destination=[node], timeout=2).active_queues() or {}).get(node)
            if queues is not None and not any(q["name"].startswith("batch.") for q in queues):
                break
            assert time.monotonic() < deadline, f"{node} still reads {queues}"
            time.sleep(0.5)
            monitor(application).tick()
        batch = client.submit(prompt="long report", max_tokens=8, priority="batch").get_json()["id"]
        answered = client.wait(client.submit(prompt="a user is waiting", max_tokens=8).get_json()["id"])
        assert answered["status"] == "succeeded"
        time.sleep(2)
        assert client.get(batch).get_json()["status"] == "queued", "batch was read during the window"
        # The scheduler that paused the worker is gone; another one ends the window.
        time.sleep(max(0.0, (datetime.fromisoformat(window["until"]) - datetime.now(UTC)).total_seconds()) + 0.2)
        monitor(application).tick()
        assert load(application)["paused_for_reservations"] == []
        assert client.wait(batch, timeout=30)["status"] == "succeeded"
    finally:
        worker.stop()


def test_reservations_are_listed_cancelled_and_checked(reserving):
    application, _, book = reserving
    http = application.test_client()
    later = book(**{"from": iso(3600), "until": iso(7200), "role": "all"})
    assert later["state"] == "scheduled"
    listed = http.get("/v1/admin/reservations", headers=HEADERS).get_json()["reservations"]
    assert later["id"] in [r["id"] for r in listed]
    cancelled = http.delete(f"/v1/admin/reservations/{later['id']}", headers=HEADERS)
    assert cancelled.status_code == 200 and cancelled.get_json()["state"] == "cancelled"
    assert later["id"] not in [r["id"] for r in http.get("/v1/admin/reservations", headers=HEADERS)
                               .get_json()["reservations"]]
    for body, what in (({"from": iso(-60), "until": iso(-30)}, "already over"),
                       ({"from": iso(60), "until": iso(30)}, "end after it starts"),
                       ({"from": iso(0), "until": iso(60), "role": "gpu"}, "role"),
                       ({"from": "2026-12-01T18:00:00", "until": iso(60)}, "from")):
        error = assert_envelope(http.post("/v1/admin/reservations", json=body, headers=HEADERS), 422)
        assert what in error["message"] or what in str(error.get("details")), error
    assert_envelope(http.delete("/v1/admin/reservations/not-a-uuid", headers=HEADERS), 404)
    assert_envelope(http.post("/v1/admin/reservations", json={"from": iso(0), "until": iso(60)}), 401)
