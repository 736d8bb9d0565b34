"""Identical requests in flight are computed once: twins park on the first and take its answer."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from core.submit.answers import answer_key
from core.submit.twins import FOLLOWED_PREFIX, LEADER_PREFIX
from models import InferenceRequest, Priority, SizeClass, Status
from models.lifecycle import SUCCEEDED, Lifecycle
from web.services import services
from workers.sweep import sweep

pytestmark = pytest.mark.usefixtures("worker")


def question(max_tokens: int = 400) -> dict:
    return {"prompt": f"why do retries bury a service? {uuid.uuid4()}", "max_tokens": max_tokens,
            "temperature": 0}


def row(app, request_id) -> InferenceRequest:
    with services(app).db.session() as session:
        return session.get(InferenceRequest, uuid.UUID(request_id))


def test_identical_requests_in_flight_are_computed_once(client, app):
    body = question()
    leader = client.submit(**body).get_json()["id"]
    client.wait(leader, statuses={"running"})
    twins = [client.submit(**body) for _ in range(5)]
    assert all(t.status_code == 202 and "Sluice-Cache" not in t.headers for t in twins)
    assert {str(row(app, t.get_json()["id"]).follows_id) for t in twins} == {leader}
    first = client.wait(leader)
    assert first["status"] == "succeeded" and first["cache_hit"] is False
    for twin in twins:
        view = client.wait(twin.get_json()["id"], timeout=10)
        assert view["status"] == "succeeded" and view["cache_hit"] is True, view
        assert view["output"] == first["output"] and view["worker"] is None and view["attempts"] == 0
    # What the engine ran for this tenant: the leader alone. (Not the shared worker's token counter:
    # requests earlier tests left queued may run on it meanwhile.)
    tenant_id = row(app, leader).tenant_id
    with services(app).db.session() as session:
        ran = session.scalars(select(InferenceRequest.id).where(
            InferenceRequest.tenant_id == tenant_id, InferenceRequest.attempts > 0)).all()
    assert [str(i) for i in ran] == [leader], "a twin was computed too"
    svc = services(app)
    key = answer_key(str(tenant_id), svc.settings.registry.default.name, {"prompt": body["prompt"]},
                     {"temperature": 0}, 400)
    assert not svc.redis.exists(LEADER_PREFIX + key.split(":")[-1]), "the leader key outlived the leader"


def test_twins_of_a_cancelled_request_are_computed_on_their_own(client):
    body = question()
    leader = client.submit(**body).get_json()["id"]
    twin = client.submit(**body).get_json()["id"]
    assert client.cancel(leader).status_code == 200
    view = client.wait(twin)
    assert view["status"] == "succeeded" and view["cache_hit"] is False and view["attempts"] == 1
    assert client.get(leader).get_json()["status"] == "cancelled"


def test_a_twin_parked_on_a_leader_that_just_ended_settles_itself(client, app):
    """The leader's end hook ran before the twin's row existed: the twin's own check answers it."""
    body = question(max_tokens=8)
    svc = services(app)
    # A finished leader whose answer never reached the cache, but whose leader key is still there.
    leader = client.wait(client.submit(**body).get_json()["id"])
    key = answer_key(str(row(app, leader["id"]).tenant_id), svc.settings.registry.default.name,
                     {"prompt": body["prompt"]}, {"temperature": 0}, 8)
    svc.redis.delete(key)
    svc.redis.set(LEADER_PREFIX + key.split(":")[-1], leader["id"], ex=30)
    twin = client.submit(**body)
    assert twin.status_code == 202
    view = client.get(twin.get_json()["id"]).get_json()
    assert view["status"] == "succeeded" and view["cache_hit"] is True and view["output"] == leader["output"]


def test_the_sweep_settles_twins_whose_leader_ended_without_its_hook(app, client):
    svc = services(app)
    tenant_id = row(app, client.submit(prompt="whose tenant", max_tokens=1).get_json()["id"]).tenant_id
    bare = Lifecycle(svc.db)  # no hooks: a process that died between its commit and the hook
    columns = dict(tenant_id=tenant_id, priority=Priority.REALTIME, size_class=SizeClass.SMALL, queue="nobody.reads",
                   model_requested="m", input={"prompt": "p"}, params={}, max_tokens=4, time_limit_s=60,
                   reserved_tokens=5, input_tokens=1)
    leader = InferenceRequest(id=uuid.uuid4(), **columns)
    bare.accept(leader)
    twin = InferenceRequest(id=uuid.uuid4(), follows_id=leader.id, **columns)
    bare.accept(twin)
    assert bare.claim(leader.id, "w/gone", "dev0") is not None
    out = SimpleNamespace(text="the answer", output_tokens=2, prompt_tokens=1, cached_tokens=0, finish_reason="length")
    bare.finish(leader.id, "w/gone", SUCCEEDED, output=out)
    svc.redis.delete(FOLLOWED_PREFIX + str(leader.id))
    sweep(svc)  # (or the session's own beat got there first)
    settled = row(app, str(twin.id))
    assert settled.status == Status.SUCCEEDED and settled.output_text == "the answer" and settled.cache_hit
    assert settled.enqueued_at is None, "a parked twin is never published"


def test_parked_twins_are_charged_to_their_tenant(isolated_app, new_client):
    """A twin holds a row and a concurrency slot, and runs if its leader ends without an answer:
    it passes its tenant's gates like any request. Sixty twins of a 1,500-token request from a
    tenant allowed four at once are four requests in all, never sixty running when the first is
    cancelled. (No worker: the leader stays queued, which is enough to park on it.)"""
    from admission_support import set_limits
    from test_api_errors import assert_envelope

    application = isolated_app()
    client = new_client(application)
    # Buckets that refill slowly: 20 requests and 12,000 tokens a minute (a third of a request and
    # 200 tokens a second). With the tier's millions a minute, a submit slower than ~45 ms found the
    # bucket refilled to the brim, and two answers showed the same remaining count.
    set_limits(application, client, max_concurrent=4, requests_per_minute=20, tokens_per_minute=12_000)
    body = {"prompt": f"X {uuid.uuid4()}", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "priority": "batch", "deadline_s": 3600}
    answers = [client.submit(**body) for _ in range(10)]
    assert [a.status_code for a in answers] == [202] * 4 + [429] * 6
    for refused in answers[4:]:
        assert_envelope(refused, 429, "tenant_concurrency_limit")
    leader, *twins = (a.get_json()["id"] for a in answers[:4])
    assert {str(row(application, t).follows_id) for t in twins} == {leader}
    for kind in ("requests", "tokens"):  # every one was charged
        remaining = [int(a.headers[f"x-ratelimit-remaining-{kind}"]) for a in answers[:4]]
        assert remaining == sorted(remaining, reverse=True) and len(set(remaining)) == 4, (kind, remaining)
    # The leader cancelled, its twins are un-parked into plain queued requests: they keep the slots
    # they were charged, so the tenant has one slot free, not four.
    assert client.cancel(leader).status_code == 200
    assert {row(application, t).status for t in twins} == {Status.QUEUED}
    assert client.submit(**{**body, "prompt": f"another {uuid.uuid4()}"}).status_code == 202
    assert_envelope(client.submit(**{**body, "prompt": f"one more {uuid.uuid4()}"}), 429, "tenant_concurrency_limit")
