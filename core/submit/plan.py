"""Step 1 of a submit: turn a validated body into a frozen plan, or say what is wrong with it.

Planning checks the body against the server's caps, counts input tokens with the target
model's tokenizer, routes a request too long for the default model to a long-context one, and
picks the queue (the worker that served the conversation's last turn, when there is one). It
writes nothing: admission prices the plan, and only an admitted plan becomes a row.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import redis
from sqlalchemy import func

from core.broker.queues import direct_queue, queue_name, size_class_for
from core.errors import InvalidRequest, RequestTooLarge
from core.hooks import DEFAULT_EVENTS, check_url
from core.rediskeys import conversation_key, node_key
from core.registry import ModelSpec
from core.settings import Settings
from core.submit.answers import OUTPUT_PARAMS, answer_key, cache_scope
from core.submit.sampling import check_tools
from core.submit.tokens import ChatTemplateError, TokenCounters
from core.usage.prices import FREE, Price
from models import InferenceRequest, Priority, ServiceTier, SizeClass, Source

log = logging.getLogger(__name__)

# Everything that changes the answer (the hot cache and twins key on all of them).
SAMPLING_FIELDS = OUTPUT_PARAMS
# How the client takes the answer; kept with the sampling parameters (the worker streams when
# `stream` is set; `detach` and `abandon_after_s` are read by core/delivery/waits.py).
DELIVERY_FIELDS = ("stream", "detach", "abandon_after_s")


@dataclass(frozen=True)
class Plan:
    """Everything a request's row will say, before admission decides whether it gets one."""

    request_id: uuid.UUID
    tenant_id: uuid.UUID
    priority: Priority
    size_class: SizeClass
    queue: str
    model_requested: str
    model_routed: str | None  # set when routing chose another model than the one asked for
    route_reason: str | None
    input: dict[str, Any]
    params: dict[str, Any]
    meta: dict[str, str]
    conversation_id: str | None
    max_tokens: int
    time_limit_s: float
    input_tokens: int
    deadline_s: float
    degradation: tuple[str, ...] = ()  # ladder steps that changed it (core/submit/ladder.py)
    cache_scope: str = ""  # whose cached answers and twins it may share (core/submit/answers.py)
    webhook_url: str | None = None  # checked by the SSRF guard (core/hooks.py)
    webhook_events: tuple[str, ...] = ()
    # Whose usage it is and what it is charged (core/usage/): the key that sent it, the door it came
    # in by, and its model's prices for its priority (set by RequestService.prepare).
    api_key_id: uuid.UUID | None = None
    source: Source = Source.API
    price: Price = FREE
    # The service tier that serves it (docs/tiers.md), and whether it may run as default when the
    # priority promise cannot be kept (its tenant's `auto` asks for priority).
    service_tier: ServiceTier = ServiceTier.DEFAULT
    may_downgrade: bool = False
    default_deadline_s: float | None = None  # its deadline as default: the body's, else the realtime default
    # When this process planned it (time.monotonic): its deadline counts from here, not from the
    # later moment its row is written, so a web tier slowed by a spike spends its own share of it.
    received: float = dataclasses.field(default_factory=time.monotonic, compare=False)

    def spent_s(self) -> float:
        """Seconds of its deadline gone by since it was planned."""
        return time.monotonic() - self.received

    def deadline_left_s(self) -> float:
        """What is left of ``deadline_s`` now: the budget admission judges and the row keeps."""
        return max(0.0, self.deadline_s - self.spent_s())

    @property
    def choices(self) -> int:
        return self.params.get("n", 1)

    @property
    def reserved_tokens(self) -> int:
        """What admission prices: input tokens plus every output token the request may use
        (``max_tokens`` for each of its ``n`` choices)."""
        return self.input_tokens + self.choices * self.max_tokens

    @property
    def target_model(self) -> str:
        return self.model_routed or self.model_requested

    @functools.cached_property
    def answer_key(self) -> str:
        """Its hot-cache key (``core/submit/answers.py``), which also names its twins (``core/submit/twins.py``)."""
        return answer_key(self.cache_scope or str(self.tenant_id), self.target_model, self.input, self.params,
                          self.max_tokens)

    def row(self) -> InferenceRequest:
        """The request's row, born ``queued`` (the column default); its deadline on the database clock,
        less the time since it was planned."""
        return InferenceRequest(
            id=self.request_id, tenant_id=self.tenant_id, priority=self.priority, size_class=self.size_class,
            queue=self.queue, model_requested=self.model_requested, model_routed=self.model_routed,
            route_reason=self.route_reason, input=self.input, params=self.params, meta=self.meta,
            conversation_id=self.conversation_id, max_tokens=self.max_tokens, time_limit_s=self.time_limit_s,
            reserved_tokens=self.reserved_tokens, input_tokens=self.input_tokens, attempts=0,
            deadline_at=func.now() + timedelta(seconds=self.deadline_left_s()),
            degradation_step=",".join(self.degradation) or None, webhook_url=self.webhook_url,
            webhook_events=list(self.webhook_events) if self.webhook_url else None, api_key_id=self.api_key_id,
            source=self.source, price_input=self.price.input, price_cached=self.price.cached,
            price_output=self.price.output, service_tier=self.service_tier.value)


def with_patience(body: dict[str, Any], wait_s: int | None, realtime_deadline_s: float) -> dict[str, Any]:
    """``body`` with the client's patience as its deadline: a realtime request that names no
    ``deadline_s`` and whose client waits ``wait_s`` seconds for the answer (``Prefer: wait``)
    must finish within that wait, when sooner than its tier's default (``realtime_deadline_s``).
    A client gone by then gains nothing from an answer computed later (one that comes back for it says
    ``Prefer: respond-async``), so the promise judges the request by the time its client will
    really wait. No grace past the wait: the deadline counts from planning, a moment after the wait
    began, so an answer in time always reaches the client still waiting for it. A second of grace
    had the engine paced and the promise planned for a client already gone (in the 94M incident at
    half scale, waiting users late in the spike: 10.2% with it, 5.0% without; docs/benchmarks.md)."""
    if not wait_s or "deadline_s" in body or body.get("priority", "realtime") != "realtime":
        return body
    return {**body, "deadline_s": min(realtime_deadline_s, float(wait_s))}


SERVICE_TIER_HEADER = "Sluice-Service-Tier"  # an answer's header naming the tier that serves it


def tier_of(body: dict[str, Any]) -> ServiceTier:
    """The service tier a validated body asks for: the one it names (``auto`` resolved already by
    ``RequestService.prepare``; left unresolved, its class's plain tier), else its class's plain tier."""
    named = body.get("service_tier")
    return ServiceTier(named) if named not in (None, "auto") else ServiceTier.of(body["priority"])


def input_chars(body: dict[str, Any]) -> int:
    """Characters of a validated submit body's input: its prompt, its messages' contents, or its
    embeddings' texts."""
    if "input" in body:
        return sum(len(text) for text in body["input"])
    return (sum(len(m.get("content") or "") for m in body["messages"]) if "messages" in body
            else len(body["prompt"]))


def reader(body: dict[str, Any], model: ModelSpec) -> dict[str, str]:
    """How the answer's tool calls will be read, kept on the request: the parser of the model that
    runs it, for tools whose choice is left to the model (``auto``)."""
    if body.get("tools") and body.get("tool_choice", "auto") == "auto" and model.tool_parser:
        return {"tool_parser": model.tool_parser}
    return {}


def request_input_of(body: dict[str, Any]) -> dict[str, Any]:
    """What the engine is given to continue: the prompt, or the messages with the tools the chat
    template renders beside them."""
    if "input" in body:
        return {"texts": body["input"]}
    if "messages" not in body:
        return {"prompt": body["prompt"]}
    return {"messages": body["messages"], **({"tools": body["tools"]} if body.get("tools") else {})}


class Planner:
    def __init__(self, settings: Settings, counters: TokenCounters, redis_client: redis.Redis,
                 redis_healthy: Callable[[], bool]) -> None:
        self.settings = settings
        self.counters = counters
        self.redis = redis_client
        self.redis_healthy = redis_healthy

    def plan(self, tenant_id: uuid.UUID, body: dict[str, Any]) -> Plan:
        """Raises InvalidRequest (422) naming every field over a server cap."""
        if "input" in body:
            return self._embedding(tenant_id, body)
        settings = self.settings
        max_tokens = body.get("max_tokens", settings.default_max_tokens)
        time_limit = body.get("time_limit_s", settings.time_limit_s)
        model = self._check(body, max_tokens, time_limit)
        if "webhook_url" in body:
            check_url(body["webhook_url"], settings.webhook_allow_list)
        request_input = request_input_of(body)
        input_tokens = self._count(model, request_input)
        requested, route_reason = model, None
        if "model" not in body and input_tokens + max_tokens > model.context_tokens:
            model, input_tokens = self._longer_model(model, input_tokens, request_input, max_tokens)
            route_reason = "long_context" if model is not requested else None
        priority = Priority(body["priority"])
        tier = tier_of(body)
        size_class, queue = self._shared_queue(priority, input_tokens + body.get("n", 1) * max_tokens, model)
        conversation_id = body.get("conversation_id")
        if conversation_id and self.redis_healthy():  # with Redis away, don't spend its timeout on affinity
            queue = self._conversation_queue(tenant_id, conversation_id, queue) or queue
        return Plan(
            request_id=uuid.uuid4(), tenant_id=tenant_id, priority=priority, size_class=size_class, queue=queue,
            model_requested=requested.name, model_routed=model.name if route_reason else None,
            route_reason=route_reason, input=request_input,
            params={k: body[k] for k in SAMPLING_FIELDS if k in body} | {k: body[k] for k in DELIVERY_FIELDS
                                                                       if body.get(k)} | reader(body, model),
            meta=body.get("metadata", {}),
            conversation_id=conversation_id, max_tokens=max_tokens, time_limit_s=float(time_limit),
            input_tokens=input_tokens, deadline_s=self._deadline_s(body, tier),
            webhook_url=body.get("webhook_url"),
            webhook_events=tuple(body.get("webhook_events", DEFAULT_EVENTS)) if "webhook_url" in body else (),
            cache_scope=cache_scope(tenant_id, settings.cache_shared_tenants), service_tier=tier)

    def _embedding(self, tenant_id: uuid.UUID, body: dict[str, Any]) -> Plan:
        """An embeddings request: each input a prefill of an embedding model, priced as its input
        tokens (plus the one step that pools them: ``max_tokens`` 1), on that model's embed queue."""
        settings, registry = self.settings, self.settings.registry
        model = registry.get(body["model"]) if "model" in body else registry.embed
        problems: dict[str, list[str]] = {}
        if model is None or model.role != "embed":
            served = ", ".join(m.name for m in registry.models if m.role == "embed") or "none"
            problems["model"] = [f"Not an embedding model: {body.get('model', '(none named)')!r}; this platform's "
                                 f"embedding models: {served}."]
        time_limit = body.get("time_limit_s", settings.time_limit_s)
        if time_limit > settings.time_limit_s:
            problems["time_limit_s"] = [f"Must be at most {settings.time_limit_s:g} seconds."]
        if "webhook_url" in body:
            check_url(body["webhook_url"], settings.webhook_allow_list)
        chars = sum(len(text) for text in body["input"])
        if chars > settings.max_prompt_chars:
            problems["input"] = [f"Input is {chars} characters; at most {settings.max_prompt_chars} are accepted."]
        dimensions = body.get("dimensions")
        if model is not None and model.dimensions and dimensions is not None and dimensions != model.dimensions:
            if dimensions > model.dimensions or not model.matryoshka:
                problems["dimensions"] = [f"{model.name} embeds in {model.dimensions} dimensions" + (
                    "; fewer may be asked for." if model.matryoshka else " (not a Matryoshka model: leave "
                    "dimensions out).")]
        if problems:
            raise InvalidRequest("The request has invalid fields; see details.", details=problems)
        assert model is not None
        counter = self.counters.for_model(model)
        counts = [counter.count({"prompt": text}) for text in body["input"]]
        longest = max(counts)
        if longest > model.context_tokens:
            raise RequestTooLarge(
                f"Input {counts.index(longest)} is {longest} tokens, more than {model.name}'s context length of "
                f"{model.context_tokens}. Shorten it.", details={"limit": "context_length", "requested_tokens": longest,
                                                                 "limit_tokens": model.context_tokens})
        priority = Priority(body["priority"])
        suffix = settings.registry.queue_suffix(model)
        return Plan(
            request_id=uuid.uuid4(), tenant_id=tenant_id, priority=priority, size_class=SizeClass.EMBED,
            queue=queue_name(priority, SizeClass.EMBED, suffix), model_requested=model.name, model_routed=None,
            route_reason=None, input={"texts": body["input"]},
            # The model's own length is no request for fewer: not sent (vLLM refuses any `dimensions`
            # for a model that is not Matryoshka).
            params={"task": "embed", **({"dimensions": dimensions} if dimensions not in (None, model.dimensions)
                                        else {}),
                    **({"encoding_format": body["encoding_format"]} if "encoding_format" in body else {}),
                    **{k: body[k] for k in DELIVERY_FIELDS if body.get(k)}},
            meta=body.get("metadata", {}), conversation_id=None, max_tokens=1, time_limit_s=float(time_limit),
            input_tokens=sum(counts),
            deadline_s=self._deadline_s(body, tier_of(body)),
            webhook_url=body.get("webhook_url"),
            webhook_events=tuple(body.get("webhook_events", DEFAULT_EVENTS)) if "webhook_url" in body else (),
            cache_scope=cache_scope(tenant_id, settings.cache_shared_tenants), service_tier=tier_of(body))

    def _deadline_s(self, body: dict[str, Any], tier: ServiceTier) -> float:
        """The body's deadline, else its tier's default."""
        settings = self.settings
        default = {ServiceTier.PRIORITY: settings.priority_deadline_s, ServiceTier.FLEX: settings.flex_deadline_s,
                   ServiceTier.BATCH: settings.batch_deadline_s}.get(tier, settings.realtime_deadline_s)
        return body.get("deadline_s", default)

    def reroute(self, plan: Plan, model: ModelSpec, reason: str) -> Plan | None:
        """``plan`` sent to ``model`` instead (counted with its tokenizer, on its queues), or None
        when it does not fit that model's context or belongs to a conversation (whose turns stay
        with the worker holding its prefix cache)."""
        if plan.conversation_id or check_tools({**plan.params, **plan.input}, model.tool_parser):
            return None  # (nor to a model whose tool-call parser the request needs and it lacks)
        vocab = self.counters.for_model(model).vocab_size if "logit_bias" in plan.params else None
        if vocab is not None and any(int(token) >= vocab for token in plan.params["logit_bias"]):
            return None  # its token ids are the requested model's, not this one's
        input_tokens = self._count(model, plan.input)
        if input_tokens + plan.max_tokens > model.context_tokens:
            return None
        size_class, queue = self._shared_queue(plan.priority, input_tokens + plan.choices * plan.max_tokens, model)
        params = {k: v for k, v in plan.params.items() if k != "tool_parser"} | reader(
            {**plan.params, **plan.input}, model)
        return dataclasses.replace(plan, model_routed=model.name, route_reason=reason, input_tokens=input_tokens,
                                   size_class=size_class, queue=queue, params=params)

    def _shared_queue(self, priority: Priority, reserved_tokens: int, model: ModelSpec) -> tuple[SizeClass, str]:
        """The size class a reservation prices into, and the model's shared queue for it."""
        size_class = size_class_for(reserved_tokens, self.settings.large_threshold_tokens)
        return size_class, queue_name(priority, size_class, self.settings.registry.queue_suffix(model))

    def _check(self, body: dict[str, Any], max_tokens: int, time_limit: float) -> ModelSpec:
        """The model asked for (or the default), once every field is within the server's caps."""
        settings, registry = self.settings, self.settings.registry
        problems: dict[str, list[str]] = {}
        if max_tokens > settings.max_output_tokens:
            problems["max_tokens"] = [f"Must be at most {settings.max_output_tokens}."]
        if body.get("min_tokens", 0) > max_tokens:  # max_tokens here may be the server's default
            problems["min_tokens"] = [f"Must be at most max_tokens ({max_tokens})."]
        if time_limit > settings.time_limit_s:
            problems["time_limit_s"] = [f"Must be at most {settings.time_limit_s:g} seconds."]
        model = registry.get(body["model"]) if "model" in body else registry.default
        if model is None:
            served = ", ".join(m.name for m in registry.models)
            problems["model"] = [f"Unknown model {body['model']!r}; this platform serves: {served}."]
        elif model.role == "embed":
            problems["model"] = [f"{model.name} is an embedding model: send `input` (or POST /v1/embeddings)."]
            model = None
        if model is not None:
            problems.update(check_tools(body, model.tool_parser))
            vocab = self.counters.for_model(model).vocab_size if "logit_bias" in body else None
            outside = sorted((t for t in body.get("logit_bias", {}) if vocab is not None and int(t) >= vocab), key=int)
            if outside:
                problems["logit_bias"] = [f"Token ids must be below {vocab}, this model's vocabulary: "
                                          f"{', '.join(outside[:5])} are not."]
        chars = input_chars(body)
        if chars > settings.max_prompt_chars:
            problems["prompt" if "prompt" in body else "messages"] = [
                f"Input is {chars} characters; at most {settings.max_prompt_chars} are accepted."]
        if problems:
            raise InvalidRequest("The request has invalid fields; see details.", details=problems)
        assert model is not None
        return model

    def _longer_model(self, model: ModelSpec, input_tokens: int, request_input: dict[str, Any],
                      max_tokens: int) -> tuple[ModelSpec, int]:
        """The smallest long-context model that holds the request, counted with its own tokenizer.

        If none does, the largest is kept and the per-request gate answers 413 with its numbers;
        with none configured, ``model`` stays.
        """
        for longer in self.settings.registry.long_models():
            if longer.context_tokens <= model.context_tokens:
                continue
            model, input_tokens = longer, self._count(longer, request_input)
            if input_tokens + max_tokens <= longer.context_tokens:
                break
        return model, input_tokens

    def _count(self, model: ModelSpec, request_input: dict[str, Any]) -> int:
        try:
            return self.counters.for_model(model).count(request_input)
        except ChatTemplateError as exc:
            raise InvalidRequest(exc.message, details={"messages": [exc.message]}) from None

    def _conversation_queue(self, tenant_id: uuid.UUID, conversation_id: str, shared_queue: str) -> str | None:
        """The direct queue of the live worker that served this conversation's last turn, if any.

        Only if that worker also consumes ``shared_queue``: affinity never moves a turn to a worker
        of another role (a batch turn onto a reserved realtime device), size class or model.
        Best effort: if Redis cannot say, the turn goes to the shared queue and only loses its
        prefix cache hit.
        """
        try:
            node = self.redis.get(conversation_key(str(tenant_id), conversation_id))
            owner = json.loads(self.redis.get(node_key(node)) or "{}") if node else {}
            if shared_queue in owner.get("queues", ()):
                return direct_queue(node)
        except Exception:
            log.warning("conversation routing unavailable; using the shared queue")
        return None
