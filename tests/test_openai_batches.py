"""OpenAI Files and Batches through OpenAI's own SDK, unmodified: a real gunicorn web process, a
real worker (simulated engine) and the feeder, on a Redis database of the module's own.

A batch is a bulk job; what is checked here is what an OpenAI client sees: the upload round
trip, a batch polled to its end, its output and error files in OpenAI's batch output format
matched to the input by custom_id, a cancel that keeps what finished, lists, and tenancy.
"""

from __future__ import annotations

import json
import time
import uuid

import openai
import pytest
from conftest import WorkerProcess, feeder_running, make_settings, service_env
from sqlalchemy import text

from core.settings import Settings
from launcher.database import create_key
from launcher.harness import WebProcess
from web import create_app
from web.services import services

ENV = {"SLUICE_SIM_SPEED": "4", "SLUICE_JOB_INFLIGHT_PER_WORKER": "8", "SLUICE_FEEDER_INTERVAL_S": "0.2"}
ENDED = {"completed", "failed", "expired", "cancelled"}


def chat_line(custom_id: str, words: str, max_tokens: int = 5) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"Say something about {words}."}],
                     "max_tokens": max_tokens}}


def completion_line(custom_id: str, prompt: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": 6}}


def jsonl(lines: list) -> bytes:
    return ("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n").encode()


class Platform:
    def __init__(self, web: WebProcess, app, database_url: str) -> None:
        self.web = web
        self.app = app
        self.database_url = database_url
        self.clients: list[openai.OpenAI] = []

    def client(self) -> openai.OpenAI:
        """An OpenAI SDK client of a new tenant (closed with the module: no socket is left to the GC)."""
        key = create_key(Settings(database_url=self.database_url).sqlalchemy_url, f"tenant-{uuid.uuid4().hex[:10]}")
        self.clients.append(openai.OpenAI(api_key=key, base_url=f"{self.web.url}/v1", max_retries=0, timeout=60))
        return self.clients[-1]


@pytest.fixture(scope="module")
def platform(database_url, redis_dbs, tmp_path_factory):
    redis_url = redis_dbs()
    tmp = tmp_path_factory.mktemp("openai-batches")
    app = create_app(make_settings(database_url, redis_url, ENV))
    worker = WorkerProcess(database_url, redis_url, tmp, extra_env=ENV, concurrency=16)
    web = WebProcess(service_env(database_url, redis_url, ENV), tmp)
    state = Platform(web, app, database_url)
    try:
        with feeder_running(app):
            yield state
    finally:
        for client in state.clients:
            client.close()
        web.stop()
        worker.stop()
        # No batch of this module is left for another test's feeder (the database is shared).
        with services(app).db.session() as session:
            session.execute(text("UPDATE jobs SET status = 'cancelled' WHERE id IN (SELECT job_id FROM batches) "
                                 "AND status IN ('in_progress', 'finalizing', 'cancelling')"))
        services(app).db.dispose()
        redis_dbs.release(redis_url)


def wait(client: openai.OpenAI, batch_id: str, statuses=ENDED, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.3)


def lines_of(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def submit(client: openai.OpenAI, lines: list, endpoint: str = "/v1/chat/completions", **extra):
    upload = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h", **extra)


def test_a_batch_runs_and_its_output_matches_the_input_by_custom_id(platform):
    client = platform.client()
    lines = [chat_line(f"req-{i}", f"river {i}") for i in range(24)]
    body = jsonl(lines)
    upload = client.files.create(file=("rivers.jsonl", body), purpose="batch")
    assert (upload.object, upload.purpose, upload.bytes, upload.filename) == ("file", "batch", len(body),
                                                                             "rivers.jsonl")
    assert client.files.retrieve(upload.id).bytes == len(body)
    assert client.files.content(upload.id).content == body  # stored compressed, read back as sent

    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"project": "rivers"})
    assert batch.id.startswith("batch_") and batch.input_file_id == upload.id
    assert batch.status in ("in_progress", "finalizing", "completed") and batch.metadata == {"project": "rivers"}
    done = wait(client, batch.id)
    assert done.status == "completed" and done.completed_at is not None and done.in_progress_at is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (24, 24, 0)
    assert done.error_file_id is None and done.output_file_id is not None

    output = {line["custom_id"]: line for line in lines_of(client, done.output_file_id)}
    assert set(output) == {line["custom_id"] for line in lines}
    for line in output.values():
        assert line["error"] is None and line["response"]["status_code"] == 200 and line["id"].startswith("batch_req_")
        answer = line["response"]["body"]
        assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["completion_tokens"] == 5 and answer["usage"]["prompt_tokens"] > 0
    assert len({line["response"]["request_id"] for line in output.values()}) == 24
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_a_file_of_several_chunks_round_trips_and_runs(platform):
    """Stored in 1 MiB chunks: the content comes back byte for byte, and lines that straddle two
    chunks are read whole when the batch is made (JSON allows the padding after each object)."""
    client = platform.client()
    lines = [json.dumps(chat_line(f"wide-{i}", f"cloud {i}")) + " " * 700_000 for i in range(3)]
    body = jsonl(lines)
    upload = client.files.create(file=("wide.jsonl", body), purpose="batch")
    assert upload.bytes == len(body) > 2 * (1 << 20)
    assert client.files.content(upload.id).content == body
    done = wait(client, client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                              completion_window="24h").id)
    assert done.status == "completed" and done.request_counts.completed == 3
    assert sorted(line["custom_id"] for line in lines_of(client, done.output_file_id)) == ["wide-0", "wide-1",
                                                                                           "wide-2"]


def test_bad_lines_are_reported_in_the_error_file_and_the_rest_run(platform):
    """A bad line does not refuse the batch: it is an error-file line with its reason. A file
    with no valid line is refused when the batch is created (400)."""
    client = platform.client()
    lines = [completion_line("good-0", "Once upon a time"), "{not json",
             {"custom_id": "a-document", "text": "not an OpenAI request"}, completion_line("good-1", "The river"),
             {"custom_id": "no-prompt", "method": "POST", "url": "/v1/completions", "body": {}},
             completion_line("good-2", "At dawn")]
    done = wait(client, submit(client, lines, endpoint="/v1/completions").id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 3, 3)
    output = {line["custom_id"]: line for line in lines_of(client, done.output_file_id)}
    assert set(output) == {"good-0", "good-1", "good-2"}
    assert all(line["response"]["body"]["object"] == "text_completion"
               and line["response"]["body"]["choices"][0]["text"] for line in output.values())
    errors = lines_of(client, done.error_file_id)
    # A line the ingest could not read has no custom_id; its id ends with its line number.
    assert [(e["id"].rsplit("_", 1)[1], e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("2", None, "malformed_json"), ("3", "a-document", "invalid_url"), ("5", None, "invalid_body")]
    assert all(e["response"] is None and e["error"]["message"] for e in errors)

    with pytest.raises(openai.BadRequestError) as refused:
        submit(client, ["{not json", {"custom_id": "doc", "text": "a document"}], endpoint="/v1/completions")
    assert refused.value.code == "no_valid_lines" and refused.value.type == "invalid_request_error"


def test_only_batch_files_and_openai_shaped_errors(platform):
    client = platform.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("tune.jsonl", jsonl([chat_line("a", "b")])), purpose="fine-tune")
    assert refused.value.status_code == 400 and refused.value.code == "invalid_purpose"
    assert set(refused.value.body) == {"message", "type", "param", "code"} and refused.value.param == "purpose"
    upload = client.files.create(file=("in.jsonl", jsonl([chat_line("a", "b")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h")
    assert refused.value.param == "endpoint"


def test_a_cancelled_batch_keeps_its_finished_lines(platform):
    client = platform.client()
    lines = [chat_line(f"c{i}", f"mountain {i}", max_tokens=40) for i in range(600)]
    batch = submit(client, lines)
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 5:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = wait(client, batch.id, {"cancelled"}, timeout=120)
    assert done.cancelled_at is not None and done.request_counts.completed >= 5
    kept = lines_of(client, done.output_file_id)
    assert len(kept) == done.request_counts.completed
    assert all(line["response"]["status_code"] == 200 and line["response"]["body"]["choices"][0]["message"]["content"]
               for line in kept)
    stopped = lines_of(client, done.error_file_id)
    assert stopped and all(line["response"] is None and line["error"]["code"] for line in stopped)
    # Every line ended in exactly one of the two files.
    assert sorted(line["custom_id"] for line in kept + stopped) == sorted(line["custom_id"] for line in lines)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_tenants_see_only_their_own_batches_and_files(platform):
    owner, other = platform.client(), platform.client()
    first = submit(owner, [chat_line("x", "fog")])
    second = submit(owner, [chat_line("y", "rain")])
    done = wait(owner, first.id)
    for call in (lambda: other.batches.retrieve(first.id), lambda: other.batches.cancel(second.id),
                 lambda: other.files.retrieve(first.input_file_id), lambda: other.files.content(first.input_file_id),
                 lambda: other.files.content(done.output_file_id),
                 lambda: other.batches.create(input_file_id=first.input_file_id, endpoint="/v1/chat/completions",
                                              completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.type == "not_found_error" and missing.value.code in ("batch_not_found",
                                                                                  "file_not_found")
    with pytest.raises(openai.NotFoundError) as missing:
        other.files.retrieve(done.output_file_id)
    assert missing.value.code == "file_not_found"
    assert other.batches.list().data == []
    page = owner.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    assert [b.id for b in owner.batches.list(limit=1)] == [second.id, first.id]  # the SDK pages with ?after=


def test_a_batch_mixing_structured_output_tools_and_choices_answers_each_line_right(platform):
    """200 lines: plain chat, a json_schema, forced tool calls, and n = 2 with logprobs; every line's
    answer is what the same call to /v1/chat/completions would give (issue 22)."""
    import jsonschema

    schema = {"type": "object", "required": ["city", "rank"], "additionalProperties": False,
              "properties": {"city": {"type": "string"}, "rank": {"type": "integer", "minimum": 1}}}
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "required": ["term"], "properties": {"term": {"type": "string"}}}}}
    extras = {"plain": {}, "schema": {"response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "city", "schema": schema}}},
              "tools": {"tools": [tool], "tool_choice": "required"}, "choices": {"n": 2, "logprobs": True,
                                                                                 "top_logprobs": 2}}
    lines = []
    for i in range(200):
        kind = list(extras)[i % 4]
        line = chat_line(f"{kind}-{i}", f"line {i}", max_tokens=60)
        line["body"].update(extras[kind])
        lines.append(line)
    client = platform.client()
    done = wait(client, submit(client, lines).id, timeout=300)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 200, 0)
    for line in lines_of(client, done.output_file_id):
        kind, answer = line["custom_id"].split("-")[0], line["response"]["body"]
        choices = answer["choices"]
        if kind == "plain":
            assert len(choices) == 1 and choices[0]["message"]["content"].startswith("[simulated]")
        elif kind == "schema":
            jsonschema.validate(json.loads(choices[0]["message"]["content"]), schema)
        elif kind == "tools":
            (call,) = choices[0]["message"]["tool_calls"]
            assert call["function"]["name"] == "lookup" and choices[0]["finish_reason"] == "tool_calls"
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
        else:
            assert [c["index"] for c in choices] == [0, 1]
            assert all(len(t["top_logprobs"]) == 2 for c in choices for t in c["logprobs"]["content"])
            assert answer["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in choices)


def test_files_are_listed_and_deleted_and_a_batch_keeps_its_lines_and_usage(platform):
    client = platform.client()
    uploads = [client.files.create(file=(f"f{i}.jsonl", jsonl([chat_line(f"c{i}", "x")])), purpose="batch")
               for i in range(3)]
    listed = client.files.list()
    assert [f.id for f in listed.data] == [u.id for u in uploads[::-1]]  # newest first
    first_page = client.files.list(limit=2, order="asc")
    assert [f.id for f in first_page.data] == [u.id for u in uploads[:2]] and first_page.has_more
    rest = client.files.list(limit=2, order="asc", after=first_page.data[-1].id)
    assert [f.id for f in rest.data] == [uploads[2].id] and not rest.has_more
    assert [f.id for f in platform.client().files.list().data] == []  # another tenant's list

    batch = client.batches.create(input_file_id=uploads[0].id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deleted = client.files.delete(uploads[0].id)
    assert (deleted.id, deleted.deleted) == (uploads[0].id, True)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploads[0].id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(uploads[0].id)
    done = wait(client, batch.id)  # its lines were read when it was made
    assert done.status == "completed" and done.input_file_id == uploads[0].id
    assert done.model == "simulated-llama-8b"
    (line,) = lines_of(client, done.output_file_id)
    usage = line["response"]["body"]["usage"]
    assert (done.usage.input_tokens, done.usage.output_tokens) == (usage["prompt_tokens"],
                                                                   usage["completion_tokens"])
    assert done.usage.total_tokens == usage["total_tokens"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.delete(done.output_file_id)
    assert refused.value.code == "file_not_deletable"


def test_an_expired_batch_reads_back_as_openais_do(platform):
    """Its window ends while lines wait: the batch is `expired` with `expired_at`, its finished lines
    are in the output file and billed, the rest in the error file as `batch_expired`."""
    import redis as redis_lib

    from core.fleet.workers import warm_workers
    from core.rediskeys import PAUSED_KEY

    client = platform.client()
    lines = [chat_line(f"late-{i}", f"lake {i}", max_tokens=4) for i in range(120)]
    batch = submit(client, lines)
    wait(client, batch.id, {"in_progress", *ENDED})
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed == 0:
        assert time.monotonic() < deadline, "no line finished"
        time.sleep(0.1)
    # The feeder's capacity held at 0 (every worker marked paused for a reservation), then the window ends.
    redis = redis_lib.Redis.from_url(services(platform.app).settings.redis_url, decode_responses=True)
    for worker in warm_workers(redis):
        redis.hset(PAUSED_KEY, worker["worker"], json.dumps({"node": worker.get("node", "?"), "queues": []}))
    try:
        with services(platform.app).db.session() as session:
            session.execute(text("UPDATE jobs SET expires_at = now() WHERE id = :id"),
                            {"id": uuid.UUID(batch.id.removeprefix("batch_"))})
        done = wait(client, batch.id)
        # Expired at once; a line whose request was running then ends a moment later (expired, as
        # its request is stopped, or completed if it finished first).
        deadline = time.monotonic() + 60
        while (done.request_counts.completed + done.request_counts.failed < 120
               and time.monotonic() < deadline):
            time.sleep(0.2)
            done = client.batches.retrieve(batch.id)
    finally:
        redis.delete(PAUSED_KEY)
        redis.close()
    assert done.status == "expired" and done.expired_at is not None, done
    counts = done.request_counts
    assert counts.total == 120 and counts.completed > 0 and counts.failed > 0
    assert counts.completed + counts.failed == 120, counts
    finished = lines_of(client, done.output_file_id)
    assert len(finished) == counts.completed and all(line["error"] is None for line in finished)
    expired = lines_of(client, done.error_file_id)
    assert len(expired) == counts.failed and {e["error"]["code"] for e in expired} == {"batch_expired"}
    assert all(e["response"] is None for e in expired)
    assert {line["custom_id"] for line in finished + expired} == {line["custom_id"] for line in lines}
