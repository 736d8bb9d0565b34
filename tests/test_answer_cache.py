"""The hot answer cache: a twin of an answered request is answered without a GPU."""

from __future__ import annotations

import time
import uuid

import pytest
from sqlalchemy import select

from core.admission.load import LoadLevel, write_level
from core.rediskeys import LOAD_LEVEL_KEY
from models import InferenceRequest
from web.services import services

pytestmark = pytest.mark.usefixtures("worker")


def test_a_deterministic_twin_is_answered_from_the_cache(client, app):
    body = {"prompt": f"what is a sluice? {time.time()}", "max_tokens": 8, "temperature": 0}
    first = client.wait(client.submit(**body).get_json()["id"])
    assert first["status"] == "succeeded" and first["cache_hit"] is False
    twin = client.submit(**body)
    assert twin.status_code == 202 and twin.headers["Sluice-Cache"] == "hit"
    assert twin.get_json()["status"] == "succeeded"
    view = client.get(twin.get_json()["id"]).get_json()
    assert view["cache_hit"] is True and view["worker"] is None and view["attempts"] == 0
    assert view["output"] == first["output"] and view["usage"]["output_tokens"] == 8
    assert view["timings"]["queue_wait_s"] < 0.5 and view["timings"]["inference_s"] == 0
    # No engine ran for the twin: of this tenant's rows, only the first was ever claimed. (Not the
    # shared worker's token counter: requests earlier tests left queued may run on it meanwhile.)
    with services(app).db.session() as session:
        ran = session.scalars(select(InferenceRequest.id).where(
            InferenceRequest.tenant_id == session.get(InferenceRequest, uuid.UUID(first["id"])).tenant_id,
            InferenceRequest.attempts > 0)).all()
    assert [str(i) for i in ran] == [first["id"]], "no engine ran for the twin"
    # Any parameter that changes the output makes another request.
    other = client.submit(**{**body, "max_tokens": 9})
    assert "Sluice-Cache" not in other.headers and client.wait(other.get_json()["id"])["cache_hit"] is False


def test_a_sampled_twin_is_answered_from_the_cache_only_at_the_cached_answer_level(client, app):
    body = {"prompt": f"tell me a story {time.time()}", "max_tokens": 8, "temperature": 0.8, "seed": 7}
    client.wait(client.submit(**body).get_json()["id"])
    assert "Sluice-Cache" not in client.submit(**body).headers, "outside degradation: computed again"
    redis = services(app).redis
    write_level(redis, LoadLevel.CACHED_ANSWERS, ttl_s=5)
    try:
        time.sleep(0.6)  # the web process reads the level at most every 0.5 s
        twin = client.submit(**body)
        assert twin.headers["Sluice-Cache"] == "hit"
        assert twin.headers["Sluice-Degradation"] == "cached_answer"
        assert client.get(twin.get_json()["id"]).get_json()["degradation_step"] == "cached_answer"
    finally:
        redis.delete(LOAD_LEVEL_KEY)
        time.sleep(0.6)  # the next test must not see the level


def test_with_the_cache_off_nothing_is_cached(isolated_app, new_client):
    application = isolated_app(cache_ttl_s=0)
    cache = services(application).answers
    cache.put("sluice:answer:off", {"text": "x", "output_tokens": 1})
    assert cache.get("sluice:answer:off") is None
    assert services(application).redis.exists("sluice:answer:off") == 0


def test_answers_are_kept_per_tenant(client, new_client, app):
    """Another tenant's identical request is neither answered from this one's cache (a hit would
    tell it what was asked, and at the cached_answer level give it a sampled answer) nor parked on
    this one's request in flight: it is computed for it."""
    body = {"prompt": f"what did the other team ask? {uuid.uuid4()}", "max_tokens": 8, "temperature": 0}
    first = client.wait(client.submit(**body).get_json()["id"])
    assert first["status"] == "succeeded"
    other = new_client()
    twin = other.submit(**body)
    assert twin.status_code == 202 and "Sluice-Cache" not in twin.headers
    view = other.wait(twin.get_json()["id"])
    assert view["status"] == "succeeded" and view["cache_hit"] is False and view["attempts"] == 1
    # While one tenant's request is in flight, another's twin is not parked on it.
    slow = {**body, "prompt": f"a long one {uuid.uuid4()}", "max_tokens": 400}
    leader = client.submit(**slow).get_json()["id"]
    client.wait(leader, statuses={"running"})
    theirs = other.submit(**slow).get_json()["id"]
    with services(app).db.session() as session:
        assert session.get(InferenceRequest, uuid.UUID(theirs)).follows_id is None
    assert client.cancel(leader).status_code == 200 and other.cancel(theirs).status_code == 200


def test_tenants_the_operator_names_share_answers(database_url, redis_dbs, new_client, app, tmp_path):
    """SLUICE_CACHE_SHARED_TENANTS: what one of the named tenants was answered, the others are
    answered from the cache too (the worker stores it under the shared scope); anyone else is not."""
    from admission_support import tenant_id_of
    from conftest import WorkerProcess, make_settings

    from web import create_app

    ours, theirs, outsider = new_client(), new_client(), new_client()
    env = {"SLUICE_CACHE_SHARED_TENANTS": ",".join(str(tenant_id_of(app, c)) for c in (ours, theirs))}
    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url, env))
    worker = WorkerProcess(database_url, redis_url, tmp_path, extra_env=env)
    try:
        for member in (ours, theirs, outsider):
            member.http = application.test_client()
        body = {"prompt": f"a question two teams ask {uuid.uuid4()}", "max_tokens": 8, "temperature": 0}
        first = ours.wait(ours.submit(**body).get_json()["id"])
        assert first["status"] == "succeeded" and first["cache_hit"] is False
        answered = theirs.submit(**body)
        assert answered.headers.get("Sluice-Cache") == "hit"
        assert theirs.get(answered.get_json()["id"]).get_json()["output"] == first["output"]
        assert "Sluice-Cache" not in outsider.submit(**body).headers
    finally:
        worker.stop()
        services(application).db.dispose()
        redis_dbs.release(redis_url)


def test_cache_hits_count_against_the_request_rate_not_tokens(client, app):
    """A hit costs no GPU but a row and a round trip: one request of the tenant's rate each, and
    no tokens, so a tenant cannot write rows past its request rate by asking one question again."""
    from admission_support import set_limits
    from test_api_errors import assert_envelope

    # Tokens refill at 1,000 a minute: a hit charged its ~20 tokens would show as a fall.
    set_limits(app, client, requests_per_minute=6, tokens_per_minute=1000)
    body = {"prompt": f"asked again and again {uuid.uuid4()}", "max_tokens": 8, "temperature": 0}
    client.wait(client.submit(**body).get_json()["id"])
    answers = [client.submit(**body) for _ in range(7)]
    hits = [a for a in answers if a.status_code == 202]
    assert len(hits) == 5 and all(a.headers["Sluice-Cache"] == "hit" for a in hits), [a.status_code for a in answers]
    assert_envelope(answers[-1], 429, "rate_limited")
    assert [int(a.headers["x-ratelimit-remaining-requests"]) for a in hits] == [4, 3, 2, 1, 0]
    tokens = [int(a.headers["x-ratelimit-remaining-tokens"]) for a in hits]
    assert tokens == sorted(tokens), f"a hit charges no tokens: {tokens}"
