"""The OpenAI door takes its client's patience as the request's deadline (``web/openai/patience.py``).

The official SDK sends its read timeout in ``x-stainless-read-timeout`` on every call; a client
may say ``Prefer: wait=N``. The shorter, less the margin (10%, at most 1 s), is the row's
deadline, never past the door's default (SLUICE_OPENAI_DEFAULT_DEADLINE_S, else the realtime
deadline: 300 s under the tests' settings). Each answer, refusal and stream says what it was
given in Sluice-Deadline-S and Sluice-Deadline-Source, and the tier that served it in
Sluice-Service-Tier and the body's ``service_tier``. Real Postgres, Redis and workers (the
simulated engine); the SDK talks to the app in-process.
"""

from __future__ import annotations

import uuid
from functools import partial

import httpx
import pytest
from admission_support import rows_of, tenant_id_of
from conftest import WorkerProcess, make_settings
from test_openai_errors import openai_error
from test_promise import publish

from core.admission.load import LoadLevel, write_level
from core.settings import Settings
from launcher.database import create_key
from launcher.harness import start_all, stop_all
from models import InferenceRequest
from web import create_app
from web.openai import patience
from web.services import services

openai = pytest.importorskip("openai")

MODEL, EMBED_MODEL = "simulated-llama-8b", "simulated-embed"
ENV = {"SLUICE_EMBED_MODEL": EMBED_MODEL, "SLUICE_EMBED_DIMENSIONS": "16", "SLUICE_SIM_SPEED": "4"}
MESSAGES = [{"role": "user", "content": "How long will you wait?"}]
DEFAULT_S = 300.0  # SLUICE_REALTIME_DEADLINE_S under the tests' settings (conftest.TEST_ENV)


@pytest.fixture(scope="module")
def stack(database_url, redis_dbs, tmp_path_factory):
    """An app, a worker of the main model and one of the embedding model, on a Redis database of their own."""
    redis_url = redis_dbs()
    tmp = tmp_path_factory.mktemp("patience")
    app = create_app(make_settings(database_url, redis_url, ENV))
    workers = []
    try:
        workers += start_all(partial(WorkerProcess, database_url, redis_url, tmp, extra_env=ENV, concurrency=8),
                             partial(WorkerProcess, database_url, redis_url, tmp, extra_env=ENV, model=EMBED_MODEL,
                                     concurrency=8))
        yield app, redis_url
    finally:
        stop_all(workers)
        services(app).db.dispose()
        redis_dbs.release(redis_url)


@pytest.fixture
def app(stack):
    return stack[0]


@pytest.fixture
def key(database_url) -> str:
    return create_key(Settings(database_url=database_url).sqlalchemy_url, f"patience-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def sdk(key):
    """``sdk(app, **options)``: the official client of ``app`` (in-process), closed after the test."""
    made = []

    def make(application, **options):
        http = httpx.Client(transport=httpx.WSGITransport(app=application), base_url="http://sluice.test")
        made.append(openai.OpenAI(api_key=key, base_url="http://sluice.test/v1", max_retries=0, http_client=http,
                                  **options))
        return made[-1]

    yield make
    for client in made:
        client.close()


def row_deadline_s(app, request_id: str) -> float:
    """The row's deadline, counted from its creation."""
    with services(app).db.session() as session:
        row = session.get(InferenceRequest, uuid.UUID(request_id))
        return (row.deadline_at - row.created_at).total_seconds()


def assert_given(app, headers, seconds: float, source: str) -> None:
    """The answer states ``seconds`` from ``source``, and its row has that deadline, less the time
    the web tier spent between planning it and the insert's transaction (the row's created_at).
    That time is not bounded on a loaded machine (2.6 s once, in a spread run on 2 cores), so the
    lower bound only tells the deadlines this module uses apart; the header pins the exact value."""
    assert headers[patience.DEADLINE_HEADER] == f"{seconds:g}"
    assert headers[patience.SOURCE_HEADER] == source
    for request_id in headers.get("Sluice-Request-Ids", headers["Sluice-Request-Id"]).split(","):
        assert 0.8 * seconds - 2 < row_deadline_s(app, request_id) <= seconds


def tier(answer) -> str | None:
    """An SDK object's ``service_tier``, a field of its model or an extra one (text completions)."""
    return getattr(answer, "service_tier", None) or (answer.model_extra or {}).get("service_tier")


def test_the_sdks_read_timeout_less_the_margin_is_the_deadline(app, sdk):
    raw = sdk(app, timeout=8).chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES,
                                                                         max_tokens=4)
    assert float(raw.http_request.headers[patience.READ_TIMEOUT_HEADER]) == 8  # what the SDK sent
    answer = raw.parse()
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert_given(app, raw.headers, 7.2, "x-stainless-read-timeout")  # 8 s less 10%
    assert raw.headers["Sluice-Service-Tier"] == "default" == tier(answer)
    # A long timeout shortens nothing: the SDK's default (600 s) leaves the door's default.
    raw = sdk(app).completions.with_raw_response.create(model=MODEL, prompt="Patient", max_tokens=4)
    assert float(raw.http_request.headers[patience.READ_TIMEOUT_HEADER]) == 600
    assert_given(app, raw.headers, DEFAULT_S, "default")
    assert tier(raw.parse()) == "default"


def test_without_patience_the_default_setting_is_the_deadline(app, stack, database_url, key):
    headers = {"Authorization": f"Bearer {key}"}
    plain = app.test_client().post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                                  "max_tokens": 4}, headers=headers)
    assert plain.status_code == 200, plain.get_json()
    assert_given(app, plain.headers, DEFAULT_S, "default")
    # SLUICE_OPENAI_DEFAULT_DEADLINE_S: the deadline of a call that states none, and the most one that does gets.
    door = create_app(make_settings(database_url, stack[1], {**ENV, "SLUICE_OPENAI_DEFAULT_DEADLINE_S": "20"}))
    cases = ((None, 20, "default"), ("60", 20, "default"), ("10", 9, "x-stainless-read-timeout"))
    try:
        for sent, given, source in cases:
            stated = {patience.READ_TIMEOUT_HEADER: sent} if sent else {}
            answer = door.test_client().post("/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 4},
                                             headers={**headers, **stated})
            assert answer.status_code == 200, answer.get_json()
            assert_given(door, answer.headers, given, source)
    finally:
        services(door).db.dispose()


def test_prefer_wait_and_the_shorter_of_both(app, sdk):
    chat = sdk(app, timeout=8).chat.completions.with_raw_response
    raw = chat.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"Prefer": "wait=5"})
    assert_given(app, raw.headers, 4.5, "prefer")
    raw = chat.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"Prefer": "wait=30"})
    assert_given(app, raw.headers, 7.2, "x-stainless-read-timeout")
    raw = sdk(app, timeout=None).chat.completions.with_raw_response.create(  # no timeout: no header
        model=MODEL, messages=MESSAGES, max_tokens=4, extra_headers={"Prefer": "respond-async, wait=12"})
    assert patience.READ_TIMEOUT_HEADER not in raw.http_request.headers
    assert_given(app, raw.headers, 11, "prefer")  # 12 s less 1 s; this door cannot answer later anyway


@pytest.mark.parametrize("sent", ["soon", "nan", "inf", "-3", "0", "", "8" * 40])
def test_a_malformed_read_timeout_is_ignored(app, key, sent):
    answer = app.test_client().post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                                  "max_tokens": 4},
                                    headers={"Authorization": f"Bearer {key}", patience.READ_TIMEOUT_HEADER: sent,
                                             "Prefer": "wait=soon"})
    assert answer.status_code == 200, answer.get_json()
    assert_given(app, answer.headers, DEFAULT_S, "default")


def test_each_tier_runs_in_its_class_and_says_so(app, sdk):
    raw = sdk(app, timeout=8).chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, service_tier="flex")
    answer = raw.parse()
    assert_given(app, raw.headers, 7.2, "x-stainless-read-timeout")  # no 202 to come back to: patience counts
    assert raw.headers["Sluice-Service-Tier"] == "flex" == tier(answer)
    with services(app).db.session() as session:
        assert session.get(InferenceRequest, uuid.UUID(raw.headers["Sluice-Request-Id"])).priority.value == "batch"
    raw = sdk(app).completions.with_raw_response.create(model=MODEL, prompt="later", max_tokens=4,
                                                        extra_body={"service_tier": "priority"})  # not in its types
    assert raw.headers["Sluice-Service-Tier"] == "priority" == tier(raw.parse())  # served ahead, at its price
    with services(app).db.session() as session:
        assert session.get(InferenceRequest, uuid.UUID(raw.headers["Sluice-Request-Id"])).priority.value == "realtime"
    # The SDK's priority call states no patience: priority's own deadline.
    assert_given(app, raw.headers, services(app).settings.priority_deadline_s, "default")


def test_a_stream_takes_prefer_not_the_read_timeout(app, sdk):
    """A stream's first chunk leaves at once and pings fill its silences: the SDK's read timeout
    never ends it, so only ``Prefer: wait`` speaks of its patience."""
    client = sdk(app, timeout=8)
    with client.chat.completions.with_streaming_response.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                                                stream=True) as streamed:
        chunks = list(streamed.parse())
        assert_given(app, streamed.headers, DEFAULT_S, "default")
        assert streamed.headers["Sluice-Service-Tier"] == "default"
    assert chunks and all(chunk.service_tier == "default" for chunk in chunks)
    with client.completions.with_streaming_response.create(model=MODEL, prompt="p", max_tokens=4, stream=True,
                                                           extra_body={"service_tier": "flex"},
                                                           extra_headers={"Prefer": "wait=6"}) as streamed:
        chunks = list(streamed.parse())
        assert_given(app, streamed.headers, 5.4, "prefer")
        assert streamed.headers["Sluice-Service-Tier"] == "flex"
    assert chunks and all(tier(chunk) == "flex" for chunk in chunks)


def test_many_prompts_and_embeddings_take_the_patience_too(app, sdk):
    raw = sdk(app, timeout=8).completions.with_raw_response.create(model=MODEL, prompt=["one", "two", "three"],
                                                                   max_tokens=4)
    assert len(raw.headers["Sluice-Request-Ids"].split(",")) == 3 and len(raw.parse().choices) == 3
    assert_given(app, raw.headers, 7.2, "x-stainless-read-timeout")  # every row of the call
    raw = sdk(app, timeout=3).embeddings.with_raw_response.create(model=EMBED_MODEL, input=["a", "b"])
    assert len(raw.parse().data) == 2
    assert_given(app, raw.headers, 2.7, "x-stainless-read-timeout")
    assert raw.headers["Sluice-Service-Tier"] == "default"


def test_the_promise_judges_the_clients_patience(promising):
    application, client = promising
    # 500 tokens ahead at 100 tokens/s: 5 s of queue + 2 s of its own = 7 s, inside the 30 s default.
    publish(application, queued_work=500, drain_tps=100, seq_tps=50)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100}
    impatient = {**client.headers, patience.READ_TIMEOUT_HEADER: "3.0"}
    refused = client.http.post("/v1/chat/completions", json=body, headers=impatient)
    error = openai_error(refused, 503, "service_unavailable_error", "overloaded")  # a client gone at 3 s
    assert error["param"] is None and int(refused.headers["Retry-After"]) >= 1
    assert refused.headers[patience.DEADLINE_HEADER] == "2.7"
    assert refused.headers[patience.SOURCE_HEADER] == "x-stainless-read-timeout"
    assert refused.headers["Sluice-Service-Tier"] == "default"
    assert rows_of(application, tenant_id_of(application, client)) == []
    # A stream's read timeout is no patience: the same call streamed is judged by the 30 s, and accepted.
    publish(application, queued_work=500, drain_tps=100, seq_tps=50)
    streamed = client.http.post("/v1/chat/completions", json={**body, "stream": True}, headers=impatient,
                                buffered=False)
    try:
        assert streamed.status_code == 200, streamed.get_data(as_text=True)
        assert streamed.headers[patience.DEADLINE_HEADER] == "30"
        assert streamed.headers[patience.SOURCE_HEADER] == "default"
    finally:
        assert client.cancel(streamed.headers["Sluice-Request-Id"]).status_code == 200  # no worker would run it
        streamed.close()


def test_a_shed_refusal_says_the_deadline_and_tier(isolated_app, new_client):
    application = isolated_app()
    client = new_client(application)
    write_level(services(application).redis, LoadLevel.SHED)
    refused = client.http.post("/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 4,
                                                        "service_tier": "flex"},
                               headers={**client.headers, "Prefer": "wait=20"})
    openai_error(refused, 503, "service_unavailable_error", "overloaded")
    assert int(refused.headers["Retry-After"]) >= 1 and "retry-after-ms" in refused.headers
    assert refused.headers[patience.DEADLINE_HEADER] == "19"
    assert refused.headers[patience.SOURCE_HEADER] == "prefer"
    assert refused.headers["Sluice-Service-Tier"] == "flex"
