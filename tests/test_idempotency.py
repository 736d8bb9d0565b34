"""Idempotency-Key: a retried submit returns the original request and creates no new work."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from admission_support import idempotency_keys_of, rows_of, set_limits, tenant_id_of
from conftest import ApiClient
from sqlalchemy import text
from test_admission import assert_ratelimit_headers
from test_api_errors import assert_envelope

from web.services import services

BODY = {"prompt": "summarise the quarterly report", "max_tokens": 32}


def submit(client: ApiClient, key: str, body: dict | None = None):
    return client.http.post("/v1/requests", json=body or BODY, headers={**client.headers, "Idempotency-Key": key})


def test_retry_with_the_same_key_returns_the_original_request(app, client):
    tenant_id = set_limits(app, client, requests_per_minute=2)
    first = submit(client, "order-1")
    assert first.status_code == 202 and "Idempotent-Replayed" not in first.headers
    again = submit(client, "order-1")
    assert again.status_code == 202 and again.headers["Idempotent-Replayed"] == "true"
    assert again.get_json()["id"] == first.get_json()["id"]
    assert again.headers["Location"] == first.headers["Location"]
    assert_ratelimit_headers(again, services(app).settings.tiers["standard"].tokens_per_minute, 2)
    # The replay was not charged: one request of the two per minute is gone, not both.
    assert again.headers["x-ratelimit-remaining-requests"] == "1"
    assert len(rows_of(app, tenant_id)) == 1
    assert submit(client, "order-2").get_json()["id"] != first.get_json()["id"]


def test_same_key_with_another_body_is_422(client):
    assert submit(client, "k").status_code == 202
    error = assert_envelope(submit(client, "k", {**BODY, "max_tokens": 33}), 422, "idempotency_key_reused")
    assert "different body" in error["message"]


def test_keys_are_scoped_per_tenant(app, client, new_client):
    other = new_client()
    mine, theirs = submit(client, "shared-name"), submit(other, "shared-name", {**BODY, "max_tokens": 5})
    assert mine.status_code == theirs.status_code == 202
    assert mine.get_json()["id"] != theirs.get_json()["id"]


def test_a_replay_is_not_rate_limited(app, client):
    set_limits(app, client, requests_per_minute=1)
    first = submit(client, "once")
    assert submit(client, "once").get_json()["id"] == first.get_json()["id"]
    assert_envelope(client.submit(**BODY), 429, "rate_limited")


def test_concurrent_retries_create_exactly_one_row(isolated_app, new_client):
    application = isolated_app()
    client = new_client(application)
    tenant_id = tenant_id_of(application, client)
    start = threading.Barrier(16)

    def race(_):
        start.wait()
        return submit(ApiClient(application, client.key), "racing-key")

    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(race, range(16)))
    assert {r.status_code for r in responses} == {202}
    assert len({r.get_json()["id"] for r in responses}) == 1
    assert sum(r.headers.get("Idempotent-Replayed") == "true" for r in responses) == 15
    assert len(rows_of(application, tenant_id)) == 1 and idempotency_keys_of(application, tenant_id) == 1
    # The losers' reservations were given back: only the one request is in flight.
    assert services(application).admission.shared.in_flight(str(tenant_id)) == [
        responses[0].get_json()["id"]]


def test_an_expired_key_starts_a_new_request_and_the_sweep_deletes_old_keys(isolated_app, new_client):
    from workers.sweep import sweep

    application = isolated_app()
    client = new_client(application)
    tenant_id = tenant_id_of(application, client)
    first = submit(client, "nightly").get_json()["id"]
    with services(application).db.session() as session:
        session.execute(text("UPDATE idempotency_keys SET created_at = now() - interval '2 days' "
                             "WHERE tenant_id = :t"), {"t": tenant_id})
    second = submit(client, "nightly")
    assert second.status_code == 202 and "Idempotent-Replayed" not in second.headers
    assert second.get_json()["id"] != first
    assert idempotency_keys_of(application, tenant_id) == 1

    with services(application).db.session() as session:
        session.execute(text("UPDATE idempotency_keys SET created_at = now() - interval '2 days' "
                             "WHERE tenant_id = :t"), {"t": tenant_id})
    assert sweep(services(application))["idempotency_keys_expired"] >= 1
    assert idempotency_keys_of(application, tenant_id) == 0


def test_malformed_keys_are_rejected(client):
    for bad in ("", "has space", "x" * 256, "ümlaut"):
        response = client.http.post("/v1/requests", json=BODY,
                                    headers={**client.headers, "Idempotency-Key": bad.encode().decode("latin-1")})
        error = assert_envelope(response, 422, "invalid_request")
        assert "Idempotency-Key" in error["details"]
