"""OpenAI's Responses API (``POST /v1/responses``) as request rows: the body's check and mapping,
and a row read back as a Response object, its output items, its input items and its stream's
typed events.

A response *is* a request row (chat, on the model's queues, through the same admission, ladder
and billing as ``/v1/chat/completions``); its ``responses`` row (``models/response.py``) adds what
the Response object names and a request does not: the response it continues, where its own input
begins among the messages the engine saw, and whether it runs in the background. Its text lives in
the request row alone, so the retention sweep redacts it with the row.

The body becomes a chat body and goes through ``shapes.to_native``, the one check of an OpenAI
body: ``input`` (a string, or message, ``function_call`` and ``function_call_output`` items) are
messages, ``instructions`` a system message put first, ``text.format`` the response format,
function tools the chat tools; ``previous_response_id`` puts that response's messages (its own
instructions left out, as OpenAI does) and its answer before this input, and keeps the turns on
one conversation, so each runs where the last one's prefix is cached. Fields Sluice cannot honour
(hosted tools, reasoning, ``include``, images and files in input) are refused by name.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any, TypeVar

from core.errors import ApiError, InvalidRequest, NotFound, OpenAIBodyError
from core.openai import shapes
from models import InferenceRequest, Status
from models.response import StoredResponse

E = TypeVar("E", bound=ApiError)
RESPONSES_URL = "/v1/responses"
PREFIX = "resp_"
# What the Responses body may hold, beside the Sluice extensions (EXTENSIONS).
FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
          "tool_choice", "parallel_tool_calls", "stream", "background", "previous_response_id", "store",
          "metadata", "service_tier", "user", "truncation", "reasoning", "include", "top_logprobs",
          "max_tool_calls", "prompt", "prompt_cache_key", "safety_identifier", "stream_options", "conversation",
          "ignore_eos"}
# Sluice's own fields (extra_body), as on the native route: the request's deadline and webhook.
EXTENSIONS = ("deadline_s", "webhook_url", "webhook_events")
# Fields OpenAI takes and Sluice cannot honour: refused by name, never ignored.
REFUSED = {
    "reasoning": "Reasoning options are not served: these models do not reason in hidden tokens.",
    "include": "No extra output is served (reasoning, logprobs, tool results); leave include out.",
    "top_logprobs": "Logprobs are not served on this route; use /v1/chat/completions.",
    "max_tool_calls": "Hosted tools are not served, so there is no tool-call budget; leave it out.",
    "prompt": "Stored prompt templates are not served; send input and instructions.",
    "conversation": "The Conversations API is not served; chain turns with previous_response_id.",
    "stream_options": "Stream options are not served; leave stream_options out.",
}
# Built-in tools OpenAI hosts: refused by name.
HOSTED_TOOLS = {"web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                "computer_use_preview", "computer_use", "code_interpreter", "image_generation", "mcp",
                "local_shell", "shell", "custom", "apply_patch"}
# Chat fields whose problems are this route's fields.
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
           "tools": "tools", "tool_choice": "tool_choice", "conversation_id": "previous_response_id"}
STATUS = {Status.QUEUED: "queued", Status.RUNNING: "in_progress", Status.SUCCEEDED: "completed",
          Status.CANCELLED: "cancelled"}


def parse_id(response_id: str) -> uuid.UUID:
    """The request id behind ``resp_<hex>``; 404 for anything else."""
    try:
        if response_id.startswith(PREFIX):
            return uuid.UUID(hex=response_id[len(PREFIX):])
    except ValueError:
        pass
    raise NotFound(f"No response {response_id[:80]!r}.", code="response_not_found")


def response_id(request_id: uuid.UUID) -> str:
    return PREFIX + request_id.hex


class Turn:
    """A Responses body as a chat body: what ``to_native`` checks, and where this call's input
    begins among the messages (``turn_from``; ``instructions_at``: its instructions' message)."""

    def __init__(self, body: dict[str, Any], history: list[dict[str, Any]]) -> None:
        problems: dict[str, list[str]] = {}
        for name, value in body.items():
            if name in REFUSED and value not in (None, [], {}):  # an empty one asks for nothing
                problems[name] = [REFUSED[name]]
            elif name not in FIELDS and name not in EXTENSIONS and name not in REFUSED:
                problems[name] = [shapes.UNKNOWN_FIELD]
        if body.get("truncation") not in (None, "disabled"):
            problems["truncation"] = ["Only disabled: a conversation longer than the model's context is refused (413), "
                                      "never cut."]
        for flag in ("background", "store"):
            if body.get(flag) is not None and not isinstance(body[flag], bool):
                problems[flag] = ["true or false."]
        self.background, self.store = body.get("background") is True, body.get("store") is not False
        if self.background and not self.store:
            problems["background"] = ["A background response is stored (it is read back with GET); leave store out."]
        if not self.background and "deadline_s" in body:
            problems["deadline_s"] = ["A foreground response's deadline is its client's patience (its read timeout, "
                                      "Prefer: wait); deadline_s is for background: true."]
        instructions = body.get("instructions")
        if instructions is not None and not (isinstance(instructions, str) and instructions):
            problems["instructions"] = ["A non-empty string."]
        if body.get("text") is not None and (not isinstance(body["text"], dict) or set(body["text"]) - {"format"}):
            problems["text"] = ["{format: {type: text | json_object | json_schema, …}}; nothing else of it (verbosity) "
                                "is served."]
        if body.get("safety_identifier") is not None and body.get("user") is not None:
            problems["safety_identifier"] = ["Kept as user is (the metadata's user): give one of the two."]
        cache_key = body.get("prompt_cache_key")
        if cache_key is not None and not (isinstance(cache_key, str) and 0 < len(cache_key) <= 64):
            problems["prompt_cache_key"] = ["A string of 1 to 64 characters."]
        items = _items(body.get("input"), problems)
        tools = _tools(body.get("tools"), problems)
        if problems:
            raise OpenAIBodyError(problems, {n for n, why in problems.items() if why == [shapes.UNKNOWN_FIELD]}
                                  | (set(REFUSED) & set(problems)))
        head = [{"role": "system", "content": instructions}] if instructions else []
        self.instructions_at = 0 if head else None
        self.turn_from = len(head) + len(history)
        self.items = items
        chat: dict[str, Any] = {"model": body.get("model"), "messages": head + history + items}
        for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"),
                             ("metadata", "metadata"), ("service_tier", "service_tier"), ("user", "user"),
                             ("safety_identifier", "user"), ("stream", "stream"), ("ignore_eos", "ignore_eos")):
            if body.get(ours) is not None:
                chat[theirs] = body[ours]
        if tools:
            chat["tools"] = tools
        if "tool_choice" in body:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        text_format = (body.get("text") or {}).get("format")
        if text_format is not None:
            chat["response_format"] = _response_format(text_format)
        self.chat = chat
        self.extension = {k: body[k] for k in EXTENSIONS if k in body}

    def native(self, default_model: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the chat fields as loaded, the native submit body): ``shapes.to_native``, its problems
        named by this route's fields."""
        try:
            return shapes.to_native(self.chat, True, default_model, extra=self.extension)
        except OpenAIBodyError as exc:
            renamed(exc)
            raise


def renamed(exc: E) -> E:
    """``exc``, its problems with a chat body's fields named by this route's."""
    if isinstance(exc.details, dict):
        exc.details = {RENAMED.get(str(name).split(".")[0], name): why for name, why in exc.details.items()}
    if isinstance(exc, OpenAIBodyError):
        exc.unsupported = {RENAMED.get(name, name) for name in exc.unsupported}
    return exc


def _items(value: Any, problems: dict[str, list[str]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is the user's message; a list holds message items
    (``{role, content}``, content a string or input_text/output_text parts), ``function_call``
    items (the assistant's calls, as it made them) and ``function_call_output`` items (a tool's
    result)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        problems["input"] = ["A string, or a list of input items (messages, function_call, function_call_output)."]
        return []
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item, dict):
            content = _text(item.get("content"))
            if content is None or item.get("role") not in ("user", "system", "developer", "assistant"):
                problems[f"input.{i}"] = ["A message is {role: user, system, developer or assistant, content: a "
                                          "string or text parts}; images, audio and files are not served."]
                continue
            messages.append({"role": "system" if item["role"] == "developer" else item["role"], "content": content})
        elif kind == "function_call" and isinstance(item, dict):
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) and v for v in (call["id"], item.get("name"), item.get("arguments"))):
                problems[f"input.{i}"] = ["A function_call item has call_id, name and arguments (strings)."]
                continue
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # the calls of one turn are one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item, dict):
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                problems[f"input.{i}"] = ["A function_call_output item has call_id and output (strings)."]
                continue
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output or " "})
        else:
            problems[f"input.{i}"] = [f"Input items of type {str(kind)[:40]!r} are not served: messages, "
                                      "function_call and function_call_output are."]
    return messages


def _text(content: Any) -> str | None:
    """A message's content as one string (text parts joined); None when it holds anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
            and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return None


def _tools(value: Any, problems: dict[str, list[str]]) -> list[dict[str, Any]]:
    """Function tools (``{type: function, name, description, parameters, strict}``) as chat's;
    a hosted tool is refused by name."""
    if value is None:
        return []
    if not isinstance(value, list):
        problems["tools"] = ["A list of function tools."]
        return []
    tools = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) and isinstance(tool.get("type"), str) else None
        if kind in HOSTED_TOOLS:
            problems[f"tools.{i}"] = [f"The hosted tool {kind} is not served: only function tools, which your "
                                      "code runs."]
        elif kind != "function" or not isinstance(tool.get("name"), str):
            problems[f"tools.{i}"] = ["A function tool: {type: function, name, parameters, description, strict}."]
        elif unknown := set(tool) - {"type", "name", "description", "parameters", "strict"}:
            problems[f"tools.{i}"] = [f"A function tool has no {', '.join(sorted(unknown))}."]
        else:  # checked as chat's function is (strict too: kept, and said back as sent)
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # auto, none, required; anything else is refused by the chat check


def _response_format(form: Any) -> Any:
    """``text.format`` as chat's response_format: ``json_schema`` carries name, schema, strict and
    description at its top level here."""
    if isinstance(form, dict) and form.get("type") == "json_schema":
        inner = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        return {"type": "json_schema", "json_schema": inner}
    return form


def history(row: InferenceRequest, stored: StoredResponse) -> list[dict[str, Any]]:
    """The messages a response continuing ``row`` starts from: its messages, its instructions left
    out, then its answer (text, or the calls it made)."""
    if row.status != Status.SUCCEEDED:
        raise InvalidRequest(f"The previous response is {STATUS.get(row.status, 'failed')}: only a completed "
                             "response can be continued.", code="invalid_request",
                             details={"previous_response_id": ["Not completed."]})
    if row.redacted_at is not None:
        raise InvalidRequest("The previous response's text is no longer kept (the retention period passed); "
                             "send the whole conversation as input.", code="invalid_request",
                             details={"previous_response_id": ["Its text was redacted."]})
    messages = [m for i, m in enumerate(row.input.get("messages", [])) if i != stored.instructions_at]
    message = shapes.row_choices(row, True)[0]["message"]
    answer: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        answer["tool_calls"] = message["tool_calls"]
    elif not answer["content"]:
        answer["content"] = " "  # an empty answer is still a turn; a message needs content
    return [*messages, answer]


def output_items(row: InferenceRequest) -> list[dict[str, Any]]:
    """A finished row's answer as output items: the message (its text) and each function call."""
    if row.status != Status.SUCCEEDED:
        return []
    choice = shapes.row_choices(row, True)[0]
    message, incomplete = choice["message"], row.finish_reason == "length"
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append(message_item(row, message["content"], "incomplete" if incomplete else "completed"))
    for call in message.get("tool_calls") or ():
        items.append(call_item(call, "completed"))
    return items


def message_item(row: InferenceRequest, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": "msg_" + row.id.hex, "status": status, "role": "assistant", "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + hashlib.sha256(call["id"].encode()).hexdigest()[:32],
            "call_id": call["id"], "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def status_of(row: InferenceRequest) -> str:
    if row.status == Status.SUCCEEDED and row.finish_reason == "length":
        return "incomplete"
    return STATUS.get(row.status, "failed")


def response(row: InferenceRequest, stored: StoredResponse, status: str | None = None,
             output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Response object of ``row`` (``status`` and ``output`` as a stream shows them so far)."""
    status = status or status_of(row)
    messages = row.input.get("messages", [])
    echo = stored.fields or {}
    done = status in ("completed", "incomplete")
    error = None
    if status == "failed":
        error = {"code": row.error_code or row.status.value, "message": row.error_message or
                 f"The request ended {row.status.value}."}
    form = row.params.get("response_format") or {"type": "text"}
    if form.get("type") == "json_schema":
        form = {"type": "json_schema", **form.get("json_schema", {})}
    return {
        "id": response_id(row.id), "object": "response", "created_at": int(row.created_at.timestamp()),
        "status": status, "background": stored.background, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": messages[stored.instructions_at]["content"] if stored.instructions_at is not None
        and stored.instructions_at < len(messages) else None,
        "max_output_tokens": echo.get("max_output_tokens"), "model": shapes.model_of(row),
        "output": output_items(row) if output is None else output,
        "parallel_tool_calls": row.params.get("parallel_tool_calls", True),
        "previous_response_id": None if stored.previous_id is None else response_id(stored.previous_id),
        "reasoning": {"effort": None, "summary": None}, "service_tier": row.service_tier,
        "store": echo.get("store", True), "temperature": row.params.get("temperature", 1.0),
        "text": {"format": form}, "tool_choice": _echo_choice(row.params.get("tool_choice", "auto")),
        "tools": [{"type": "function", "name": t["function"]["name"],
                   "description": t["function"].get("description"), "parameters": t["function"].get("parameters"),
                   "strict": t["function"].get("strict")} for t in row.input.get("tools") or ()],
        "top_p": row.params.get("top_p", 1.0), "truncation": "disabled",
        "usage": usage(row) if done else None, "user": (row.meta or {}).get("user"),
        "metadata": {k: v for k, v in (row.meta or {}).items() if k != "user"}, "sluice": shapes.extension(row),
    }


def _echo_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "name": choice["function"]["name"]}
    return choice


def usage(row: InferenceRequest) -> dict[str, Any]:
    prompt, completion = row.input_tokens or 0, row.output_tokens or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": row.cached_tokens or 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def input_items(row: InferenceRequest, stored: StoredResponse) -> list[dict[str, Any]]:
    """This call's input items (not the turns before it, nor its instructions), with ids."""
    items: list[dict[str, Any]] = []
    for i, message in enumerate(row.input.get("messages", [])[stored.turn_from:]):
        item_id = f"msg_{row.id.hex}_{i}"
        if message["role"] == "tool":
            items.append({"type": "function_call_output", "id": item_id, "call_id": message.get("tool_call_id"),
                          "output": message.get("content"), "status": "completed"})
        elif message.get("tool_calls"):
            items.extend(call_item(call, "completed") for call in message["tool_calls"])
        else:
            kind = "output_text" if message["role"] == "assistant" else "input_text"
            items.append({"type": "message", "id": item_id, "status": "completed", "role": message["role"],
                          "content": [{"type": kind, "text": message.get("content") or ""}]})
    return items
