"""Admission over HTTP: the three gates, their headers and codes, and reconciliation on finish."""

from __future__ import annotations

import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from admission_support import rows_of, set_limits
from conftest import ApiClient
from sqlalchemy import update
from test_api_errors import assert_envelope

from core.admission.load import LoadLevel, write_level
from core.rediskeys import LOAD_LEVEL_KEY, inflight_key
from models import InferenceRequest, Status, Tenant
from web.services import services
from workers.sweep import sweep

DURATION = re.compile(r"^(\d+ms|(\d+m)?\d+(\.\d+)?s)$")
HEADERS = [f"x-ratelimit-{kind}-{unit}" for kind in ("limit", "remaining", "reset") for unit in ("tokens", "requests")]


def assert_ratelimit_headers(response, tokens_limit: int, requests_limit: int) -> dict[str, str]:
    h = response.headers
    for name in HEADERS:
        assert name in h, (name, dict(h))
    assert int(h["x-ratelimit-limit-tokens"]) == tokens_limit
    assert int(h["x-ratelimit-limit-requests"]) == requests_limit
    assert 0 <= int(h["x-ratelimit-remaining-tokens"]) <= tokens_limit
    assert 0 <= int(h["x-ratelimit-remaining-requests"]) <= requests_limit
    assert DURATION.match(h["x-ratelimit-reset-tokens"]) and DURATION.match(h["x-ratelimit-reset-requests"])
    return dict(h)


def assert_retry_after(response) -> int:
    seconds = int(response.headers["Retry-After"])
    assert seconds >= 1 and int(response.headers["retry-after-ms"]) > 0
    return seconds


def test_accepted_submit_carries_the_tenant_quota(app, client):
    response = client.submit(prompt="abcd" * 10, max_tokens=90)  # 10 input tokens + 90 reserved
    assert response.status_code == 202
    standard = services(app).settings.tiers["standard"]
    h = assert_ratelimit_headers(response, standard.tokens_per_minute, standard.requests_per_minute)
    # A fresh bucket: exactly this request's price is gone (refill cannot exceed a full bucket).
    assert int(h["x-ratelimit-remaining-tokens"]) == standard.tokens_per_minute - 100
    assert int(h["x-ratelimit-remaining-requests"]) == standard.requests_per_minute - 1
    assert client.get(response.get_json()["id"]).get_json()["usage"]["reserved_tokens"] == 100


def test_every_submit_answer_after_authentication_has_the_headers(app, client):
    standard = services(app).settings.tiers["standard"]
    invalid = client.submit(prompt="x", max_tokens=0)
    assert_envelope(invalid, 422, "invalid_request")
    assert_ratelimit_headers(invalid, standard.tokens_per_minute, standard.requests_per_minute)
    unauthenticated = client.http.post("/v1/requests", json={"prompt": "x"})
    assert_envelope(unauthenticated, 401)
    assert "x-ratelimit-limit-tokens" not in unauthenticated.headers  # no tenant, no quota to report


def test_token_budget_rejects_with_429_and_writes_no_row(app, client):
    tenant_id = set_limits(app, client, tokens_per_minute=1000)
    assert client.submit(prompt="abcd", max_tokens=599).status_code == 202  # 600 tokens
    rejected = client.submit(prompt="abcd", max_tokens=599)
    error = assert_envelope(rejected, 429, "rate_limited")
    assert error["details"] == {"gate": "tenant", "reason": "tokens_per_minute"}
    assert "600 tokens" in error["message"] and "1000 tokens per minute" in error["message"]
    h = assert_ratelimit_headers(rejected, 1000, services(app).settings.tiers["standard"].requests_per_minute)
    assert int(h["x-ratelimit-remaining-tokens"]) < 600
    # 200 tokens short at 1000/min is 12 s; Retry-After rounds the exact wait up.
    assert 1 <= assert_retry_after(rejected) <= 12
    assert len(rows_of(app, tenant_id)) == 1


def test_request_rate_rejects_with_429(app, client):
    set_limits(app, client, requests_per_minute=2)
    assert [client.submit(prompt="q", max_tokens=4).status_code for _ in range(2)] == [202, 202]
    rejected = client.submit(prompt="q", max_tokens=4)
    assert assert_envelope(rejected, 429, "rate_limited")["details"]["reason"] == "requests_per_minute"
    assert rejected.headers["x-ratelimit-remaining-requests"] == "0"
    assert_retry_after(rejected)


def test_concurrency_cap_and_cancel_frees_the_slot(isolated_app, new_client):
    application = isolated_app()
    client = new_client(application)
    set_limits(application, client, max_concurrent=2)
    first, second = (client.submit(prompt=f"q{i}", max_tokens=4).get_json()["id"] for i in range(2))
    rejected = client.submit(prompt="q3", max_tokens=4)
    error = assert_envelope(rejected, 429, "tenant_concurrency_limit")
    assert "2 requests queued or running" in error["message"]
    assert assert_retry_after(rejected) == 1
    assert client.cancel(first).get_json()["status"] == "cancelled"
    assert client.submit(prompt="q4", max_tokens=4).status_code == 202


def test_too_large_for_the_model_or_the_tenant_is_413_with_the_numbers(app, client):
    context = services(app).settings.registry.default.context_tokens
    prompt = "abcd" * 250  # 250 tokens
    error = assert_envelope(client.submit(prompt=prompt, max_tokens=context), 413, "request_too_large")
    assert f"needs {250 + context} tokens" in error["message"] and f"context length of {context}" in error["message"]
    assert error["details"]["limit"] == "context_length" and error["details"]["limit_tokens"] == context

    tenant_id = set_limits(app, client, max_request_tokens=1000)
    error = assert_envelope(client.submit(prompt=prompt, max_tokens=800), 413, "request_too_large")
    assert "needs 1050 tokens (250 input + 800 max_tokens)" in error["message"]
    assert "per-request maximum of 1000" in error["message"]
    assert rows_of(app, tenant_id) == []


def test_shedding_and_batch_pause_come_from_the_load_level(isolated_app, new_client):
    application = isolated_app()
    client, redis = new_client(application), services(application).redis
    write_level(redis, LoadLevel.REJECT_BATCH)
    batch = client.submit(prompt="later", max_tokens=4, priority="batch")
    assert assert_envelope(batch, 503, "overloaded")["details"] == {"gate": "global", "reason": "batch_paused",
                                                                        "load_level": 4}
    assert_retry_after(batch)
    assert client.submit(prompt="now", max_tokens=4).status_code == 202

    write_level(redis, LoadLevel.SHED)
    shed = client.submit(prompt="now", max_tokens=4)
    assert assert_envelope(shed, 503, "overloaded")["details"]["reason"] == "shed"
    assert_retry_after(shed)

    # A level nobody refreshed is stale: the platform is treated as normal, never stuck shedding.
    seconds, _ = redis.time()
    redis.hset(LOAD_LEVEL_KEY, "updated_at_ms", (seconds - 3600) * 1000)
    assert client.submit(prompt="now", max_tokens=4, priority="batch").status_code == 202


def test_platform_token_rate_is_shared_by_all_tenants(isolated_app, new_client):
    application = isolated_app(platform_tokens_per_minute=1000)
    one, two = new_client(application), new_client(application)
    assert one.submit(prompt="abcd", max_tokens=599).status_code == 202
    rejected = two.submit(prompt="abcd", max_tokens=599)
    assert assert_envelope(rejected, 503, "overloaded")["details"]["reason"] == "platform_tokens"
    assert_retry_after(rejected)


def test_parallel_submits_never_exceed_the_token_budget(isolated_app, new_client):
    application = isolated_app()
    client = new_client(application)
    tenant_id = set_limits(application, client, tokens_per_minute=3000, requests_per_minute=10_000)

    def submit(i: int):
        return ApiClient(application, client.key).submit(prompt="abcd", max_tokens=199)  # 200 tokens each

    began = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(submit, range(48)))
    elapsed_s = time.monotonic() - began
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {202, 429}
    admitted_tokens = 200 * statuses.count(202)
    # A full bucket plus what refilled while the test ran, and not a token more.
    assert admitted_tokens <= 3000 + elapsed_s * 3000 / 60
    assert admitted_tokens > 3000 - 200
    rows = rows_of(application, tenant_id)
    assert len(rows) == statuses.count(202) and sum(r.reserved_tokens for r in rows) == admitted_tokens
    for response in responses:
        assert_ratelimit_headers(response, 3000, 10_000)


@pytest.mark.usefixtures("worker")
def test_finished_request_gives_back_what_it_did_not_use(app, client):
    """Through a real worker: 8,000 tokens reserved, a stop string ends it after a few.

    The budget is barely larger than the reservation, so refill alone would need a minute to
    give back what the refund gives back at once.
    """
    tenant_id = set_limits(app, client, tokens_per_minute=8100)
    limiter = services(app).admission.shared
    began = time.monotonic()
    # Its own deadline: the promise judges 8,000 tokens by the session worker's measured speed,
    # which a loaded host (four test processes on two cores) can bring below 8,000 in 300 s.
    accepted = client.submit(prompt="tell me a story", max_tokens=8000, stop=[" "], deadline_s=3600)
    assert accepted.status_code == 202
    reserved_remaining = int(accepted.headers["x-ratelimit-remaining-tokens"])
    view = client.wait(accepted.get_json()["id"])
    assert view["status"] == "succeeded" and view["usage"]["output_tokens"] < 10
    deadline = time.monotonic() + 10
    while limiter.in_flight(str(tenant_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert limiter.in_flight(str(tenant_id)) == [], "the worker never released the slot"

    with services(app).db.session() as session:
        limits = services(app).admission.limits_for(session.get(Tenant, tenant_id))
    remaining = limiter.peek(str(tenant_id), limits).tokens.remaining
    elapsed_s = time.monotonic() - began
    used = view["usage"]["input_tokens"] + view["usage"]["output_tokens"]
    refill = elapsed_s * 8100 / 60 + 1
    assert remaining >= 8100 - used - 1  # the unused 7,990-odd tokens came back
    assert remaining > reserved_remaining + refill  # more than refilling alone could have given
    # A duplicate release (a retried task, the sweep) gives nothing back twice.
    row = rows_of(app, tenant_id)[0]
    assert limiter.release_row(row) is False


def test_sweep_releases_slots_that_leaked(isolated_app, new_client):
    """A worker killed between its final write and its release; a web process killed before commit."""
    application = isolated_app()
    client = new_client(application)
    tenant_id = set_limits(application, client, max_concurrent=2, tokens_per_minute=10_000)
    limiter = services(application).admission.shared
    request_id = client.submit(prompt="abcd", max_tokens=999).get_json()["id"]
    with services(application).db.session() as session:
        session.execute(update(InferenceRequest).where(InferenceRequest.id == uuid.UUID(request_id)).values(
            status=Status.SUCCEEDED, started_at=InferenceRequest.created_at, output_tokens=10))
    seconds, _ = limiter.redis.time()
    limiter.redis.zadd(inflight_key(str(tenant_id)), {str(uuid.uuid4()): (seconds - 3600) * 1000})
    assert assert_envelope(client.submit(prompt="q", max_tokens=4), 429, "tenant_concurrency_limit")
    report = sweep(services(application))
    assert report["released"] == 2
    assert limiter.in_flight(str(tenant_id)) == []
    assert client.submit(prompt="q", max_tokens=4).status_code == 202


def test_rejections_are_counted_by_gate_and_reason(app, client):
    set_limits(app, client, requests_per_minute=1)
    client.submit(prompt="q", max_tokens=4)
    client.submit(prompt="q", max_tokens=4)
    metrics = app.test_client().get("/metrics").get_data(as_text=True)
    line = next(m for m in metrics.splitlines() if m.startswith("sluice_admission_rejections_total{")
                and 'reason="requests_per_minute"' in m)
    assert 'gate="tenant"' in line and float(line.rsplit(" ", 1)[1]) >= 1


def test_a_tenant_over_its_limits_is_refused_before_its_input_is_tokenized(app, client, monkeypatch):
    """Cheap gates first: counting 400 K characters of input costs the web tier real work, and a
    tenant whose request rate is used up would be refused whatever the count."""
    set_limits(app, client, requests_per_minute=1)
    counted = []
    planner = services(app).requests.planner
    real = planner.counters.for_model

    def counting(model):
        counter = real(model)
        monkeypatch.setattr(counter, "count", lambda request_input, _count=counter.count: (
            counted.append(1), _count(request_input))[1])
        return counter

    monkeypatch.setattr(planner.counters, "for_model", counting)
    assert client.submit(prompt="word " * 1000, max_tokens=4).status_code == 202
    assert len(counted) == 1
    rejected = client.submit(prompt="word " * 80_000, max_tokens=4)
    error = assert_envelope(rejected, 429, "rate_limited")
    assert error["details"]["reason"] == "requests_per_minute"
    assert len(counted) == 1, "the refused request was tokenized"
    assert_retry_after(rejected)
