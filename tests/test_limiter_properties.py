"""The limiter's arithmetic, against the real Lua scripts in a real Redis.

Time is driven explicitly (``now_ms``) so that properties are exact: the script runs the same
float operations as the in-process bucket of the local floor, so the two must agree bit for bit,
and neither may ever admit more tokens than a full bucket plus what refilled meanwhile.
"""

from __future__ import annotations

import math
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis as redis_lib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.admission.gates import duration
from core.admission.limiter import SharedLimiter, unused_tokens
from core.admission.local_floor import LocalFloor, RedisBreaker, TokenBucket
from core.rediskeys import PLATFORM_BUCKET_KEY
from core.tenants.tiers import Limits

T0 = 1_800_000_000_000  # ms; any fixed origin will do
NO_CAP = 10**6


@pytest.fixture(scope="module")
def limiter(admission_redis_url):
    client = redis_lib.Redis.from_url(admission_redis_url, decode_responses=True)
    yield SharedLimiter(client)
    client.close()


def fresh_tenant() -> str:
    return str(uuid.uuid4())


class Model:
    """The reference: what admit.lua / release.lua must do, written with the floor's TokenBucket."""

    def __init__(self, limits: Limits, now: int) -> None:
        self.limits = limits
        self.tokens = TokenBucket(limits.tokens_per_minute, now)
        self.requests = TokenBucket(limits.requests_per_minute, now)
        self.in_flight: set[str] = set()

    def admit(self, request_id: str, cost: int, now: int) -> tuple[str, int]:
        need = min(cost, self.tokens.cap)
        if self.tokens.level_at(now)[0] < need:
            return "tokens_per_minute", self.tokens.wait_ms(need, now)
        if self.requests.level_at(now)[0] < 1:
            return "requests_per_minute", self.requests.wait_ms(1, now)
        if len(self.in_flight) >= self.limits.max_concurrent:
            return "concurrency", 0
        if cost > self.limits.max_request_tokens:
            return "too_large", 0
        self.tokens.take(cost, now)
        self.requests.take(1, now)
        self.in_flight.add(request_id)
        return "", 0

    def release(self, request_id: str, refund: int, now: int) -> bool:
        if request_id not in self.in_flight:
            return False
        self.in_flight.remove(request_id)
        if refund:
            self.tokens.give(refund, now)
        return True


limits_st = st.builds(Limits, tokens_per_minute=st.integers(1, 5000), requests_per_minute=st.integers(1, 40),
                      max_concurrent=st.integers(1, 8), max_request_tokens=st.integers(1, 6000))
ops_st = st.lists(st.tuples(st.sampled_from(["admit", "admit", "release"]), st.integers(0, 30_000),
                            st.integers(1, 6000), st.integers(-200, 6000), st.integers(0, 50)),
                  min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limits=limits_st, ops=ops_st)
def test_script_and_in_process_bucket_agree_exactly(limiter, limits, ops):
    tenant, now = fresh_tenant(), T0
    model, admitted = Model(limits, now), []
    for kind, dt, cost, refund, pick in ops:
        now += dt
        if kind == "admit":
            request_id = str(uuid.uuid4())
            verdict = limiter.admit(request_id, tenant, limits, cost, "realtime",
                                    too_large=cost > limits.max_request_tokens, now_ms=now)
            reason, retry = model.admit(request_id, cost, now)
            assert (verdict.reason, verdict.retry_after_ms) == (reason, retry)
            if verdict.admitted:
                admitted.append(request_id)
        elif admitted:
            request_id = admitted[pick % len(admitted)]
            assert limiter.release(request_id, tenant, refund, now_ms=now) == model.release(request_id, refund, now)
        peek = limiter.peek(tenant, limits, now_ms=now)
        assert peek.tokens == model.tokens.quota(now)
        assert peek.requests == model.requests.quota(now)
        assert sorted(limiter.in_flight(tenant)) == sorted(model.in_flight)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tpm=st.integers(1, 5000), steps=st.lists(st.tuples(st.integers(0, 20_000), st.integers(1, 6000)),
                                                 min_size=1, max_size=60))
def test_never_more_than_a_full_bucket_plus_refill_in_any_window(limiter, tpm, steps):
    """Tokens admitted during [a, b] ≤ tpm + (b - a)·tpm/60 s, for every window, costs of any size."""
    limits = Limits(tpm, NO_CAP, NO_CAP, tpm)
    tenant, now, log = fresh_tenant(), T0, []
    for dt, cost in steps:
        now += dt
        verdict = limiter.admit(str(uuid.uuid4()), tenant, limits, cost, "batch", too_large=cost > tpm, now_ms=now)
        if verdict.admitted:
            log.append((now, cost))
        assert 0 <= verdict.tokens.remaining <= tpm
    for i, (start, _) in enumerate(log):
        total = 0
        for end, cost in log[i:]:
            total += cost
            assert total <= tpm + (end - start) * tpm / 60000 + 1e-6


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limits=limits_st, first=st.integers(1, 6000), second=st.integers(1, 6000), dt=st.integers(0, 5000))
def test_a_rejection_charges_nothing(limiter, limits, first, second, dt):
    tenant = fresh_tenant()
    limiter.admit(str(uuid.uuid4()), tenant, limits, first, "realtime", too_large=first > limits.max_request_tokens,
                  now_ms=T0)
    before = limiter.peek(tenant, limits, now_ms=T0 + dt)
    in_flight = limiter.in_flight(tenant)
    verdict = limiter.admit(str(uuid.uuid4()), tenant, limits, second, "realtime",
                            too_large=second > limits.max_request_tokens, now_ms=T0 + dt)
    if not verdict.admitted:
        assert limiter.peek(tenant, limits, now_ms=T0 + dt) == before
        assert limiter.in_flight(tenant) == in_flight


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tpm=st.integers(100, 100_000), cost=st.integers(1, 100), used=st.integers(0, 100), dt=st.integers(0, 9000))
def test_release_refunds_unused_tokens_once_and_never_beyond_a_full_bucket(limiter, tpm, cost, used, dt):
    limits, tenant, request_id = Limits(tpm, NO_CAP, NO_CAP, tpm), fresh_tenant(), str(uuid.uuid4())
    assert limiter.admit(request_id, tenant, limits, cost, "realtime", now_ms=T0).admitted
    refund = unused_tokens(cost, 0, min(used, cost), started=True)
    assert limiter.release(request_id, tenant, refund, now_ms=T0 + dt)
    after = limiter.peek(tenant, limits, now_ms=T0 + dt).tokens.remaining
    expected = min(tpm, tpm - cost + dt * tpm / 60000 + refund)
    assert after == math.floor(expected)
    assert not limiter.release(request_id, tenant, refund, now_ms=T0 + dt), "released twice"
    assert limiter.peek(tenant, limits, now_ms=T0 + dt).tokens.remaining == after
    assert limiter.in_flight(tenant) == []


def test_unused_tokens_of_requests_that_never_ran_is_the_whole_reservation():
    assert unused_tokens(300, 40, None, started=False) == 300
    assert unused_tokens(300, 40, 10, started=True) == 250
    assert unused_tokens(300, 320, 10, started=True) == -30  # the engine counted more input


def test_parallel_admissions_at_one_instant_admit_exactly_the_budget(limiter):
    """64 threads race for one bucket; with the clock fixed no refill can blur the count."""
    limits, tenant, cost = Limits(10_000, NO_CAP, NO_CAP, 10_000), fresh_tenant(), 300
    with ThreadPoolExecutor(16) as pool:
        verdicts = list(pool.map(lambda _: limiter.admit(str(uuid.uuid4()), tenant, limits, cost, "realtime",
                                                         now_ms=T0), range(64)))
    assert sum(v.admitted for v in verdicts) == 10_000 // cost
    assert {v.reason for v in verdicts if not v.admitted} == {"tokens_per_minute"}


def test_parallel_admissions_never_exceed_the_concurrency_cap(limiter):
    limits, tenant = Limits(NO_CAP, NO_CAP, 5, NO_CAP), fresh_tenant()
    with ThreadPoolExecutor(16) as pool:
        verdicts = list(pool.map(lambda _: limiter.admit(str(uuid.uuid4()), tenant, limits, 1, "realtime"),
                                 range(50)))
    assert sum(v.admitted for v in verdicts) == 5
    assert len(limiter.in_flight(tenant)) == 5


def test_platform_bucket_is_shared_by_every_tenant(limiter):
    client = limiter.redis
    client.delete(PLATFORM_BUCKET_KEY)
    try:
        platform = SharedLimiter(client, platform_tokens_per_minute=1000)
        limits = Limits(NO_CAP, NO_CAP, NO_CAP, NO_CAP)
        assert platform.admit("a", fresh_tenant(), limits, 600, "realtime", now_ms=T0).admitted
        verdict = platform.admit("b", fresh_tenant(), limits, 600, "realtime", now_ms=T0 + 1000)
        assert (verdict.gate, verdict.reason) == ("global", "platform_tokens")
        # 200 tokens short at 1000/min: 12 s from the first admission, 11 s from this one.
        assert verdict.retry_after_ms == 11_000
    finally:
        client.delete(PLATFORM_BUCKET_KEY)


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(1, 10**6), ops=st.lists(st.tuples(st.integers(0, 10**5), st.integers(-(10**6), 10**6)),
                                               max_size=30))
def test_in_process_bucket_stays_within_its_cap_and_its_waits_suffice(cap, ops):
    bucket, now = TokenBucket(cap, 0), 0
    for dt, amount in ops:
        now += dt
        if amount >= 0:
            bucket.give(amount, now)
        else:
            need = min(-amount, cap)
            wait = bucket.wait_ms(need, now)
            assert bucket.level_at(now + wait)[0] >= need  # waiting as told is always enough
            if wait >= 2:  # and not longer than needed (1 ms of float rounding aside)
                assert bucket.level_at(now + wait - 2)[0] < need
            bucket.take(need, now + wait)
            now += wait
        assert bucket.level_at(now)[0] <= cap


def test_local_floor_rules():
    clock = [0.0]
    floor = LocalFloor(tokens_per_minute=1000, clock=lambda: clock[0])
    limits = Limits(tokens_per_minute=600, requests_per_minute=2, max_concurrent=1, max_request_tokens=400)
    assert floor.admit("t", limits, 10, "batch", too_large=False).reason == "local_floor_batch"
    assert floor.admit("t", limits, 400, "realtime", too_large=False).admitted
    assert floor.admit("t", limits, 300, "realtime", too_large=False).reason == "tokens_per_minute"
    assert floor.admit("t", limits, 100, "realtime", too_large=False).admitted  # concurrency is not counted
    assert floor.admit("t", limits, 1, "realtime", too_large=False).reason == "requests_per_minute"
    assert floor.admit("u", limits, 600, "realtime", too_large=False).reason == "local_floor_tokens"
    assert floor.admit("u", limits, 450, "realtime", too_large=True).reason == "too_large"
    clock[0] += 60_000
    assert floor.admit("u", limits, 400, "realtime", too_large=False).admitted


def test_a_class_the_promise_refused_stays_closed_on_the_floor_until_its_retry_after():
    """The class the promise refused is refused on the floor until that refusal's Retry-After
    (never longer than CLOSED_MAX_MS), and only that class."""
    clock = [0.0]
    floor = LocalFloor(tokens_per_minute=10_000, clock=lambda: clock[0])
    limits = Limits(tokens_per_minute=6000, requests_per_minute=100, max_concurrent=10, max_request_tokens=4000)
    floor.close("realtime:m", 2500)
    refused = floor.admit("t", limits, 10, "realtime", too_large=False, klass="realtime:m")
    assert (refused.gate, refused.reason, refused.retry_after_ms) == ("global", "local_floor_deadline", 2500)
    assert floor.admit("t", limits, 10, "realtime", too_large=False, klass="realtime:other").admitted
    floor.close("realtime:m", 1000)  # a shorter horizon later does not reopen it sooner
    clock[0] += 2000
    assert floor.admit("t", limits, 10, "realtime", too_large=False, klass="realtime:m").retry_after_ms == 500
    clock[0] += 500
    assert floor.admit("t", limits, 10, "realtime", too_large=False, klass="realtime:m").admitted
    floor.close("realtime:m", 10**9)
    assert floor.admit("t", limits, 10, "realtime", too_large=False, klass="realtime:m").retry_after_ms == 30_000


def test_breaker_lets_one_probe_through_per_backoff_and_closes_on_success():
    clock = [0.0]
    breaker = RedisBreaker(base_s=1.0, max_s=4.0, clock=lambda: clock[0])
    assert breaker.allow() and breaker.healthy
    breaker.failed()
    breaker.failed()  # a concurrent failure of the same outage does not lengthen the backoff
    assert not breaker.healthy and not breaker.allow()
    clock[0] += 1.3
    assert breaker.allow() and not breaker.allow(), "only one probe at a time"
    breaker.failed()  # the probe failed: the backoff doubles
    clock[0] += 1.3
    assert not breaker.allow()
    clock[0] += 1.3
    assert breaker.allow()
    breaker.succeeded()
    assert breaker.healthy and breaker.allow() and breaker.allow()


@pytest.mark.parametrize("ms, text", [(0, "0ms"), (250, "250ms"), (1000, "1s"), (1500, "1.5s"),
                                      (59_999, "59.999s"), (60_000, "1m0s"), (360_000, "6m0s"), (90_500, "1m30.5s")])
def test_reset_durations_are_written_like_openai(ms, text):
    assert duration(ms) == text
