"""Usage, cost and budgets, as a platform team reads and enforces them.

The rollups are checked against a direct sum over the request table after a mixed day of
traffic (two tenants, three keys, two models, both priorities, cache hits, cancels, time-outs,
idempotent retries, a worker killed mid-way, refusals); hard budgets are checked at the Lua gate
under 50 concurrent submitters and through the HTTP API; the OpenAI client's usage fields are
checked against the rollups. All on the simulated engine: these prove the accounting, not an
engine's speed.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from functools import partial

import pytest
from conftest import ApiClient, BeatProcess, WorkerProcess, make_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from test_local_floor import own_redis  # noqa: F401 - a Redis of its own, to stop
from test_openai_errors import sdk
from test_tenants_admin import admin, admin_app  # noqa: F401 - the admin app fixture

from core.admission.limiter import SharedLimiter
from core.rediskeys import redis_client
from core.tenants.tiers import Limits
from core.usage import refusals
from core.usage.budgets import CHARGES_KEY
from launcher.database import create_key
from launcher.harness import start_all, stop_all
from web.services import services

MODELS = json.dumps([{"name": "m-one", "context_tokens": 8192}, {"name": "m-two", "context_tokens": 8192}])
PRICES = "m-one=0.15/0.075/0.6,m-two=1.1/0.55/4.4"
ENV = {"SLUICE_MODELS": MODELS, "SLUICE_PRICES": PRICES, "SLUICE_TIERS": "big=50000000/100000/2000/8192",
       "SLUICE_DEFAULT_TIER": "big"}
SUMS = ("requests", "input_tokens", "cached_tokens", "output_tokens", "billed_tokens")


def direct_sums(app, where: str, params: dict) -> dict:
    """What the rollups must say, summed straight from the request table (the trigger's rules:
    tokens only where the engine reported them, billed tokens and cost not for cache hits)."""
    with services(app).db.session() as session:
        row = session.execute(text(f"""
            SELECT count(*) AS requests,
                   coalesce(sum(CASE WHEN output_tokens IS NULL THEN 0 ELSE input_tokens END), 0) AS input_tokens,
                   coalesce(sum(CASE WHEN output_tokens IS NULL THEN 0 ELSE coalesce(cached_tokens, 0) END), 0)
                       AS cached_tokens,
                   coalesce(sum(output_tokens), 0) AS output_tokens,
                   coalesce(sum(CASE WHEN output_tokens IS NULL OR cache_hit THEN 0
                                ELSE input_tokens + output_tokens END), 0) AS billed_tokens,
                   coalesce(sum(cost), 0) AS cost,
                   count(*) FILTER (WHERE status NOT IN ('queued', 'running')) AS ended
            FROM requests WHERE {where}"""), params).one()
        statuses = dict(session.execute(text(f"SELECT status, count(*) FROM requests WHERE {where} GROUP BY 1"),
                                        params).all())
    return {**row._asdict(), "statuses": statuses}


def usage_of(client: ApiClient, **query) -> dict:
    query = {"start": (datetime.now(UTC) - timedelta(days=1)).isoformat(),
             "end": (datetime.now(UTC) + timedelta(hours=2)).isoformat(), "bucket": "hour", **query}
    answer = client.http.get("/v1/usage", query_string=query, headers=client.headers)
    assert answer.status_code == 200, answer.get_json()
    return answer.get_json()


def all_ended(app, tenants: list[str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with services(app).db.session() as session:
            left = session.scalar(text("SELECT count(*) FROM requests WHERE tenant_id::text = ANY(:t) AND status IN "
                                       "('queued', 'running')"), {"t": tenants})
        if not left:
            return
        assert time.monotonic() < deadline, f"{left} requests still unfinished"
        time.sleep(0.5)


def tenant_of(app, key: str) -> str:
    with services(app).db.session() as session:
        return str(session.scalar(text("SELECT tenant_id FROM api_keys WHERE key_hash = encode(sha256(:k), 'hex')"),
                                  {"k": key.encode()}))


@pytest.fixture
def platform(database_url, redis_dbs, tmp_path, request):
    """An app with two priced models, a worker for each, and beat (the sweep)."""
    from web import create_app

    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url, ENV))
    workers = start_all(partial(WorkerProcess, database_url, redis_url, tmp_path, extra_env=ENV),
                        partial(WorkerProcess, database_url, redis_url, tmp_path, extra_env=ENV, model="m-two"))
    beat = BeatProcess(database_url, redis_url, tmp_path)
    yield application, redis_url, workers
    beat.stop()
    stop_all(workers)
    services(application).db.dispose()


def test_a_thousand_mixed_requests_sum_to_the_token_and_the_cent(platform, database_url, tmp_path):
    app, redis_url, workers = platform
    url = make_settings(database_url, redis_url).sqlalchemy_url
    name_a, name_b = f"usage-a-{uuid.uuid4().hex[:6]}", f"usage-b-{uuid.uuid4().hex[:6]}"
    key_a, key_b = create_key(url, name_a), create_key(url, name_b)
    clients = [ApiClient(app, key_a), ApiClient(app, create_key_for(app, key_a)), ApiClient(app, key_b)]
    tenants = [tenant_of(app, key_a), tenant_of(app, key_b)]
    rng = random.Random(7)
    ids, refused = [], Counter()
    for i in range(1000):
        client = clients[i % 3]
        body = {"prompt": f"request {i} " + "word " * rng.randint(1, 40), "max_tokens": rng.randint(1, 24),
                "model": "m-one" if i % 2 else "m-two", "priority": "batch" if i % 3 == 0 else "realtime"}
        if i % 10 == 0:  # repeats of a few questions: the cache and twins answer most of them
            body = {**body, "prompt": f"same question {i % 4}", "temperature": 0, "max_tokens": 8}
        headers = dict(client.headers)
        if i % 25 == 1:
            headers["Idempotency-Key"] = f"retry-{i}"
        if i % 50 == 7:
            body = {**body, "max_tokens": 4000, "time_limit_s": 0.05}  # a time-out
        if i % 50 == 9:
            body = {**body, "max_tokens": 8192}  # over the context: refused, no row
        if i % 40 == 3:  # cancelled below: long enough to be in flight still when the cancel comes
            body = {**body, "max_tokens": 2000, "ignore_eos": True}
        if i == 500:  # mid-way, a worker dies with work in flight; a new one takes over
            slow = [client.submit(prompt=f"slow {j}", max_tokens=1500, model="m-one").get_json()["id"]
                    for j in range(10)]
            client.wait(slow[0], statuses={"running", "succeeded"})
            workers[0].kill()
            workers.append(WorkerProcess(database_url, redis_url, tmp_path, extra_env=ENV))
            ids += slow
        answer = client.http.post("/v1/requests", json=body, headers=headers)
        if answer.status_code in (413, 429, 503):  # refused, no row: counted by its reason
            refused[answer.get_json()["error"]["details"]["reason"]] += 1
            continue
        assert answer.status_code in (200, 202), answer.get_json()
        ids.append(answer.get_json()["id"])
        if "Idempotency-Key" in headers:  # the retry: the same request, not a second one
            again = client.http.post("/v1/requests", json=body, headers=headers)
            assert again.get_json()["id"] == ids[-1]
        if i % 40 == 3:
            client.cancel(ids[-1])
    # A few through the OpenAI front: their source is apart.
    for i in range(5):
        answer = clients[2].http.post("/v1/chat/completions", headers=clients[2].headers, json={
            "model": "m-one", "messages": [{"role": "user", "content": f"front door {i}"}], "max_tokens": 6})
        assert answer.status_code == 200, answer.get_json()
    all_ended(app, tenants)
    refusals.flush(services(app).db, services(app).redis)

    statuses = direct_sums(app, "tenant_id::text = ANY(:t)", {"t": tenants})["statuses"]
    assert {"succeeded", "cancelled", "timed_out"} <= set(statuses), statuses
    with services(app).db.session() as session:
        assert session.scalar(text("SELECT count(*) FROM requests WHERE tenant_id::text = ANY(:t) AND cache_hit"),
                              {"t": tenants}) > 0
        assert session.scalar(text("SELECT count(*) FROM requests WHERE tenant_id::text = ANY(:t) AND attempts > 1"),
                              {"t": tenants}) > 0, "the killed worker's requests were not run again"
    for client, tenant in ((clients[0], tenants[0]), (clients[2], tenants[1])):
        expected = direct_sums(app, "tenant_id = :t", {"t": tenant})
        report = usage_of(client)
        totals = report["totals"]
        assert {s: totals[s] for s in SUMS} == {s: expected[s] for s in SUMS}
        assert Decimal(totals["cost_usd"]) == expected["cost"] > 0
        assert round(totals["cost"]["value"], 2) == float(round(expected["cost"], 2))
        assert totals["statuses"] == expected["statuses"]
        # Each group's line adds up to its own direct sum too.
        grouped = usage_of(client, group_by="key,model,priority,source", bucket="day")
        for bucket in grouped["data"]:
            for result in bucket["results"]:
                where = ("tenant_id = :t AND api_key_id = :k AND coalesce(model_routed, model_requested) = :m "
                         "AND priority = :p AND source = :s")
                direct = direct_sums(app, where, {"t": tenant, "k": result["api_key_id"], "m": result["model"],
                                                  "p": result["priority"], "s": result["source"]})
                assert {s: result[s] for s in SUMS} == {s: direct[s] for s in SUMS}, result
                assert Decimal(result["cost_usd"]) == direct["cost"]
    counted = Counter(usage_of(clients[0])["totals"]["refusals"]) + Counter(usage_of(clients[2])["totals"]["refusals"])
    assert counted == refused and refused["too_large"] > 0
    sources = {r["source"] for b in usage_of(clients[2], group_by="source")["data"] for r in b["results"]}
    assert sources == {"api", "openai"}
    csv = clients[0].http.get("/v1/usage?format=csv&bucket=day", headers=clients[0].headers)
    assert csv.status_code == 200 and csv.mimetype == "text/csv"
    assert csv.get_data(as_text=True).splitlines()[0].startswith("start_time,end_time,")


def add_budget(app, tenant_id: uuid.UUID, allow: str | None = None, **values) -> dict:
    """A budget for the tenant, as the admin API makes one (``allow``: receivers the SSRF guard
    lets through, instead of the app's)."""
    from core.ssrf import AllowList
    from models import Tenant

    with services(app).db.session() as session:
        tenant = session.get(Tenant, tenant_id)
    return services(app).budgets.create(tenant, values, AllowList.parse(allow) if allow else
                                        services(app).settings.webhook_allow_list)


def create_key_for(app, key: str) -> str:
    """A second key of the tenant ``key`` belongs to, with a name and an owner."""
    from core.tenants.manage import add_key
    from models import Tenant

    with services(app).db.session() as session:
        tenant = session.get(Tenant, uuid.UUID(tenant_of(app, key)))
        return add_key(session, tenant, name="second service", owner="team@example.com")


# ---------------------------------------------------------------------- hard budgets at the gate

BUDGET_LIMIT = 2_000


@pytest.fixture
def gate(scratch_redis_url):
    client = redis_client(scratch_redis_url)
    yield SharedLimiter(client), client
    client.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(0, 420)), min_size=50, max_size=200),
       st.integers(0, 2**31))
def test_a_hard_budget_under_50_concurrent_submitters_never_overshoots_past_what_was_in_flight(gate, requests, seed):
    """Each (reservation, use) pair is one request: admitted or refused by the one Lua call, then
    released with its use (which may exceed its reservation: the engine counted more input than
    admission estimated). Whatever the interleaving of 50 threads, the counter never passed the
    budget at an admission, and the end total is within the budget plus those excesses."""
    limiter, client = gate
    client.flushdb()
    counter = f"sluice:budget:{uuid.uuid4()}:0"
    client.set(counter, 0)
    tenant, limits = str(uuid.uuid4()), Limits(10**9, 10**9, 10**9, 10**9)
    admitted, refused, lock = [], [], threading.Lock()
    queue = list(enumerate(requests))
    rng = random.Random(seed)

    def submitter() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i, (reserve, use) = queue.pop(rng.randrange(len(queue)))
            rid = f"req-{i}"
            verdict = limiter.admit(rid, tenant, limits, reserve, "realtime",
                                    budgets=[(counter, BUDGET_LIMIT, reserve)],
                                    budget_record=f"tokens {reserve} {counter}")
            if verdict.admitted:
                with lock:
                    admitted.append((reserve, use))
                if rng.random() < 0.5:
                    time.sleep(0.001)
                limiter.release(rid, tenant, 0, used_tokens=use)
            else:
                assert verdict.reason == "budget_exhausted"
                assert verdict.budget_spent + reserve > BUDGET_LIMIT
                with lock:
                    refused.append(reserve)

    threads = [threading.Thread(target=submitter) for _ in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    used = sum(use for _, use in admitted)
    excess = sum(max(use - reserve, 0) for reserve, use in admitted)
    assert int(client.get(counter)) == used  # every reservation settled to what it used, once
    assert used <= BUDGET_LIMIT + excess
    assert client.hlen(CHARGES_KEY) == 0
    assert len(admitted) + len(refused) == len(requests)
    if sum(r for r, _ in requests) <= BUDGET_LIMIT:
        assert not refused


def test_a_hard_monthly_budget_refuses_with_the_numbers_and_counts_what_ran(app, worker, client, database_url):
    """Through the HTTP API: a budget set by the operator, charged at admission, refused with
    429 budget_exhausted and its numbers, reconciled when requests end."""
    tenant = tenant_of(app, client.key)
    add_budget(app, uuid.UUID(tenant), unit="tokens", amount=Decimal(300), period="month", hard=True)
    accepted = []
    while True:
        answer = client.submit(prompt="spend", max_tokens=50)
        if answer.status_code != 202:
            break
        accepted.append(answer.get_json()["id"])
        assert len(accepted) < 10
    assert answer.status_code == 429
    error = answer.get_json()["error"]
    assert error["code"] == "budget_exhausted"
    assert error["details"]["limit"] == 300 and error["details"]["unit"] == "tokens"
    assert error["details"]["used"] + error["details"]["requested"] > 300
    assert "monthly budget of 300 tokens" in error["message"]
    assert int(answer.headers["Retry-After"]) > 0
    for request_id in accepted:
        client.wait(request_id)
    view = settled_budget(client)
    direct = direct_sums(app, "tenant_id = :t", {"t": tenant})
    assert view["used"] == direct["billed_tokens"] <= 300
    # Ended requests gave back what they did not use: a small request fits again.
    small = client.submit(prompt="spend", max_tokens=4)
    assert small.status_code == 202, small.get_json()
    client.wait(small.get_json()["id"])
    settled_budget(client)
    # Redis lost the counter (a restart): the next admission seeds it from Postgres first.
    redis = services(app).redis
    assert redis.delete(*redis.keys("sluice:budget:*:*")) == 1
    again = client.submit(prompt="spend", max_tokens=50)
    assert again.status_code == 429, again.get_json()
    assert again.get_json()["error"]["details"]["used"] == direct_sums(app, "tenant_id = :t", {"t": tenant})[
        "billed_tokens"]


def settled_budget(client: ApiClient, timeout: float = 15) -> dict:
    """The tenant's one budget once every reservation was given back: a request's end hook releases
    it just after the status a poll sees is committed."""
    deadline = time.monotonic() + timeout
    while True:
        view = client.http.get("/v1/budgets", headers=client.headers).get_json()["data"][0]
        if view["reserved"] == 0:
            return view
        assert time.monotonic() < deadline, f"reservations never settled: {view}"
        time.sleep(0.1)


def test_a_budget_crossing_a_threshold_is_announced_once_per_threshold(app, worker, client):
    from workers.sweep import _usage

    tenant = uuid.UUID(tenant_of(app, client.key))
    services(app).webhooks.rotate(tenant)  # a webhook needs the tenant's signing secret
    add_budget(app, tenant, allow="127.0.0.2", unit="tokens", amount=Decimal(100), period="day", hard=False,
               webhook_url="http://127.0.0.2:9/budget")

    def spend_until(percent: float) -> None:
        for _ in range(40):
            view = client.http.get("/v1/budgets", headers=client.headers).get_json()["data"][0]
            if view["used_percent"] >= percent:
                return
            assert client.wait(client.submit(prompt="use", max_tokens=8).get_json()["id"])["status"] == "succeeded"
        raise AssertionError(f"never reached {percent} %: {view}")

    spend_until(50)
    assert _usage(services(app))["budget_thresholds"] == 1
    assert _usage(services(app))["budget_thresholds"] == 0  # a second sweep announces nothing new
    spend_until(100)  # a soft budget refuses nothing
    assert _usage(services(app))["budget_thresholds"] == 1  # the highest threshold crossed since
    with services(app).db.session() as session:
        events = session.execute(text(
            "SELECT event, (payload->'data'->>'threshold_percent')::int, payload->'data'->>'unit', budget_id "
            "FROM webhook_deliveries WHERE tenant_id = :t ORDER BY created_at"), {"t": tenant}).all()
    assert [e[0] for e in events] == ["budget.threshold"] * 2 and all(e[2] == "tokens" and e[3] for e in events)
    assert events[0][1] in (50, 80) and events[1][1] == 100


def test_the_operator_sets_budgets_and_keys_for_people_through_the_admin_api(admin_app):  # noqa: F811
    name = f"budgeted-{uuid.uuid4().hex[:6]}"
    assert admin(admin_app, "POST", "/admin/tenants", {"name": name}).status_code == 201
    expires = (datetime.now(UTC) + timedelta(days=30)).isoformat()
    made = admin(admin_app, "POST", f"/admin/tenants/{name}/keys",
                 {"name": "search service", "owner": "search@example.com", "expires_at": expires})
    assert made.status_code == 201, made.get_json()
    key = made.get_json()["key"]
    assert (key["name"], key["owner"]) == ("search service", "search@example.com")
    assert made.get_json()["api_key"].startswith("sk-sluice-")
    fixed = admin(admin_app, "POST", f"/admin/tenants/{name}/budgets",
                  {"unit": "usd", "amount": 5, "period": "fixed", "hard": True})
    assert fixed.status_code == 422  # a fixed window needs its two ends
    budget = admin(admin_app, "POST", f"/admin/tenants/{name}/budgets",
                   {"unit": "usd", "amount": 12.5, "period": "week", "hard": False, "api_key_id": key["id"]})
    assert budget.status_code == 201, budget.get_json()
    shown = admin(admin_app, "GET", f"/admin/tenants/{name}/budgets").get_json()["data"]
    assert [(b["unit"], b["amount"], b["period"], b["api_key_id"], b["used"]) for b in shown] == [
        ("usd", 12.5, "week", key["id"], 0)]
    # The key works until it expires: then it is refused like a revoked one.
    user = ApiClient(admin_app, made.get_json()["api_key"])
    assert user.http.get("/v1/budgets", headers=user.headers).status_code == 200
    with services(admin_app).db.session() as session:
        session.execute(text("UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE id = :k"),
                        {"k": key["id"]})
    assert user.http.get("/v1/budgets", headers=user.headers).status_code == 401
    assert admin(admin_app, "DELETE", f"/admin/budgets/{shown[0]['id']}").status_code == 200
    assert admin(admin_app, "GET", f"/admin/tenants/{name}/budgets").get_json()["data"] == []


def test_the_openai_clients_usage_fields_agree_with_the_rollups(app, worker, client):
    openai, api = sdk(app, client.key)
    prompt = completion = cached = 0
    for i in range(6):
        answer = api.chat.completions.create(model=services(app).settings.registry.default.name, max_tokens=5 + i,
                                             messages=[{"role": "user", "content": f"count my tokens {i}"}])
        prompt += answer.usage.prompt_tokens
        completion += answer.usage.completion_tokens
        details = answer.usage.prompt_tokens_details
        cached += (details.cached_tokens or 0) if details else 0
    totals = usage_of(client)["totals"]
    assert (totals["input_tokens"], totals["output_tokens"], totals["cached_tokens"]) == (prompt, completion, cached)
    assert totals["requests"] == 6 and totals["statuses"] == {"succeeded": 6}


def test_a_bulk_job_the_hard_budget_cannot_cover_is_refused_at_submit(client, app):
    tenant = uuid.UUID(tenant_of(app, client.key))
    add_budget(app, tenant, unit="tokens", amount=Decimal(500), period="day", hard=True)
    lines = "".join(json.dumps({"custom_id": f"doc-{i}", "text": "a document to summarise " * 20}) + "\n"
                    for i in range(20)).encode()
    answer = client.http.post("/v1/jobs", data=lines, headers={**client.headers,
                                                              "Content-Type": "application/jsonl"})
    assert answer.status_code == 429, answer.get_json()
    error = answer.get_json()["error"]
    assert error["code"] == "budget_exhausted" and error["details"]["limit"] == 500
    assert error["details"]["requested"] > 500
    with services(app).db.session() as session:  # nothing kept of it
        assert session.scalar(text("SELECT count(*) FROM jobs WHERE tenant_id = :t"), {"t": tenant}) == 0


def test_a_hard_budget_is_never_charged_on_the_local_floor(own_redis, isolated_app, new_client):  # noqa: F811
    """With Redis away, a request under a hard budget is refused (503 budget_unavailable): the floor
    cannot charge the budget atomically. A tenant with no hard budget is still served by the floor."""
    application = isolated_app(redis_url=own_redis["server"].url)
    budgeted, free = new_client(application), new_client(application)
    tenant = uuid.UUID(tenant_of(application, budgeted.key))
    add_budget(application, tenant, unit="usd", amount=Decimal(10), period="month", hard=True)
    assert budgeted.submit(prompt="before", max_tokens=8).status_code == 202
    own_redis["server"].stop()
    refused = budgeted.submit(prompt="during", max_tokens=8)
    assert refused.status_code == 503, refused.get_json()
    assert refused.get_json()["error"]["code"] == "budget_unavailable"
    assert int(refused.headers["Retry-After"]) > 0
    assert free.submit(prompt="during", max_tokens=8).status_code == 202


def test_a_bulk_job_is_refused_when_the_tenants_other_open_jobs_already_hold_the_budget(client, app):
    """The hard-budget check at job submit counts what the tenant's other unfinished jobs have
    queued (items not started yet: no row in flight, nothing in the rollups). Two jobs that each
    fit alone do not both fit: the second is refused with the numbers."""
    tenant = uuid.UUID(tenant_of(app, client.key))
    lines = "".join(json.dumps({"custom_id": f"doc-{i}", "text": "a document to summarise " * 20}) + "\n"
                    for i in range(10)).encode()
    headers = {**client.headers, "Content-Type": "application/jsonl"}
    first = client.http.post("/v1/jobs", data=lines, headers=headers)
    assert first.status_code == 201, first.get_json()
    estimate = first.get_json()["estimated_tokens"]
    add_budget(app, tenant, unit="tokens", amount=Decimal(estimate * 3 // 2), period="day", hard=True)
    second = client.http.post("/v1/jobs", data=lines, headers=headers)
    assert second.status_code == 429, second.get_json()
    error = second.get_json()["error"]
    assert error["code"] == "budget_exhausted" and error["details"]["used"] >= estimate, error
    client.http.post(f"/v1/jobs/{first.get_json()['id']}/cancel", headers=client.headers)
