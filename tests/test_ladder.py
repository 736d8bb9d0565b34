"""The degradation ladder's first steps at admission: light model, shorter output, switches."""

from __future__ import annotations

import json

from admission_support import rows_of, tenant_id_of

from core.admission.load import ClassLoad, LoadLevel, write_level
from models import Priority
from web.services import services

MODELS = json.dumps([{"name": "simulated-llama-8b", "role": "main"}, {"name": "llama-light", "role": "light"}])


def warm(application, model: str) -> None:
    """A realtime class snapshot saying one warm worker serves ``model``."""
    svc = services(application)
    seconds, micros = svc.redis.time()
    ClassLoad(Priority.REALTIME.value, model, 0, 0, 0, 0.0, 0.0, 0.0, 0, 1, seconds * 1000 + micros // 1000).write(
        svc.redis, ttl_s=30)


def test_shorter_output_caps_realtime_max_tokens_and_says_so(isolated_app, new_client):
    application = isolated_app()
    client = new_client(application)
    write_level(services(application).redis, LoadLevel.SHORTER_OUTPUT)
    response = client.submit(prompt="tell me everything", max_tokens=1000)
    assert response.status_code == 202 and response.headers["Sluice-Degradation"] == "shorter_output"
    view = client.get(response.get_json()["id"]).get_json()
    assert view["max_tokens"] == 128 and view["degradation_step"] == "shorter_output"
    assert view["usage"]["reserved_tokens"] == view["usage"]["input_tokens"] + 128
    batch = client.submit(prompt="batch keeps its length", max_tokens=1000, priority="batch")
    assert "Sluice-Degradation" not in batch.headers
    assert client.get(batch.get_json()["id"]).get_json()["max_tokens"] == 1000
    short = client.submit(prompt="already short", max_tokens=64)
    assert "Sluice-Degradation" not in short.headers


def test_below_its_level_or_switched_off_a_step_changes_nothing(isolated_app, new_client):
    calm = isolated_app()
    write_level(services(calm).redis, LoadLevel.LIGHT_MODEL)
    client = new_client(calm)
    assert client.get(client.submit(prompt="q", max_tokens=1000).get_json()["id"]).get_json()["max_tokens"] == 1000
    off = isolated_app(ladder_steps="light_model,reject_batch,shed")
    write_level(services(off).redis, LoadLevel.SHORTER_OUTPUT)
    client = new_client(off)
    response = client.submit(prompt="q", max_tokens=1000)
    assert "Sluice-Degradation" not in response.headers
    assert client.get(response.get_json()["id"]).get_json()["degradation_step"] is None


def test_light_model_takes_realtime_requests_that_named_no_model_while_warm(isolated_app, new_client):
    application = isolated_app(models_json=MODELS)
    client = new_client(application)
    write_level(services(application).redis, LoadLevel.LIGHT_MODEL, classes={"realtime:simulated-llama-8b": 1})
    cold = client.submit(prompt="no light worker yet", max_tokens=16)
    assert "Sluice-Degradation" not in cold.headers
    warm(application, "llama-light")
    application = isolated_app(models_json=MODELS)  # a fresh process-level read of the load
    client = new_client(application)
    routed = client.submit(prompt="light will do", max_tokens=16).get_json()
    named = client.submit(prompt="I asked for main", max_tokens=16, model="simulated-llama-8b").get_json()
    rows = {str(r.id): r for r in rows_of(application, tenant_id_of(application, client))}
    light = rows[routed["id"]]
    assert (light.model_routed, light.route_reason, light.queue) == ("llama-light", "light_model",
                                                                     "realtime.small.llama-light")
    assert light.degradation_step == "light_model"
    assert rows[named["id"]].model_routed is None and rows[named["id"]].degradation_step is None


def test_reject_batch_switched_off_keeps_batch_flowing_at_level_4(isolated_app, new_client):
    application = isolated_app(ladder_steps="light_model,shorter_output,shed")
    client = new_client(application)
    write_level(services(application).redis, LoadLevel.REJECT_BATCH)
    assert client.submit(prompt="batch", max_tokens=8, priority="batch").status_code == 202


def test_each_class_is_judged_by_its_own_level(isolated_app, new_client):
    """One model shedding (issue 21, defect 3): its realtime and batch traffic are refused, the
    other model's traffic is neither refused nor degraded, and neither is a batch request of a
    model whose own realtime class is calm."""
    application = isolated_app(models_json=MODELS)
    client = new_client(application)
    write_level(services(application).redis, LoadLevel.SHED, classes={"realtime:simulated-llama-8b": 6})
    shed = client.submit(prompt="main is shedding", max_tokens=1000)
    assert shed.status_code == 503 and shed.get_json()["error"]["details"]["reason"] == "shed"
    batch = client.submit(prompt="main's batch", max_tokens=1000, priority="batch", model="simulated-llama-8b")
    assert batch.status_code == 503 and batch.get_json()["error"]["details"]["reason"] == "shed"
    for priority in ("realtime", "batch"):
        other = client.submit(prompt=f"light is calm ({priority})", max_tokens=1000, model="llama-light",
                              priority=priority)
        assert other.status_code == 202, other.get_json()
        assert "Sluice-Degradation" not in other.headers
        assert client.get(other.get_json()["id"]).get_json()["max_tokens"] == 1000

    write_level(services(application).redis, LoadLevel.REJECT_BATCH, classes={"realtime:simulated-llama-8b": 4})
    assert client.submit(prompt="batch behind busy realtime", max_tokens=8, priority="batch",
                         model="simulated-llama-8b").status_code == 503
    assert client.submit(prompt="batch of a calm model", max_tokens=8, priority="batch",
                         model="llama-light").status_code == 202


def test_the_light_model_takes_nothing_while_as_loaded_as_the_main_one(isolated_app, new_client):
    application = isolated_app(models_json=MODELS)
    warm(application, "llama-light")
    write_level(services(application).redis, LoadLevel.LIGHT_MODEL,
                classes={"realtime:simulated-llama-8b": 1, "realtime:llama-light": 1})
    client = new_client(application)
    response = client.submit(prompt="both are busy", max_tokens=16)
    assert response.status_code == 202 and "Sluice-Degradation" not in response.headers
