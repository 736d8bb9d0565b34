"""What a request may ask of the engine beyond a prompt: structured output, tools, and the
sampling fields past temperature and top_p (``n``, logprobs, penalties, ``logit_bias``,
``min_tokens``). One module for the three places that need it:

* the submit body's schemas (``core/submit/schemas.py`` nests these; the OpenAI front maps onto
  them), which refuse at submit what the engine would only fail on later: a JSON schema that is
  not one, is too large, or points at a remote ``$ref``;
* :func:`decoding`: the constraint a worker hands its engine (``workers/execution.py``), built
  from the stored params: a ``response_format``, or the tools a ``tool_choice`` of ``required``
  or a named function forces (structured decoding enforces them, so they hold on any model);
* :func:`tool_calls`: the answer's text read back as OpenAI ``tool_calls``, for the views of a
  request (native and OpenAI alike).

The web tier cannot compile a schema with the engine's own grammar library (xgrammar pulls torch
into the web tier); a schema valid JSON Schema yet beyond what the engine compiles fails its
request on the worker with ``invalid_response_format`` and the engine's reason.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
from typing import Any

import jsonschema
from marshmallow import Schema, ValidationError, fields, pre_load, validate, validates_schema

from core.submit.fields import SafeString, StrictBoolean

MAX_SCHEMA_BYTES = 32 * 1024  # a JSON schema, serialized (response_format or one tool's parameters)
# Every schema of one request together (its tools' parameters and its response_format), checked
# on the raw body before any of them is validated: validating a schema against its draft's
# meta-schema costs the web tier ~0.8 ms of CPU per subschema (2020-12, on a 2-core VM), so a body
# of 36 tools of 1,340 properties each held a process for 19 s. 5,000 is OpenAI's cap on the
# object properties of a structured output; 64 KiB leaves two schemas of the largest size.
MAX_REQUEST_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_NODES = 5_000  # JSON objects and arrays inside a request's schemas together
MAX_SCHEMA_DEPTH = 32
# The smallest answer a schema admits, in characters, at most: a million characters is ~250,000
# tokens, longer than any model here writes. A count past it (``minItems: 1e300``, four nested
# arrays of ``minItems: 30``) can only end cut short, and it made the simulated engine build the
# instance on its loop and xgrammar fail to compile it on the worker: refused at submit instead.
MAX_SMALLEST_ANSWER_CHARS = 1_000_000
MAX_TOOLS = 64
MAX_N = 16  # choices per request; each is priced max_tokens at admission
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_CHOICES = 64  # entries of a `choice` response_format
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class JsonSchemaField(fields.Dict):
    """A JSON schema the engine can be constrained by: a valid schema (its own ``$schema``
    draft, else 2020-12), at most ``MAX_SCHEMA_BYTES`` serialized, no ``$ref`` outside itself."""

    def _deserialize(self, value, attr, data, **kwargs):
        schema = super()._deserialize(value, attr, data, **kwargs)
        problem = schema_problem(schema)
        if problem:
            raise ValidationError(problem)
        return schema


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` cannot constrain decoding (or be stored: no NaN or Infinity, no NUL or lone
    surrogate in any key or string), or None. The cheap checks come first; the meta-schema's, the
    costly one, runs once per distinct schema a process sees (clients send the same tools call
    after call) and, under gevent, in a thread of its own, so the other greenlets go on meanwhile."""
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False, sort_keys=True)
    except UnicodeEncodeError:  # (a ValueError too: first)
        return "Strings must be valid Unicode (no unpaired surrogates)."
    except (TypeError, ValueError):
        return "Not a JSON schema: numbers must be finite (no NaN or Infinity)."
    except RecursionError:
        return f"The schema nests more than {MAX_SCHEMA_DEPTH} levels deep."
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        return f"The schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are accepted."
    shape = _shape_problem([schema])
    if shape:
        return shape
    count = _count_problem(schema)
    if count:
        return count
    smallest = smallest_answer(schema)
    if smallest > MAX_SMALLEST_ANSWER_CHARS:
        return (f"The schema's smallest answer is {_amount(smallest)} characters (its minItems, minLength, "
                f"minProperties and required fields); at most {MAX_SMALLEST_ANSWER_CHARS:,} can be written.")
    if any("\x00" in string for string in _strings(schema)):
        return "Strings must not contain the NUL character (\\u0000)."
    remote = next(_remote_refs(schema), None)
    if remote is not None:
        return f"$ref {remote[:80]!r} points outside the schema; only local references (#...) are followed."
    return _meta_problem(hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest(), schema)


def _nodes(schemas: list[Any]):
    """Every object and array inside ``schemas``, with its depth (1 for a schema itself),
    iteratively: a body's nesting never reaches Python's recursion limit here."""
    stack = [(node, 1) for node in schemas]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            yield node, depth
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))


def _shape_problem(schemas: list[Any]) -> str | None:
    """Whether ``schemas`` together nest deeper than MAX_SCHEMA_DEPTH or hold more than
    MAX_SCHEMA_NODES objects and arrays (stopping at the first excess)."""
    for count, (_, depth) in enumerate(_nodes(schemas), 1):
        if depth > MAX_SCHEMA_DEPTH:
            return f"The schemas nest more than {MAX_SCHEMA_DEPTH} levels deep."
        if count > MAX_SCHEMA_NODES:
            return f"The schemas hold more than {MAX_SCHEMA_NODES} objects and arrays; at most that are accepted."
    return None


_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
           "minContains", "maxContains")
MAX_COUNT = 2**31 - 1  # xgrammar reads a count as a 32-bit integer and fails the request past it


def _count_problem(schema: dict[str, Any]) -> str | None:
    """A count keyword past MAX_COUNT anywhere in ``schema``: valid JSON Schema (1e300 is an
    integer), yet no engine decodes under it."""
    for node, _ in _nodes([schema]):
        if isinstance(node, dict):
            for key in _COUNTS:
                if (count := _count(node, key)) > MAX_COUNT:
                    return f"{key} is {_amount(count)}; counts up to {MAX_COUNT:,} are accepted."
    return None


def smallest_answer(schema: Any, depth: int = 0) -> float:
    """A lower bound on the characters of the smallest JSON value ``schema`` admits, from its
    counts alone (``minItems``, ``minLength``, ``minProperties``, ``required``); references and
    what it cannot read count 1. A float: ``minItems: 1e300`` under ``minItems: 30`` is no error.
    Its recursion follows the schema's nesting, which ``_shape_problem`` has already capped."""
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return 1.0
    types = schema.get("type")
    types = [t for t in (types if isinstance(types, list) else [types]) if isinstance(t, str)]
    sizes = [_smallest_of_type(schema, kind, depth) for kind in types] if types else [_smallest_untyped(schema, depth)]
    smallest = min(sizes) if sizes else 1.0
    for key, pick in (("allOf", max), ("anyOf", min), ("oneOf", min)):
        parts = schema.get(key)
        if isinstance(parts, list) and parts:
            smallest = max(smallest, pick(smallest_answer(part, depth + 1) for part in parts))
    return smallest


def _smallest_untyped(schema: dict[str, Any], depth: int) -> float:
    """An untyped schema's smallest answer: what its array or object keywords ask, if any."""
    if any(key in schema for key in ("minItems", "items", "prefixItems")):
        return _smallest_of_type(schema, "array", depth)
    if any(key in schema for key in ("required", "minProperties")):
        return _smallest_of_type(schema, "object", depth)
    if "minLength" in schema:
        return _smallest_of_type(schema, "string", depth)
    return 1.0


def _count(schema: dict[str, Any], key: str) -> float:
    value = schema.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else 0.0


def _smallest_of_type(schema: dict[str, Any], kind: str, depth: int) -> float:
    if kind == "string":
        return 2 + _count(schema, "minLength")
    if kind == "array":
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        items = min(_count(schema, "minItems"), 1e300)
        first = [smallest_answer(part, depth + 1) + 1 for part in prefix[:int(min(items, len(prefix)))]]
        rest = max(0.0, items - len(first)) * (smallest_answer(schema.get("items"), depth + 1) + 1)
        return 2 + sum(first) + rest
    if kind == "object":
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [name for name in schema.get("required", []) if isinstance(name, str)] \
            if isinstance(schema.get("required"), list) else []
        named = sum(len(name) + 4 + smallest_answer(properties.get(name), depth + 1) for name in set(required))
        others = max(0.0, _count(schema, "minProperties") - len(set(required))) * 6  # "a":1,
        return 2 + named + others
    return 1.0


def _amount(chars: float) -> str:
    return f"{chars:,.0f}" if chars < 1e15 else f"{chars:.1e}"


_VERDICTS: collections.OrderedDict[str, str | None] = collections.OrderedDict()  # digest → meta-schema verdict
_VERDICTS_KEPT = 1024


def _meta_problem(digest: str, schema: dict[str, Any]) -> str | None:
    """The meta-schema's verdict on ``schema`` (whose canonical text hashes to ``digest``),
    remembered for the last 1,024 distinct schemas."""
    try:
        _VERDICTS.move_to_end(digest)
        return _VERDICTS[digest]
    except KeyError:
        pass
    problem = _off_loop(_check_schema, schema)
    _VERDICTS[digest] = problem
    while len(_VERDICTS) > _VERDICTS_KEPT:
        _VERDICTS.popitem(last=False)
    return problem


def _check_schema(schema: dict[str, Any]) -> str | None:
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"Not a valid JSON schema{f' at {where}' if where else ''}: {exc.message[:200]}"
    except RecursionError:  # a `pattern` of hundreds of nested groups: compiling it recurses too deep
        return "A pattern of the schema nests more groups than a regular expression may."
    return _local_problem(schema)


def _off_loop(fn, *args):
    """``fn(*args)``, in one of gevent's real threads where this process runs gevent (the web
    tier): the hub keeps serving other requests while it computes, instead of stalling them all."""
    try:
        from gevent import get_hub, monkey
    except ImportError:
        return fn(*args)
    if not monkey.is_module_patched("threading"):
        return fn(*args)
    return get_hub().threadpool.apply(fn, args)


def _local_problem(schema: dict[str, Any]) -> str | None:
    """A local ``$ref`` that points at nothing, or an ``enum`` that admits nothing: valid JSON
    Schema, yet nothing can be decoded under it (the engine would fail the request later)."""
    for node, _ in _nodes([schema]):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and local_target(schema, ref) is NOWHERE:
                return f"$ref {ref[:80]!r} points at nothing in the schema."
            if isinstance(node.get("enum"), list) and not node["enum"]:
                return "An empty enum admits no value."
    return None


NOWHERE = object()  # what local_target answers for a pointer to nothing


def local_target(root: Any, ref: str) -> Any:
    """The part of ``root`` a local ``$ref`` (``#`` or ``#/a/b``, JSON Pointer escapes) points
    at, or ``NOWHERE``. The simulated engine follows a schema's references with it too."""
    target = root
    for part in ref.lstrip("#/").split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return NOWHERE
    return target


def request_schemas_problem(data: Any) -> tuple[str, str] | None:
    """(field, why) when the raw body ``data`` carries schemas (its tools' parameters and its
    response_format's) that together pass MAX_REQUEST_SCHEMA_BYTES, MAX_SCHEMA_NODES or
    MAX_SCHEMA_DEPTH; None otherwise (each is still checked alone when its field is loaded)."""
    if not isinstance(data, dict):
        return None
    tools = data.get("tools") if isinstance(data.get("tools"), list) else []
    schemas = [tool["function"].get("parameters") for tool in tools
               if isinstance(tool, dict) and isinstance(tool.get("function"), dict)]
    response_format = data.get("response_format")
    if isinstance(response_format, dict) and isinstance(response_format.get("json_schema"), dict):
        schemas.append(response_format["json_schema"].get("schema"))
    schemas = [schema for schema in schemas if isinstance(schema, dict)]
    if not schemas:
        return None
    where = "tools" if tools else "response_format"
    problem = _shape_problem(schemas)
    if problem:
        return where, problem
    try:
        size = sum(len(json.dumps(schema, ensure_ascii=False).encode("utf-8", errors="surrogatepass"))
                   for schema in schemas)
    except (TypeError, ValueError, RecursionError):
        return None  # the field's own check names it
    if size > MAX_REQUEST_SCHEMA_BYTES:
        return where, (f"The request's schemas (tools' parameters and response_format) are {size} bytes together; "
                       f"at most {MAX_REQUEST_SCHEMA_BYTES} are accepted.")
    return None


class SchemasWithinCaps(Schema):
    """A body with ``tools`` and ``response_format``: their schemas are measured together, on the
    raw body, before any is validated alone (:func:`request_schemas_problem`)."""

    @pre_load
    def _schemas_within_caps(self, data, **kwargs):
        problem = request_schemas_problem(data)
        if problem:
            raise ValidationError(problem[1], problem[0])
        return data


def _strings(node: Any):
    """Every key and string value in ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield str(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)
    elif isinstance(node, str):
        yield node


def _remote_refs(node: Any):
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("$ref", "$dynamicRef") and isinstance(value, str) and not value.startswith("#"):
                yield value
            else:
                yield from _remote_refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _remote_refs(item)


def _name_field(**kwargs) -> fields.String:
    """A function's or schema's name: its pattern excludes NUL, and /openapi.json states it."""
    return fields.String(validate=validate.Regexp(_NAME, error="1 to 64 of a-z, A-Z, 0-9, _ and -."), **kwargs)


class _JsonSchemaSpec(Schema):
    name = _name_field(required=True)
    description = SafeString(validate=validate.Length(max=2048))
    schema = JsonSchemaField(load_default=dict)
    strict = StrictBoolean(allow_none=True)


class ResponseFormatSchema(Schema):
    """``response_format``: OpenAI's three types, and vLLM's regex and choice constraints."""

    type = SafeString(required=True, validate=validate.OneOf(
        ["text", "json_object", "json_schema", "regex", "choice"]))
    json_schema = fields.Nested(_JsonSchemaSpec, metadata={"description": "With type json_schema."})
    regex = SafeString(validate=validate.Length(min=1, max=4096),
                          metadata={"description": "With type regex (Sluice and vLLM): the output matches it."})
    choices = fields.List(SafeString(validate=validate.Length(min=1, max=512)),
                          validate=validate.Length(min=1, max=MAX_CHOICES),
                          metadata={"description": "With type choice (Sluice and vLLM): the output is one of them."})

    @validates_schema
    def _its_fields(self, data, **kwargs):
        needs = {"json_schema": "json_schema", "regex": "regex", "choice": "choices"}.get(data["type"])
        for name in ("json_schema", "regex", "choices"):
            if name in data and name != needs:
                raise ValidationError(f"Only with type {'choice' if name == 'choices' else name}.", name)
        if needs and needs not in data:
            raise ValidationError(f"Type {data['type']} needs {needs}.", needs)
        if data["type"] == "regex":
            try:
                re.compile(data["regex"])
            except re.error as exc:
                raise ValidationError(f"Not a regular expression: {exc}.", "regex") from None
            except (RecursionError, OverflowError):  # hundreds of nested groups: the parser's recursion ends
                raise ValidationError("The regular expression nests more groups than may be compiled.",
                                      "regex") from None


class _FunctionSchema(Schema):
    name = _name_field(required=True)
    description = SafeString(validate=validate.Length(max=2048))
    parameters = JsonSchemaField(metadata={"description": "A JSON schema of its arguments (an object)."})
    strict = StrictBoolean(allow_none=True)


class ToolSchema(Schema):
    type = SafeString(required=True, validate=validate.Equal("function", error="Only function tools."))
    function = fields.Nested(_FunctionSchema, required=True)


class _NamedFunction(Schema):
    name = _name_field(required=True)


class _NamedChoice(Schema):
    type = SafeString(required=True, validate=validate.Equal("function"))
    function = fields.Nested(_NamedFunction, required=True)


class ToolChoiceField(fields.Field):
    """``none``, ``auto``, ``required``, or ``{"type": "function", "function": {"name": ...}}``."""

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, str):
            if value not in ("none", "auto", "required"):
                raise ValidationError("One of none, auto, required, or a named function.")
            return value
        if isinstance(value, dict):
            return _NamedChoice().load(value)
        raise ValidationError("One of none, auto, required, or a named function.")


class ToolCallSchema(Schema):
    """A call an assistant message carries back into a conversation."""

    class _Called(Schema):
        name = _name_field(required=True)
        arguments = SafeString(required=True, validate=validate.Length(max=MAX_SCHEMA_BYTES))

    id = SafeString(required=True, validate=validate.Length(min=1, max=128))
    type = SafeString(required=True, validate=validate.Equal("function"))
    function = fields.Nested(_Called, required=True)


MAX_EMBED_INPUTS = 2048  # texts in one embeddings request, as OpenAI's


class EmbedInputField(fields.Field):
    """``input`` of an embeddings request: one string or a list of up to ``MAX_EMBED_INPUTS``
    non-empty strings; always a list once loaded. Token arrays are not taken."""

    def _deserialize(self, value, attr, data, **kwargs):
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not 1 <= len(texts) <= MAX_EMBED_INPUTS:
            raise ValidationError(f"A string or a list of 1 to {MAX_EMBED_INPUTS} strings (token arrays are "
                                  "not taken).")
        return [SafeString(validate=validate.Length(min=1)).deserialize(text) for text in texts]


class LogitBiasField(fields.Dict):
    """Token id (a decimal string, as JSON keys are) → bias in [-100, 100]; stored with string keys."""

    def _deserialize(self, value, attr, data, **kwargs):
        bias = super()._deserialize(value, attr, data, **kwargs)
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValidationError(f"At most {MAX_LOGIT_BIAS} tokens.")
        for token, weight in bias.items():
            if not (isinstance(token, str) and token.isdigit() and len(token) <= 9):
                raise ValidationError(f"Keys are token ids (decimal strings); {str(token)[:20]!r} is not one.")
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not -100 <= weight <= 100:
                raise ValidationError(f"The bias of token {token} must be a number in [-100, 100].")
        return {token: float(weight) for token, weight in bias.items()}


def check_tools(data: dict[str, Any], auto_parser: str | None) -> dict[str, list[str]]:
    """The problems of a body's tools with its ``tool_choice`` and model, by field."""
    tools, choice = data.get("tools"), data.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            return {"tool_choice": ["A tool_choice other than none needs tools."]}
        if "parallel_tool_calls" in data:
            return {"parallel_tool_calls": ["Only with tools."]}
        return {}
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        return {"tools": ["Two tools have the same name."]}
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        return {"tool_choice": [f"No tool is named {choice['function']['name']!r}."]}
    if choice == "required" and (clash := _clashing_definitions(tools)) is not None:
        return {"tools": [f"Two tools define {clash!r} differently; with tool_choice required their definitions "
                          "share one schema: rename one."]}
    if choice in (None, "auto") and auto_parser is None:
        return {"tool_choice": ["tool_choice auto needs a tool-call parser for this model (the registry's "
                                "tool_parser); use required or a named function, which structured "
                                "decoding enforces on any model."]}
    if "response_format" in data and data["response_format"]["type"] != "text" and choice != "none":
        return {"response_format": ["A response_format with tools is only allowed with tool_choice none."]}
    return {}


def decoding(params: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> tuple[str, Any] | None:
    """The constraint on the engine's output for stored ``params``, as (kind, spec): ``json``
    (a schema), ``json_object``, ``regex``, ``choice`` (a list); None for free text.

    Tools with ``tool_choice`` ``required`` force a JSON list of ``{"name", "parameters"}``
    objects, one of the tools each (just one when ``parallel_tool_calls`` is false); a named
    function forces its arguments' schema."""
    choice = params.get("tool_choice")
    if tools and choice == "required":
        parameters, shared = _hoisted(tools)
        calls = {"type": "array", "minItems": 1,
                 "items": {"anyOf": [{"type": "object", "required": ["name", "parameters"],
                                      "properties": {"name": {"const": tool["function"]["name"]},
                                                     "parameters": schema}}
                                     for tool, schema in zip(tools, parameters, strict=True)]}, **shared}
        if params.get("parallel_tool_calls") is False:
            calls["maxItems"] = 1
        return "json", calls
    if tools and isinstance(choice, dict):
        tool = next(t for t in tools if t["function"]["name"] == choice["function"]["name"])
        return "json", tool["function"].get("parameters") or {"type": "object"}
    form = params.get("response_format") or {"type": "text"}
    if form["type"] == "json_schema":
        return "json", form["json_schema"].get("schema") or {"type": "object"}
    if form["type"] == "json_object":
        return "json_object", None
    if form["type"] == "regex":
        return "regex", form["regex"]
    if form["type"] == "choice":
        return "choice", list(form["choices"])
    return None


_DEFINITIONS = ("$defs", "definitions")


def _hoisted(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each tool's parameter schema without its definitions, and those definitions gathered at the
    root: nested under the calls' list, a tool's ``#/$defs/...`` must still resolve (as vLLM's
    own server does it). ``check_tools`` refused two tools defining one name differently."""
    parameters, shared = [], {}
    for tool in tools:
        schema = dict(tool["function"].get("parameters") or {"type": "object"})
        for key in _DEFINITIONS:
            if isinstance(schema.get(key), dict):
                shared.setdefault(key, {}).update(schema.pop(key))
        parameters.append(schema)
    return parameters, shared


def _clashing_definitions(tools: list[dict[str, Any]]) -> str | None:
    """A definition name two tools give different schemas, or None."""
    seen: dict[tuple[str, str], Any] = {}
    for tool in tools:
        schema = tool["function"].get("parameters") or {}
        for key in _DEFINITIONS:
            for name, definition in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
                if seen.setdefault((key, name), definition) != definition:
                    return name
    return None


def tool_calls(request_id: str, params: dict[str, Any], tools: list[dict[str, Any]] | None, text: str,
               parser: str | None) -> tuple[list[dict[str, Any]], str | None] | None:
    """The answer ``text`` as OpenAI tool calls and what content is left, or None when it holds
    none (no tools, ``tool_choice`` none, an ``auto`` answer in plain text, or a forced answer cut
    short by max_tokens, which is no valid JSON: the text is then the content)."""
    choice = params.get("tool_choice", "auto")
    if not tools or choice == "none":
        return None
    calls: list[tuple[str, Any]] = []
    content: str | None = None
    try:  # strict=False: a grammar may let a raw control character into a string (xgrammar does)
        if choice == "required":
            calls = [(c["name"], c.get("parameters", {})) for c in json.loads(text, strict=False)]
        elif isinstance(choice, dict):
            calls = [(choice["function"]["name"], json.loads(text, strict=False))]
        elif parser is not None:
            calls, content = _READERS[parser](text)
            names = {tool["function"]["name"] for tool in tools}
            if any(name not in names or not isinstance(arguments, dict) for name, arguments in calls):
                return None  # no call of these tools (a JSON answer with a "name", say): the text is the content
    except (ValueError, TypeError, KeyError):
        return None
    if not calls:
        return None
    if params.get("parallel_tool_calls") is False:  # `auto` may write several; the first one stands
        calls = calls[:1]
    return [{"id": call_id(request_id, i), "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
            for i, (name, arguments) in enumerate(calls)], content


def _hermes(text: str) -> tuple[list[tuple[str, Any]], str | None]:
    """Hermes, Qwen and others: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, each
    call in its own tags, anywhere in the text; the rest is content."""
    calls = []
    for found in _HERMES.findall(text):
        call = json.loads(found, strict=False)
        calls.append((call["name"], call.get("arguments", {})))
    return calls, _HERMES.sub("", text).strip() or None


def _llama3_json(text: str) -> tuple[list[tuple[str, Any]], str | None]:
    """Llama 3.1 and later: the answer is the call, ``{"name": …, "parameters": {…}}`` (after
    ``<|python_tag|>`` where the special tokens were kept), several separated by ``;``. An
    answer that does not open with ``{`` is content."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return [], None
    calls, decoder, at = [], json.JSONDecoder(strict=False), 0
    while at < len(body):
        call, at = decoder.raw_decode(body, at)
        calls.append((call["name"], call.get("parameters", call.get("arguments", {}))))
        at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    return calls, None


def _mistral(text: str) -> tuple[list[tuple[str, Any]], str | None]:
    """Mistral: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (v3 templates), or
    one ``name[ARGS]{…}`` per ``[TOOL_CALLS]`` (v11 and later); what comes before is content."""
    if _TOOL_CALLS not in text:
        return [], None
    before, *parts = text.split(_TOOL_CALLS)
    calls = []
    for part in parts:
        part = part.strip()
        if _ARGS in part:
            name, arguments = part.split(_ARGS, 1)
            calls.append((name.strip(), json.loads(arguments, strict=False)))
        else:
            calls.extend((c["name"], c.get("arguments", {})) for c in json.loads(part, strict=False))
    return calls, before.strip() or None


_PYTHON_TAG, _TOOL_CALLS, _ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"
# How ``tool_choice: auto`` reads calls out of a model's free text, by the registry's tool_parser.
_READERS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}


def call_id(request_id: str, index: int) -> str:
    """A tool call's id: stable for a request's answer, however often it is read."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


# ------------------------------------------------------------------ the rules, as OpenAPI says them

NO_NUL = "^[^\\u0000]*$"
_TEXT = {"type": "string", "minLength": 1, "pattern": NO_NUL}
# The rules across fields that JSON Schema cannot state: a 422 (a 400 on the OpenAI front) names
# the field. A JSON schema must itself be valid, small and local; a named tool must be one of
# `tools`, whose names differ; `auto` needs the model's parser; min_tokens ≤ max_tokens;
# logit_bias names tokens of the model's vocabulary; fewer
# dimensions than the embedding model's only where it is a Matryoshka model.
BEYOND_THE_DOCUMENT = frozenset({"response_format", "tools", "tool_choice", "min_tokens", "n", "logprobs",
                                 "logit_bias", "echo", "dimensions"})


def document_rules(schemas: dict[str, Any]) -> None:
    """Add to an OpenAPI document's ``schemas`` what marshmallow cannot say of these fields:
    the message shapes by role, the response formats by type, tool_choice's forms, logit_bias's
    keys, and which fields need which."""
    named = {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                    "additionalProperties": False,
                                                    "properties": {"name": {"type": "string",
                                                                            "pattern": _NAME.pattern}}}}}
    bias = {"type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,9}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}
    for name in ("ChatMessage", "OpenAIChatMessage"):
        message = schemas[name]
        roles = message["properties"]["role"]["enum"]
        plain = [r for r in roles if r not in ("assistant", "tool")]
        no_calls, no_answer = {"not": {"required": ["tool_calls"]}}, {"not": {"required": ["tool_call_id"]}}
        message["oneOf"] = [
            {"properties": {"role": {"enum": plain}, "content": {"not": {"type": "null"}}},
             "required": ["content"], "allOf": [no_calls, no_answer]},
            {"properties": {"role": {"const": "assistant"}}, "allOf": [no_answer, {"anyOf": [
                {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
                {"required": ["tool_calls"]}]}]},
            {"properties": {"role": {"const": "tool"}, "content": {"not": {"type": "null"}}},
             "required": ["content", "tool_call_id"], "allOf": [no_calls]}]
    schemas["OpenAIChatMessage"]["properties"]["content"] = {"oneOf": [
        _TEXT, {"type": "null"}, {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["type", "text"], "additionalProperties": False,
            "properties": {"type": {"const": "text"}, "text": _TEXT}}}],
        "description": schemas["OpenAIChatMessage"]["properties"]["content"].get("description", "")}
    form = schemas["ResponseFormat"]
    extras = ("json_schema", "regex", "choices")

    def none_but(field: str | None) -> dict[str, Any]:
        return {"not": {"anyOf": [{"required": [f]} for f in extras if f != field]}}

    form["oneOf"] = [{"properties": {"type": {"enum": ["text", "json_object"]}}, **none_but(None)},
                     *({"properties": {"type": {"const": kind}}, "required": [field], **none_but(field)}
                       for kind, field in (("json_schema", "json_schema"), ("regex", "regex"), ("choice", "choices")))]
    schemas["SubmitRequest"]["properties"]["input"] = {
        "oneOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_EMBED_INPUTS}],
        "description": schemas["SubmitRequest"]["properties"]["input"].get("description", "")}
    for name in ("SubmitRequest", "ChatCompletionRequest", "CompletionRequest"):
        body = schemas[name]["properties"]
        if "tool_choice" in body:
            body["tool_choice"] = {"oneOf": [{"enum": ["none", "auto", "required"]}, named],
                                   "description": body["tool_choice"].get("description", "")}
        body["logit_bias"] = {**bias, "description": "Token id → bias added to its logit."}
        needs = schemas[name].setdefault("dependentRequired", {})
        if "tools" in body:
            needs.update({"tool_choice": ["tools"], "parallel_tool_calls": ["tools"]})
        if name == "SubmitRequest":
            needs["tools"] = ["messages"]
        if name == "ChatCompletionRequest":
            schemas[name].setdefault("dependentSchemas", {})["top_logprobs"] = {
                "required": ["logprobs"], "properties": {"logprobs": {"const": True}}}
