"""Admission: three token-priced gates between a validated request and its row.

    global   the promise (its class's queue says it cannot finish by its deadline → 503 with a
             Retry-After computed from the queue), the degradation level (shed → 503 for all,
             reject-batch → 503 for batch) and the
             platform's token rate (→ 503)
    tenant   tokens per minute and requests per minute (→ 429 rate_limited), requests in flight
             (→ 429 tenant_concurrency_limit), from the tenant's tier and overrides
    request  input + max_tokens against the model's context length and the tenant's per-request
             maximum (→ 413 request_too_large, with the numbers)

A request's price is its estimated input tokens plus its ``max_tokens``: the reservation stored
on the row. The gates run in that order in one Redis script (``core/admission/limiter.py``), which
charges every limit or none; the per-request verdict is plain arithmetic, worked out here and
handed to the script as its third gate. When Redis does not answer within
``SLUICE_REDIS_TIMEOUT_S``, the same gates run on this process's local floor
(``core/admission/local_floor.py``). Every outcome carries OpenAI-style ``x-ratelimit-*`` headers.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from core.admission.limiter import SharedLimiter, Verdict
from core.admission.load import class_name, tier_place
from core.admission.local_floor import LocalFloor, RedisBreaker
from core.errors import ApiError, BudgetUnavailable, Overloaded, RateLimited, RequestTooLarge
from core.fleet.workers import HEARTBEAT_PATIENCE
from core.observe import submit_metrics as metrics
from core.rediskeys import redis_client
from core.settings import Settings
from core.tenants.tiers import Limits, effective_limits
from core.usage import refusals
from core.usage.budgets import Budgets, Charge
from models import SizeClass, Tenant
from models.lifecycle import Ended

if TYPE_CHECKING:
    from core.submit.plan import Plan

log = logging.getLogger(__name__)

# When a level, not a bucket, turned the request away there is no refill time to report.
OVERLOAD_RETRY_AFTER_S = 5
CONCURRENCY_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Ticket:
    """An admitted request's reservation, until its row is committed, and the tenant's
    x-ratelimit-* headers after it."""

    request_id: str
    tenant_id: str
    cost: int
    limiter: str  # "shared" | "local_floor"
    headers: dict[str, str] = field(default_factory=dict)
    # The class's queue wait at admission, as the monitor's rates predict it; None when unknown.
    estimated_wait_s: float | None = None
    # That wait plus the request's own output at the speed a sequence gets: when its answer is due.
    estimated_finish_s: float | None = None


class Admission:
    def __init__(self, settings: Settings, budgets: Budgets | None = None) -> None:
        self.settings = settings
        # Hard budgets are charged in the same Lua call as every other limit (core/usage/budgets.py).
        self.budgets = budgets
        # The web tier's own client: one short timeout per call and no retries, so a hung Redis
        # costs a request at most SLUICE_REDIS_TIMEOUT_S before the floor takes over.
        self.redis = redis_client(settings.redis_url, settings.redis_timeout_s)
        self.redis.set_retry(Retry(NoBackoff(), 0))
        self.shared = SharedLimiter(self.redis, platform_tokens_per_minute=settings.platform_tokens_per_minute,
                                    load_level_max_age_s=settings.load_level_max_age_s,
                                    reject_batch="reject_batch" in settings.ladder, shed="shed" in settings.ladder,
                                    tight_promise_factor=(settings.tight_promise_factor
                                                          if "tight_promise" in settings.ladder else None),
                                    promise_factor=settings.promise_factor,
                                    capacity_max_age_s=HEARTBEAT_PATIENCE * settings.worker_heartbeat_s)
        self.floor = LocalFloor(settings.local_floor_tokens_per_minute)
        self.breaker = RedisBreaker()

    @property
    def redis_healthy(self) -> bool:
        """False while this process is on its local floor: callers skip optional Redis work."""
        return self.breaker.healthy

    def limits_for(self, tenant: Tenant) -> Limits:
        return effective_limits(self.settings.tiers, self.settings.default_tier, tenant)

    def admit(self, tenant: Tenant, plan: Plan, charge: str = "full") -> Ticket:
        """Pass the plan through the gates and reserve its tokens, or raise the rejection.

        ``charge``: ``full`` for a request the engine will run; ``twin`` for one parked on an
        identical request in flight, which takes a row and a concurrency slot and runs if its
        leader ends without an answer, so the tenant's gates charge it as any request (not the
        global gate: it adds no work to the engines while it waits); ``hit`` for one the cache
        answers, which costs a row and a round trip: one request of the tenant's rate, no tokens
        and no slot. Every path to a row is charged to its tenant (``SharedLimiter.admit``)."""
        limits = self.limits_for(tenant)
        cost = plan.reserved_tokens
        too_large = self._too_large(limits, plan)
        charges = self.budgets.charges(plan) if self.budgets is not None and charge != "hit" else []
        verdict = self._shared(lambda: self._gates(tenant, limits, plan, too_large=too_large is not None,
                                                   charge=charge, charges=charges))
        for _ in charges:  # a counter missing (a new window, Redis restarted): seed it, ask again
            if verdict is None or verdict.reason != "budget_unseeded":
                break
            verdict = self._shared(functools.partial(self._seeded, charges[verdict.budget - 1], tenant, limits, plan,
                                                     too_large=too_large is not None, charge=charge,
                                                     charges=charges))
        limiter = "shared"
        if verdict is None and charge == "hit":  # the cache answered through Redis a moment ago
            return Ticket(str(plan.request_id), str(tenant.id), 0, "local_floor",
                          ratelimit_headers(self.floor.peek(str(tenant.id), limits)))
        if verdict is None and charges:
            # A hard budget is only ever charged atomically, in Redis: without it, nothing is admitted
            # against one (the floor would let spend past it unseen).
            metrics.REJECTIONS.labels(gate="budget", reason="budget_unavailable").inc()
            raise BudgetUnavailable("cannot be checked while the shared limiter is unreachable",
                                    OVERLOAD_RETRY_AFTER_S)
        if verdict is None:
            verdict, limiter = self.floor.admit(str(tenant.id), limits, cost, plan.priority.value,
                                                too_large=too_large is not None, klass=_class(plan)), "local_floor"
        else:
            self._remember(verdict, plan)
        headers = ratelimit_headers(verdict)
        if verdict.admitted:
            metrics.ADMITTED.labels(limiter=limiter).inc()
            return Ticket(str(plan.request_id), str(tenant.id), cost, limiter, headers,
                          _seconds(verdict.wait_ms), _seconds(verdict.finish_ms))
        metrics.REJECTIONS.labels(gate=verdict.gate, reason=verdict.reason).inc()
        log.info("rejected at the %s gate: %s (%d tokens, %s limiter)", verdict.gate, verdict.reason, cost, limiter)
        if verdict.gate == "budget":
            if verdict.reason == "budget_unseeded":  # still missing after seeding: Redis lost it again
                raise BudgetUnavailable("could not be read", OVERLOAD_RETRY_AFTER_S)
            refusal = self.budgets.refusal(charges[verdict.budget - 1], verdict.budget_spent)
            refusal.headers = {**headers, **refusal.headers}
            raise refusal
        raise _rejection(verdict, limits, cost, too_large, headers, plan.deadline_s)

    def _remember(self, verdict: Verdict, plan: Plan) -> None:
        """A refusal of the promise that the queue caused closes the class on this process's floor
        until its Retry-After, should Redis stop answering meanwhile. One the request alone causes
        (its own run outlasts its deadline) says nothing of the queue."""
        if verdict.reason == "deadline" and verdict.retry_after_ms > 0 and not _alone(verdict, plan.deadline_s):
            self.floor.close(_class(plan), verdict.retry_after_ms)

    def _seeded(self, missing: Charge, *args, **kwargs) -> Verdict:
        """Seed a missing budget counter, then run the gates again (``_gates``' arguments)."""
        self.budgets.seed(self.redis, missing)
        return self._gates(*args, **kwargs)

    def refuse_early(self, tenant: Tenant, plan: Plan) -> None:
        """Raise the global gate's refusal (the promise, the level, the platform's rate) if it would
        refuse ``plan`` now; charge nothing either way. Only the shared limiter answers: with Redis
        away this returns and the full admission decides on the floor."""
        limits = self.limits_for(tenant)
        verdict = self._shared(lambda: self._gates(tenant, limits, plan, dry_run=True, count="global"))
        if verdict is None or verdict.gate != "global":
            return
        self._remember(verdict, plan)
        metrics.REJECTIONS.labels(gate=verdict.gate, reason=verdict.reason).inc()
        log.info("refused early at the global gate: %s (%d tokens)", verdict.reason, plan.reserved_tokens)
        raise _rejection(verdict, limits, plan.reserved_tokens, None, ratelimit_headers(verdict), plan.deadline_s)

    def refuse_over_limits(self, tenant: Tenant) -> None:
        """Raise the tenant gate's 429 if it would refuse even the cheapest request (one token): its
        request rate or concurrency used up, or its token bucket empty. Checked before the request
        is tokenized (up to SLUICE_MAX_PROMPT_CHARS), so a tenant over its limits costs the web tier
        one Redis call, not that work. Charges nothing; with Redis away the floor decides later."""
        limits = self.limits_for(tenant)
        verdict = self._shared(lambda: self.shared.admit(
            "", str(tenant.id), limits, 1, "realtime", dry_run=True, count="tenant",
            refusal_field=refusals.field(tenant.id, tenant.via_key, "", "", "", "")))
        if verdict is None or verdict.gate != "tenant":
            return
        metrics.REJECTIONS.labels(gate=verdict.gate, reason=verdict.reason).inc()
        log.info("refused before planning: tenant %s", verdict.reason)
        raise _rejection(verdict, limits, 0, None, ratelimit_headers(verdict))

    def spend_refused(self, tenant: Tenant, reason: str, counted: bool = False) -> None:
        """Count a request refused for its body (read and parsed, then found invalid or too large)
        as one request of the tenant's rate (no tokens, no slot: admit.lua's ``hit``): reading and
        checking it cost the web tier its work, so a key over its rate pays with 429s like any
        other, however it errs. Counted in ``sluice_admission_rejections_total`` (gate request).
        Best effort: with Redis away the refusal stands and nothing is counted. ``counted``: the
        gates refused it (413 request_too_large) and the metric has it already."""
        if not counted:
            metrics.REJECTIONS.labels(gate="request", reason=reason).inc()
        limits = self.limits_for(tenant)
        self._shared(lambda: self.shared.admit("", str(tenant.id), limits, 0, "realtime", charge="hit"))

    def _gates(self, tenant: Tenant, limits: Limits, plan: Plan, *, too_large: bool = False,
               dry_run: bool = False, charge: str = "full", charges: list[Charge] = (), count: str = "*"
               ) -> Verdict:
        """The shared limiter's gates for ``plan`` (its promise and hard budgets included), a
        refusal counted for the usage report as ``count`` says; raises Redis errors."""
        return self.shared.admit(str(plan.request_id), str(tenant.id), limits, plan.reserved_tokens,
                                 plan.priority.value, too_large=too_large, dry_run=dry_run, model=plan.target_model,
                                 deadline_s=plan.deadline_s, max_tokens=plan.max_tokens,
                                 input_tokens=plan.input_tokens, spent_s=plan.spent_s(), charge=charge,
                                 budgets=[(c.counter, c.rule.limit, c.amount) for c in charges],
                                 budget_record=";".join(f"{c.rule.unit} {c.amount} {c.counter}" for c in charges),
                                 count=count, refusal_field=refusals.field(
                                     tenant.id, plan.api_key_id, plan.target_model, plan.priority.value,
                                     plan.source.value, plan.service_tier.value),
                                 place=tier_place(plan.service_tier), held_share=self.settings.priority_share,
                                 queue=plan.queue, tier=plan.service_tier.value)

    def cancel(self, ticket: Ticket) -> None:
        """Undo an admission whose row was never committed."""
        if ticket.limiter == "local_floor":
            self.floor.refund(ticket.tenant_id, ticket.cost)
        else:
            self._shared(lambda: self.shared.release(ticket.request_id, ticket.tenant_id, ticket.cost))

    def release(self, ended: Ended) -> None:
        """A request ended: free its slot and refund the tokens it did not use (a lifecycle hook).

        Best effort: if Redis does not answer, the sweep's reconciliation releases it later.
        """
        self._shared(lambda: self.shared.release_row(ended))

    def headers(self, tenant: Tenant) -> dict[str, str]:
        """The tenant's current quotas as headers, for responses that ran no gate."""
        limits = self.limits_for(tenant)
        verdict = self._shared(lambda: self.shared.peek(str(tenant.id), limits))
        return ratelimit_headers(verdict or self.floor.peek(str(tenant.id), limits))

    def _shared(self, call):
        """``call()`` against Redis through the breaker; None when Redis is (or just went) away."""
        if not self.breaker.allow():
            return None
        try:
            result = call()
        except redis.RedisError as exc:
            if not isinstance(exc, redis.ConnectionError | redis.TimeoutError):
                # Redis answered with an error (out of memory, read-only replica, a script bug):
                # the floor keeps requests flowing, the traceback says why.
                log.exception("Redis error in admission; using the local floor")
            elif self.breaker.healthy:
                log.warning("Redis unreachable (%s): admission falls back to the local floor", type(exc).__name__)
            self.breaker.failed()
            metrics.LOCAL_FLOOR.set(1)
            return None
        if not self.breaker.healthy:
            log.warning("Redis answers again: admission is back on the shared limits")
        self.breaker.succeeded()
        metrics.LOCAL_FLOOR.set(0)
        return result

    def _too_large(self, limits: Limits, row: Plan) -> tuple[int, str, str] | None:
        """The smallest ceiling the request's tokens exceed, as (tokens, name, description)."""
        model = self.settings.registry.get(row.target_model)
        # The context holds one sequence: its input and max_tokens (n choices are n sequences, each
        # that long); an embeddings request's inputs are embedded one by one, each held to the
        # context by the planner. The other ceilings price the whole reservation.
        sequence = row.input_tokens + row.max_tokens
        ceilings = [] if row.size_class == SizeClass.EMBED else [
            (model.context_tokens if model else self.settings.max_context_tokens, "context_length",
             f"{row.target_model}'s context length", sequence)]
        ceilings += [
            (limits.max_request_tokens, "max_request_tokens", "your per-request maximum", row.reserved_tokens),
            # A request larger than a whole minute's budget could never be admitted: say so now.
            (limits.tokens_per_minute, "tokens_per_minute", "your tokens-per-minute limit", row.reserved_tokens),
        ]
        if self.settings.platform_tokens_per_minute:
            ceilings.append((self.settings.platform_tokens_per_minute, "platform_tokens_per_minute",
                             "the platform's tokens-per-minute limit", row.reserved_tokens))
        exceeded = [c for c in ceilings if c[3] > c[0]]
        if not exceeded:
            return None
        limit, name, what, needed = min(exceeded)
        choices = f" × {row.choices} choices" if row.choices > 1 and needed == row.reserved_tokens else ""
        return limit, name, (f"This request needs {needed} tokens ({row.input_tokens} input + {row.max_tokens} "
                             f"max_tokens{choices}), more than {what} of {limit} tokens. Shorten the input or "
                             "lower max_tokens.")


def _class(plan: Plan) -> str:
    """The class the promise judges ``plan`` in."""
    return class_name(plan.priority, plan.target_model)


def _alone(verdict: Verdict, deadline_s: float | None) -> bool:
    """Whether the request alone (its own run, nothing queued) outlasts its deadline."""
    return deadline_s is not None and verdict.run_ms > deadline_s * 1000


def _seconds(ms: int) -> float | None:
    """An estimate from the admission script, in seconds; None where it had none (-1)."""
    return ms / 1000 if ms >= 0 else None


def _rejection(verdict: Verdict, limits: Limits, cost: int, too_large, headers: dict[str, str],
               deadline_s: float | None = None) -> ApiError:
    details = {"gate": verdict.gate, "reason": verdict.reason}
    if verdict.gate == "global":
        # The level it was judged at: its class's, or its fair level for a tenant not loud there
        # (docs/fairness.md): whether a refusal came from the load or from this request's own wait.
        details["load_level"] = verdict.load_level
    if verdict.reason == "deadline":
        # estimated_from: "monitor" (its published rates) or "workers" (the monitor is away: the
        # capacity the live workers' heartbeats state).
        details.update(estimated_wait_s=verdict.wait_ms / 1000, estimated_from=verdict.basis)
        if verdict.run_ms >= 0:
            details["estimated_run_s"] = verdict.run_ms / 1000
    if verdict.gate == "request":
        limit, name, message = too_large
        return RequestTooLarge(message, headers=headers,
                               details={**details, "requested_tokens": cost, "limit_tokens": limit, "limit": name})
    retry_ms = verdict.retry_after_ms or 1000 * (
        CONCURRENCY_RETRY_AFTER_S if verdict.reason == "concurrency" else OVERLOAD_RETRY_AFTER_S)
    retry_s = max(1, math.ceil(retry_ms / 1000))
    # Retry-After takes whole seconds; OpenAI's clients read the finer retry-after-ms first.
    headers = {**headers, "Retry-After": str(retry_s), "retry-after-ms": str(retry_ms)}
    after = f"retry after {retry_s} s"
    messages = {
        "shed": f"The platform is overloaded and is shedding load; {after}.",
        "deadline": (f"The queue for this request's class would not let it finish within its deadline "
                     f"(estimated wait {verdict.wait_ms / 1000:.1f} s); {after}, or send a longer deadline_s "
                     "or a smaller max_tokens."),
        "batch_paused": f"The platform is overloaded, so batch submissions are paused; {after}.",
        "platform_tokens": f"The platform is at its token rate limit; {after}.",
        "local_floor_batch": f"Batch submissions are paused while the shared rate limiter is unreachable; {after}.",
        "local_floor_tokens": f"This server is at its emergency token limit; {after}.",
        "local_floor_deadline": (f"A moment ago this request's class could not take more requests within their "
                                 f"deadlines, and the shared limiter cannot be reached to say otherwise; {after}."),
        "tokens_per_minute": (f"Rate limit reached: this request needs {cost} tokens and "
                              f"{verdict.tokens.remaining} of your {limits.tokens_per_minute} tokens per minute "
                              f"are left; {after}." if cost else
                              f"Rate limit reached: none of your {limits.tokens_per_minute} tokens per minute "
                              f"are left; {after}."),
        "requests_per_minute": f"Rate limit reached: {limits.requests_per_minute} requests per minute; {after}.",
        "concurrency": (f"You have {limits.max_concurrent} requests queued or running, your limit; "
                        "retry when one of them finishes."),
    }
    message = messages[verdict.reason]
    if verdict.reason == "deadline" and _alone(verdict, deadline_s):
        # No queue to wait out: the request alone outlasts its deadline (a long prompt's prefill,
        # most often). Saying "retry" would only bring the same refusal; say what would fit.
        run_s = verdict.run_ms / 1000
        message = (f"This request alone would take about {run_s:.1f} s at the engines' speed now, "
                   f"longer than its deadline of {deadline_s:g} s even with nothing queued; send a deadline_s "
                   f"of at least {math.ceil(run_s)} s, a shorter prompt or a smaller max_tokens.")
    if verdict.gate == "global":
        return Overloaded(message, headers=headers, details=details)
    code = "tenant_concurrency_limit" if verdict.reason == "concurrency" else None
    return RateLimited(message, code=code, headers=headers, details=details)


def ratelimit_headers(verdict: Verdict) -> dict[str, str]:
    """The six OpenAI-style headers that client libraries read to pace themselves."""
    headers = {}
    for kind, quota in (("tokens", verdict.tokens), ("requests", verdict.requests)):
        headers[f"x-ratelimit-limit-{kind}"] = str(quota.limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(quota.remaining)
        headers[f"x-ratelimit-reset-{kind}"] = duration(quota.reset_ms)
    return headers


def duration(ms: int) -> str:
    """Milliseconds the way OpenAI writes reset times: ``250ms``, ``1.5s``, ``6m0s``."""
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"
