"""The request service: submit, read and cancel, for a tenant the API already authenticated.

A submit is four steps, each its own method:

    plan     validate against server caps, count tokens, route        → a frozen Plan (core/submit/plan.py),
             then the degradation ladder's steps for the current level (core/submit/ladder.py)
    admit    the three token-priced gates                             → a Ticket, or 429/413/503
    insert   the row (and its idempotency key) in one transaction     → accepted from here on
    publish  the Celery message; if the broker is away the sweep publishes the row later

A retried submit with the same ``Idempotency-Key`` skips all four and answers with the request
the first one created. A request the hot answer cache can answer (``core/submit/answers.py``) is
inserted already succeeded after the plan, charged one request of its tenant's rate, and skips
publish; one whose identical twin is in flight is charged to its tenant like any request, parked
on it (``core/submit/twins.py``) and takes its answer.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session

from core import hooks
from core.admission.gates import Admission, Ticket
from core.broker.fair import FairQueues
from core.broker.queues import BrokerEpoch, publish_committed
from core.broker.republish import Republisher
from core.errors import Conflict, Overloaded
from core.ids import uuid_or_404
from core.observe import submit_metrics as metrics
from core.observe.logs import bind_request
from core.rediskeys import raise_cancel_flag
from core.submit import idempotency
from core.submit.answers import AnswerCache, deterministic
from core.submit.ladder import Ladder
from core.submit.plan import Plan, Planner, input_chars
from core.submit.twins import Twins
from core.tenants.scopes import Caller
from models import InferenceRequest, Priority, ServiceTier, Source, Status, Tenant
from models.lifecycle import Lifecycle, TransitionRefused
from models.session import Database

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accepted:
    row: InferenceRequest
    replayed: bool  # an earlier submit with the same Idempotency-Key created it
    headers: dict[str, str]  # the tenant's x-ratelimit-* after this submit
    estimated_wait_s: float | None = None  # its class's queue wait at admission, when known
    degradation: tuple[str, ...] = ()  # ladder steps that changed it
    cache_hit: bool = False  # answered from the hot cache: already succeeded
    estimated_finish_s: float | None = None  # when its answer is due, as admission predicted it
    unpublished: bool = False  # admitted and committed with publish=False: the caller publishes it


# Inputs longer than this are run past the tenant gate before they are tokenized.
CHEAP_GATE_CHARS = 16_000


class RequestService:
    def __init__(self, db: Database, planner: Planner, ladder: Ladder, admission: Admission, publisher: Celery,
                 epoch: BrokerEpoch, lifecycle: Lifecycle, answers: AnswerCache, twins: Twins,
                 republisher: Republisher, fair: FairQueues | None = None) -> None:
        self.db = db
        self.fair = fair
        self.republisher = republisher
        self.answers = answers
        self.twins = twins
        self.planner = planner
        self.ladder = ladder
        self.admission = admission
        self.publisher = publisher
        self.epoch = epoch
        self.lifecycle = lifecycle

    def prepare(self, tenant: Tenant, body: dict[str, Any], source: Source = Source.API,
                key: uuid.UUID | None = None) -> Plan:
        """The request's plan with the ladder's steps for the current level applied, and whose
        usage it is: ``key`` (default: the key ``tenant`` was authenticated by), ``source``, and
        the prices of the model it will run on. A long input from a tenant over its limits
        whatever the request is refused first: planning tokenizes it, which costs more than the
        one Redis call that tells (short inputs skip the call)."""
        if input_chars(body) > CHEAP_GATE_CHARS:
            self.admission.refuse_over_limits(tenant)
        body, may_downgrade = resolve_auto(body, tenant)
        plan = self.ladder.apply(self.planner.plan(tenant.id, body), model_named="model" in body)
        price = self.admission.settings.price_for(plan.target_model, plan.service_tier)
        plan = dataclasses.replace(plan, api_key_id=key or tenant.via_key, source=source, price=price,
                                   may_downgrade=may_downgrade, default_deadline_s=body.get(
                                       "deadline_s", self.admission.settings.realtime_deadline_s))
        bind_request(str(plan.request_id))
        return plan

    def refuse_early(self, tenant: Tenant, plan: Plan) -> None:
        """Raise the 503 the global gate would answer ``plan`` with, before anything reads Postgres.

        For a tenant authenticated a moment ago (``web/auth.py:RecentKeys``) and a submit without an
        Idempotency-Key (a retry of an accepted request must get its original back, which only
        Postgres knows). A request the hot cache can answer is never refused here: it costs no GPU.
        """
        if plan.may_downgrade or self._cacheable(plan) and self.answers.get(plan.answer_key) is not None:
            return  # (one that may run as default is judged as such if priority is refused)
        self.admission.refuse_early(tenant, plan)

    def submit(self, tenant: Tenant, body: dict[str, Any], key: idempotency.Key | None = None,
               plan: Plan | None = None, source: Source = Source.API, publish: bool = True) -> Accepted:
        """Plan (unless ``prepare`` did), admit, insert, publish; raises the ApiError of the step
        that refused. ``publish=False``: an admitted row is left for the caller to publish (its
        Accepted says ``unpublished``), so that several can be admitted before any runs; the
        sweep publishes one the caller never does."""
        original = idempotency.find(self.db, key) if key else None
        if original is None:
            if "webhook_url" in body:
                hooks.require_secret(tenant)
            plan = plan or self.prepare(tenant, body, source)
            try:
                answered = self.from_cache(plan, tenant, key) or self.follow(plan, tenant, key)
                if answered is not None:
                    return answered
                try:
                    ticket, plan = self._admit(tenant, plan)
                    row = self.insert(plan, ticket, key)
                except BaseException:
                    if self._cacheable(plan):  # it may have become its twins' leader: it no longer is
                        self.twins.forget(plan.answer_key, plan.request_id)
                    raise
            except idempotency.KeyTaken:  # a concurrent submit with this key committed first
                original = idempotency.find(self.db, key)
                if original is None:  # the winner's key expired in between: vanishingly rare
                    raise
            else:
                if publish:
                    self.publish(row)
                return Accepted(row, False, ticket.headers, ticket.estimated_wait_s, plan.degradation,
                                estimated_finish_s=ticket.estimated_finish_s, unpublished=not publish)
        metrics.IDEMPOTENT_REPLAYS.inc()
        bind_request(str(original.id))
        return Accepted(original, True, self.admission.headers(tenant))

    def _admit(self, tenant: Tenant, plan: Plan) -> tuple[Ticket, Plan]:
        """Admit ``plan``; a priority plan that may run as default (``auto``) and that the promise
        refuses is admitted as default instead (the longer default deadline, unless it named its own),
        if that promise holds, named on its row (``default_tier``) and billed at default's prices."""
        try:
            return self.admission.admit(tenant, plan), plan
        except Overloaded as refused:
            if not plan.may_downgrade or (refused.details or {}).get("reason") != "deadline":
                raise
        plan = dataclasses.replace(plan, service_tier=ServiceTier.DEFAULT, may_downgrade=False,
                                   deadline_s=plan.default_deadline_s or plan.deadline_s,
                                   degradation=(*plan.degradation, "default_tier"),
                                   price=self.admission.settings.price_for(plan.target_model, ServiceTier.DEFAULT))
        return self.admission.admit(tenant, plan), plan

    def from_cache(self, plan: Plan, tenant: Tenant, key: idempotency.Key | None) -> Accepted | None:
        """The request answered from the hot cache, or None. A deterministic request is served from
        it whenever its twin was answered; any other only at the cached_answer level. No GPU is
        used, so only the tenant's request rate is charged (a hit still costs a row and a round
        trip): the global gate, tokens and concurrency are not."""
        if not self._cacheable(plan):
            return None
        answer = self.answers.get(plan.answer_key)
        if answer is None:
            return None
        ticket = self.admission.admit(tenant, plan, charge="hit")
        if not deterministic(plan.params):
            plan = dataclasses.replace(plan, degradation=(*plan.degradation, "cached_answer"))
        row = plan.row()
        self.lifecycle.answer(row, answer, also=_claiming(key, row))
        metrics.CACHE_HITS.inc()
        log.info("answered from the hot cache")
        return Accepted(row, False, ticket.headers, None, plan.degradation, cache_hit=True)

    def _cacheable(self, plan: Plan) -> bool:
        return deterministic(plan.params) or self.ladder.answers_samples_from_cache(plan)

    def follow(self, plan: Plan, tenant: Tenant, key: idempotency.Key | None) -> Accepted | None:
        """Park the request on its identical twin in flight (``core/submit/twins.py``), or None when it
        has none and now leads. A parked twin is accepted (its row is committed) but never queued.
        It is charged to its tenant like any request (tokens, the request rate, a concurrency slot:
        it holds a row and runs if its leader ends without an answer; refunded when it takes the
        leader's answer), but passes no global gate: it adds no work to the engines while it waits."""
        if not self._cacheable(plan):
            return None
        leader = self.twins.lead(plan.answer_key, plan.request_id, plan.deadline_s)
        if leader is None:
            return None
        ticket = self.admission.admit(tenant, plan, charge="twin")
        self.twins.park_on(leader, plan.deadline_s)
        row = plan.row()
        row.follows_id = leader
        try:
            self.lifecycle.accept(row, also=_claiming(key, row))
        except BaseException:
            self.admission.cancel(ticket)  # no row was written, so nothing stays reserved
            raise
        log.info("parked on its twin %s, already in flight", leader)
        self.twins.settle(leader)  # the leader may have ended before this row existed
        return Accepted(row, False, ticket.headers, None, plan.degradation)

    def insert(self, plan: Plan, ticket: Ticket, key: idempotency.Key | None) -> InferenceRequest:
        """Commit the row (and claim the idempotency key with it); on failure, undo the admission."""
        row = plan.row()
        try:
            self.lifecycle.accept(row, also=_claiming(key, row))
        except BaseException:
            self.admission.cancel(ticket)  # no row was written, so nothing stays reserved
            raise
        # Committed: from here on the request is accepted and must reach a terminal status.
        log.info("accepted into %s: %d tokens reserved", row.queue, row.reserved_tokens)
        return row

    def publish(self, row: InferenceRequest) -> None:
        """Publish a committed row; one Redis could not take now is published again from this
        process once it can (``core/broker/republish.py``), else by the sweep."""
        if not self.admission.redis_healthy:
            log.warning("Redis unreachable; publishing it once Redis answers")
            self.republisher.add([row])
            return
        try:
            publish_committed(self.lifecycle, self.publisher, [row], self.epoch, fair=self.fair)
        except Exception as exc:
            log.warning("publish failed (%s); publishing it again shortly", type(exc).__name__)
            self.republisher.add([row])

    def get(self, caller: Caller, request_id: str, session: Session | None = None) -> InferenceRequest:
        """A request ``caller`` sees (its key's scope: ``core/tenants/scopes.py``), or 404; read in
        ``session`` when given (the caller's transaction)."""
        visible = caller.sees(InferenceRequest.tenant_id, InferenceRequest.api_key_id, "requests")
        rid = _parse_id(request_id)
        with self.db.joined(session) as read:
            row = read.scalar(select(InferenceRequest).where(InferenceRequest.id == rid, visible))
        if row is None:
            raise caller.missing("request", request_id)
        return row

    def cancel(self, caller: Caller, request_id: str) -> InferenceRequest:
        """Cancel a queued request outright; ask the worker of a running one to abort it. Only one
        ``caller`` sees: a key scoped ``own`` cancels only what it made."""
        caller.reads("requests")
        if caller.own_only:  # another key's request: the 404 a GET of it gets (the key never changes)
            self.get(caller, request_id)
        rid = _parse_id(request_id)
        try:
            row = self.lifecycle.cancel(caller.tenant_id, rid)
        except TransitionRefused as exc:
            raise Conflict(f"Request is already {exc.status.value}; nothing to cancel.",
                           code="not_cancellable") from None
        if row is None:
            raise caller.missing("request", request_id)
        if row.status == Status.RUNNING:
            try:
                raise_cancel_flag(self.admission.redis, str(rid), row.time_limit_s)
            except Exception:
                # The flag on the row is durable; the sweep re-raises it in Redis.
                log.warning("cancel flag not set in Redis; the sweep will retry")
        return row


def resolve_auto(body: dict[str, Any], tenant: Tenant) -> tuple[dict[str, Any], bool]:
    """``body`` with ``service_tier: auto`` made the tenant's auto tier (a batch request's: batch),
    and whether it may run as default when priority is refused (its tenant's auto is priority)."""
    if body.get("service_tier") != "auto":
        return body, False
    if body["priority"] == Priority.BATCH:
        return {**body, "service_tier": ServiceTier.BATCH.value}, False
    tier = tenant.auto_service_tier or ServiceTier.DEFAULT.value
    return {**body, "service_tier": tier}, tier == ServiceTier.PRIORITY


def _claiming(key: idempotency.Key | None, row: InferenceRequest):
    """What the row's insert also does in its transaction: claim the Idempotency-Key, if any."""
    return None if key is None else lambda session: key.claim(session, row.id)


def _parse_id(request_id: str) -> uuid.UUID:
    rid = uuid_or_404(request_id, "request")
    bind_request(str(rid))
    return rid
