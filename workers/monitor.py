"""The load monitor: every second, how long each class's queue would make a new request wait.

One monitor is active at a time (a Redis lease); others started beside it stand by and take
over within a lease if it dies. Each tick it reads, without touching Postgres:

* per class (priority × model) the live queue counters (``core/admission/load.py``): requests, tokens
  and work (``max_tokens``) queued, and the cumulative work claimed off the queue;
* the heartbeats of warm workers: which classes each serves, and its engine's step count.

From those it publishes per class, with a short TTL: the drain rate, the speed one running
sequence gets, the price of a prompt token, the room left in the engines and the wait for a slot
while they are full, the estimated wait (in engine time, below, plus that slot wait) and a
degradation level.
Admission judges each request by its own class's level (a batch request also by its model's
realtime level); the platform's level, the highest realtime one, is what the operator sees.

Workers that govern their engines (``workers/governor.py``) report their in-engine limit, the
speed each sequence gets at it, what the limit decodes a second with no prefill in its steps, the
price of a prompt token (all from the step curve learned from every engine step), the prefill
waiting inside the engine and their room. The wait is then in engine time: the queued output at
Σ what the limits decode, plus the queued prompts and the engines' prefill backlog at the price
of a prompt token, shared by the engines. Always fresh, never a memory of an overload: once the
load is gone, the limit and the speeds are those of the engine now. The rest of this note is how
the drain is found for workers that report no limit (an engine that cannot time its steps).

While a class has a backlog, its measured drain is its capacity, and it is remembered with the
number of threads that produced it (for realtime, those of live workers less the ones running
batch work). When the backlog is gone (nothing to measure), a worker stops heartbeating or batch
work takes threads, the capacity is that memory scaled by the threads serving the class now, so
a lost node (or a batch backlog resuming) shows in the estimate at the next tick, not after the
measuring window. Before any backlog was
measured, a class's capacity is its workers' threads times the speed one sequence gets (each
thread keeps one sequence decoding), so the first burst after a start is already promised.

Every ``RECOUNT_S`` the leader re-counts queued work per class from Postgres (a process can die
between a commit and its counter update), and every few seconds it reads the peak reservations
in force, which it carries out (``workers/reservations.py``: shared workers stop reading batch
queues, and leave the batch classes' capacity meanwhile); nothing else here reads the database.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import redis
from celery import Celery
from sqlalchemy import BigInteger, cast, func, select

from core.admission.load import (
    CAPACITY_PREFIX,
    COUNTERS_PREFIX,
    PRIOR_SHARE,
    ROOM_PREFIX,
    ClassLoad,
    LoadLevel,
    class_name,
    counters_key,
    decode_drain,
    tier_place,
    write_level,
)
from core.broker.fair import Excess, FairQueues, line_excess, sync_reservations
from core.fleet.lease import Lease, run_leading
from core.fleet.workers import live_workers
from core.settings import Settings
from models import InferenceRequest, Priority, ServiceTier, Status
from models.session import Database
from workers.reservations import BatchPause

log = logging.getLogger(__name__)

LEADER_KEY = "sluice:monitor:leader"
TICK_S = 1.0
WINDOW_S = 10.0  # drain is measured over this much history ...
MEASURE_MIN_S = 2.0  # ... once a backlog has lasted this long
# What a job's estimate reads as the class's busy drain (``busy_tps``) comes from this much
# backlog at least: in a 2 s one the few requests claimed swing the figure (threads holding long
# documents claimed a tenth of the drain, and a 27-document job was told 8 minutes) ...
BUSY_MIN_S = 5.0
# ... counted from this long after the backlog began: its first seconds claim what the engines had
# room for at once (64 documents in a second, where the class then drained ~5 a second), a burst
# that read as a drain twice the real one on the simulated engine.
FILL_S = 2.0
# ... and faded over this much busy time: one 5 s stretch of documents that take seconds each
# swung by ±20% from one job's submit to the next, and every estimate with it.
BUSY_TAU_S = 30.0
RECOUNT_S = 30.0
RESERVATIONS_S = 5.0  # how often the tenants' reserved shares are copied to Redis (core/broker/fair.py)
# Estimated wait ÷ the class's deadline at which each level (1..6) is entered; a level is left
# only after the ratio stayed below DOWN_FACTOR × its threshold for HOLD_S. Shedding waits for
# twice the deadline: below that the promise at arrival already refuses each request that cannot
# finish in time and admits those that can (with a margin from level 5 on).
UP_THRESHOLDS = (0.25, 0.4, 0.55, 0.7, 0.85, 2.0)
DOWN_FACTOR = 0.6
HOLD_S = 10.0

@dataclass
class LevelPolicy:
    """Levels rise at once on the wait/deadline ratio and fall one step at a time, each only
    after the ratio stayed below the lower threshold for ``hold_s`` (hysteresis)."""

    up: tuple[float, ...] = UP_THRESHOLDS
    down_factor: float = DOWN_FACTOR
    hold_s: float = HOLD_S
    level: int = 0
    _calm_since: float | None = None

    def step(self, ratio: float, now: float) -> int:
        target = sum(1 for threshold in self.up if ratio >= threshold)
        if target >= self.level:
            self.level, self._calm_since = target, None
            return self.level
        if ratio >= self.up[self.level - 1] * self.down_factor:
            self._calm_since = None  # not calm enough to step down
        elif self._calm_since is None:
            self._calm_since = now
        elif now - self._calm_since >= self.hold_s:
            self.level -= 1
            self._calm_since = now  # the next step down waits a full hold again
        return self.level


class _Sample(NamedTuple):
    """One tick's counters of a class."""

    t: float
    claimed: int  # claimed_work so far
    queued: int  # queued_work now
    threads: int
    ahead: int  # ahead_claimed_work so far
    prompt: int = 0  # claimed_prompt so far
    squares: int = 0  # claimed_prompt_sq so far
    ahead_prompt: int = 0
    ahead_squares: int = 0


def _for_threads(tps: float, measured_by: int, threads: int) -> float:
    """A drain measured by ``measured_by`` threads, for the ``threads`` serving the class now (a
    dead worker's leave it at once); 0 where nothing was measured."""
    return tps * min(1.0, threads / measured_by) if measured_by else 0.0


@dataclass
class _ClassState:
    samples: deque = field(default_factory=deque)  # of _Sample, over WINDOW_S
    capacity_tps: float = 0.0  # drain measured while backlogged ...
    capacity_threads: int = 0  # ... by this many threads (of live workers, less those batch held)
    busy_tps: float = 0.0  # busy_work ÷ busy_time, once BUSY_MIN_S were counted (what a job's estimate reads)
    busy_threads: int = 0
    busy_work: float = 0.0  # work claimed in backlogs past their fill, fading over BUSY_TAU_S ...
    busy_time: float = 0.0  # ... and the seconds they lasted, faded alike
    seq_tps: float = 0.0
    policy: LevelPolicy = field(default_factory=LevelPolicy)
    fair_policy: LevelPolicy = field(default_factory=LevelPolicy)  # the level of the fair wait


@dataclass(frozen=True)
class Engines:
    """What the governed engines serving one class report (``workers/governor.py``)."""

    drain_tps: float  # Σ output tokens a second their limits decode, prefill priced apart
    seq_tps: float  # the speed a sequence gets at the limit, median over the workers
    room: int  # Σ sequences their engines would take in now
    slot_wait_s: float  # the shortest wait for a slot among the full ones
    prefill_s_tok: float = 0.0  # engine seconds a prompt token costs, median over the workers
    prefill_s_tok2: float = 0.0  # and per prompt token squared (its attention), median over them
    count: int = 0  # how many engines share the prefill ahead
    backlog_s: float = 0.0  # Σ engine seconds of prefill waiting inside them
    # The slowest limit line among them (a step: step_base_s + step_seq_s × sequences) and the
    # share of its deadline a priority request decodes in: what the priority tier is promised at.
    step_base_s: float = 0.0
    step_seq_s: float = 0.0
    priority_safety: float = 0.0


def engines(serving: list[dict], priority: str = "realtime") -> Engines | None:
    """The governed view of ``serving`` workers for a class of ``priority``; None unless every one
    reports its limit. A realtime request goes into an engine before the batch prompts waiting
    there: only the prefill ahead of it counts."""
    if not serving or not all(w.get("limit_seq_tps") for w in serving):
        return None
    full = [w.get("slot_wait_s", 0.0) for w in serving if w.get("room", 0) <= 0]
    return Engines(drain_tps=sum(decode_drain(w, priority == Priority.BATCH.value) for w in serving),
                   seq_tps=statistics.median(w["limit_seq_tps"] for w in serving),
                   room=sum(max(0, w.get("room", 0)) for w in serving),
                   slot_wait_s=min(full) if len(full) == len(serving) else 0.0,
                   prefill_s_tok=statistics.median(w.get("prefill_s_tok") or 0.0 for w in serving),
                   prefill_s_tok2=statistics.median(w.get("prefill_s_tok2") or 0.0 for w in serving),
                   count=len(serving), backlog_s=sum(w.get("backlog_s" if priority == Priority.BATCH.value
                                                            else "realtime_backlog_s") or 0.0 for w in serving),
                   step_base_s=max(w.get("step_base_s") or 0.0 for w in serving),
                   step_seq_s=max(w.get("step_seq_s") or 0.0 for w in serving),
                   priority_safety=min(w.get("priority_safety") or 0.0 for w in serving))


# Loud tenants named per class in the published levels; past it every tenant of the class is
# judged on the class's whole wait (the fair level is not published).
MAX_LOUD = 1000


def levels(loads: list[ClassLoad], lines: dict[str, Excess]) -> dict[str, int]:
    """What the monitor publishes (``write_level``'s ``classes``): each class's level on its whole
    wait; where some tenants queued past their turns in its fair lines, also its level on the fair
    wait (``<class>:fair``) and those tenants (``<class>|<tenant>``), who alone are judged on the
    whole (``core/admission/load.py class_level``, ``admit.lua``)."""
    out: dict[str, int] = {}
    for load in loads:
        name = class_name(load.priority, load.model)
        out[name] = load.level
        loud = lines[name].loud if name in lines else frozenset()
        if loud and len(loud) <= MAX_LOUD and load.fair_level < load.level:
            out[name + ":fair"] = load.fair_level
            out.update((f"{name}|{tenant}", 1) for tenant in loud)
    return out


def with_realtime_share(loads: list[ClassLoad]) -> list[ClassLoad]:
    """``loads`` with each batch class's ``realtime_share``: the part of its model's engines the
    realtime class claimed over the window (``claimed_share``: its output at its drain and its
    prompts at the prefill prices). Batch work, flex included, runs in what that leaves, so its
    promise and a job's estimate count only the rest."""
    realtime = {c.model: c for c in loads if c.priority == Priority.REALTIME.value}
    out = []
    for load in loads:
        rt = realtime.get(load.model)
        if load.priority == Priority.BATCH.value and rt is not None and rt.drain_tps > 0:
            load = dataclasses.replace(load, realtime_share=rt.claimed_share)
        out.append(load)
    return out


class Monitor:
    def __init__(self, settings: Settings, client: redis.Redis, db: Database,
                 clock=time.monotonic, policy: LevelPolicy | None = None, broker: Celery | None = None,
                 fair: FairQueues | None = None) -> None:
        self.settings = settings
        # The floor under the fair lines (core/broker/fair.py): each tick tops up every class
        # queue from its line, should no publisher or worker have done it.
        self.fair = fair if broker is not None else None
        self.broker = broker
        # Peak reservations are carried out by the leader (workers/reservations.py); without a
        # broker to send remote-control commands through, they are not.
        self.pause = BatchPause(client, db, broker, clock) if broker is not None else None
        self.redis = client
        self.db = db
        self.clock = clock
        self.policy = policy or LevelPolicy()
        self.lease = Lease(client, LEADER_KEY, 3 * TICK_S)
        self._classes: dict[str, _ClassState] = {}
        self._steps: dict[str, tuple[float, int]] = {}  # worker → (t, engine steps)
        self._last_recount = float("-inf")
        self._last_reservations = float("-inf")

    # ------------------------------------------------------------------ one tick

    def tick(self) -> list[ClassLoad]:
        now = self.clock()
        workers = self._live_workers()
        self._drop_dead_rooms({w["worker"] for w in workers})
        paused = self.pause.apply(workers) if self.pause is not None else set()
        seq_by_model = self._sequence_speeds(workers, now)
        seconds, micros = self.redis.time()
        stamp = seconds * 1000 + micros // 1000  # the Redis clock, which admission compares it with
        loads = []
        lines = line_excess(self.redis, self.settings.registry.default.name) if self.settings.fair_depth > 0 else {}
        for name, counters in self._counters(workers).items():
            priority, model = name.split(":", 1)
            if name in lines:  # a reserved tenant inside its reservation is not loud
                lines[name] = lines[name].within(self._deadline(priority, counters))
            serving = [w for w in workers if w.get("model") == model
                       and any(q.startswith(priority + ".") for q in w.get("queues", ()))
                       and not (priority == Priority.BATCH.value and w["worker"] in paused)]
            threads = sum(w.get("threads", 0) for w in serving)
            if priority == Priority.REALTIME.value:  # threads busy with batch work serve no realtime
                threads -= sum(w.get("batch_in_flight", 0) for w in serving)
            loads.append(self._class_load(priority, model, counters, len(serving), max(0, threads),
                                          seq_by_model.get(model), now, stamp, engines(serving, priority),
                                          lines.get(name)))
        loads = with_realtime_share(loads)
        level = max((load.level for load in loads if load.priority == Priority.REALTIME.value), default=0)
        write_level(self.redis, LoadLevel(level), ttl_s=3 * TICK_S, classes=levels(loads, lines), snapshots=loads)
        return loads

    def _live_workers(self) -> list[dict]:
        return live_workers(self.redis, self.settings.worker_heartbeat_s)

    def _drop_dead_rooms(self, live: set[str]) -> None:
        """The room and capacity a worker wrote for admission leave with it: a killed one never
        cleans up (admission also skips capacity entries older than a heartbeat allows)."""
        keys = [*self.redis.scan_iter(match=ROOM_PREFIX + "*", count=200),
                *self.redis.scan_iter(match=CAPACITY_PREFIX + "*", count=200)]
        with self.redis.pipeline(transaction=False) as pipe:  # one round trip for every class
            for key in keys:
                pipe.hkeys(key)
            fields = pipe.execute()
        with self.redis.pipeline(transaction=False) as pipe:
            for key, workers in zip(keys, fields, strict=True):
                dead = [w for w in workers if w not in live]
                if dead:
                    pipe.hdel(key, *dead)
            pipe.execute()

    def _sequence_speeds(self, workers: list[dict], now: float) -> dict[str, float]:
        """The speed one sequence gets, per model (median over its workers): each worker's own
        measure of its finished runs, warm-up included, so a fresh worker already has one; else
        engine steps per second while busy (one token per running sequence per step), measured
        between two of its heartbeats on the times they were sent (beats come less often than ticks).
        """
        speeds: dict[str, list[float]] = {}
        for w in workers:
            if w.get("seq_tps"):  # the worker's own measure of finished runs (warm-up included)
                speeds.setdefault(w.get("model", "?"), []).append(w["seq_tps"])
                continue
            sent, steps = now - w.get("heartbeat_age_s", 0.0), w.get("steps", 0)
            previous = self._steps.get(w["worker"])
            if previous is not None and sent - previous[0] < 0.5 * self.settings.worker_heartbeat_s:
                continue  # the same heartbeat as last tick
            self._steps[w["worker"]] = (sent, steps)
            if previous and w.get("running", 0) > 0 and steps > previous[1]:
                speeds.setdefault(w.get("model", "?"), []).append((steps - previous[1]) / (sent - previous[0]))
        return {model: statistics.median(values) for model, values in speeds.items()}

    def _counters(self, workers: list[dict]) -> dict[str, dict[str, int]]:
        names = {key.removeprefix(COUNTERS_PREFIX) for key in self.redis.scan_iter(match=COUNTERS_PREFIX + "*",
                                                                                     count=200)}
        for w in workers:  # a class with workers but no traffic yet still has a (zero) snapshot
            for queue in w.get("queues", ()):
                head = queue.split(".", 1)[0]
                if head in (Priority.REALTIME.value, Priority.BATCH.value):
                    names.add(class_name(head, w.get("model", "?")))
        ordered = sorted(names)
        with self.redis.pipeline(transaction=False) as pipe:  # one round trip for every class
            for name in ordered:
                pipe.hgetall(counters_key(*name.split(":", 1)))
            hashes = pipe.execute()
        return {name: {k: int(v) for k, v in raw.items()} for name, raw in zip(ordered, hashes, strict=True)}

    def _deadline(self, priority: str, counters: dict[str, int]) -> float:
        """What a class's wait is judged against: the deadlines its queued requests carry (users
        who state a 5 s patience degrade the class sooner than the 30 s default would), never a
        longer one than the default."""
        deadline = (self.settings.realtime_deadline_s if priority == Priority.REALTIME.value
                    else self.settings.batch_deadline_s)
        requests = counters.get("queued_requests", 0)
        if requests > 0 and counters.get("queued_deadline_ms", 0) > 0:
            deadline = min(deadline, counters["queued_deadline_ms"] / requests / 1000)
        return deadline

    def _class_load(self, priority: str, model: str, counters: dict[str, int], workers: int,
                    threads: int, seq_tps: float | None, now: float, stamp: int,
                    engine: Engines | None = None, lines: Excess | None = None) -> ClassLoad:
        # Each class keeps its own level: a fresh copy of the configured policy.
        state = self._classes.setdefault(class_name(priority, model),
                                         _ClassState(policy=dataclasses.replace(self.policy)))
        queued = max(0, counters.get("queued_work", 0))
        state.samples.append(_Sample(now, counters.get("claimed_work", 0), queued, threads,
                                     counters.get("ahead_claimed_work", 0), counters.get("claimed_prompt", 0),
                                     counters.get("claimed_prompt_sq", 0), counters.get("ahead_claimed_prompt", 0),
                                     counters.get("ahead_claimed_prompt_sq", 0)))
        while state.samples and now - state.samples[0][0] > WINDOW_S:
            state.samples.popleft()
        if seq_tps:
            state.seq_tps = seq_tps
        # A measurement is the capacity of `threads` only over samples in which the queue never ran
        # dry and the same threads served it: the latest such run, once it spans MEASURE_MIN_S
        # (a backlog that just began is measured within seconds, not after a whole window).
        backlog = 0
        for sample in reversed(state.samples):
            if sample.queued <= 0 or sample.threads != threads:
                break
            backlog += 1
        if backlog > 1:
            t0, claimed0 = state.samples[-backlog].t, state.samples[-backlog].claimed
            if now - t0 >= MEASURE_MIN_S:
                measured = (counters.get("claimed_work", 0) - claimed0) / (now - t0)
                if measured > 0:
                    state.capacity_tps, state.capacity_threads = measured, threads
            # The estimate's: each tick of a backlog from FILL_S after it was seen to begin (one
            # older than the window began before it), in a fading sum (BUSY_TAU_S of busy time),
            # once BUSY_MIN_S of it were counted.
            last = state.samples[-2]
            if backlog == len(state.samples) or last.t - t0 >= FILL_S:
                if threads != state.busy_threads:  # a measurement is of the threads that took it
                    state.busy_work = state.busy_time = 0.0
                    state.busy_threads = threads
                step = now - last.t
                fade = math.exp(-step / BUSY_TAU_S)
                state.busy_work = state.busy_work * fade + max(0, counters.get("claimed_work", 0) - last.claimed)
                state.busy_time = state.busy_time * fade + step
                if state.busy_time >= BUSY_MIN_S:
                    state.busy_tps = state.busy_work / state.busy_time
        # Remembered capacity scales with the threads serving the class now: a dead worker's, or
        # (for realtime) those batch work holds, leave it at once.
        drain = 0.0
        if engine is not None:
            # Governed workers say what their engines give at their limits: the drain and the speed
            # a sequence gets there, learned from every step (batch yields to realtime, so a
            # realtime class gets the whole limit).
            drain, state.seq_tps = engine.drain_tps, engine.seq_tps
        elif state.capacity_threads and workers:
            drain = _for_threads(state.capacity_tps, state.capacity_threads, threads)
        elif workers and state.seq_tps:
            # Nothing measured yet: every thread decoding one sequence, at the speed one sequence
            # got at the batch sizes seen so far (often small), discounted for a full batch.
            drain = threads * state.seq_tps * PRIOR_SHARE
        prompts = max(0, counters.get("queued_prompt", 0))
        squares = max(0, counters.get("queued_prompt_sq", 0))
        # In engine time: the queued output at what the limits decode, the queued prompts (P
        # tokens each at P × prefill_s_tok + P² × prefill_s_tok2) and the prefill already waiting
        # in the engines, shared by them.
        prefill_s = 0.0
        if engine is not None and engine.prefill_s_tok > 0:
            prefill_s = (prompts * engine.prefill_s_tok + squares * engine.prefill_s_tok2
                         + engine.backlog_s) / max(1, engine.count)
        if queued == 0:
            wait = prefill_s
        elif drain > 0:
            wait = queued / drain + prefill_s
        else:
            wait = -1.0 if workers else float("inf")  # unknown yet; or nobody serves this class at all
        if engine is not None and engine.room == 0 and wait >= 0:
            wait += engine.slot_wait_s  # full engines: a request also waits for a slot
        deadline = self._deadline(priority, counters)
        requests = counters.get("queued_requests", 0)
        def ratio(w: float) -> float:
            return max(0.0, w) / deadline if w != float("inf") else float("inf")

        level = state.policy.step(ratio(wait), now)
        # The wait of a tenant whose next request is one turn away in the fair lines: the class's,
        # less what tenants queued past their turns (core/broker/fair.py line_excess). A flooder's
        # excess waits behind everyone else's next request, so it raises only its own level.
        fair_wait = max(0.0, wait - lines.seconds) if lines is not None and wait > 0 else wait
        fair_level = state.fair_policy.step(ratio(fair_wait), now)
        first, last = state.samples[0], state.samples[-1]
        span = now - first.t
        claimed_tps = (last.claimed - first.claimed) / span if span > 0 else 0.0
        ahead_tps = (last.ahead - first.ahead) / span if span > 0 else 0.0
        price, price2 = (engine.prefill_s_tok, engine.prefill_s_tok2) if engine is not None else (0.0, 0.0)
        count = engine.count if engine is not None else 1

        def share(work_tps: float, prompts: int, squares: int) -> float:
            """The engines' time (0 to 1) work claimed at ``work_tps``, with ``prompts`` and
            ``squares`` of prompt over the window, takes: output at the drain, prompts at the
            prefill prices shared by the engines."""
            if span <= 0 or drain <= 0:
                return 0.0
            return min(1.0, max(0.0, work_tps / drain + (prompts * price + squares * price2) / max(1, count) / span))

        claimed_share = share(claimed_tps, last.prompt - first.prompt, last.squares - first.squares)
        ahead_share = share(ahead_tps, last.ahead_prompt - first.ahead_prompt, last.ahead_squares - first.ahead_squares)
        return ClassLoad(priority, model, max(0, counters.get("queued_tokens", 0)),
                         max(0, requests), queued, round(drain, 1), round(state.seq_tps, 2),
                         round(wait, 3) if wait != float("inf") else -1.0, level, workers, stamp, round(deadline, 3),
                         engine.room if engine is not None else -1,
                         round(engine.slot_wait_s, 3) if engine is not None else 0.0,
                         prompts, round(engine.prefill_s_tok, 7) if engine is not None else 0.0,
                         engine.count if engine is not None else 0,
                         round(engine.backlog_s, 3) if engine is not None else 0.0,
                         queued_prompt_sq=squares,
                         prefill_s_tok2=engine.prefill_s_tok2 if engine is not None else 0.0,
                         step_base_s=engine.step_base_s if engine is not None else 0.0,
                         step_seq_s=engine.step_seq_s if engine is not None else 0.0,
                         priority_safety=engine.priority_safety if engine is not None else 0.0,
                         claimed_tps=round(max(0.0, claimed_tps), 2), ahead_tps=round(max(0.0, ahead_tps), 2),
                         claimed_share=round(claimed_share, 3), ahead_share=round(ahead_share, 3),
                         busy_tps=round(_for_threads(state.busy_tps, state.busy_threads, threads), 2),
                         fair_wait_s=round(fair_wait, 3) if fair_wait != float("inf") else -1.0, fair_level=fair_level)

    # ------------------------------------------------------------------ leading and re-counting

    def lead(self) -> bool:
        """Take or keep the lease; False while another monitor holds it."""
        return self.lease.hold()

    def recount(self) -> None:
        """Set every class's queued counters to what Postgres says is queued."""
        t = InferenceRequest
        model = func.coalesce(t.model_routed, t.model_requested)
        ahead = t.service_tier.in_([tier for tier in ServiceTier if tier_place(tier) == "ahead"])
        work, prompt = t.reserved_tokens - t.input_tokens, t.input_tokens
        square = cast(t.input_tokens, BigInteger) * t.input_tokens
        sums = [func.coalesce(func.sum(column), 0) for column in (t.reserved_tokens, work, prompt, square)]
        sums += [func.coalesce(func.sum(column).filter(ahead), 0) for column in (work, prompt, square)]
        with self.db.session() as session:
            rows = session.execute(
                select(t.priority, model, func.count(), *sums,
                       func.coalesce(func.sum(func.extract("epoch", t.deadline_at - t.created_at)), 0))
                .where(t.status == Status.QUEUED, t.follows_id.is_(None)).group_by(t.priority, model)).all()
        names = ("queued_requests", "queued_tokens", "queued_work", "queued_prompt", "queued_prompt_sq",
                 "ahead_queued_work", "ahead_queued_prompt", "ahead_queued_prompt_sq")
        queued = {counters_key(p, m): {**{name: int(v) for name, v in zip(names, values[:-1], strict=True)},
                                       "queued_deadline_ms": int(float(values[-1]) * 1000)}
                  for p, m, *values in rows}
        with self.redis.pipeline(transaction=False) as pipe:
            for key in set(self.redis.scan_iter(match=COUNTERS_PREFIX + "*", count=200)) | set(queued):
                pipe.hset(key, mapping=queued.get(key) or dict.fromkeys((*names, "queued_deadline_ms"), 0))
            pipe.execute()

    def run(self, stop: threading.Event) -> None:
        """Tick every second while leading; stand by otherwise. Survives Redis and Postgres outages
        (a stale snapshot only sends admission to its local rules)."""
        run_leading("load monitor", self.lease, self._round, TICK_S, stop, self.clock)

    def _round(self) -> None:
        if self.clock() - self._last_recount >= RECOUNT_S:
            self.recount()
            self._last_recount = self.clock()
        if self.clock() - self._last_reservations >= RESERVATIONS_S:
            sync_reservations(self.db, self.redis)
            self._last_reservations = self.clock()
        self.tick()
        if self.fair is not None and self.fair.depth > 0:
            self.fair.publish(self.broker, self.fair.take_all())
