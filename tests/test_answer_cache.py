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
