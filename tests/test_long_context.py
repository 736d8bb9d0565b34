"""Requests too long for the default model go to a configured long-context model, or get 413.

Two simulated models: `sim-main` (the default, 1,024-token context) and `sim-long` (4,096).
One real worker serves only `sim-long`, on a Redis database of its own.
"""

from __future__ import annotations

import json

import pytest
from conftest import WorkerProcess, make_settings

from core.registry import RegistryError, parse_registry
from web.services import services

MODELS = json.dumps([
    {"name": "sim-main", "role": "main", "context_tokens": 1024},
    {"name": "sim-long", "role": "long", "context_tokens": 4096},
])
ENV = {"SLUICE_MODELS": MODELS}


@pytest.fixture(scope="module")
def long_stack(database_url, redis_dbs, tmp_path_factory):
    from web import create_app

    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url, ENV))
    worker = WorkerProcess(database_url, redis_url, tmp_path_factory.mktemp("long"), extra_env=ENV,
                           model="sim-long")
    yield application
    worker.stop()
    services(application).redis.flushdb()
    services(application).db.dispose()


@pytest.fixture
def api(long_stack, new_client):
    return new_client(long_stack)


def test_too_long_for_the_default_model_runs_on_the_long_context_model(api):
    prompt = "abcd" * 1500  # 1,500 tokens by the estimate: over sim-main's 1,024
    response = api.submit(prompt=prompt, max_tokens=16)
    assert response.status_code == 202, response.get_json()
    view = api.wait(response.get_json()["id"])
    assert view["status"] == "succeeded", view
    assert view["model"] == "sim-main" and view["model_routed"] == "sim-long"
    assert view["route_reason"] == "long_context" and view["model_used"] == "sim-long"
    assert view["queue"] == "realtime.large.sim-long" and view["usage"]["reserved_tokens"] == 1516


def test_a_request_that_fits_is_not_routed(api):
    view = api.get(api.submit(prompt="short question", max_tokens=16).get_json()["id"]).get_json()
    assert view["model_routed"] is None and view["route_reason"] is None and view["queue"] == "realtime.small"
    assert api.cancel(view["id"]).get_json()["status"] == "cancelled"  # nobody serves sim-main here


def test_naming_the_default_model_keeps_it_and_gets_413(api):
    response = api.submit(prompt="abcd" * 1500, max_tokens=16, model="sim-main")
    assert response.status_code == 413
    error = response.get_json()["error"]
    assert error["code"] == "request_too_large" and "sim-main's context length of 1024" in error["message"]


def test_too_long_for_every_model_is_413_citing_the_long_model(api):
    response = api.submit(prompt="abcd" * 4000, max_tokens=200)
    assert response.status_code == 413
    error = response.get_json()["error"]
    assert "needs 4200 tokens" in error["message"] and "sim-long's context length of 4096" in error["message"]
    assert error["details"]["limit"] == "context_length" and error["details"]["limit_tokens"] == 4096


def test_registry_lists_long_models_smallest_first():
    registry = parse_registry(json.dumps([
        {"name": "main", "role": "main", "context_tokens": 8192},
        {"name": "long-128k", "role": "long", "context_tokens": 131072},
        {"name": "long-32k", "role": "long", "context_tokens": 32768},
    ]), name="unused", path=None, context_tokens=8192)
    assert registry.default.name == "main"
    assert [m.name for m in registry.long_models()] == ["long-32k", "long-128k"]
    assert parse_registry(None, name="m", path=None, context_tokens=8192).long_models() == []
    with pytest.raises(RegistryError, match="main, light, long or embed"):
        parse_registry(json.dumps([{"name": "x", "role": "huge"}]), name="m", path=None, context_tokens=8192)


def test_the_smallest_long_model_that_holds_the_request_takes_it(database_url, redis_dbs, new_client):
    from web import create_app

    models = json.dumps([{"name": "sim-main", "role": "main", "context_tokens": 1024},
                         {"name": "sim-long-4k", "role": "long", "context_tokens": 4096},
                         {"name": "sim-long-2k", "role": "long", "context_tokens": 2048}])
    application = create_app(make_settings(database_url, redis_dbs(), {"SLUICE_MODELS": models}))
    client = new_client(application)
    try:
        routed = {}
        for prompt_tokens in (1500, 3000):
            request_id = client.submit(prompt="abcd" * prompt_tokens, max_tokens=16).get_json()["id"]
            routed[prompt_tokens] = client.get(request_id).get_json()["model_routed"]
            client.cancel(request_id)  # no worker serves these models here
        assert routed == {1500: "sim-long-2k", 3000: "sim-long-4k"}
    finally:
        services(application).redis.flushdb()
        services(application).db.dispose()
