"""The hot answer cache: a request the platform answered recently is answered again from Redis.

The key is the tenant, the target model, the input (prompt or messages and tools, canonical JSON) and
every parameter that changes the output (max_tokens and ``OUTPUT_PARAMS``: sampling, ``n``, logprobs,
penalties, ``response_format``, ``tool_choice``), hashed.
The tenant is in it so that no tenant learns what another sent (a hit says that exact prompt was
asked lately) or gets another's sampled answer at the ``cached_answer`` level; an operator may name
tenants that share one cache (SLUICE_CACHE_SHARED_TENANTS: teams of one company asking the same
questions), which then share their twins too (``core/submit/twins.py`` keys on the same digest). A
worker stores each succeeded answer. Admission serves one without touching a GPU when the
request is deterministic (temperature 0), or, at the ``CACHED_ANSWERS`` level and above, for any
request whose exact twin was answered (a retry storm of one question costs one inference).

Bounded: entries expire after ``ttl_s``; answers over ``max_bytes`` are not stored; past
``max_entries`` the oldest are evicted. Best effort everywhere: a Redis error is a miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

log = logging.getLogger(__name__)

ANSWER_PREFIX = "sluice:answer:"
INDEX_KEY = "sluice:answers"  # sorted set: key → time stored, for eviction
# Every submit field that changes the answer: the request's params (core/submit/plan.py keeps these);
# with the model, the input (tools included) and max_tokens, its key.
OUTPUT_PARAMS = ("temperature", "top_p", "seed", "stop", "ignore_eos", "n", "logprobs", "top_k", "min_p",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                 "response_format", "tool_choice", "parallel_tool_calls", "task", "dimensions")


SHARED_SCOPE = "shared"


def cache_scope(tenant_id: uuid.UUID | str, shared_tenants: frozenset[str] = frozenset()) -> str:
    """Whose answers a tenant's requests may be answered with: its own, or the shared scope of the
    tenants the operator named."""
    tenant = str(tenant_id)
    return SHARED_SCOPE if tenant in shared_tenants else tenant


def answer_key(scope: str, model: str, request_input: dict[str, Any], params: dict[str, Any],
               max_tokens: int) -> str:
    """The cache key (and twin digest) of an answer within ``scope`` (:func:`cache_scope`)."""
    material = json.dumps({"scope": scope, "model": model, "input": request_input, "max_tokens": max_tokens,
                           "params": {k: params[k] for k in OUTPUT_PARAMS if k in params}},
                          sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return ANSWER_PREFIX + hashlib.sha256(material.encode()).hexdigest()


def deterministic(params: dict[str, Any]) -> bool:
    """Whether the same request always gets the same answer: greedy decoding, or an embedding."""
    return params.get("temperature", 1.0) == 0 or params.get("task") == "embed"


class AnswerCache:
    def __init__(self, client: redis.Redis, *, ttl_s: float, max_entries: int, max_bytes: int,
                 healthy: Callable[[], bool] = lambda: True, shared_tenants: frozenset[str] = frozenset()) -> None:
        self.redis = client
        self.shared_tenants = shared_tenants  # the tenants that share one scope (cache_scope)
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.healthy = healthy

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def get(self, key: str) -> dict[str, Any] | None:
        if not self.enabled or not self.healthy():
            return None
        try:
            raw = self.redis.get(key)
        except redis.RedisError:
            return None
        return json.loads(raw) if raw else None

    def put(self, key: str, answer: dict[str, Any]) -> None:
        if not self.enabled or not self.healthy():
            return
        raw = json.dumps(answer, ensure_ascii=False)
        if len(raw.encode()) > self.max_bytes:
            return
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.set(key, raw, ex=max(1, int(self.ttl_s)))
                pipe.zadd(INDEX_KEY, {key: time.time()})
                pipe.zremrangebyscore(INDEX_KEY, "-inf", time.time() - self.ttl_s)  # expired ones
                pipe.zcard(INDEX_KEY)
                *_, size = pipe.execute()
            if size > self.max_entries:
                oldest = self.redis.zpopmin(INDEX_KEY, size - self.max_entries)
                if oldest:
                    self.redis.delete(*(k for k, _ in oldest))
        except redis.RedisError as exc:
            log.warning("answer not cached (%s)", type(exc).__name__)
