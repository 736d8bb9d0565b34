"""OpenAI request and response shapes: what ``/v1/chat/completions`` and ``/v1/completions``
accept, how a body becomes a native submit body (``core/submit/schemas.py SubmitRequestSchema``), and
how a request row reads back as an OpenAI completion or chunk. ``to_native`` is the one check and
mapping of an OpenAI body: the front, a batch line and the feeder all use it. (Errors in OpenAI's
shape are the web tier's: ``web/openai/errors.py``.)

Only the translation lives here; admission, queues, the ladder and the request table are the
native ones (``web/openai/chat.py`` calls ``RequestService.submit``). Structured output, tools,
``n``, logprobs and the penalties map onto the native fields of the same names
(``core/submit/sampling.py``); fields OpenAI has and Sluice cannot honour (``audio``,
``prediction``, ``suffix``, ``best_of``, a list of prompts, ...) are refused by name, never ignored:
a client must not believe it got what it did not. ``docs/openai.md`` lists every field.
"""

from __future__ import annotations

from typing import Any

from marshmallow import Schema, ValidationError, fields, pre_load, validate, validates_schema

from core.errors import OpenAIBodyError
from core.submit.embeddings import row_vectors
from core.submit.sampling import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_TOOLS,
    EmbedInputField,
    LogitBiasField,
    ResponseFormatSchema,
    SchemasWithinCaps,
    ToolChoiceField,
    ToolSchema,
    tool_calls,
)
from core.submit.schemas import (
    ChatMessageSchema,
    SafeString,
    StrictBoolean,
    StrictFloat,
    StrictInteger,
    SubmitRequestSchema,
)
from models import InferenceRequest

# service_tier → the class it runs in (docs/tiers.md): auto is the tenant's auto tier (default, or
# priority, which may run as default); flex is batch capacity with a deadline.
TIERS = {"auto": "realtime", "default": "realtime", "priority": "realtime", "flex": "batch"}
# Row status → the HTTP status a call answers when its request ended without an answer.
ENDED = {"failed": 500, "timed_out": 504, "expired": 504, "cancelled": 409, "rejected": 503}
_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}
CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)  # what a batch line or a batch may run
MAX_METADATA = 16  # pairs, as OpenAI and the native request take them
# Fields a batch line's body may not set: the job decides how its requests run.
NOT_IN_BATCH = {"stream": "A batch line cannot stream; leave stream out or false.",
                "stream_options": "A batch line cannot stream.",
                "service_tier": "A batch line runs at its batch's service tier; leave service_tier out.",
                "echo": "A batch line's answer does not repeat its prompt; leave echo out."}
UNKNOWN_FIELD = "Unknown field."  # marshmallow's message for a field a schema does not have


class StopField(fields.Field):
    """``stop``: one string or a list of up to 4, as OpenAI takes it; always a list once loaded."""

    def _deserialize(self, value, attr, data, **kwargs):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not 1 <= len(items) <= 4:
            raise ValidationError("A string or a list of 1 to 4 strings.")
        return [SafeString(validate=validate.Length(min=1, max=64)).deserialize(item) for item in items]


class StreamOptionsSchema(Schema):
    include_usage = StrictBoolean(metadata={"description": "Send a last chunk with `usage` and no choices."})


class OpenAIChatMessageSchema(ChatMessageSchema):
    role = SafeString(required=True, validate=validate.OneOf(["system", "developer", "user", "assistant", "tool"]),
                      metadata={"description": "`developer` is taken as `system`."})
    content = fields.Raw(allow_none=True, metadata={
        "description": "A string, or a list of text parts ({type: text, text}), joined. Required, except on an "
                       "assistant message with tool_calls."})
    name = SafeString(validate=validate.Length(min=1, max=64),
                      metadata={"description": "Accepted and not used (no chat template reads it)."})

    @pre_load
    def _text_parts(self, data, **kwargs):
        """OpenAI's content parts, text only, as one string (what the native message holds)."""
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            parts = data["content"]
            if not parts or not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                    for p in parts):
                raise ValidationError("Content parts must be text parts ({\"type\": \"text\", \"text\": ...}); "
                                      "images, audio and files are not served.", "content")
            data = {**data, "content": "".join(p["text"] for p in parts)}
        return data

    @validates_schema
    def _content_is_text(self, data, **kwargs):
        content = data.get("content")
        if content is not None:
            try:
                SafeString(validate=validate.Length(min=1)).deserialize(content)
            except ValidationError as exc:
                raise ValidationError(exc.messages, "content") from None


class _CommonSchema(Schema):
    model = SafeString(required=True, validate=validate.Length(min=1, max=128),
                       metadata={"description": "A model of GET /v1/models."})
    max_tokens = StrictInteger(validate=validate.Range(min=1))
    max_completion_tokens = StrictInteger(validate=validate.Range(min=1), metadata={
        "description": "Same as max_tokens (which it replaces in OpenAI's API); give one."})
    temperature = StrictFloat(validate=validate.Range(min=0, max=2))
    top_p = StrictFloat(validate=validate.Range(min=0, max=1, min_inclusive=False))
    stop = StopField(metadata={"description": "A string or up to 4 strings."})
    n = StrictInteger(validate=validate.Range(min=1, max=MAX_N), metadata={
        "description": f"Choices, 1 to {MAX_N}: one engine request; priced n × max_tokens."})
    seed = StrictInteger(validate=validate.Range(min=0, max=2**63 - 1))
    presence_penalty = StrictFloat(validate=validate.Range(min=-2, max=2))
    frequency_penalty = StrictFloat(validate=validate.Range(min=-2, max=2))
    logit_bias = LogitBiasField()
    repetition_penalty = StrictFloat(validate=validate.Range(min=0, max=2, min_inclusive=False),
                                     metadata={"description": "vLLM extension."})
    top_k = StrictInteger(validate=validate.Range(min=1, max=1_000_000), metadata={"description": "vLLM extension."})
    min_p = StrictFloat(validate=validate.Range(min=0, max=1), metadata={"description": "vLLM extension."})
    min_tokens = StrictInteger(validate=validate.Range(min=0), metadata={"description": "vLLM extension."})
    user = SafeString(validate=validate.Length(min=1, max=512),
                      metadata={"description": "Kept as the request's metadata `user`."})
    stream = StrictBoolean()
    stream_options = fields.Nested(StreamOptionsSchema)
    service_tier = SafeString(validate=validate.OneOf(list(TIERS)), metadata={
        "description": "priority (2x price, served ahead), default, flex (batch capacity, 0.5x, refused at once "
                       "when its deadline cannot be kept) or auto (the tenant's auto tier); docs/tiers.md."})
    ignore_eos = StrictBoolean(metadata={"description": "Sluice (and vLLM) extension: generate exactly "
                                                        "max_tokens (benchmarks)."})
    metadata = fields.Dict(keys=SafeString(validate=validate.Length(min=1, max=64)),
                           values=SafeString(validate=validate.Length(max=512)),
                           validate=validate.Length(max=MAX_METADATA), metadata={
        "description": f"Up to {MAX_METADATA} string pairs, kept as the request's metadata (with `user`)."})

    @validates_schema
    def _one_limit(self, data, **kwargs):
        if "max_tokens" in data and "max_completion_tokens" in data:
            raise ValidationError("Give max_tokens or max_completion_tokens, not both.", "max_completion_tokens")

    @validates_schema
    def _stream_options_need_stream(self, data, **kwargs):
        if "stream_options" in data and not data.get("stream"):
            raise ValidationError("stream_options is only allowed with stream: true.", "stream_options")

    @validates_schema
    def _metadata_holds_user(self, data, **kwargs):
        if "user" in data and len(data.get("metadata", {})) > MAX_METADATA - 1:
            raise ValidationError(f"With user (kept as metadata `user`), at most {MAX_METADATA - 1} pairs.",
                                  "metadata")


class ChatCompletionRequestSchema(SchemasWithinCaps, _CommonSchema):
    """Body of POST /v1/chat/completions."""

    messages = fields.List(fields.Nested(OpenAIChatMessageSchema), required=True,
                           validate=validate.Length(min=1, max=256))
    response_format = fields.Nested(ResponseFormatSchema, metadata={
        "description": "text, json_object, json_schema (checked at submit), and vLLM's regex and choice."})
    tools = fields.List(fields.Nested(ToolSchema), validate=validate.Length(min=1, max=MAX_TOOLS))
    tool_choice = ToolChoiceField()
    parallel_tool_calls = StrictBoolean()
    logprobs = StrictBoolean(metadata={"description": "Each output token's log probability."})
    top_logprobs = StrictInteger(validate=validate.Range(min=0, max=MAX_LOGPROBS),
                                 metadata={"description": "With logprobs: this many alternatives per token."})

    @validates_schema
    def _top_needs_logprobs(self, data, **kwargs):
        if "top_logprobs" in data and not data.get("logprobs"):
            raise ValidationError("top_logprobs needs logprobs: true.", "top_logprobs")


class CompletionRequestSchema(_CommonSchema):
    """Body of POST /v1/completions (a single string prompt)."""

    prompt = SafeString(required=True, validate=validate.Length(min=1), metadata={
        "description": "One string; on POST /v1/completions also a list of up to 64 strings (one request row "
                       "each, every choice in one answer). Token arrays are refused."})
    logprobs = StrictInteger(validate=validate.Range(min=0, max=MAX_LOGPROBS), allow_none=True,
                             metadata={"description": "Each token's log probability and this many alternatives."})
    echo = StrictBoolean(metadata={"description": "Put the prompt before the completion's text."})

    @validates_schema
    def _echo_alone(self, data, **kwargs):
        if data.get("echo") and data.get("logprobs") is not None:
            raise ValidationError("echo with logprobs (the prompt's own logprobs) is not served.", "echo")


class EmbeddingRequestSchema(Schema):
    """Body of POST /v1/embeddings."""

    model = SafeString(required=True, validate=validate.Length(min=1, max=128),
                       metadata={"description": "An embedding model of GET /v1/models (role embed)."})
    input = EmbedInputField(required=True, metadata={
        "description": "A string or a list of up to 2048 strings; token arrays are refused."})
    dimensions = StrictInteger(validate=validate.Range(min=1, max=65536),
                               metadata={"description": "Fewer dimensions (a Matryoshka model only)."})
    encoding_format = SafeString(validate=validate.OneOf(["float", "base64"]))
    user = SafeString(validate=validate.Length(min=1, max=512),
                      metadata={"description": "Kept as the request's metadata `user`."})


_EMBEDDINGS = {False: EmbeddingRequestSchema(), True: EmbeddingRequestSchema(partial=("model",))}
_SCHEMAS = {True: ChatCompletionRequestSchema(), False: CompletionRequestSchema()}
_BATCH_SCHEMAS = {True: ChatCompletionRequestSchema(partial=("model",)),
                  False: CompletionRequestSchema(partial=("model",))}
_NATIVE = SubmitRequestSchema()


def to_native(body: dict[str, Any], chat: bool, default_model: str | None = None,
              batch: bool = False, extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Validate the OpenAI ``body`` of ``/v1/chat/completions`` (``chat``) or ``/v1/completions``
    and map it: (the OpenAI fields as loaded, the native submit body, validated by
    ``SubmitRequestSchema``). Raises ``OpenAIBodyError`` naming every bad field.

    The one check and mapping of an OpenAI body, wherever one enters: the front
    (``web/openai/chat.py``), a batch line when a job file is read (``core/jobs/ingest.py``,
    ``batch``) and when the feeder runs it (``core/jobs/bodies.py``). A ``batch`` body may leave
    ``model`` out (the job's) and cannot stream or pick a tier (``NOT_IN_BATCH``). ``extra``: native
    fields the route takes beside OpenAI's (the Responses route's deadline and webhook), checked
    as the native route checks them."""
    try:
        asked = (_BATCH_SCHEMAS if batch else _SCHEMAS)[chat].load(body)
    except ValidationError as exc:
        details = exc.messages if isinstance(exc.messages, dict) else {"_schema": exc.messages}
        raise OpenAIBodyError(details, {name for name, why in details.items()
                                        if why == [UNKNOWN_FIELD]}) from None
    refused = {name: [why] for name, why in NOT_IN_BATCH.items() if batch and asked.get(name)}
    if refused:
        raise OpenAIBodyError(refused, set(refused))
    try:  # loaded for the native defaults (priority, temperature, top_p: the cache key reads them);
        # the OpenAI schemas are as strict on every field they map, so this refuses nothing today
        return asked, _NATIVE.load({**native_body(asked, default_model), **(extra or {})})
    except ValidationError as exc:  # kept so a field the native side tightens later still answers 400
        raise OpenAIBodyError(exc.messages if isinstance(exc.messages, dict) else {"_schema": exc.messages},
                              set()) from None


def to_native_for(url: str, body: dict[str, Any], default_model: str | None = None,
                  batch: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """``to_native`` for the route ``url`` names: chat, completions or embeddings."""
    if url == EMBEDDINGS_URL:
        return embeddings_to_native(body, batch)
    return to_native(body, url == CHAT_URL, default_model, batch)


def embeddings_to_native(body: dict[str, Any], batch: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Validate and map the body of POST /v1/embeddings (a batch line's may leave ``model`` out:
    the platform's embedding model)."""
    try:
        asked = _EMBEDDINGS[batch].load(body)
    except ValidationError as exc:
        details = exc.messages if isinstance(exc.messages, dict) else {"_schema": exc.messages}
        raise OpenAIBodyError(details, {name for name, why in details.items() if why == [UNKNOWN_FIELD]}) from None
    native = {"input": asked["input"], **{k: asked[k] for k in ("model", "dimensions", "encoding_format")
                                          if k in asked}}
    if "user" in asked:
        native["metadata"] = {"user": asked["user"]}
    try:
        return asked, _NATIVE.load(native)
    except ValidationError as exc:
        raise OpenAIBodyError(exc.messages if isinstance(exc.messages, dict) else {"_schema": exc.messages},
                              set()) from None


def embedding_list(vectors: list, model: str, tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings list: the route's answer, and a batch output line's body."""
    return {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": vector}
                                       for i, vector in enumerate(vectors)],
            "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def embedding_answer(row: InferenceRequest, encoding: str = "float") -> dict[str, Any]:
    """A succeeded embeddings row as OpenAI's embeddings list."""
    return {**embedding_list(row_vectors(row, encoding) or [], model_of(row), row.input_tokens or 0),
            "sluice": {**extension(row), "simulated": (row.device or "").startswith("simulated")}}


def native_body(asked: dict[str, Any], default_model: str | None) -> dict[str, Any]:
    """The native submit body that does what the validated OpenAI body ``asked`` asks for.

    OpenAI clients must name a model; naming the platform's default one (``default_model``) is
    taken as naming none, so the degradation ladder may still send it to the light model (the
    answer's ``model`` says which ran). Any other model is pinned, as on the native route; with
    ``default_model`` None, every named model is."""
    model = asked.get("model")
    body: dict[str, Any] = {} if model is None or model == default_model else {"model": model}
    if "messages" in asked:
        body["messages"] = [{**{k: v for k, v in m.items() if k != "name"},
                             "role": "system" if m["role"] == "developer" else m["role"]} for m in asked["messages"]]
        if asked.get("logprobs"):
            body["logprobs"] = asked.get("top_logprobs", 0)
    else:
        body["prompt"] = asked["prompt"]
        if asked.get("logprobs") is not None:
            body["logprobs"] = asked["logprobs"]
    max_tokens = asked.get("max_completion_tokens", asked.get("max_tokens"))
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "stop", "seed", "ignore_eos", "n", "presence_penalty", "frequency_penalty",
                 "logit_bias", "repetition_penalty", "min_tokens", "top_k", "min_p", "response_format", "tools",
                 "tool_choice", "parallel_tool_calls"):
        if asked.get(name) is not None:
            body[name] = asked[name]
    if "service_tier" in asked:
        body["service_tier"] = asked["service_tier"]
    metadata = {**asked.get("metadata", {}), **({"user": asked["user"]} if "user" in asked else {})}
    if metadata:
        body["metadata"] = metadata
    if asked.get("stream"):
        body["stream"] = True
    return body


def model_of(row: InferenceRequest) -> str:
    """The model that ran (or will run) the request: a degraded request names the lighter one."""
    return row.model_used or row.target_model


def extension(row: InferenceRequest) -> dict[str, Any]:
    """The ``sluice`` field of every answer: the row to GET, and what the ladder changed."""
    return {"request_id": str(row.id),
            "degradation": row.degradation_step.split(",") if row.degradation_step else [],
            "cache_hit": row.cache_hit, "queue_wait_s": row.queue_wait_s}


def usage(row: InferenceRequest) -> dict[str, Any]:
    return token_usage(row.input_tokens, row.output_tokens, row.cached_tokens)


def token_usage(prompt: int | None, completion: int | None, cached: int | None) -> dict[str, Any]:
    """An answer's ``usage`` as OpenAI's: with the prompt tokens the engine's prefix cache held
    (``prompt_tokens_details.cached_tokens``), which a model's cached price bills apart."""
    prompt, completion = prompt or 0, completion or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached or 0}}


def finish_reason(row: InferenceRequest) -> str:
    return _FINISH.get(row.finish_reason or "stop", "stop")


def choices(request_id: str, text: str | None, finish: str | None, stored: list[dict[str, Any]] | None,
            params: dict[str, Any], tools: list[dict[str, Any]] | None, chat: bool,
            echo: str | None = None) -> list[dict[str, Any]]:
    """An answer's OpenAI choices: each of its ``n`` texts (``stored``: the row's ``choices``,
    else the one ``text``), with its logprobs in the endpoint's shape and, on chat, the tool
    calls read out of it (``core/submit/sampling.py tool_calls``). ``echo``: the prompt, put
    before each completion's text."""
    stored = stored or [{"text": text or "", "finish_reason": finish, "logprobs": None}]
    out = []
    for i, choice in enumerate(stored):
        reason, logprobs = _FINISH.get(choice["finish_reason"] or "stop", "stop"), choice.get("logprobs")
        if not chat:
            out.append({"index": i, "text": (echo or "") + choice["text"], "finish_reason": reason,
                        "logprobs": None if logprobs is None else _completion_logprobs(logprobs, len(echo or ""))})
            continue
        message: dict[str, Any] = {"role": "assistant", "content": choice["text"]}
        called = tool_calls(request_id if i == 0 else f"{request_id}/{i}", params, tools, choice["text"],
                            params.get("tool_parser"))
        if called is not None:
            message["content"], message["tool_calls"] = called[1], called[0]
            # As OpenAI: a function the request named ends with stop; a call the model chose, tool_calls.
            if reason == "stop" and not isinstance(params.get("tool_choice"), dict):
                reason = "tool_calls"
        out.append({"index": i, "message": message, "finish_reason": reason,
                    "logprobs": None if logprobs is None else {"content": [_chat_logprob(t) for t in logprobs],
                                                               "refusal": None}})
    return out


def _chat_logprob(token: dict[str, Any]) -> dict[str, Any]:
    return {"token": token["token"], "logprob": token["logprob"], "bytes": list(token["token"].encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in token["top"]]}


def _completion_logprobs(tokens: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token["token"])
    return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [dict(t["top"]) for t in tokens], "text_offset": offsets}


def row_choices(row: InferenceRequest, chat: bool, echo: bool = False) -> list[dict[str, Any]]:
    return choices(str(row.id), row.output_text, row.finish_reason, row.choices, row.params,
                   row.input.get("tools"), chat, row.input.get("prompt") if echo else None)


def completion(row: InferenceRequest, chat: bool, echo: bool = False) -> dict[str, Any]:
    """A succeeded row as a ``chat.completion`` or ``text_completion`` object."""
    return {**_header(row, chat, "chat.completion" if chat else "text_completion"),
            "choices": row_choices(row, chat, echo), "usage": usage(row), "sluice": extension(row)}


def chunk(row: InferenceRequest, chat: bool, text: str | None = None, finish: str | None = None,
          first: bool = False, calls: list[dict[str, Any]] | None = None, index: int = 0,
          logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk of choice ``index``: a text increment (with its tokens' ``logprobs``,
    shaped by ``chunk_logprobs``), the tool calls (each whole, in one delta), or (``finish``) the
    end of the choice."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text is not None:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        choice: dict[str, Any] = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text or ""}
    body = {**_header(row, chat, "chat.completion.chunk" if chat else "text_completion"),
            "choices": [{**choice, "finish_reason": finish, "logprobs": logprobs}]}
    if first or finish:
        body["sluice"] = extension(row)
    return body


def chunk_logprobs(tokens: list[dict[str, Any]], chat: bool, offset: int) -> dict[str, Any]:
    """A streamed increment's tokens' logprobs (as a row's choices keep them) in the endpoint's
    shape; ``offset``: where the increment starts in its choice's text (completions' text_offset)."""
    if chat:
        return {"content": [_chat_logprob(t) for t in tokens], "refusal": None}
    return _completion_logprobs(tokens, offset)


def usage_chunk(row: InferenceRequest, chat: bool) -> dict[str, Any]:
    """The last chunk of a stream asked with ``stream_options.include_usage``: no choices."""
    return {**_header(row, chat, "chat.completion.chunk" if chat else "text_completion"),
            "choices": [], "usage": usage(row)}


def _header(row: InferenceRequest, chat: bool, kind: str) -> dict[str, Any]:
    return {"id": ("chatcmpl-" if chat else "cmpl-") + row.id.hex, "object": kind,
            "created": int(row.created_at.timestamp()), "model": model_of(row),
            "service_tier": row.service_tier, "system_fingerprint": None}
