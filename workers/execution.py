"""One request's life on a worker: claim the row, run it in the engine, write the outcome.

No database session is held across inference: the claim and the outcome are separate short
transactions, both lifecycle transitions (``models/lifecycle.py``), so a duplicate delivery, a
cancel that won the race, or a sweep that requeued the row after this worker was presumed dead
can never make a request run twice or reach two terminal states.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from core.observe import metrics
from core.rediskeys import conversation_key
from core.submit.answers import AnswerCache, answer_key, cache_scope
from core.submit.sampling import decoding
from core.submit.tokens import message_text
from core.submit.twins import Twins
from models import ServiceTier, Status
from models import lifecycle as lc
from models.lifecycle import Claimed, Ended, Lifecycle
from models.request import storable_text
from workers.engines import GenerationRequest, SamplingParams
from workers.engines.base import TIER_RANK, Constraint, ConstraintError, RequestRefused
from workers.runtime import EngineRuntime, RunResult

log = logging.getLogger(__name__)

# Seconds to wait before each retry of a row write when Postgres is briefly unreachable; the
# answer was computed at GPU cost, so it is worth a few seconds of patience.
OUTCOME_WRITE_BACKOFF = (0.5, 2.0, 5.0, 10.0)
# Postgres unreachable, or every pooled connection busy past pool_timeout (a worker runs more
# threads than it has connections): transient, so retried, then the message is handed back.
DB_UNAVAILABLE = (OperationalError, PoolTimeout)

# How the engine run ended → how the request ends.
ENDS = {"finished": lc.SUCCEEDED, "timeout": lc.TIME_LIMIT, "deadline": lc.DEADLINE_RUNNING,
        "unreachable": lc.DEADLINE_UNREACHABLE,
        "cancel": lc.CANCELLED_RUNNING, "engine_abort": lc.ENGINE_SHUTDOWN}
# A conversation sticks to its worker this long after its last turn started.
CONVERSATION_TTL_S = 3600


def with_db_retries(attempt):
    """Run ``attempt()``, retrying while the database is unavailable along OUTCOME_WRITE_BACKOFF."""
    for delay in (*OUTCOME_WRITE_BACKOFF, None):
        try:
            return attempt()
        except DB_UNAVAILABLE as exc:
            if delay is None:
                raise
            log.warning("database unavailable (%s); retrying in %.1fs", type(exc).__name__, delay)
            time.sleep(delay)


def execute(lifecycle: Lifecycle, redis_client: redis.Redis, runtime: EngineRuntime, request_id: uuid.UUID,
            answers: AnswerCache | None = None, twins: Twins | None = None,
            publish: Callable[..., None] | None = None) -> None:
    """Claim, run and finish one request. ``publish`` sends a request this worker hands back
    (it stopped before the request finished) to its queue again; without it the sweep does."""
    # started_at on this host's clock: read as the claim that succeeded was sent, so never after
    # the database stamped it. The deadline counted from here ends no later than the row's, and
    # the stamps counted from here (first token, finish) are never earlier than what they stamp.
    claimed_mono = 0.0

    def claim():
        nonlocal claimed_mono
        claimed_mono = time.monotonic()
        return lifecycle.claim(request_id, runtime.worker_id, runtime.info["device"])

    claimed = with_db_retries(claim)
    if claimed is None:
        return
    metrics.QUEUE_WAIT.labels(claimed.priority.value, runtime.info["model"]).observe(claimed.queue_wait_s)
    if claimed.conversation_id and runtime.node:
        try:
            redis_client.set(conversation_key(str(claimed.tenant_id), claimed.conversation_id), runtime.node,
                             ex=CONVERSATION_TTL_S)
        except Exception:
            log.warning("could not record conversation affinity; the next turn may miss the prefix cache")
    key = answer_key(cache_scope(claimed.tenant_id, answers.shared_tenants if answers else frozenset()),
                     runtime.info["model"], claimed.input, claimed.params, claimed.max_tokens)
    try:
        run(lifecycle, runtime, claimed, claimed_mono, key, answers, publish)
    finally:
        if twins is not None:  # whatever the end, it computes this answer no longer
            twins.forget(key, request_id)


def run(lifecycle: Lifecycle, runtime: EngineRuntime, claimed: Claimed, claimed_mono: float, key: str,
        answers: AnswerCache | None, publish: Callable[..., None] | None = None) -> None:
    """Run a claimed request in the engine and write its outcome; a success goes into the cache."""
    request_id = claimed.id
    try:
        whole = None if claimed.deadline_in_s is None else claimed.deadline_in_s + claimed.queue_wait_s
        # What is left of its deadline now: the claim's return and what came since are spent.
        left = None if claimed.deadline_in_s is None else claimed.deadline_in_s - (time.monotonic() - claimed_mono)
        result = runtime.run(generation_request(claimed), claimed.time_limit_s, left, whole)
    except RequestRefused as exc:  # the request's fault, not the engine's
        log.info("refused by the engine: %s", exc)
        end = lc.invalid_constraint(str(exc)) if isinstance(exc, ConstraintError) else lc.engine_refused(str(exc))
        with_db_retries(lambda: lifecycle.finish(request_id, runtime.worker_id, end))
        return
    except Exception:
        log.exception("engine error")
        with_db_retries(lambda: lifecycle.finish(request_id, runtime.worker_id, lc.ENGINE_ERROR))
        return
    _observe(claimed, runtime.info["model"], result, claimed_mono)
    if result.ended_by in ("shutdown", "preempted"):  # handed back: queued again, no attempt spent
        why = ("preempted for work of a better tier" if result.ended_by == "preempted"
               else "its worker stopped before it finished")
        requeued = with_db_retries(lambda: lifecycle.hand_back(request_id, runtime.worker_id, why))
        if requeued is None:  # the client asked to cancel it meanwhile (or it is no longer ours)
            with_db_retries(lambda: lifecycle.finish(request_id, runtime.worker_id, lc.CANCELLED_RUNNING))
        elif publish is not None:
            try:
                # A preempted batch request goes back to the head of its queue: it was in line
                # before everything queued behind it, and its preemptions are capped.
                publish([requeued], head=result.ended_by == "preempted")
            except Exception:
                log.warning("handed-back request not published; the sweep will publish it", exc_info=True)
        return
    try:
        ended = finish(lifecycle, request_id, runtime.worker_id, runtime.info["model"], result, claimed_mono)
    except DB_UNAVAILABLE:
        raise  # Postgres stayed unavailable through every retry; the sweep finds the overdue row
    except Exception:
        # The outcome itself cannot be stored: say so on the row rather than leave it running.
        log.exception("outcome not storable")
        with_db_retries(lambda: lifecycle.finish(request_id, runtime.worker_id, lc.RESULT_NOT_STORABLE))
        return
    if answers is not None and ended is not None and ended.status == Status.SUCCEEDED and result.output:
        out = result.output
        answers.put(key, {"text": storable_text(out.text), "finish_reason": out.finish_reason,
                          "input_tokens": out.prompt_tokens, "output_tokens": out.output_tokens,
                          "choices": lc.stored_choices(out), "device": runtime.info.get("device"),
                          "embedding": base64.b64encode(out.embedding).decode() if out.embedding else None})


def _observe(claimed: Claimed, model: str, result: RunResult, claimed_mono: float) -> None:
    """One engine run into the worker's histograms (core/observe/metrics.py)."""
    labels = (claimed.priority.value, model)
    metrics.INFERENCE.labels(*labels).observe(time.monotonic() - claimed_mono)
    first = result.first_token_after(claimed_mono)
    if first is not None:
        metrics.FIRST_TOKEN.labels(*labels).observe(max(0.0, first))
    if result.output is not None:
        metrics.OUTPUT_TOKENS.labels(*labels).inc(result.output.output_tokens)


def finish(lifecycle: Lifecycle, request_id: uuid.UUID, worker_id: str, model: str, result: RunResult,
           claimed_mono: float) -> Ended | None:
    """The engine run's outcome onto the row, if this worker still owns it."""
    return with_db_retries(lambda: lifecycle.finish(
        request_id, worker_id, ENDS[result.ended_by], model=model, output=result.output,
        first_token_after_s=result.first_token_after(claimed_mono),
        finished_after_s=result.finished_after(claimed_mono)))


def engine_priority(claimed: Claimed) -> int:
    """The engine priority of a claimed request: its service tier's rank (a row that names no
    tier, or one its class does not hold, gets its class's plain tier)."""
    tier = claimed.service_tier
    if tier not in TIER_RANK or ServiceTier(tier).priority != claimed.priority:
        tier = ServiceTier.of(claimed.priority)
    return TIER_RANK[tier]


def generation_request(claimed: Claimed) -> GenerationRequest:
    params, tools = claimed.params, claimed.input.get("tools")
    if "texts" in claimed.input:  # embeddings: nothing is sampled
        return GenerationRequest(request_id=str(claimed.id), prompt="", params=SamplingParams(max_tokens=1),
                                 priority=engine_priority(claimed), prompt_tokens=claimed.input_tokens,
                                 texts=tuple(claimed.input["texts"]), dimensions=params.get("dimensions"))
    constraint = decoding(params, tools)
    return GenerationRequest(
        request_id=str(claimed.id), prompt=render_prompt(claimed.input),
        params=SamplingParams(
            max_tokens=claimed.max_tokens, temperature=params.get("temperature", 1.0),
            top_p=params.get("top_p", 1.0), seed=params.get("seed"), stop=tuple(params.get("stop", ())),
            ignore_eos=params.get("ignore_eos", False), n=params.get("n", 1), top_k=params.get("top_k"),
            min_p=params.get("min_p", 0.0),
            presence_penalty=params.get("presence_penalty", 0.0),
            frequency_penalty=params.get("frequency_penalty", 0.0),
            repetition_penalty=params.get("repetition_penalty", 1.0),
            logit_bias=tuple((int(token), bias) for token, bias in params.get("logit_bias", {}).items()),
            min_tokens=params.get("min_tokens", 0), logprobs=params.get("logprobs"),
            keep_special_tokens=params.get("tool_parser") == "mistral",
            constraint=None if constraint is None else Constraint(
                constraint[0], json.dumps(constraint[1]) if constraint[0] == "json"
                else tuple(constraint[1]) if constraint[0] == "choice" else constraint[1])),
        priority=engine_priority(claimed), prompt_tokens=claimed.input_tokens,
        messages=tuple(claimed.input["messages"]) if "messages" in claimed.input else None,
        stream=bool(params.get("stream")), tools=tuple(tools) if tools else None,
        calls_as=params.get("tool_parser") if tools else None)


def render_prompt(request_input: dict[str, Any]) -> str:
    """Flatten chat messages into one prompt (engines with a chat template replace this)."""
    if "prompt" in request_input:
        return request_input["prompt"]
    lines = [f"{m['role']}: {message_text(m)}" for m in request_input["messages"]]
    if request_input.get("tools"):
        lines.insert(0, "tools: " + json.dumps(request_input["tools"]))
    return "\n".join(lines) + "\nassistant:"
