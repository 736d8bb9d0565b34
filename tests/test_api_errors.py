"""Garbage in: every bad input gets a 4xx with the one error envelope, never a 500."""

from __future__ import annotations

import io
import json
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from web.services import services


def assert_envelope(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)
    body = response.get_json()
    assert set(body) == {"error"}
    error = body["error"]
    assert isinstance(error["code"], str) and error["code"]
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if code:
        assert error["code"] == code
    return error


def test_no_key_wrong_key_malformed_header(app):
    http = app.test_client()
    body = {"prompt": "hi"}
    assert_envelope(http.post("/v1/requests", json=body), 401, "missing_api_key")
    assert_envelope(http.post("/v1/requests", json=body, headers={"Authorization": "Bearer sk-sluice-nope"}),
                    401, "invalid_api_key")
    assert_envelope(http.post("/v1/requests", json=body, headers={"Authorization": "Basic abc"}),
                    401, "invalid_api_key")
    response = http.get(f"/v1/requests/{uuid.uuid4()}", headers={"Authorization": "Bearer"})
    assert_envelope(response, 401)
    assert response.headers["WWW-Authenticate"].startswith("Bearer")


def test_malformed_json_and_content_type(client):
    http, headers = client.http, client.headers
    as_json = {**headers, "Content-Type": "application/json"}
    assert_envelope(http.post("/v1/requests", data="{not json", headers=as_json), 400, "malformed_json")
    assert_envelope(http.post("/v1/requests", data="prompt=hi", headers={**headers, "Content-Type": "text/plain"}),
                    415, "unsupported_media_type")
    assert_envelope(http.post("/v1/requests", json=["prompt"], headers=headers), 422, "invalid_request")


@pytest.mark.parametrize("body, field", [
    ({}, "_schema"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "_schema"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "temperature": 2.5}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "priority": "urgent"}, "priority"),
    ({"prompt": "a", "stop": ["1", "2", "3", "4", "5"]}, "stop"),
    ({"prompt": "a", "time_limit_s": -1}, "time_limit_s"),
    ({"prompt": "a", "time_limit_s": 10**6}, "time_limit_s"),
    ({"prompt": "a", "metadata": {"k": 1}}, "metadata"),
    ({"prompt": "a", "model": "gpt-17"}, "model"),
    ({"prompt": "a", "temperture": 0.5}, "temperture"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"prompt": "nul \u0000 inside"}, "prompt"),
    ({"prompt": "lone \ud800 surrogate"}, "prompt"),
    ({"messages": [{"role": "user", "content": "\u0000"}]}, "messages"),
    ({"prompt": "a", "metadata": {"k": "\u0000"}}, "metadata"),
    ({"prompt": "a", "metadata": {"k\ud800": "v"}}, "metadata"),
    ({"prompt": "a", "metadata": {"k": "lone \udfff"}}, "metadata"),
    ({"prompt": "a", "conversation_id": "c\u0000"}, "conversation_id"),
    ({"prompt": "a", "deadline_s": 1e12}, "deadline_s"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
])
def test_invalid_fields_are_named(client, body, field):
    error = assert_envelope(client.submit(**body), 422, "invalid_request")
    assert field in error["details"], error


def test_oversized_body_and_prompt(app, client):
    limit = services(app).settings.max_body_bytes
    error = assert_envelope(client.submit(prompt="x" * (limit + 1)), 413, "body_too_large")
    assert str(limit) in error["message"]
    chars = services(app).settings.max_prompt_chars
    small_app_limit = min(limit - 100, chars + 1)
    if small_app_limit > chars:  # only reachable when the char cap is below the body cap
        error = assert_envelope(client.submit(prompt="x" * small_app_limit), 422, "invalid_request")
        assert "prompt" in error["details"]


def test_chunked_body_over_the_limit_is_413_like_a_sized_one(app, client):
    """A body sent chunked (no Content-Length), as gunicorn passes it on (wsgi.input_terminated):
    over the limit it is refused as too large, not cut at the limit and parsed as broken JSON."""
    limit = services(app).settings.max_body_bytes
    chunked = {**client.headers, "Content-Type": "application/json", "Transfer-Encoding": "chunked"}

    def send(body: bytes):
        return client.http.post("/v1/requests", input_stream=io.BytesIO(body), headers=chunked,
                                environ_overrides={"wsgi.input_terminated": True})

    over = b'{"prompt": "' + b"x" * limit + b'"}'
    error = assert_envelope(send(over), 413, "body_too_large")
    assert str(limit) in error["message"]
    exactly = b'{"prompt": "' + b"x" * (limit - 14) + b'"}'
    assert len(exactly) == limit
    assert send(exactly).status_code != 413  # read whole and parsed: the limit itself is allowed
    assert send(b'{"prompt": "chunked and small"}').status_code == 202


def test_a_limit_in_other_digits_than_ascii_is_refused(client):
    """The digit "²" passes str.isdigit() and fails int(); so does a number longer than int() parses."""
    for limit in ("²", "١٠", "9" * 5000, "5\n"):
        assert_envelope(client.http.get("/v1/jobs", query_string={"limit": limit}, headers=client.headers),
                        422, "invalid_request")
        batches = client.http.get("/v1/batches", query_string={"limit": limit}, headers=client.headers)
        assert batches.status_code == 400 and batches.get_json()["error"]["param"] == "limit"
    assert client.http.get("/v1/jobs?limit=5", headers=client.headers).status_code == 200


def test_a_wait_of_thousands_of_digits_is_clamped_not_a_500(client, worker):
    """Past the digits int() parses (4,300), and in another call past float()'s range: the wait is
    the maximum, for a submit that waits and for one that comes back (respond-async)."""
    maximum = int(services(client.http.application).settings.wait_max_s)
    for prefer in (f"wait={'9' * 4400}", f"respond-async, wait={'9' * 4400}", f"wait={'9' * 400}"):
        response = client.http.post("/v1/requests", json={"prompt": "wait long", "max_tokens": 4},
                                    headers={**client.headers, "Prefer": prefer})
        assert response.status_code == 200, response.get_json()
        assert response.headers["Preference-Applied"] == f"wait={maximum}"
        polled = client.http.get(f"/v1/requests/{response.get_json()['id']}",
                                 headers={**client.headers, "Prefer": prefer})
        assert polled.status_code == 200 and polled.headers["Preference-Applied"] == f"wait={maximum}"


def test_a_dashboard_file_name_the_filesystem_refuses_is_404(isolated_app):
    http = isolated_app(admin_key="an-admin-key-of-16+").test_client()
    assert http.get("/dashboard/static/dashboard.js").status_code == 200
    # The page itself is /dashboard: the scripts' route serves scripts only, as its document says.
    for name in ("x%00.js", "dashboard.js%00", "%ED%A0%80.js", "a" * 300 + ".js", "..%2F..%2Fetc%2Fpasswd",
                 "dashboard.html"):
        assert_envelope(http.get(f"/dashboard/static/{name}"), 404, "not_found")


def test_unknown_route_and_wrong_method(client):
    assert_envelope(client.http.get("/v2/nothing"), 404, "not_found")
    response = client.http.delete("/v1/requests", headers=client.headers)
    assert_envelope(response, 405, "method_not_allowed")
    assert "POST" in response.headers["Allow"]


def test_ids_of_other_tenants_and_garbage_ids_are_404(client, new_client):
    accepted = client.submit(prompt="mine").get_json()
    other = new_client()
    assert_envelope(other.get(accepted["id"]), 404, "not_found")
    assert_envelope(other.cancel(accepted["id"]), 404, "not_found")
    assert_envelope(client.get("not-a-uuid"), 404, "not_found")
    assert_envelope(client.cancel("../../etc"), 404)
    assert client.get(accepted["id"]).status_code == 200


def test_openapi_is_generated_from_the_validating_schema(app):
    from web.schemas import SubmitRequestSchema

    spec = app.test_client().get("/openapi.json").get_json()
    assert spec["openapi"].startswith("3.")
    submit = spec["components"]["schemas"]["SubmitRequest"]
    assert set(submit["properties"]) == set(SubmitRequestSchema().fields)
    assert submit["properties"]["temperature"]["maximum"] == 2
    assert "/v1/requests/{request_id}/cancel" in spec["paths"]


def _submit_validator(spec):
    import jsonschema

    # The component's $refs point into the document: validate with the components beside it.
    return jsonschema.Draft202012Validator({**spec["components"]["schemas"]["SubmitRequest"],
                                            "components": spec["components"]})


@pytest.mark.parametrize("body", [
    {"prompt": "x", "deadline_s": 0}, {"prompt": "x", "time_limit_s": 0}, {"prompt": "x", "top_p": 0},
    {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, {"max_tokens": 4},
    {"prompt": "x", "metadata": {"": "empty key"}}, {"prompt": "x", "metadata": {f"k{i}": "v" for i in range(17)}},
])
def test_openapi_refuses_what_validation_refuses(app, client, body):
    """Bodies a schema-driven fuzzer found the document allowed and the server refused."""
    spec = app.test_client().get("/openapi.json").get_json()
    assert not _submit_validator(spec).is_valid(body), body
    assert_envelope(client.submit(**body), 422, "invalid_request")


def test_openapi_allows_what_validation_allows(isolated):
    """On a Redis database of its own: the shared one may hold other tests' backlog, which the
    promise rightly counts against a 0.5 s deadline (a 503 that says nothing of validation)."""
    application, client, _ = isolated
    spec = application.test_client().get("/openapi.json").get_json()
    for body in ({"prompt": "x", "deadline_s": 0.5, "time_limit_s": 0.5, "top_p": 1, "max_tokens": 4},
                 {"messages": [{"role": "user", "content": "x"}], "metadata": {"k": "v"}, "max_tokens": 4}):
        assert _submit_validator(spec).is_valid(body), body
        assert client.submit(**body).status_code == 202


def test_openapi_covers_every_public_route(isolated_app):
    import re

    application = isolated_app(admin_key="an-admin-key-of-16+")
    paths = application.test_client().get("/openapi.json").get_json()["paths"]
    for rule in application.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            assert method.lower() in paths.get(path, {}), f"{method} {path} is not documented"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=12)
field_names = st.sampled_from(["prompt", "messages", "max_tokens", "priority", "temperature", "top_p", "seed",
                               "stop", "time_limit_s", "metadata", "model"]) | st.text(max_size=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(field_names, json_values, max_size=6) | json_values,
       raw=st.binary(max_size=64), path_id=st.text(min_size=1, max_size=40))
def test_fuzzed_input_never_500s(client, body, raw, path_id):
    for response in (
        client.http.post("/v1/requests", data=json.dumps(body), headers={**client.headers,
                                                                        "Content-Type": "application/json"}),
        client.http.post("/v1/requests", data=raw, headers={**client.headers, "Content-Type": "application/json"}),
        client.http.get("/v1/requests/" + path_id.replace("/", "_").replace("?", "_").replace("#", "_"),
                        headers=client.headers),
        client.http.post("/v1/requests/" + path_id.replace("/", "_").replace("?", "_").replace("#", "_") + "/cancel",
                         headers=client.headers),
    ):
        assert response.status_code < 500, response.get_data(as_text=True)
        if response.status_code >= 400:
            assert_envelope(response, response.status_code)
