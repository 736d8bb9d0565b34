"""The degradation ladder over every combination it can meet: never a 5xx, and the row says which
steps changed the request.

Level (of the main model's class alone, or of every class) × the steps switched on × a light
model in the registry (warm or not) × the answer cached
or not × the native or the OpenAI route × the request's shape (priority, a model named or not,
long or short max_tokens, sampled or not). One request is submitted to find the row its twin
will have; when the case wants it cached, that row's answer is put in the cache under the key a
worker would store it with, and the twin is submitted through the route. No worker runs: a twin
that is not answered from the cache is queued, and the OpenAI route (which waits for its answer)
is only taken for cache hits.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, update
from test_ladder import MODELS, warm

from core.admission.load import SNAPSHOT_PREFIX, LoadLevel, write_level
from core.rediskeys import LOAD_LEVEL_KEY
from core.settings import LADDER_STEPS
from core.submit.answers import answer_key, cache_scope
from models import InferenceRequest, Status
from web.services import services

# Which steps each level turns on (core/admission/load.py steps_in_force): a step's rank.
RANK = {step: rank for rank, step in enumerate(LADDER_STEPS, start=1)}
SWITCHES = ("light_model,shorter_output,cached_answer,reject_batch,tight_promise,shed",
            "light_model,shorter_output,cached_answer,shed", "cached_answer,shed", "none")


@pytest.fixture
def apps(isolated_app):
    """An app per (steps switched on, light model in the registry), made on first use. Afterwards
    the rows the test left queued (no worker ran them; many are parked twins) are cancelled: the
    database is shared, and another test's sweep or count must not meet them."""
    made: dict[tuple[str, bool], object] = {}

    def app(switches: str, light: bool):
        if (switches, light) not in made:
            made[switches, light] = isolated_app(ladder_steps=switches, **({"models_json": MODELS} if light else {}))
        return made[switches, light]

    began = datetime.now(UTC)
    yield app
    if made:
        with services(next(iter(made.values()))).db.session() as session:
            session.execute(update(InferenceRequest).where(
                InferenceRequest.status == Status.QUEUED, InferenceRequest.created_at >= began)
                .values(status=Status.CANCELLED, finished_at=func.now()))


def at_level(application, level: LoadLevel, light_warm: bool, everywhere: bool) -> None:
    """The main model's realtime class at ``level``; every class there too when ``everywhere``
    (the light model as loaded as the main one takes nothing off it), else the rest calm."""
    svc = services(application)
    svc.redis.delete(LOAD_LEVEL_KEY, *svc.redis.scan_iter(match=SNAPSHOT_PREFIX + "*"))
    if level:
        write_level(svc.redis, level, classes=None if everywhere else {"realtime:simulated-llama-8b": level})
    if light_warm:
        warm(application, "llama-light")
    svc.requests.ladder.reader._read_at = float("-inf")  # read the level now, not within 0.5 s


def row_of(application, request_id: str) -> InferenceRequest:
    with services(application).db.session() as session:
        return session.get(InferenceRequest, uuid.UUID(request_id))


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(switches=st.sampled_from(SWITCHES), light=st.booleans(), light_warm=st.booleans(),
       level=st.sampled_from(list(LoadLevel)), cached=st.booleans(), openai=st.booleans(),
       batch=st.booleans(), named=st.booleans(), max_tokens=st.sampled_from([16, 1000]),
       temperature=st.sampled_from([0.0, 0.7]), everywhere=st.booleans())
# The longest: light_model,shorter_output then cached_answer, 40 characters, past the 32 the column
# once held (a DataError, a 500, on a retry answered from the cache in an overload), on each route.
@example(switches=SWITCHES[0], light=True, light_warm=True, level=LoadLevel.CACHED_ANSWERS, cached=True,
         openai=False, batch=False, named=False, max_tokens=1000, temperature=0.7, everywhere=False)
@example(switches=SWITCHES[0], light=True, light_warm=True, level=LoadLevel.CACHED_ANSWERS, cached=True,
         openai=True, batch=False, named=False, max_tokens=1000, temperature=0.7, everywhere=False)
def test_no_combination_of_the_ladder_answers_5xx_but_503(apps, new_client, switches, light, light_warm, level, cached,
                                                  openai, batch, named, max_tokens, temperature, everywhere):
    application = apps(switches, light)
    client = new_client(application)
    at_level(application, level, light and light_warm, everywhere)
    question = f"what is a sluice? {uuid.uuid4()}"
    body = {"prompt": question, "max_tokens": max_tokens, "temperature": temperature,
            "priority": "batch" if batch else "realtime", **({"model": "simulated-llama-8b"} if named else {})}
    chat = {"model": body.get("model", "simulated-llama-8b"), "max_tokens": max_tokens, "temperature": temperature,
            "messages": [{"role": "user", "content": question}]}
    if openai:  # realtime only; a stream gives its row's id at once, and leaving it costs nothing here
        first = client.http.post("/v1/chat/completions", json={**chat, "stream": True}, headers=client.headers,
                                 buffered=False)
        first_id = first.headers.get("Sluice-Request-Id")
        first.close()
    else:
        first = client.submit(**body)
        first_id = first.get_json().get("id") if first.status_code == 202 else None
    assert first.status_code < 500 or first.status_code == 503
    on = () if switches == "none" else tuple(switches.split(","))
    answerable = temperature == 0 or (level >= LoadLevel.CACHED_ANSWERS and "cached_answer" in on)
    if openai and not (cached and first_id and answerable):
        return  # a chat call the cache does not answer would wait for a worker
    if cached and first_id:
        # The answer its twin would find, stored where a worker stores it (workers/execution.py).
        row = row_of(application, first_id)
        svc = services(application)
        svc.answers.put(answer_key(cache_scope(row.tenant_id, svc.settings.cache_shared_tenants),
                                   row.model_routed or row.model_requested, row.input, row.params, row.max_tokens),
                        {"text": "cached", "finish_reason": "length", "input_tokens": 4, "output_tokens": 1})
    if openai:
        twin = client.http.post("/v1/chat/completions", json=chat, headers=client.headers)
        assert twin.status_code < 500 or twin.status_code == 503, twin.get_data()[:300]
        twin_id = twin.headers.get("Sluice-Request-Id")
    else:
        twin = client.submit(**body)
        twin_id = twin.get_json().get("id")
    if twin.status_code not in (200, 202):
        assert twin.status_code in (413, 422, 429, 503), twin.get_data()[:300]
        return
    row = row_of(application, twin_id)
    steps = row.degradation_step.split(",") if row.degradation_step else []
    for step in steps:
        assert step in on and level >= RANK[step], (steps, switches, level)
    assert ("light_model" in steps) == (row.route_reason == "light_model")
    assert ("shorter_output" in steps) == (row.max_tokens < max_tokens and (openai or not batch))
    assert ("cached_answer" in steps) == (row.cache_hit and temperature > 0)
    if row.cache_hit and not openai:
        assert twin.headers.get("Sluice-Cache") == "hit"
    assert twin.headers.get("Sluice-Degradation") == (row.degradation_step or None)

    if "light_model" in steps:
        assert not everywhere, "the light model took traffic while as loaded as the main one"
    every_step = (switches in SWITCHES[:2] and light and light_warm and not everywhere
                  and level >= LoadLevel.CACHED_ANSWERS and cached
                  and not named and max_tokens > 128 and temperature > 0 and (openai or not batch))
    if every_step and level < LoadLevel.SHED:
        assert steps == ["light_model", "shorter_output", "cached_answer"], steps
