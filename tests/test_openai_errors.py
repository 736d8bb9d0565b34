"""Every OpenAI route answers errors in OpenAI's shape, one way (``web/openai/errors.py``):

    {"error": {"message", "type", "param", "code"}}

with ``type`` from the status alone, ``code`` Sluice's stable code, ``param`` the first invalid
field, and the native status and headers except that an invalid body is 400. One test per
status, through the real routes (chat and completions, models, Files, Batches) of an app built
by ``create_app``; the official SDK, given the same answers, raises the matching exception.
"""

from __future__ import annotations

import io
import json
import threading
import time
import uuid

import httpx
import pytest
from conftest import make_settings
from sqlalchemy import select, text

import models.lifecycle as lc
from core.settings import Settings
from launcher.database import create_key
from models import ApiKey, InferenceRequest, Status, hash_key
from web import create_app
from web.openai.errors import TYPES
from web.services import services

MODEL = "simulated-llama-8b"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
WORKER = "test-openai-errors"


def openai_error(response, status: int, kind: str, code: str | None = None) -> dict:
    """The answer's error object, checked: OpenAI's four fields and nothing else, the status, the type."""
    assert response.status_code == status, response.get_data(as_text=True)
    body = response.get_json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error = body["error"]
    assert error["type"] == kind == TYPES.get(status, kind)
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def jsonl(lines: list) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def upload(http, headers: dict[str, str], body: bytes, purpose: str = "batch"):
    return http.post("/v1/files", headers=headers, content_type="multipart/form-data",
                     data={"purpose": purpose, "file": (io.BytesIO(body), "input.jsonl")})


def sdk(app, key: str, **options):
    """The official OpenAI client, talking to ``app`` in-process (no socket); ``options`` go to
    ``openai.OpenAI`` (``timeout``, say)."""
    openai = pytest.importorskip("openai")
    http = httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://sluice.test")
    return openai, openai.OpenAI(api_key=key, base_url="http://sluice.test/v1", max_retries=0, http_client=http,
                                 **options)


def tenant_sql(app, key: str, statement: str) -> None:
    with services(app).db.session() as session:
        session.execute(text(statement.format(tenant="(SELECT tenant_id FROM api_keys WHERE key_hash = :h)")),
                        {"h": hash_key(key)})


def queued_request(app, key: str, timeout: float = 30) -> uuid.UUID:
    """The id of the tenant's one queued request (a call still waiting for its answer)."""
    deadline = time.monotonic() + timeout
    db = services(app).db
    while True:
        with db.session() as session:
            tenant = select(ApiKey.tenant_id).where(ApiKey.key_hash == hash_key(key)).scalar_subquery()
            found = session.scalar(select(InferenceRequest.id).where(InferenceRequest.tenant_id == tenant,
                                                                     InferenceRequest.status == Status.QUEUED))
        if found is not None:
            return found
        assert time.monotonic() < deadline, "the call made no request"
        time.sleep(0.05)


def waiting_call(app, key: str, path: str = "/v1/chat/completions", body: dict | None = None):
    """Start a completion call that waits for its answer; returns (thread, answer holder)."""
    answer: dict = {}

    def call() -> None:
        answer["response"] = app.test_client().post(path, json=body or CHAT, headers={"Authorization": f"Bearer {key}"})

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, answer


# ------------------------------------------------------------------ 400

def test_400_invalid_body_names_the_field(client):
    http, headers = client.http, client.headers
    error = openai_error(http.post("/v1/chat/completions", json={**CHAT, "n": 17}, headers=headers),
                         400, "invalid_request_error", "invalid_request")
    assert error["param"] == "n" and "16" in error["message"]  # OpenAI has no details: they are here
    error = openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "best_of": 2},
                                   headers=headers), 400, "invalid_request_error", "invalid_request")
    assert error["param"] == "best_of"
    error = openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [101, 102]},
                                   headers=headers), 400, "invalid_request_error", "invalid_request")
    assert error["param"] == "prompt"  # token arrays are refused (a list of strings is taken)
    error = openai_error(http.post("/v1/completions", json={"model": "gpt-17", "prompt": "hi"}, headers=headers),
                         400, "invalid_request_error", "invalid_request")
    assert error["param"] == "model" and MODEL in error["message"]  # the native check, as OpenAI's shape
    error = openai_error(http.post("/v1/chat/completions", data="{not json",
                                   headers={**headers, "Content-Type": "application/json"}),
                         400, "invalid_request_error", "malformed_json")
    assert error["param"] is None
    # Batches: an invalid field (a 422 natively) is a 400 here too, with its param.
    error = openai_error(http.post("/v1/batches", json={"input_file_id": "file-" + "0" * 32, "endpoint": "/v1/x",
                                                       "completion_window": "24h"}, headers=headers),
                         400, "invalid_request_error")
    assert error["param"] == "endpoint"
    error = openai_error(upload(http, headers, jsonl([{"custom_id": "a", "text": "b"}]), purpose="fine-tune"),
                         400, "invalid_request_error", "invalid_purpose")
    assert error["param"] == "purpose"
    error = openai_error(http.get("/v1/batches?limit=0", headers=headers), 400, "invalid_request_error")
    assert error["param"] == "limit"


def test_a_file_with_no_valid_line_is_refused_with_the_line_checks_of_the_front(client):
    """The batch's lines go through the front's own body check: a line the front would refuse is
    an invalid line, with the code ingest gives it."""
    http, headers = client.http, client.headers
    lines = [{"custom_id": "n", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "alloy"}}},
             {"custom_id": "tools", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}], "prediction": {"type": "content"}}},
             {"custom_id": "stream", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "p", "stream": True}},
             {"custom_id": "temperature", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "p", "temperature": 9}},
             {"custom_id": "role", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "wizard", "content": "hi"}]}},
             {"custom_id": "model", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "model": "x"}}]
    file_id = upload(http, headers, jsonl(lines)).get_json()["id"]
    error = openai_error(http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                       "completion_window": "24h"}, headers=headers),
                         400, "invalid_request_error", "no_valid_lines")
    assert error["param"] is None
    native = http.post("/v1/jobs", data=jsonl(lines), headers={**headers, "Content-Type": "application/jsonl"})
    assert native.status_code == 422, native.get_json()
    codes = [line["code"] for line in native.get_json()["error"]["details"]["lines"]]
    assert codes == ["unsupported_fields", "unsupported_fields", "unsupported_fields", "invalid_body", "invalid_body",
                     "unknown_model"]


# ------------------------------------------------------------------ 401, 403

def test_401_for_a_missing_or_wrong_key_on_every_openai_route(app):
    http = app.test_client()
    wrong = {"Authorization": "Bearer sk-sluice-nope"}
    for method, path in (("post", "/v1/chat/completions"), ("post", "/v1/completions"), ("get", "/v1/models"),
                         ("get", "/v1/files/file-" + "0" * 32), ("get", "/v1/files/file-" + "0" * 32 + "/content"),
                         ("post", "/v1/files"), ("get", "/v1/batches"), ("post", "/v1/batches"),
                         ("get", "/v1/batches/batch_x"), ("post", "/v1/batches/batch_x/cancel")):
        response = getattr(http, method)(path, headers=wrong, json={})
        openai_error(response, 401, "authentication_error", "invalid_api_key")
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    openai_error(http.get("/v1/models"), 401, "authentication_error", "missing_api_key")


def test_403_for_a_disabled_tenant(app, new_client):
    client = new_client()
    tenant_sql(app, client.key, "UPDATE tenants SET disabled_at = now() WHERE id = {tenant}")
    openai_error(client.http.post("/v1/chat/completions", json=CHAT, headers=client.headers),
                 403, "permission_error", "tenant_disabled")
    openai_error(client.http.get("/v1/batches", headers=client.headers), 403, "permission_error", "tenant_disabled")


# ------------------------------------------------------------------ 404

def test_404_for_an_unknown_file_or_batch(client):
    http, headers = client.http, client.headers
    missing = "0" * 32
    openai_error(http.get(f"/v1/files/file-{missing}", headers=headers), 404, "not_found_error", "file_not_found")
    openai_error(http.get(f"/v1/files/file-{missing}/content", headers=headers), 404, "not_found_error",
                 "file_not_found")
    openai_error(http.get(f"/v1/files/file-out-{missing}", headers=headers), 404, "not_found_error")
    openai_error(http.get("/v1/files/not-an-id", headers=headers), 404, "not_found_error")
    openai_error(http.get(f"/v1/batches/batch_{missing}", headers=headers), 404, "not_found_error",
                 "batch_not_found")
    openai_error(http.post(f"/v1/batches/batch_{missing}/cancel", headers=headers), 404, "not_found_error",
                 "batch_not_found")
    openai_error(http.post("/v1/batches", json={"input_file_id": f"file-{missing}", "endpoint": "/v1/completions",
                                                "completion_window": "24h"}, headers=headers),
                 404, "not_found_error", "file_not_found")


# ------------------------------------------------------------------ 409, 500, 504: a request that ended unanswered

@pytest.mark.parametrize("end, status, kind, code", [
    (None, 409, "conflict_error", "cancelled"),  # the client cancelled it (natively) while the call waited
    (lc.ENGINE_ERROR, 500, "server_error", "engine_error"),
    (lc.TIME_LIMIT, 504, "server_error", "time_limit_exceeded"),
])
def test_a_request_that_ends_without_an_answer(isolated, end, status, kind, code):
    """The call waits for its request; how the request ended is the call's error, never retried
    by the SDK (``x-should-retry: false``). The worker's own writes end it (no worker runs here)."""
    app, client, _ = isolated
    thread, answer = waiting_call(app, client.key)
    request_id = queued_request(app, client.key)
    if end is None:
        assert client.cancel(str(request_id)).status_code == 200
    else:
        lifecycle = services(app).lifecycle
        assert lifecycle.claim(request_id, WORKER, "cpu") is not None
        assert lifecycle.finish(request_id, WORKER, end) is not None
    thread.join(60)
    response = answer["response"]
    error = openai_error(response, status, kind, code)
    assert error["param"] is None
    assert response.headers["x-should-retry"] == "false"
    assert response.headers["Sluice-Request-Id"] == str(request_id)


# ------------------------------------------------------------------ 413, 415

@pytest.fixture(scope="module")
def small_app(database_url, redis_dbs):
    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url, {"SLUICE_MAX_BODY_BYTES": "4000",
                                                                     "SLUICE_JOB_MAX_BYTES": "1000"}))
    yield application
    services(application).db.dispose()
    redis_dbs.release(redis_url)


def test_413_for_a_body_or_file_over_the_limits(small_app, database_url):
    key = create_key(Settings(database_url=database_url).sqlalchemy_url, f"tenant-{uuid.uuid4().hex[:10]}")
    http, headers = small_app.test_client(), {"Authorization": f"Bearer {key}"}
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    openai_error(http.post("/v1/chat/completions", json=big, headers=headers), 413, "invalid_request_error",
                 "body_too_large")
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p" * 100}}
    openai_error(upload(http, headers, jsonl([line] * 800)), 413, "invalid_request_error", "file_too_large")


def test_415_for_a_body_not_sent_as_json_or_a_form(client):
    http, headers = client.http, client.headers
    openai_error(http.post("/v1/chat/completions", data="hi", headers={**headers, "Content-Type": "text/plain"}),
                 415, "invalid_request_error", "unsupported_media_type")
    openai_error(http.post("/v1/files", json={"file": "x"}, headers=headers), 415, "invalid_request_error",
                 "unsupported_media_type")


# ------------------------------------------------------------------ 429

def test_429_over_a_tenant_limit_keeps_the_backoff_headers(isolated):
    app, client, _ = isolated
    tenant_sql(app, client.key, "UPDATE tenants SET max_concurrent = 1 WHERE id = {tenant}")
    blocker = client.submit(prompt="hold the slot", max_tokens=4)
    assert blocker.status_code in (201, 202), blocker.get_json()
    try:
        response = client.http.post("/v1/chat/completions", json=CHAT, headers=client.headers)
        error = openai_error(response, 429, "rate_limit_error")
        assert error["code"] and error["param"] is None
        assert int(response.headers["Retry-After"]) >= 1 and "retry-after-ms" in response.headers
        openai, sdk_client = sdk(app, client.key)
        with pytest.raises(openai.RateLimitError) as refused:
            sdk_client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert refused.value.type == "rate_limit_error" and refused.value.code == error["code"]
    finally:
        client.cancel(blocker.get_json()["id"])


# ------------------------------------------------------------------ 503

def test_503_when_the_database_is_out_of_reach(redis_dbs):
    """Postgres unreachable (a closed port): every OpenAI route answers 503 in OpenAI's shape with
    Retry-After, not the native envelope; the SDK raises InternalServerError."""
    redis_url = redis_dbs()
    app = create_app(make_settings("postgresql://postgres@127.0.0.1:9/nowhere", redis_url))
    try:
        http, headers = app.test_client(), {"Authorization": "Bearer sk-sluice-" + "a" * 40}
        for method, path in (("post", "/v1/chat/completions"), ("post", "/v1/completions"), ("get", "/v1/models"),
                             ("get", "/v1/files/file-" + "0" * 32), ("get", "/v1/batches"),
                             ("get", "/v1/batches/batch_x"), ("post", "/v1/batches/batch_x/cancel")):
            response = getattr(http, method)(path, headers=headers, json=CHAT if method == "post" else None)
            error = openai_error(response, 503, "service_unavailable_error", "service_unavailable")
            assert error["param"] is None and response.headers["Retry-After"] == "5"
        openai, sdk_client = sdk(app, "sk-sluice-" + "a" * 40)
        with pytest.raises(openai.InternalServerError) as unavailable:
            sdk_client.batches.list()
        assert unavailable.value.status_code == 503 and unavailable.value.type == "service_unavailable_error"
        assert unavailable.value.code == "service_unavailable"
    finally:
        services(app).db.dispose()
        redis_dbs.release(redis_url)


# ------------------------------------------------------------------ the SDK's exception classes

def test_the_sdk_raises_the_exception_of_each_status(client, app):
    openai, sdk_client = sdk(app, client.key)
    with pytest.raises(openai.BadRequestError) as bad:
        sdk_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=17)
    assert (bad.value.type, bad.value.code, bad.value.param) == ("invalid_request_error", "invalid_request", "n")
    with pytest.raises(openai.NotFoundError) as missing:
        sdk_client.batches.retrieve("batch_" + "0" * 32)
    assert (missing.value.type, missing.value.code) == ("not_found_error", "batch_not_found")
    with pytest.raises(openai.NotFoundError) as missing:
        sdk_client.files.retrieve("file-" + "0" * 32)
    assert (missing.value.type, missing.value.code) == ("not_found_error", "file_not_found")
    _, stranger = sdk(app, "sk-sluice-nope")
    with pytest.raises(openai.AuthenticationError) as unknown:
        stranger.models.list()
    assert (unknown.value.type, unknown.value.code) == ("authentication_error", "invalid_api_key")
