"""The whole OpenAPI document, fuzzed by schemathesis through the real WSGI stack.

Every operation gets generated bodies, paths, queries and headers, valid and not: no answer
may be a 5xx, every answer must match the document (status, headers, content type, body,
errors in the envelope), every body the document allows must be accepted and every body it
forbids refused. A tenant key authenticates the public routes, the admin key the admin ones.
"""

from __future__ import annotations

import io
import json
import re
import time
import uuid

import pytest
import schemathesis
from conftest import WorkerProcess, make_settings
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import positive_data_acceptance
from sqlalchemy import delete, func, select, update

from core.broker.fair import sync_reservations
from core.settings import Settings
from core.submit.sampling import BEYOND_THE_DOCUMENT
from launcher.database import create_key
from models import ApiKey, Delivery, DeliveryStatus, InferenceRequest, Job, JobStatus, Status, Tenant, hash_key
from models.job import LIVE_JOB
from models.reservation import Reservation
from web.services import services

ADMIN_KEY = "admin-" + "f" * 24
# 28 operations, a few without parameters (one case each): over 1,000 cases in all.
EXAMPLES_PER_OPERATION = 80
# A valid request may still be over its tenant's max_request_tokens (413): that is the tenant's
# limit, not the document's, so it is not "valid data rejected".
CONFIG = SchemathesisConfig.from_str("""
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "3xx", "401", "403", "404", "409", "413", "429"]
""")
# A reservation's window must end after it starts and not lie in the past: rules across fields
# and of time that JSON Schema cannot say (a 422 names them). Every other check still runs on it.
# A job file is checked line by line (each a JSON object with custom_id and text, ids unique),
# and its summary must fit the model's context with the instruction: a text body's rules.
# A response's input items, tools and text format are checked as a chat body's messages, tools
# and response_format are (their rules across fields the chat document states, not this one).
CROSS_FIELD_RULES = {"POST /v1/admin/reservations", "POST /v1/jobs", "POST /admin/tenants/{tenant_ref}/budgets",
                     "GET /v1/usage", "GET /v1/admin/usage", "POST /v1/responses"}
# An OpenAI-style completion answers when its request ends, and the simulated engine writes all
# of max_tokens: generated bodies keep their shape but ask for a short answer (a valid value,
# added when they name none), or a case near the 8192 maximum would hold the fuzz for a minute.
SHORT_ANSWERS = {"POST /v1/chat/completions": ("max_tokens", "max_completion_tokens"),
                 "POST /v1/completions": ("max_tokens", "max_completion_tokens"),
                 "POST /v1/responses": ("max_output_tokens",)}
# The document's embeddings route and `input` need an embedding model, served by a worker of its own.
EMBED = {"SLUICE_EMBED_MODEL": "simulated-embed", "SLUICE_EMBED_DIMENSIONS": "32"}
SHORT = 16


# Webhook URLs must resolve to a receiver the SSRF guard lets through: the fuzz app allows
# 127.0.0.2, where nothing listens (a refused URL is a rule of DNS no document can state).
schemathesis.openapi.format("uri", st.sampled_from(["http://127.0.0.2:9/hook", "http://127.0.0.2:9/a?b=c"]))


@schemathesis.serializer("application/jsonl")
def _json_lines(ctx, value) -> bytes:
    """A job file as the document describes it: an array, one element per line."""
    lines = value if isinstance(value, list) else [value]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


@pytest.fixture
def fuzz_app(database_url, scratch_redis_url, tmp_path):
    """An app and a worker of its own (so /readyz answers 200 and accepted requests run without
    loading the session's worker); afterwards nothing it made outlives it: its open requests
    are cancelled and its reservations (global: they would pause batch work) deleted."""
    from web import create_app

    application = create_app(make_settings(database_url, scratch_redis_url, {"SLUICE_WEBHOOK_ALLOW": "127.0.0.2",
                                                                             **EMBED}, admin_key=ADMIN_KEY))
    tenant = f"fuzz-{uuid.uuid4().hex[:8]}"
    key = create_key(Settings(database_url=database_url).sqlalchemy_url, tenant)
    application.config["fuzz_key"] = key
    # A webhook needs its tenant's signing secret (else 422 webhook_secret_missing, a rule of state).
    application.test_client().post("/v1/webhooks/secret/rotate", headers={"Authorization": f"Bearer {key}"})
    db = services(application).db
    with db.session() as session:
        began = session.scalar(select(func.now()))
    worker = WorkerProcess(database_url, scratch_redis_url, tmp_path, concurrency=8, extra_env=EMBED)
    embedder = WorkerProcess(database_url, scratch_redis_url, tmp_path, concurrency=8, extra_env=EMBED,
                             model="simulated-embed")
    try:
        yield application
    finally:
        http = application.test_client()
        with db.session() as session:
            ours = select(ApiKey.tenant_id).where(ApiKey.key_hash == hash_key(key)).scalar_subquery()
            open_ids = session.scalars(select(InferenceRequest.id).where(
                InferenceRequest.tenant_id == ours,
                InferenceRequest.status.in_([Status.QUEUED, Status.RUNNING]))).all()
            session.execute(delete(Reservation).where(Reservation.created_at >= began))
            # Nor the reserved shares of the tenants it made: they count against every later
            # test's (at most 0.9 in all), and the fair lines read them.
            session.execute(update(Tenant).where(Tenant.created_at >= began, Tenant.reserved_share.is_not(None))
                            .values(reserved_share=None))
            # Jobs it made are not left for another test's feeder (the database is shared).
            session.execute(update(Job).where(Job.tenant_id == ours, Job.status.in_(LIVE_JOB))
                            .values(status=JobStatus.CANCELLED))
        for request_id in open_ids:
            http.post(f"/v1/requests/{request_id}/cancel", headers={"Authorization": f"Bearer {key}"})
        worker.stop()
        embedder.stop()
        # Nor webhook deliveries (nobody receives them) for another module's sweep to send again.
        with db.session() as session:
            session.execute(update(Delivery).where(Delivery.tenant_id == ours,
                                                   Delivery.status == DeliveryStatus.PENDING)
                            .values(status=DeliveryStatus.FAILED))
        sync_reservations(db, services(application).redis)
        db.dispose()


def test_every_operation_answers_as_documented(fuzz_app):
    schema = schemathesis.openapi.from_wsgi("/openapi.json", fuzz_app, config=CONFIG)
    cases: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        fuzz_operation(operation, fuzz_app.config["fuzz_key"], cases)
    assert sum(cases.values()) >= 1000, (sum(cases.values()), len(cases))


def overloaded(response) -> bool:
    """A 503 ``overloaded`` with a Retry-After: admission refused the request for the load."""
    if response.status_code != 503:
        return False
    try:
        code = json.loads(response.content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return False
    return code == "overloaded" and any(name.lower() == "retry-after" for name in response.headers)


def beyond_the_document(response) -> bool:
    """A refusal that names only fields whose rules across fields JSON Schema cannot state
    (core/submit/sampling.py BEYOND_THE_DOCUMENT: a response_format's schema must itself be a
    valid one, a named tool one of `tools`, ...): valid by the document, refused by those rules."""
    if response.status_code not in (400, 422):
        return False
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    if response.status_code == 422:
        names = set((error.get("details") or {"?": None}).keys())
    else:
        names = {re.split(r"[.\[]", error.get("param") or "?")[0]}
    return names <= BEYOND_THE_DOCUMENT


def fuzz_operation(operation, tenant_key: str, cases: dict[str, int]) -> None:
    label = f"{operation.method.upper()} {operation.path}"
    key = ADMIN_KEY if operation.path.startswith(("/admin", "/v1/admin")) else tenant_key

    @given(case=operation.as_strategy())
    @hypothesis_settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                         suppress_health_check=list(HealthCheck))
    def answers_as_documented(case) -> None:
        cases[label] = cases.get(label, 0) + 1
        headers = {**(case.headers or {}), "Authorization": f"Bearer {key}"}
        if "Idempotency-Key" in headers:
            # A generated key would repeat across cases with other bodies (a 422 by design).
            headers["Idempotency-Key"] = uuid.uuid4().hex
        if label in SHORT_ANSWERS and isinstance(case.body, dict):
            if not set(SHORT_ANSWERS[label]) & case.body.keys():
                case.body[SHORT_ANSWERS[label][0]] = SHORT
            for name in SHORT_ANSWERS[label]:
                value = case.body.get(name)
                if isinstance(value, int | float) and not isinstance(value, bool) and value > SHORT:
                    case.body[name] = SHORT
        excluded = [positive_data_acceptance] if label in CROSS_FIELD_RULES else []
        response = case.call(headers=headers)
        if beyond_the_document(response):
            excluded = [*excluded, positive_data_acceptance]
        if overloaded(response):
            # The promise refused it (a deadline its class's queue cannot keep): the platform's load,
            # not the data, answered as documented. Every other check still runs on the answer.
            excluded = [*excluded, not_a_server_error, positive_data_acceptance]
        case.validate_response(response, headers=headers, excluded_checks=excluded or None,
                               transport_kwargs={"headers": dict(headers)})

    answers_as_documented()


def test_another_tenants_ids_are_not_found_through_any_operation(fuzz_app, database_url):
    """The two-tenant pass: every operation that names a tenant's object in its path, generated by
    schemathesis from the document but with the path naming tenant A's real objects (a request, its
    webhook delivery, a job, a file, a batch) and tenant B's key. Each answers 404 as documented
    (429 where B's own rate limit of webhook actions ran out first), never 2xx or 5xx."""
    owner = fuzz_app.config["fuzz_key"]
    http, auth = fuzz_app.test_client(), {"Authorization": f"Bearer {owner}"}
    mine = {"prompt": "mine", "max_tokens": 4, "webhook_url": "http://127.0.0.2:9/hook"}
    request_id = http.post("/v1/requests", json=mine, headers=auth).get_json()["id"]
    job_id = http.post("/v1/jobs", data=b'{"custom_id": "a", "text": "mine"}\n',
                       headers={**auth, "Content-Type": "application/jsonl"}).get_json()["id"]
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "simulated-llama-8b", "max_tokens": 4,
                                "messages": [{"role": "user", "content": "mine"}]}})
    file_id = http.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line.encode() + b"\n"), "b.jsonl")},
                        headers=auth).get_json()["id"]
    batch_id = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"}, headers=auth).get_json()["id"]
    db = services(fuzz_app).db
    deadline = time.monotonic() + 60
    while True:
        with db.session() as session:
            delivery = session.scalar(select(Delivery.id).where(Delivery.request_id == uuid.UUID(request_id)))
        if delivery is not None:
            break
        assert time.monotonic() < deadline, "the request's webhook delivery never appeared"
        time.sleep(0.2)
    theirs = {"request_id": request_id, "job_id": job_id, "delivery_id": str(delivery), "file_id": file_id,
              "batch_id": batch_id}
    other = create_key(Settings(database_url=database_url).sqlalchemy_url, f"fuzz-other-{uuid.uuid4().hex[:8]}")
    schema = schemathesis.openapi.from_wsgi("/openapi.json", fuzz_app, config=CONFIG)
    crossed = set()
    for result in schema.get_all_operations():
        operation = result.ok()
        names = [p.name for p in operation.path_parameters]
        if not names or not set(names) <= theirs.keys():  # admin routes, the operator page's files
            continue
        crossed.add(f"{operation.method.upper()} {operation.path}")
        cross_tenant(operation, other, {name: theirs[name] for name in names})
    assert len(crossed) >= 12, sorted(crossed)  # requests 2, jobs 4, deliveries 2, files 2, batches 2


def cross_tenant(operation, key: str, path: dict[str, str]) -> None:
    @given(case=operation.as_strategy())
    @hypothesis_settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def not_found(case) -> None:
        case.path_parameters = {**(case.path_parameters or {}), **path}
        response = case.call(headers={**(case.headers or {}), "Authorization": f"Bearer {key}"})
        assert response.status_code < 500, (operation.path, response.status_code, response.get_data()[:300])
        assert response.status_code in (400, 404, 422, 429), (operation.path, response.status_code,
                                                               response.get_data()[:300])
        case.validate_response(response, excluded_checks=[positive_data_acceptance])

    not_found()
