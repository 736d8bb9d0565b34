"""No one request may stall a shared process: what a body asks of the web tier and of a worker's
event loop is bounded before the costly part runs (issue 35).

* A body's schemas (its tools' parameters, its response_format's) are measured together on the
  raw body, before any is validated against its draft's meta-schema (~0.8 ms of web CPU per
  subschema): 36 tools of 1,340 properties held a gevent process for 19 s.
* A body refused after it was read spends one request of its tenant's rate.
* A schema's counts are bounded at submit: 1e300 anywhere, or a smallest answer past a million
  characters, is a 4xx. Under that, the simulated engine writes a schema's answer lazily, no
  further than ``max_tokens`` carries it: ``minItems: 1e300`` froze its event loop until the
  watchdog killed the worker.
* Patterns nested past the regex parser's recursion are a 4xx naming the field, not a 500.
* A local ``$ref`` to nothing, or an empty ``enum``, is refused at submit (it failed later on the
  worker, as engine_error with a traceback).
"""

from __future__ import annotations

import collections
import json

import pytest
from admission_support import set_limits
from test_api_errors import assert_envelope

from core.observe import submit_metrics
from core.submit import sampling

MODEL = "simulated-llama-8b"  # the test settings' default model
NESTED_GROUPS = "(" * 500 + "a" + ")" * 500  # deeper than Python's regex parser recurses


def tools(count: int = 36, properties: int = 780) -> list[dict]:
    """Just under a MiB of tools (the body cap) by default: ``count`` functions of ``properties``
    string arguments each."""
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object", "properties": {f"argument_{j}": {"type": "string"} for j in range(properties)}}}}
        for i in range(count)]


@pytest.fixture
def meta_checks(monkeypatch) -> list[dict]:
    """The schemas the meta-schema check validated (the costly step), in order."""
    seen: list[dict] = []
    real = sampling._check_schema
    monkeypatch.setattr(sampling, "_VERDICTS", collections.OrderedDict())  # no verdict remembered from before
    monkeypatch.setattr(sampling, "_check_schema", lambda schema: seen.append(schema) or real(schema))
    return seen


def test_a_megabyte_of_tool_schemas_is_refused_before_any_is_validated(client, meta_checks):
    body = {"messages": [{"role": "user", "content": "which tool?"}], "tools": tools(), "tool_choice": "required"}
    assert 900_000 < len(json.dumps(body)) < 2**20
    error = assert_envelope(client.submit(**body), 422, "invalid_request")
    assert "5000" in error["details"]["tools"][0]
    openai = client.http.post("/v1/chat/completions", json={"model": MODEL, **body}, headers=client.headers)
    assert openai.status_code == 400 and openai.get_json()["error"]["param"] == "tools", openai.get_json()
    assert meta_checks == [], "no schema of the refused bodies reached the meta-schema check"

    # Three schemas of near the largest size each are too many bytes together, and refused as
    # early; two small ones pass, and one seen twice in a body is checked once.
    near = {"type": "object", "properties": {f"a{j}": {"type": "string", "maxLength": 8} for j in range(700)}}
    assert 2 * len(json.dumps(near)) < sampling.MAX_REQUEST_SCHEMA_BYTES < 3 * len(json.dumps(near)) and \
        len(json.dumps(near)) < sampling.MAX_SCHEMA_BYTES
    three = [{"type": "function", "function": {"name": name, "parameters": near}} for name in ("f", "g", "h")]
    over = client.submit(messages=[{"role": "user", "content": "go"}], tools=three, tool_choice="required")
    assert "bytes together" in assert_envelope(over, 422, "invalid_request")["details"]["tools"][0]
    assert meta_checks == []
    small = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    two = [{"type": "function", "function": {"name": name, "parameters": small}} for name in ("f", "g")]
    assert client.submit(messages=[{"role": "user", "content": "go"}], tools=two, tool_choice="required",
                         max_tokens=4).status_code == 202
    assert meta_checks == [small]


def test_a_body_refused_after_reading_spends_a_request_of_the_rate(app, client):
    set_limits(app, client, requests_per_minute=3)
    counted = submit_metrics.REJECTIONS.labels(gate="request", reason="invalid")
    before = counted._value.get()
    refused = [client.submit(messages=[{"role": "user", "content": "x"}], tools=tools(2, 3000)),
               client.submit(prompt="x", max_tokens=0),
               client.submit(prompt="x", response_format={"type": "regex", "regex": NESTED_GROUPS})]
    assert [r.status_code for r in refused] == [422, 422, 422]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in refused] == ["2", "1", "0"]
    assert counted._value.get() == before + 3  # in sluice_admission_rejections_total, as every refusal
    over = client.submit(prompt="a fine request", max_tokens=4)
    assert assert_envelope(over, 429, "rate_limited")["details"]["reason"] == "requests_per_minute"


def test_a_large_body_from_a_tenant_over_its_rate_is_refused_before_it_is_validated(app, client, meta_checks):
    set_limits(app, client, requests_per_minute=1)
    assert client.submit(prompt="the one request of the minute", max_tokens=4).status_code == 202
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools(1, 1000), "tool_choice": "required"}
    assert len(json.dumps(body)) > 16_000
    assert assert_envelope(client.submit(**body), 429, "rate_limited")["details"]["reason"] == "requests_per_minute"
    assert meta_checks == []


@pytest.mark.parametrize("response_format, field", [
    ({"type": "regex", "regex": NESTED_GROUPS}, "regex"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "pattern": NESTED_GROUPS}}},
     "json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "patternProperties": {NESTED_GROUPS: {"type": "string"}}}}}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": []}}}, "json_schema"),
])
def test_patterns_past_the_parser_and_schemas_that_admit_nothing_are_refused_by_field(client, response_format, field):
    error = assert_envelope(client.submit(prompt="x", response_format=response_format), 422, "invalid_request")
    assert field in error["details"]["response_format"], error
    openai = client.http.post("/v1/chat/completions", headers=client.headers, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": response_format})
    assert openai.status_code == 400 and openai.get_json()["error"]["param"].startswith("response_format"), \
        openai.get_json()
    line = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": response_format}}
    upload = client.http.post("/v1/jobs", data=json.dumps(line) + "\n",
                              headers={**client.headers, "Content-Type": "application/x-ndjson"})
    assert upload.status_code == 422, upload.get_json()


UNBOUNDED = [
    {"type": "array", "minItems": 1e300},
    {"type": "array", "minItems": 30, "items": {"type": "array", "minItems": 30, "items": {
        "type": "array", "minItems": 30, "items": {"type": "array", "minItems": 30, "items": {"type": "integer"}}}}},
    {"type": "object", "properties": {"text": {"type": "string", "minLength": 1e300}}},
    {"type": "object", "properties": {"text": {"type": "string", "maxLength": 1e300}}},
]


@pytest.mark.parametrize("schema", UNBOUNDED, ids=["huge_count", "nested_arrays", "huge_string", "huge_bound"])
def test_a_schema_whose_counts_no_answer_can_meet_is_refused_at_submit(client, schema):
    """1e300 as a count (a valid JSON Schema integer that xgrammar cannot read), or counts whose
    smallest answer passes a million characters (30 x 30 x 30 x 30 integers): refused on both doors
    and in a job's lines, naming the field, instead of failing on the worker."""
    response_format = {"type": "json_schema", "json_schema": {"name": "unbounded", "schema": schema}}
    error = assert_envelope(client.submit(prompt="x", max_tokens=16, response_format=response_format),
                            422, "invalid_request")
    assert "json_schema" in error["details"]["response_format"], error
    why = json.dumps(error["details"])
    assert "counts up to" in why or "smallest answer" in why, why
    openai = client.http.post("/v1/chat/completions", headers=client.headers, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": response_format})
    assert openai.status_code == 400 and openai.get_json()["error"]["param"].startswith("response_format"), \
        openai.get_json()
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": schema}, "required": ["a"]}}}
    with_tool = client.http.post("/v1/chat/completions", headers=client.headers, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [tool]})
    assert with_tool.status_code == 400 and with_tool.get_json()["error"]["param"].startswith("tools"), \
        with_tool.get_json()


# Under the caps, yet far more than max_tokens carries: the simulated engine writes such an
# answer lazily (it built the whole instance on its loop: 30^4 integers held it 3.5 s).
@pytest.mark.parametrize("schema", [
    {"type": "array", "minItems": 400_000},
    {"type": "array", "minItems": 22, "items": {"type": "array", "minItems": 22, "items": {
        "type": "array", "minItems": 22, "items": {"type": "array", "minItems": 22, "items": {"type": "integer"}}}}},
    {"type": "object", "properties": {"text": {"type": "string", "minLength": 900_000}}, "required": ["text"]},
], ids=["large_count", "nested_arrays", "long_string"])
def test_a_schema_asking_for_an_unbounded_answer_costs_the_simulated_engine_its_max_tokens(client, worker, schema):
    key_before = worker.worker_key
    response_format = {"type": "json_schema", "json_schema": {"name": "unbounded", "schema": schema}}
    asked = client.submit(prompt="as much as the schema asks", max_tokens=16, response_format=response_format)
    assert asked.status_code == 202, asked.get_json()
    view = client.wait(asked.get_json()["id"], timeout=60)
    assert view["status"] == "succeeded", view
    assert view["usage"]["output_tokens"] == 16 and view["output"]["finish_reason"] == "length"
    assert view["output"]["text"][:1] in "[{"
    # The worker that answered is the one that was there: its loop never stalled into a restart.
    after = client.wait(client.submit(prompt="and the next one", max_tokens=4).get_json()["id"], timeout=60)
    assert after["status"] == "succeeded" and after["worker"] == view["worker"]
    assert worker.proc.poll() is None and worker.worker_key == key_before and worker.stats()


def test_the_meta_schema_check_is_not_repeated_for_a_schema_seen_before(client, meta_checks):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    for _ in range(3):
        assert client.submit(prompt="where?", max_tokens=4, response_format=response_format).status_code == 202
    assert meta_checks == [schema]
