"""When a bulk job will finish, worked out at submit from what the engines measure (docs/tiers.md).

A job's lines run in the batch capacity of its model: what realtime work leaves of the engines,
shared between the tenants with jobs by their ``batch_weight`` (``core/jobs/scheduling.py``), a
tenant's own jobs earliest promise first. The estimate follows that:

1. **The job's engine time.** Every request it will make (a document's map-reduce included) is
   priced as the promise prices a request (``admit.lua``): its prompt of P tokens at
   ``prefill_s_tok`` × P + ``prefill_s_tok2`` × P², shared by the engines, and its output at the
   batch class's decode drain. That is how long the job would take with every engine to itself.
2. **The capacity it gets.** The batch class has what the model's realtime class does not use:
   1 − the share of the engines' time the realtime requests claimed over the monitor's window
   (their output at the drain, their prompts at the prefill prices), at least ``MIN_SHARE``. The
   work already queued in the batch class (plain batch requests) is served before.
3. **Its share of that.** A fluid model of the feeder's fair share: every tenant with unfinished
   jobs drains its remaining work at a rate in proportion to its weight, and a tenant that
   finishes leaves its share to the others. Other jobs' remaining work is priced at this job's
   engine seconds per token.
   Where the batch class was measured busy (the work it claimed while it had queued work all
   along, ``busy_tps``, ``workers/monitor.py``), that measurement replaces steps 1 and 2: it
   already counts the prompts, realtime beside them and the Python around the engines. A class
   not yet measured so is priced by steps 1 and 2, the idle model.
4. **The pipeline ahead of it**: what is queued in the batch class (plain batch requests, and
   job requests the feeder put there) and the requests the feeder already put in the engines (its
   bound per worker, ``SLUICE_JOB_INFLIGHT_PER_WORKER``, less the queued ones: on average half
   done) go before any of this job's, whatever its place among the jobs, at the same price per
   token as its own work. On an idle class a job takes at least its requests' own latency, each
   stage of a document's map-reduce after the other (``floor_s``: the prompt at the prefill
   prices and the output at the speed one sequence gets at the engines' limit, ``seq_tps``).
5. **A margin** (``MARGIN``) over that, for what the model leaves out (realtime bursts, requests
   that end before max_tokens go the other way), and the feeder's rounds to start and settle a
   job (four of ``SLUICE_FEEDER_INTERVAL_S``).

6. **Its place in its tenant's line** (:func:`place`). The estimate is a promise: the feeder feeds
   a tenant's jobs earliest promise first (a job without one: its window's end), so a job goes
   ahead of the tenant's jobs promised later only where each of them that is on time still keeps
   its promise with this job's work ahead of it. A later job with a short window overtakes an
   earlier one with a long window as far as the earlier one's promise leaves room; the margin is
   that room. So later jobs never push an accepted job past its promise, and the promise is what
   the job's own work and the work promised before it take.

7. **What finished jobs teach** (:func:`learn`). Each job the feeder completes or expires
   compares what it took with what it was expected to take (its promise without the margin); the
   model's factor moves by the fourth root of that ratio, within ``BOUNDS``, and scales the engine
   time of every later estimate for the model. A bias the model leaves out (the feeder's gaps, the
   stack around the engines, a realtime mix it does not see) is measured away in a few jobs;
   one job's noise moves it little. A job priced by the idle model (no busy stretch measured
   yet) teaches nothing (``Lessons.mark_idle_priced``): the idle model leaves out the Python around the
   engines, which every measured price counts, and its miss (2.5 times, on the simulated engine
   on 2 cores) would make the next measured prices that much too long.

Without the monitor's figures for the model's classes (no warm worker, the monitor away) there is
no estimate: the job is judged by its tenant's limits alone and says ``estimated_finish_at: null``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import redis

from core.admission.load import ClassLoad

MIN_SHARE = 0.05  # of the engines batch work gets however busy realtime is: the feeder always feeds some
MARGIN = 1.1
SAME_DUE_S = 1.0  # a tenant's jobs promised this close together are fed as due together
# A job already expected past its promise may still be overtaken until it is expected this far past
# it, counted on the time left to it (:func:`place`); one past its promise, not at all.
LATE_ROOM = 1.1
# Per model, the factor a job's engine time is scaled by: learned from the jobs that finished
# (:func:`learn`). Each moves it by the GAIN-th power of how far it took from what was expected
# of it, within BOUNDS: one job's noise moves it a little, a lasting bias all the way.
CALIBRATION_PREFIX = "sluice:jobs:calibration:"
UNMEASURED_PREFIX = "sluice:jobs:unmeasured:"  # jobs priced by the idle model: they teach nothing
GAIN = 0.25
BOUNDS = (0.5, 3.0)


@dataclass
class Work:
    """What a job asks of the engines: its requests' prompts (tokens, and Σ tokens² for their
    attention) and the output each may produce."""

    requests: int = 0
    prompt: int = 0
    squares: int = 0
    output: int = 0
    # The longest chain of requests one line makes, one after another (a document's map-reduce
    # stages): (prompt tokens, output tokens) of each.
    chain: tuple[tuple[int, int], ...] = ()

    def add(self, prompt: int, output: int, times: int = 1) -> None:
        self._add(prompt, output, times)
        self._longest(((prompt, output),))

    def document(self, tokens: int, overhead: int, output: int, budget: int) -> None:
        """A document of ``tokens`` summarised in requests of at most ``budget`` input tokens
        (``core/jobs/ingest.py item_tokens``: chunks, then their summaries, until one fits)."""
        stages = []
        while tokens > budget > 0:
            chunks = math.ceil(tokens / budget)
            prompt = math.ceil(tokens / chunks) + overhead
            self._add(prompt, output, chunks)
            stages.append((prompt, output))
            tokens = chunks * output
        self._add(tokens + overhead, output, 1)
        self._longest((*stages, (tokens + overhead, output)))

    def _add(self, prompt: int, output: int, times: int) -> None:
        self.requests += times
        self.prompt += prompt * times
        self.squares += prompt * prompt * times
        self.output += output * times

    def _longest(self, chain: tuple[tuple[int, int], ...]) -> None:
        if (len(chain), sum(sum(r) for r in chain)) > (len(self.chain), sum(sum(r) for r in self.chain)):
            self.chain = chain


@dataclass(frozen=True)
class Tenant:
    """Another tenant's unfinished jobs: their remaining tokens and its weight."""

    tokens: float
    weight: float


def engine_s(work: Work, batch: ClassLoad) -> float | None:
    """Seconds ``work`` takes with every engine of the batch class to itself; None without figures."""
    if batch.drain_tps <= 0:
        return None
    return work.output / batch.drain_tps + _prefill_s(batch, work.prompt, work.squares) / max(1, batch.engines)


def _prefill_s(batch: ClassLoad, prompt: float, squares: float) -> float:
    """Engine seconds prompts of ``prompt`` tokens (Σ P²: ``squares``) take at the prefill prices."""
    return prompt * batch.prefill_s_tok + squares * batch.prefill_s_tok2


def latency_s(work: Work, batch: ClassLoad) -> float:
    """Seconds the longest chain of ``work``'s requests takes on engines with room, one request
    after another: each prompt at the prefill prices, its output at the speed one sequence gets
    at the engines' limit (``seq_tps``); 0 without that speed."""
    if batch.seq_tps <= 0:
        return 0.0
    return sum(_prefill_s(batch, p, p * p) + out / batch.seq_tps for p, out in work.chain)


def batch_share(batch: ClassLoad, realtime: ClassLoad | None = None) -> float:
    """The share of the engines realtime work leaves to batch work: as the monitor states it on
    the batch class (``realtime_share``), else as the realtime class states its own
    (``claimed_share``), else from its claimed work and drain."""
    used = batch.realtime_share
    if not used and realtime is not None and realtime.drain_tps > 0:
        used = realtime.claimed_share or realtime.claimed_tps / realtime.drain_tps
    return max(MIN_SHARE, 1.0 - used)


def fair_finish_s(own_s: float, weight: float, others: dict[object, tuple[float, float]],
                  capacity: float) -> float:
    """When a tenant with ``own_s`` seconds of work (at the whole capacity) and ``weight`` is done,
    beside ``others`` (tenant → (seconds of work, weight)), all sharing ``capacity`` (0..1) in
    proportion to their weights; a tenant that finishes leaves its share to those still working."""
    remaining = {None: own_s, **{t: s for t, (s, _) in others.items() if s > 0}}
    weights = {None: max(weight, 1e-6), **{t: max(w, 1e-6) for t, (_, w) in others.items()}}
    clock = 0.0
    while True:
        total = sum(weights[t] for t in remaining)
        # The next to finish, at the rate each gets now.
        step = min(remaining[t] * total / (weights[t] * capacity) for t in remaining)
        clock += step
        for t in list(remaining):
            remaining[t] -= step * capacity * weights[t] / total
            if remaining[t] <= 1e-9:
                if t is None:
                    return clock
                del remaining[t]


@dataclass(frozen=True)
class Capacity:
    """What one tenant's jobs get of the batch class, worked out once: its work's engine seconds
    per priced token, the share of the engines realtime leaves, the plain batch work queued ahead,
    the tenant's weight beside the other tenants' remaining work, and the feeder's rounds."""

    per_token_s: float
    share: float
    ahead_s: float  # what the queues and engines already hold, before any work not yet fed
    weight: float
    others: dict[object, tuple[float, float]]
    overhead_s: float = 0.0
    floor_s: float = 0.0  # the job's own longest chain of requests, on engines with room
    measured: bool = True  # priced by what the batch class was measured to take (not the idle model)

    def finish_s(self, tokens: float, margin: float = MARGIN, own: bool = True) -> float:
        """Seconds from now until the tenant's first ``tokens`` of work not yet fed (its jobs
        ahead, then this one's) are done: after what is queued in the batch class and half of
        what the feeder put in the engines (on average half done), and (``own``: for the job being
        estimated) never sooner than its own chain of requests takes. With the margin, what is
        promised; with ``margin=1``, what is expected."""
        mine = tokens * self.per_token_s
        expected = self.ahead_s / self.share + fair_finish_s(mine, self.weight, self.others, self.share)
        return margin * max(expected, self.floor_s if own else 0.0) + self.overhead_s


def capacity(work: Work, batch: ClassLoad | None, realtime: ClassLoad | None, *, tokens: int, weight: float,
             others: list[Tenant], overhead_s: float = 0.0, calibration: float = 1.0,
             in_flight: float = 0.0, in_flight_requests: int = 0) -> Capacity | None:
    """The :class:`Capacity` a job of ``work`` (``tokens`` as admission prices them) finishes in;
    None without the batch class's figures. ``others``: the other tenants with unfinished jobs.
    What the batch class was measured to take while it had queued work all along (``busy_tps``,
    the monitor's latest such stretch) is its capacity where there is one: what the engines,
    realtime beside them and the stack around them really gave batch work, prompts included. A
    class not yet measured so is priced by the idle model (the engines' prices: ``measured``
    False), not by what it claimed over the monitor's window, which understates a class just
    getting busy, and one never backlogged (its arrivals, not its capacity).
    ``overhead_s``: the feeder's rounds a job takes to start and to settle, whatever its size;
    ``calibration``: what the jobs that finished say of this model's estimates (:func:`learn`);
    ``in_flight``, ``in_flight_requests``: tokens and requests of the model's job requests the
    feeder already put in the queues or the engines, any tenant's (ahead of every job not yet
    fed: those still queued whole, those in the engines half, as on average half done)."""
    if batch is None:
        return None
    own = engine_s(work, batch)
    if own is None:
        return None
    share = batch_share(batch, realtime)
    measured = batch.busy_tps
    if measured > 0:
        own, share = work.output / measured, 1.0
    per_token = own * calibration / max(tokens, 1)
    queued = max(0, batch.queued_requests)
    running = max(0, in_flight_requests - queued)  # fed job requests the engines hold
    ahead_s = in_flight * per_token * (1 - running / in_flight_requests / 2) if in_flight_requests else 0.0
    if queued > in_flight_requests:  # plain batch requests queued beside them, at the promise's price
        ahead_s += max(0.0, batch.wait_s) * calibration * (queued - in_flight_requests) / queued
    return Capacity(per_token, share, ahead_s, weight,
                    {i: (t.tokens * per_token, t.weight) for i, t in enumerate(others)}, overhead_s,
                    latency_s(work, batch) * calibration, measured > 0)


def finish_s(work: Work, batch: ClassLoad | None, realtime: ClassLoad | None, *, tokens: int,
             ahead_tokens: float, weight: float, others: list[Tenant], overhead_s: float = 0.0) -> float | None:
    """Seconds from now until a job of ``work`` finishes behind ``ahead_tokens`` of its tenant's
    other jobs (:func:`capacity`), with the margin; None without the batch class's figures."""
    plan = capacity(work, batch, realtime, tokens=tokens, weight=weight, others=others, overhead_s=overhead_s)
    return None if plan is None else plan.finish_s(ahead_tokens + tokens)


def place(plan: Capacity, tokens: float, line: list[tuple[float, float]]) -> float:
    """When a job of ``tokens`` is promised to finish (seconds from now), placed in its tenant's
    line: ``line`` holds the tenant's other unfinished jobs as (seconds until their promised
    finish, tokens not yet fed). The feeder feeds a tenant's jobs earliest promise first, so the
    job goes at the earliest place where it finishes before the job behind it is due and where
    every job behind it is still expected to keep its promise with this one's work ahead of it:
    a 1 h job overtakes a 24 h job as far as the 24 h job's promise (its margin over what it is
    expected to take) leaves room, never further; a job already expected late, only within
    ``LATE_ROOM`` of the time left to its promise."""
    line = sorted(line)
    through, total = [], 0.0
    for _, left in line:
        total += left
        through.append(total)
    # A job behind keeps its promise with this one's work ahead of it: the margin it was promised
    # with is the room a job placed ahead of it may take. One already expected late keeps only
    # LATE_ROOM of the time left to its promise: overtaking a late job freely made it later still
    # (a 767-document job, 5% behind, was overtaken by 759 documents of shorter windows and ended
    # 45% past its promise); blocking it outright refused an 11-document job a 4 min window.
    room = []
    for j, (due, _) in enumerate(line):
        late = plan.finish_s(through[j], margin=1.0, own=False) > due
        room.append(due * LATE_ROOM if late else due)
    for k in range(len(line) + 1):
        finish = plan.finish_s((through[k - 1] if k else 0.0) + tokens)
        if k < len(line) and finish > line[k][0]:
            continue  # it would be due after the job at k: the feeder would put it behind
        if all(plan.finish_s(through[j] + tokens, margin=1.0, own=False) <= room[j] for j in range(k, len(line))):
            return finish
    raise AssertionError("the last place always holds")  # k == len(line): no job behind it


def window_text(seconds: float) -> str:
    """The shortest window a job that takes ``seconds`` fits: whole minutes under 2 h, whole hours
    (a ``completion_window`` value) above."""
    if seconds < 7200:
        return f"{max(1, math.ceil(seconds / 60))}m"
    return f"{math.ceil(seconds / 3600)}h"


@dataclass(frozen=True)
class Lessons:
    """What the jobs that finished taught a model's estimates, in Redis (``client`` None: nothing
    was taught, and nothing is kept)."""

    client: redis.Redis | None

    def factor(self, model: str) -> float:
        return 1.0 if self.client is None else calibration(self.client, model)

    def mark_idle_priced(self, job_id: object, window_s: float) -> bool:
        """Mark a job priced by the idle model, for its window and a day; False without Redis."""
        return self._call(lambda c: bool(c.set(UNMEASURED_PREFIX + str(job_id), "1", ex=int(window_s) + 86400)))

    def was_idle_priced(self, job_id: object) -> bool:
        """Whether a job was marked priced by the idle model; the mark is gone once read."""
        return self._call(lambda c: bool(c.delete(UNMEASURED_PREFIX + str(job_id))))

    def _call(self, op: Callable[[redis.Redis], bool]) -> bool:
        if self.client is None:
            return False
        try:
            return op(self.client)
        except redis.RedisError:
            return False


def calibration(client: redis.Redis, model: str) -> float:
    """The factor ``model``'s jobs' engine time is scaled by (1 until a job finished, or without
    Redis)."""
    try:
        raw = client.get(CALIBRATION_PREFIX + model)
    except redis.RedisError:
        return 1.0
    return float(raw) if raw else 1.0


def learn(client: redis.Redis, model: str, promised_s: float, actual_s: float, *, ended: bool = True) -> float | None:
    """A job of ``model`` promised ``promised_s`` took ``actual_s`` (``ended``: finished; else it
    expired then, and took at least that): move the model's factor by the GAIN-th power of actual
    ÷ expected (the promise without its margin), within BOUNDS. The new factor; None when nothing
    was learned (no promise, or an expired job that ran faster than expected)."""
    if promised_s <= 0 or actual_s <= 0:
        return None
    ratio = actual_s * MARGIN / promised_s
    if not ended and ratio <= 1:
        return None
    key = CALIBRATION_PREFIX + model
    try:  # read and written here, not through calibration(): a failed read must not reset it to 1
        raw = client.get(key)
        factor = min(BOUNDS[1], max(BOUNDS[0], (float(raw) if raw else 1.0) * min(4.0, max(0.25, ratio)) ** GAIN))
        client.set(key, f"{factor:.4f}")
    except redis.RedisError:
        return None
    return factor
