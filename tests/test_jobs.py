"""Bulk jobs end to end: a real upload into Postgres, the real feeder, a real worker (simulated
engine) on a Redis database of the module's own, results read back through the API.

The model's context is 512 tokens here, so a 12 KB document is summarised by map-reduce.
"""

from __future__ import annotations

import functools
import io
import json
import math
import time
import uuid
from dataclasses import dataclass, field

import pytest
import redis as redis_lib
from conftest import BeatProcess, WorkerProcess, feeder_running, make_settings
from sqlalchemy import text

from core.admission.load import LoadLevel, write_level
from core.broker.queues import queue_length
from core.jobs.feeder import Feeder
from core.rediskeys import FEEDER_STATE_KEY
from launcher.harness import stop_all
from web import create_app
from web.services import services

ENV = {"SLUICE_MAX_CONTEXT_TOKENS": "512", "SLUICE_SIM_SPEED": "4", "SLUICE_JOB_INFLIGHT_PER_WORKER": "16",
       "SLUICE_FEEDER_INTERVAL_S": "0.2"}
JSONL = {"Content-Type": "application/jsonl"}
WORDS = ("harbour", "lantern", "meadow", "copper", "violet", "granite", "orchard", "thunder", "saffron", "willow")


def doc(i: int, words: int) -> str:
    """A document of its own: no two are alike, so none is answered from another's summary."""
    return f"document {i}: " + " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] + str(k % 13) for k in range(words))


def jsonl(lines: list) -> bytes:
    return ("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n").encode()


@dataclass
class Bulk:
    app: object
    redis_url: str
    database_url: str
    tmp: object
    workers: list = field(default_factory=list)

    @property
    def svc(self):
        return services(self.app)

    def submit(self, client, body: bytes, **params):
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return client.http.post(f"/v1/jobs?{query}", data=body, headers={**client.headers, **JSONL})

    def job(self, client, job_id: str) -> dict:
        return client.http.get(f"/v1/jobs/{job_id}", headers=client.headers).get_json()

    def wait(self, client, job_id: str, statuses, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            view = self.job(client, job_id)
            if view["status"] in statuses:
                return view
            assert time.monotonic() < deadline, f"job still {view['status']}: {view['counts']}"
            time.sleep(0.3)

    def lines(self, client, job_id: str, kind: str = "results") -> list[dict]:
        response = client.http.get(f"/v1/jobs/{job_id}/{kind}", headers=client.headers)
        assert response.status_code == 200 and response.mimetype == "application/jsonl"
        return [json.loads(line) for line in response.get_data(as_text=True).splitlines()]

    def sql(self, statement: str, **params):
        with self.svc.db.session() as session:
            result = session.execute(text(statement), params)
            return result.all() if result.returns_rows else []


@pytest.fixture(scope="module")
def bulk(database_url, redis_dbs, tmp_path_factory):
    redis_url = redis_dbs()
    tmp = tmp_path_factory.mktemp("jobs")
    app = create_app(make_settings(database_url, redis_url, ENV))
    state = Bulk(app, redis_url, database_url, tmp)
    state.workers.append(WorkerProcess(database_url, redis_url, tmp, extra_env=ENV, concurrency=32))
    with feeder_running(app):
        yield state
    stop_all(state.workers)
    # No job of this module is left for another test's feeder (the database is shared).
    state.sql("UPDATE jobs SET status = 'cancelled' WHERE status IN ('in_progress', 'finalizing', 'cancelling')")
    services(app).db.dispose()
    redis_dbs.release(redis_url)


def test_a_job_with_long_documents_and_bad_lines_completes_in_input_order(bulk, new_client):
    client = new_client(bulk.app)
    lines: list = [{"custom_id": f"doc-{i}", "text": doc(i, 30)} for i in range(1000)]
    lines[10] = {"custom_id": "long-1", "text": doc(10, 1500)}  # ~3 chunks, one reduce
    lines[500] = {"custom_id": "long-2", "text": doc(500, 3500)}  # enough chunks for two rounds
    lines[990] = {"custom_id": "long-3", "text": doc(990, 1500)}
    expected = [line["custom_id"] for line in lines]
    lines.insert(100, "{not json")
    lines.insert(200, {"custom_id": "no-text"})
    lines.insert(300, {"custom_id": "doc-7", "text": "a second doc-7"})
    response = bulk.submit(client, jsonl(lines), summary_tokens=24, on_invalid="skip")
    assert response.status_code == 201, response.get_json()
    job = response.get_json()
    assert job["counts"]["total"] == 1000 and job["counts"]["invalid"] == 3
    done = bulk.wait(client, job["id"], {"completed", "failed"})
    assert done["status"] == "completed", done
    assert done["counts"]["succeeded"] == 1000 and done["done"] == 1000
    assert done["tokens"]["output"] > 0 and done["tokens"]["input"] > 0

    results = bulk.lines(client, job["id"])
    assert [r["custom_id"] for r in results] == expected
    assert [r["line"] for r in results] == sorted(r["line"] for r in results)
    assert all(r["outcome"] == "succeeded" and r["output"] for r in results)
    by_id = {r["custom_id"]: r for r in results}
    assert by_id["doc-0"]["chunks"] == 1 and by_id["doc-0"]["depth"] == 0
    assert by_id["long-1"]["chunks"] > 1 and by_id["long-1"]["depth"] == 1
    assert by_id["long-2"]["depth"] >= 2 and by_id["long-2"]["usage"]["requests"] > by_id["long-2"]["chunks"]

    errors = bulk.lines(client, job["id"], "errors")
    assert [(e["line"], e["error"]["code"]) for e in errors] == [
        (101, "malformed_json"), (201, "invalid_text"), (301, "duplicate_custom_id")]
    # Every request the job made ran once: as many requests as the items say, none twice.
    made = bulk.sql("SELECT count(*), count(*) FILTER (WHERE status = 'succeeded'), max(attempts) FROM requests "
                    "WHERE metadata->>'job_id' = :job", job=job["id"])[0]
    assert made[0] == made[1] == sum(r["usage"]["requests"] for r in results)
    assert made[2] == 1


def test_bad_uploads_are_refused_with_reasons_and_leave_nothing_behind(bulk, new_client, database_url, redis_dbs):
    client = new_client(bulk.app)
    good = jsonl([{"custom_id": "a", "text": "one"}, {"custom_id": "b", "text": "two"}])

    wrong_type = client.http.post("/v1/jobs", data=good, headers={**client.headers, "Content-Type": "text/csv"})
    assert wrong_type.status_code == 415 and wrong_type.get_json()["error"]["code"] == "unsupported_media_type"
    empty = bulk.submit(client, b"\n\n")
    assert empty.status_code == 422 and empty.get_json()["error"]["code"] == "empty_file"
    nothing_valid = bulk.submit(client, jsonl(["[1]", {"custom_id": "x"}]))
    assert nothing_valid.status_code == 422 and nothing_valid.get_json()["error"]["code"] == "no_valid_lines"
    bad_lines = bulk.submit(client, jsonl([{"custom_id": "a", "text": "one"}, "nope", {"custom_id": "a", "text": "2"}]))
    body = bad_lines.get_json()["error"]
    assert bad_lines.status_code == 422 and body["code"] == "invalid_lines"
    assert [(e["line"], e["code"]) for e in body["details"]["lines"]] == [(2, "malformed_json"),
                                                                          (3, "duplicate_custom_id")]
    params = bulk.submit(client, good, modle="x", summary_tokens="lots", completion_window="3 weeks")
    assert params.status_code == 422 and set(params.get_json()["error"]["details"]) == {
        "modle", "summary_tokens", "completion_window"}
    openai = bulk.submit(client, jsonl([{"custom_id": "o", "method": "POST", "url": "/v1/responses", "body": {}}]))
    assert openai.status_code == 422 and openai.get_json()["error"]["details"]["lines"][0]["code"] == "invalid_url"

    # Over the tenant's token budget for its window: refused at submit, with the numbers.
    bulk.sql("UPDATE tenants SET tokens_per_minute = 100 WHERE id = (SELECT tenant_id FROM api_keys "
             "WHERE key_hash = encode(sha256(convert_to(:key, 'UTF8')), 'hex'))", key=client.key)
    many = jsonl([{"custom_id": str(i), "text": doc(i, 50)} for i in range(200)])
    over = bulk.submit(client, many, completion_window="1h")
    error = over.get_json()["error"]
    assert over.status_code == 422 and error["code"] == "job_over_token_budget"
    assert error["details"]["budget_tokens"] == 6000 and error["details"]["estimated_tokens"] > 6000

    # A file over the size limit: 413 from its Content-Length, before the body is read; and one
    # sent without a length is cut off once it passes the limit.
    small = create_app(make_settings(database_url, bulk.redis_url, {**ENV, "SLUICE_JOB_MAX_BYTES": "1000"}))
    try:
        tight = small.test_client()
        big = jsonl([{"custom_id": str(i), "text": doc(i, 20)} for i in range(50)])
        sized = tight.post("/v1/jobs", data=big, headers={**client.headers, **JSONL})
        assert sized.status_code == 413 and "1000" in sized.get_json()["error"]["message"]
        streamed = tight.post("/v1/jobs", input_stream=io.BytesIO(big), headers={**client.headers, **JSONL},
                              environ_overrides={"wsgi.input_terminated": True})
        assert streamed.status_code == 413 and streamed.get_json()["error"]["code"] == "file_too_large"
    finally:
        services(small).db.dispose()

    left = bulk.sql("SELECT count(*) FROM jobs WHERE tenant_id = (SELECT tenant_id FROM api_keys "
                    "WHERE key_hash = encode(sha256(convert_to(:key, 'UTF8')), 'hex'))", key=client.key)
    assert left[0][0] == 0
    # Another tenant's job is not there for this one.
    mine = bulk.submit(new_client(bulk.app), good)
    assert mine.status_code == 201
    other = client.http.get(f"/v1/jobs/{mine.get_json()['id']}", headers=client.headers)
    assert other.status_code == 404 and other.get_json()["error"]["code"] == "not_found"
    assert client.http.post(f"/v1/jobs/{mine.get_json()['id']}/cancel", headers=client.headers).status_code == 404


def test_metadata_postgres_cannot_store_is_refused_by_name(client):
    """JSON can spell a NUL or a lone surrogate, which a jsonb column refuses: 422 naming
    metadata, before the file is read, never a 500 from the insert."""
    good = jsonl([{"custom_id": "a", "text": "one"}])
    for metadata in ('{"k": "\\u0000"}', '{"\\u0000": "v"}', '{"k": "\\ud800"}', '{"\\udfff": "v"}'):
        response = client.http.post("/v1/jobs", query_string={"metadata": metadata}, data=good,
                                    headers={**client.headers, **JSONL})
        error = response.get_json()["error"]
        assert response.status_code == 422 and error["code"] == "invalid_request", error
        assert set(error["details"]) == {"metadata"} and "NUL" in error["details"]["metadata"][0]
    # A raw NUL (%00) in the query, inside the JSON string, is refused the same way.
    raw = client.http.post("/v1/jobs?metadata=%7B%22k%22%3A%22%00%22%7D", data=good,
                           headers={**client.headers, **JSONL})
    assert raw.status_code == 422 and set(raw.get_json()["error"]["details"]) == {"metadata"}


def test_cancel_keeps_finished_results_and_stops_the_rest(bulk, new_client):
    client = new_client(bulk.app)
    lines = [{"custom_id": f"c{i}", "text": doc(i, 40)} for i in range(600)]
    job = bulk.submit(client, jsonl(lines), summary_tokens=48).get_json()
    deadline = time.monotonic() + 60
    while bulk.job(client, job["id"])["counts"]["succeeded"] < 20:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    cancelled = client.http.post(f"/v1/jobs/{job['id']}/cancel", headers=client.headers).get_json()
    assert cancelled["status"] in ("cancelling", "cancelled")
    final = bulk.wait(client, job["id"], {"cancelled"}, timeout=60)
    counts = final["counts"]
    assert counts["succeeded"] >= 20 and counts["cancelled"] > 0 and counts["pending"] == counts["running"] == 0
    assert counts["succeeded"] + counts["cancelled"] + counts["failed"] == 600
    results = bulk.lines(client, job["id"])
    kept = [r for r in results if r["outcome"] == "succeeded"]
    assert len(kept) == counts["succeeded"] and all(r["output"] for r in kept)
    live = bulk.sql("SELECT count(*) FROM requests WHERE metadata->>'job_id' = :job AND status IN "
                    "('queued', 'running')", job=job["id"])
    assert live[0][0] == 0
    again = client.http.post(f"/v1/jobs/{job['id']}/cancel", headers=client.headers)
    assert again.status_code == 409 and again.get_json()["error"]["code"] == "not_cancellable"


def test_tenants_share_batch_capacity_by_weight_counted_in_tokens(bulk, new_client):
    """Start-time fair queueing, checked on the order of starts, not on a share after a sleep: with
    the batch capacity held at 0 until both jobs are loaded, every start from then on goes to the
    tenant that has used the least tokens per unit of weight, so at every point of the sequence the
    two tenants' used-per-weight differ by at most one item's cost."""
    from core.fleet.workers import warm_workers
    from core.rediskeys import PAUSED_KEY
    from core.submit.tokens import estimate_text_tokens

    heavy, light = new_client(bulk.app), new_client(bulk.app)
    weights = {}
    for client, weight in ((heavy, 3), (light, 1)):
        bulk.sql("UPDATE tenants SET batch_weight = :w WHERE id = (SELECT tenant_id FROM api_keys "
                 "WHERE key_hash = encode(sha256(convert_to(:key, 'UTF8')), 'hex'))", w=weight, key=client.key)
    # Every worker marked paused for a reservation: the feeder's batch capacity is 0 meanwhile.
    r = redis_lib.Redis.from_url(bulk.redis_url, decode_responses=True)
    workers = warm_workers(r)
    assert workers
    for worker in workers:
        r.hset(PAUSED_KEY, worker["worker"], json.dumps({"node": worker.get("node", "?"), "queues": []}))
    try:
        # The light tenant's documents are four times longer: counted in items it would get more.
        short = bulk.submit(heavy, jsonl([{"custom_id": str(i), "text": doc(i, 60)} for i in range(2000)]),
                            summary_tokens=16).get_json()
        long = bulk.submit(light, jsonl([{"custom_id": str(i), "text": doc(i, 240)} for i in range(500)]),
                           summary_tokens=16).get_json()
        weights = {short["id"]: 3.0, long["id"]: 1.0}
        # Both loaded before the capacity comes back: a job still validating is not fed, and on a
        # loaded machine the heavy tenant's shorter file was fed 17 items before the light one's
        # had finished loading.
        bulk.wait(heavy, short["id"], {"in_progress"}, timeout=120)
        bulk.wait(light, long["id"], {"in_progress"}, timeout=120)
        assert bulk.sql("SELECT count(*) FROM requests WHERE metadata->>'job_id' IN (:a, :b)",
                        a=short["id"], b=long["id"])[0][0] == 0, "fed while the capacity was 0"
    finally:
        r.delete(PAUSED_KEY)
    deadline = time.monotonic() + 120
    while bulk.sql("SELECT count(*) FROM requests WHERE metadata->>'job_id' IN (:a, :b)",
                   a=short["id"], b=long["id"])[0][0] < 150:
        assert time.monotonic() < deadline, "the feeder started too few items"
        time.sleep(0.2)
    for client, job in ((heavy, short), (light, long)):
        client.http.post(f"/v1/jobs/{job['id']}/cancel", headers=client.headers)
    # The feeder's own cost of a start: the prompts' estimate plus max_tokens, summed over the
    # requests of one item's first stage (a long document is several chunks, started together; the
    # summary of their summaries comes later, from the worker's settle, not from the feeder).
    rows = bulk.sql("SELECT metadata->>'job_id', metadata->>'line', input->>'prompt', max_tokens FROM requests "
                    "WHERE metadata->>'job_id' IN (:a, :b) AND metadata->>'stage' LIKE 'depth 0,%' "
                    "ORDER BY created_at, id", a=short["id"], b=long["id"])
    items: dict[tuple[str, str], int] = {}
    for job_id, line, prompt, max_tokens in rows:
        items[(job_id, line)] = items.get((job_id, line), 0) + estimate_text_tokens(prompt or "") + max_tokens
    starts = [(job_id, cost) for (job_id, _), cost in list(items.items())[:100]]
    largest = max(cost / weights[job_id] for job_id, cost in starts)
    used = {short["id"]: 0.0, long["id"]: 0.0}
    lags = []
    for job_id, cost in starts:
        used[job_id] += cost / weights[job_id]
        lags.append(abs(used[short["id"]] - used[long["id"]]))
    assert max(lags) <= largest, (max(lags), largest, "".join("H" if j == short["id"] else f"L{c}," for j, c in starts))
    # Both tenants were served all along, the heavy one (weight 3) about three times the tokens.
    fed = {job_id: sum(c for j, c in starts if j == job_id) for job_id in used}
    assert fed[short["id"]] > fed[long["id"]] > 0, fed


def test_the_feeder_keeps_the_queue_bounded_and_pauses_while_degraded(bulk, new_client):
    client = new_client(bulk.app)
    job = bulk.submit(client, jsonl([{"custom_id": str(i), "text": doc(i, 30)} for i in range(1500)]),
                      summary_tokens=64).get_json()
    r = redis_lib.Redis.from_url(bulk.redis_url)
    try:
        # In flight (queued or running, so on a queue or held by the worker) and the messages Redis
        # holds stay within one worker × SLUICE_JOB_INFLIGHT_PER_WORKER, whatever the job's size.
        peak_rows = peak_messages = 0
        for _ in range(30):
            peak_rows = max(peak_rows, bulk.sql("SELECT count(*) FROM requests WHERE metadata->>'job_id' = :j "
                                                "AND status IN ('queued', 'running')", j=job["id"])[0][0])
            peak_messages = max(peak_messages, queue_length(r, "batch.small") + queue_length(r, "batch.large")
                                + r.hlen("unacked"))
            time.sleep(0.1)
        assert 0 < peak_rows <= 16 and peak_messages <= 16 + 2  # (+ the sweep's own message, if any)

        written = time.time()
        write_level(r, LoadLevel.LIGHT_MODEL)
        # What the rounds before the first paused one fed may still be created while they end (a
        # round on a loaded host can outlast any fixed sleep); once a round that saw the level
        # has reported, nothing more is.
        deadline = time.monotonic() + 30
        while not ((state := r.hgetall(FEEDER_STATE_KEY)) and state.get(b"paused")
                   and float(state[b"at"]) > written):
            assert time.monotonic() < deadline, f"the feeder never paused: {state}"
            time.sleep(0.05)
        made = bulk.sql("SELECT count(*) FROM requests WHERE metadata->>'job_id' = :j", j=job["id"])[0][0]
        time.sleep(2.0)
        assert bulk.sql("SELECT count(*) FROM requests WHERE metadata->>'job_id' = :j", j=job["id"])[0][0] == made
        assert bulk.job(client, job["id"])["feeder"]["paused"].startswith("degradation level 1 on ")

        write_level(r, LoadLevel.NORMAL)
        deadline = time.monotonic() + 10
        while bulk.sql("SELECT count(*) FROM requests WHERE metadata->>'job_id' = :j", j=job["id"])[0][0] == made:
            assert time.monotonic() < deadline, "the feeder did not resume"
            time.sleep(0.2)
    finally:
        write_level(r, LoadLevel.NORMAL)
        r.close()
        client.http.post(f"/v1/jobs/{job['id']}/cancel", headers=client.headers)
        bulk.wait(client, job["id"], {"cancelled"}, timeout=60)


def test_the_feeder_pauses_while_a_peak_reservation_is_in_force(bulk):
    from datetime import UTC, datetime, timedelta

    from models.reservation import book, cancel

    feeder = Feeder(bulk.svc)
    assert feeder._paused([]) == (None, [])
    with bulk.svc.db.session() as session:
        now = datetime.now(UTC)
        booked = book(session, now - timedelta(seconds=5), now + timedelta(minutes=5), None, "jobs test", ("all",))
    try:
        assert Feeder(bulk.svc)._paused([]) == ("peak reservation in force", [])
    finally:
        with bulk.svc.db.session() as session:
            cancel(session, booked.id)
    assert Feeder(bulk.svc)._paused([]) == (None, [])


def test_the_feeder_holds_back_only_the_jobs_of_a_degraded_class(bulk):
    """Levels are per class (issue 21, defect 3): a job whose model's realtime class is degraded
    waits; a job of a calm model goes on being fed."""
    from models.job import Job

    busy, calm = Job(model="busy-model", priority="batch"), Job(model="calm-model", priority="batch")
    r = redis_lib.Redis.from_url(bulk.redis_url)
    write_level(r, LoadLevel.SHORTER_OUTPUT, classes={"realtime:busy-model": 2})
    try:
        feeder = Feeder(bulk.svc)
        feeder.svc.requests.ladder.reader._read_at = float("-inf")  # read the levels now
        paused, feeding = feeder._paused([busy, calm])
        assert paused == "degradation level 2 on batch:busy-model" and feeding == [calm]
    finally:
        write_level(r, LoadLevel.NORMAL)


def test_a_worker_killed_mid_job_loses_nothing(bulk, new_client):
    client = new_client(bulk.app)
    job = bulk.submit(client, jsonl([{"custom_id": f"k{i}", "text": doc(i, 30)} for i in range(300)]),
                      summary_tokens=96).get_json()
    beat = BeatProcess(bulk.database_url, bulk.redis_url, bulk.tmp)
    try:
        deadline = time.monotonic() + 60
        while bulk.job(client, job["id"])["counts"]["succeeded"] < 30:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        bulk.workers.pop(0).kill()
        bulk.workers.append(WorkerProcess(bulk.database_url, bulk.redis_url, bulk.tmp, extra_env=ENV,
                                          concurrency=32))
        done = bulk.wait(client, job["id"], {"completed", "failed"}, timeout=180)
    finally:
        beat.stop()
    assert done["status"] == "completed" and done["counts"]["succeeded"] == 300, done["counts"]
    results = bulk.lines(client, job["id"])
    assert [r["custom_id"] for r in results] == [f"k{i}" for i in range(300)]
    ran = bulk.sql("SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*), max(attempts) FROM requests "
                   "WHERE metadata->>'job_id' = :j", j=job["id"])[0]
    assert ran[0] == ran[1] == 300  # one request per item, each succeeded once
    assert ran[2] >= 1
    assert uuid.UUID(job["id"])


def test_openai_batch_lines_run_as_they_are(bulk, new_client):
    client = new_client(bulk.app)
    lines = [{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "developer", "content": "Be brief."},
                                    {"role": "user", "content": "Name a river."}], "max_tokens": 5}},
             {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Once upon a time", "max_completion_tokens": 7, "temperature": 0}},
             {"custom_id": "doc", "text": "A document line beside them."}]
    job = bulk.submit(client, jsonl(lines), summary_tokens=8).get_json()
    done = bulk.wait(client, job["id"], {"completed", "failed"}, timeout=60)
    assert done["status"] == "completed"
    results = {r["custom_id"]: r for r in bulk.lines(client, job["id"])}
    assert [r["outcome"] for r in results.values()] == ["succeeded"] * 3
    assert results["chat"]["usage"]["output_tokens"] == 5 and results["completion"]["usage"]["output_tokens"] == 7
    assert results["doc"]["usage"]["output_tokens"] == 8


def test_a_feeder_that_died_between_naming_and_creating_requests_loses_nothing(bulk, new_client):
    """A feeder writes an item's request ids before it creates the requests; one killed in
    between leaves ids with no rows. The next leader creates them with those very ids, once.
    Only one feeder leads at a time."""
    assert Feeder(bulk.svc).lead() is False  # the module's feeder holds the lease
    client = new_client(bulk.app)
    r = redis_lib.Redis.from_url(bulk.redis_url)
    write_level(r, LoadLevel.LIGHT_MODEL)  # nothing is fed while the item is set up
    try:
        job = bulk.submit(client, jsonl([{"custom_id": "only", "text": doc(7, 40)}]), summary_tokens=16).get_json()
        named = uuid.uuid4()
        bulk.sql("UPDATE job_items SET status = 'running', requests = ARRAY[CAST(:r AS uuid)], request_count = 1, "
                 "chunks = 1, final = true WHERE job_id = :j", r=str(named), j=job["id"])
    finally:
        write_level(r, LoadLevel.NORMAL)
        r.close()
    done = bulk.wait(client, job["id"], {"completed", "failed"}, timeout=60)
    assert done["status"] == "completed"
    made = bulk.sql("SELECT id, status FROM requests WHERE metadata->>'job_id' = :j", j=job["id"])
    assert [(str(row[0]), row[1]) for row in made] == [(str(named), "succeeded")]
    assert bulk.lines(client, job["id"])[0]["output"]


def test_a_tenants_jobs_share_its_budget_and_its_limits(isolated_app, new_client):
    """Job intake is charged across the tenant's unfinished jobs, not per job; it is refused while
    the tenant is over its request limits, past its unfinished jobs and past its stored lines. (No
    feeder here: every accepted job stays unfinished.)"""
    from admission_support import set_limits

    application = isolated_app(job_max_open_per_tenant=3, job_max_stored_items_per_tenant=60)
    client = new_client(application)
    submit = functools.partial(Bulk(application, "", "", None).submit, client)
    lines = jsonl([{"custom_id": str(i), "text": doc(i, 30)} for i in range(20)])
    first = submit(lines, completion_window="1h", summary_tokens=50)
    assert first.status_code == 201, first.get_json()
    priced = first.get_json()["estimated_tokens"]
    # A window's budget that holds one such job and a half: alone the second would fit, not beside the first.
    set_limits(application, client, tokens_per_minute=math.ceil(1.5 * priced / 60))
    second = submit(lines, completion_window="1h", summary_tokens=50)
    error = second.get_json()["error"]
    assert second.status_code == 422 and error["code"] == "job_over_token_budget", error
    assert error["details"]["open_jobs_tokens"] == priced and error["details"]["estimated_tokens"] == priced
    set_limits(application, client, tokens_per_minute=10**7)
    assert submit(lines, completion_window="1h", summary_tokens=50).status_code == 201  # 40 lines stored
    # 20 more lines would be 60, the most this tenant may store: but 21 are over it.
    over = submit(jsonl([{"custom_id": str(i), "text": doc(i, 5)} for i in range(21)]))
    assert over.status_code == 429 and over.get_json()["error"]["code"] == "job_storage_full"
    assert "Retry-After" in over.headers
    assert submit(jsonl([{"custom_id": str(i), "text": doc(i, 5)} for i in range(20)])).status_code == 201
    # Three unfinished jobs, the most: the next is refused before its file is read.
    too_many = submit(jsonl([{"custom_id": "x", "text": "one more"}]))
    assert too_many.status_code == 429 and too_many.get_json()["error"]["code"] == "too_many_open_jobs"
    assert too_many.get_json()["error"]["details"] == {"open_jobs": 3, "limit": 3}


def test_a_job_is_refused_while_its_tenant_is_rate_limited(isolated_app, new_client):
    from admission_support import set_limits

    application = isolated_app()
    client = new_client(application)
    set_limits(application, client, requests_per_minute=2)
    for i in range(2):
        assert client.submit(prompt=f"use the rate {i}", max_tokens=4).status_code == 202
    refused = Bulk(application, "", "", None).submit(client, jsonl([{"custom_id": "a", "text": "one"}]))
    assert refused.status_code == 429 and refused.get_json()["error"]["code"] == "rate_limited"
    assert "Retry-After" in refused.headers


def test_a_big_job_is_loaded_in_short_statements_and_its_repeats_found(isolated_app, new_client, monkeypatch):
    """50,000 lines in COPY statements of 10,000 rows, three custom_ids repeated across statements:
    accepted, the repeats listed by line. (The duplicate check once joined the window query to every
    line of the job just loaded and ran it per line: minutes for 100,000 lines, past any timeout.)"""
    from admission_support import set_limits

    from core.jobs import intake

    monkeypatch.setattr(intake, "COPY_CHUNK_ROWS", 10_000)
    application = isolated_app()
    client = new_client(application)
    set_limits(application, client, tokens_per_minute=10**9)
    lines = [{"custom_id": f"d{i}", "text": f"a short document number {i}"} for i in range(50_000)]
    lines += [{"custom_id": f"d{i}", "text": "said again"} for i in (5, 12_345, 49_999)]
    answer = Bulk(application, "", "", None).submit(client, jsonl(lines), on_invalid="skip", completion_window="7d")
    assert answer.status_code == 201, answer.get_json()
    view = answer.get_json()
    assert view["counts"]["total"] == 50_000 and view["counts"]["invalid"] == 3
    errors = client.http.get(f"/v1/jobs/{view['id']}/errors", headers=client.headers).get_data(as_text=True)
    repeats = sorted((e["line"], e["error"]["code"]) for e in map(json.loads, errors.splitlines()))
    assert repeats == [(50_001, "duplicate_custom_id"), (50_002, "duplicate_custom_id"),
                       (50_003, "duplicate_custom_id")], repeats


def test_a_statement_past_its_timeout_is_a_503_not_a_500(isolated_app, new_client, monkeypatch):
    """A real statement timeout (the whole-job budget squeezed to 1 ms): the client is told to
    retry, with nothing half-written left."""
    from admission_support import set_limits, tenant_id_of

    from core.jobs import intake

    monkeypatch.setattr(intake, "_whole_job_budget_ms", lambda lines: 1)
    application = isolated_app()
    client = new_client(application)
    set_limits(application, client, tokens_per_minute=10**9)
    lines = jsonl([{"custom_id": f"d{i}", "text": f"document {i}"} for i in range(20_000)])
    answer = Bulk(application, "", "", None).submit(client, lines, completion_window="7d")
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "5"
    assert answer.get_json()["error"]["message"].startswith("The request store took too long")
    with services(application).db.session() as session:
        left = session.execute(text("SELECT count(*) FROM jobs WHERE tenant_id = :t"),
                               {"t": tenant_id_of(application, client)}).scalar()
    assert left == 0
