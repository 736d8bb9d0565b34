"""How many requests a worker lets into its engine: a limit learned from the engine's own steps
and governed by the deadlines of what runs in it.

Continuous batching trades each sequence's speed for throughput: every sequence added to a step
makes the step longer, on a CPU (compute-bound from the first sequence) or at large batches on a
GPU. A worker that takes in whatever its threads can hold turns the engine into the queue: every
request starts at once, then crawls, and the wait the promise at arrival watches stays at zero.

So the worker learns its engine's **step curve** (:class:`StepCurve`: a step's time against the
sequences in it and the prompt tokens it prefills, fitted online from every step the engine
reports, with older steps forgotten) and the :class:`Governor` keeps in the engine only as many
requests as let each of them finish by its deadline: a request admitted with a deadline of ``d``
seconds for ``m`` tokens needs a step at most ``d / m`` long (its *pace*; the whole deadline, not
what a queue wait left of it: the promise at arrival counts the wait), so the tightest pace among the
requests in flight, and among those that entered in the last ``MEMORY_S`` (the traffic that is
coming), caps the step time and with it the number of sequences. The excess stays in the broker,
where the promise at arrival sees it as queued work and refuses what cannot be served in time.

This is the adaptive-concurrency idea (a limit measured, not configured, as in gradient/AIMD
limiters) with the SLA-aware twist of dynamic batching research: the limit is the largest batch at
which every request in it meets its own deadline, not the one with the best throughput.

The worker carries the limit out as its Celery prefetch count (the consumer holds at most that
many unacknowledged messages: each one is a request in the engine), and tells batch work to yield
(:meth:`Governor.batch_yields`, :meth:`Governor.preempt`) while realtime needs the engine. Beside
realtime, a batch prompt is prefilled only with the time the steps realtime lived through left
unused (:meth:`Governor.earn_prefill`, :meth:`Governor.take_prefill`): on a compute-bound engine
one prompt in a step can cost the realtime decoding in it more than its whole margin.
Pure logic with an injectable clock: ``tests/test_governor.py`` drives it without an engine.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from workers.engines.base import StepSample

# A step is ~0.5× as long as the fit says about this many steps later (older steps fade out).
HALF_LIFE_STEPS = 300
# Feature scales, so that the ridge pull and the numbers stay in the same range whatever the engine.
SEQ_SCALE = 64.0
TOKEN_SCALE = 1024.0
# Pull of the per-sequence and per-prompt-token slopes toward 0 (flat: one sequence costs nothing
# more than none) where the steps seen so far cannot tell: with only one batch size seen, the
# curve stays flat until a bigger batch shows its price.
RIDGE = 1e-5
# The share of a request's pace its steps may take: the rest is left for its prefill, its queue
# wait and the noise of a shared machine.
SAFETY = 0.7
# The paces of requests that entered this long ago still count: the traffic they came with is
# likely still arriving.
MEMORY_S = 60.0
# Batch prefill credit: each step hands on this share of what it had banked (the rest fades), so
# the bank holds about the slack of the last 1 / (1 - BANK_KEEP) steps, which the realtime requests
# in the engine now mostly lived through, not slack left by requests long gone.
BANK_KEEP = 1.0 - 1.0 / 32
# Batch prompt tokens released to the engine are looked for in this many steps' prefill; later
# they are taken as never prefilled (cached, or aborted before the engine saw them).
PENDING_STEPS = 4


class StepCurve:
    """Step time ≈ a + b·seqs + c·prompt_tokens, by weighted least squares with exponential
    forgetting and a ridge pull of b and c toward zero. Thread-safe."""

    def __init__(self, half_life_steps: float = HALF_LIFE_STEPS) -> None:
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._xx = [[0.0] * 3 for _ in range(3)]  # Σ w·x·xᵀ
        self._xt = [0.0] * 3  # Σ w·x·t
        self._weight = 0.0
        self._coef: tuple[float, float, float] | None = None
        self._prompt_mean = 0.0  # prompt tokens per step, smoothed: the prefill share of a step
        self._batch_mean = 0.0  # of which batch prompts, smoothed the same way
        self._batch_pending = 0  # batch prompt tokens released to the engine, not yet seen prefilled
        self._pending_age = 0
        self.samples = 0
        self._lock = threading.Lock()

    def add(self, sample: StepSample) -> None:
        if sample.seconds <= 0 or sample.seqs <= 0:
            return
        x = (1.0, sample.seqs / SEQ_SCALE, sample.prompt_tokens / TOKEN_SCALE)
        with self._lock:
            for i in range(3):
                self._xt[i] = self._xt[i] * self._decay + x[i] * sample.seconds
                for j in range(3):
                    self._xx[i][j] = self._xx[i][j] * self._decay + x[i] * x[j]
            self._weight = self._weight * self._decay + 1.0
            self._prompt_mean = 0.98 * self._prompt_mean + 0.02 * sample.prompt_tokens
            batch = min(self._batch_pending, sample.prompt_tokens)
            self._batch_pending -= batch
            self._pending_age += 1
            if self._pending_age > PENDING_STEPS:
                self._batch_pending = 0
            self._batch_mean = 0.98 * self._batch_mean + 0.02 * batch
            self.samples += 1
            self._coef = None

    def note_batch_prefill(self, prompt_tokens: int) -> None:
        """A batch prompt of ``prompt_tokens`` was let into the engine: the prefill of the next steps
        is (up to that many tokens) batch work, paced by the slack realtime leaves, not traffic the
        in-engine limit must make room for."""
        with self._lock:
            self._batch_pending += max(0, prompt_tokens)
            self._pending_age = 0

    def batch_pending(self) -> int:
        """Batch prompt tokens let into the engine and not yet seen prefilled."""
        with self._lock:
            return self._batch_pending

    def realtime_prompt_mean(self) -> float:
        """Prompt tokens per step, smoothed, less those of batch prompts: the prefill that comes
        with the traffic the limit is set for."""
        with self._lock:
            return max(0.0, self._prompt_mean - self._batch_mean)

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c) in seconds, seconds per sequence and seconds per prompt token; None before
        any step was seen."""
        with self._lock:
            if self.samples == 0:
                return None
            if self._coef is None:
                m = [row[:] for row in self._xx]
                ridge = RIDGE * self._weight
                m[1][1] += ridge
                m[2][2] += ridge
                a, b, c = _solve(m, self._xt[:])
                self._coef = (a, max(0.0, b) / SEQ_SCALE, max(0.0, c) / TOKEN_SCALE)
            return self._coef

    def step_s(self, seqs: float, prompt_tokens: float | None = None) -> float | None:
        """Predicted seconds of a step with ``seqs`` sequences (and ``prompt_tokens`` prefilled:
        by default the mean a step has prefilled lately); None before any step was seen."""
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c = coef
        tokens = self._prompt_mean if prompt_tokens is None else prompt_tokens
        return max(1e-4, a + b * seqs + c * tokens)

    def seq_tps(self, seqs: float) -> float | None:
        """Tokens per second each of ``seqs`` running sequences gets (one token per step)."""
        step = self.step_s(max(1.0, seqs))
        return None if step is None else 1.0 / step


def _solve(m: list[list[float]], v: list[float]) -> tuple[float, float, float]:
    """Gaussian elimination with partial pivoting for a 3×3 system; zeros where singular."""
    n = 3
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-15:
            continue
        m[col], m[pivot] = m[pivot], m[col]
        v[col], v[pivot] = v[pivot], v[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            v[r] -= f * v[col]
            for k in range(col, n):
                m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        if abs(m[r][r]) < 1e-15:
            continue
        x[r] = (v[r] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x[0], x[1], x[2]


@dataclass
class _Entry:
    pace_s: float  # seconds a step may take for this request to finish by its deadline
    batch: bool
    entered: float
    tokens: int  # its max_tokens


class Governor:
    """The in-engine limit of one worker.

    ``enter`` and ``leave`` bracket each request's time in the engine; ``limit()`` is the number
    of requests the engine may hold now. ``default_pace_s`` stands for traffic not seen yet (the
    realtime class's default deadline over its default ``max_tokens``)."""

    def __init__(self, curve: StepCurve, *, max_seqs: int, default_pace_s: float, safety: float = SAFETY,
                 memory_s: float = MEMORY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.curve = curve
        self.max_seqs = max(1, max_seqs)
        self.default_pace_s = default_pace_s
        self.safety = safety
        self.memory_s = memory_s
        self.clock = clock
        self._in_engine: dict[str, _Entry] = {}
        self._recent: deque[tuple[float, float]] = deque()  # (entered, pace) of recent realtime entries
        self._credit_s = 0.0  # batch prefill credit beside realtime, seconds of engine time
        self._lock = threading.Lock()

    def enter(self, request_id: str, *, batch: bool, deadline_s: float | None, max_tokens: int) -> None:
        now = self.clock()
        pace = math.inf if deadline_s is None else max(0.0, deadline_s) / max(1, max_tokens)
        with self._lock:
            self._in_engine[request_id] = _Entry(pace, batch, now, max(1, max_tokens))
            if not batch and math.isfinite(pace):
                self._recent.append((now, pace))

    def leave(self, request_id: str) -> None:
        with self._lock:
            self._in_engine.pop(request_id, None)

    def in_engine(self) -> tuple[int, int]:
        """(requests in the engine, of which batch)."""
        with self._lock:
            return len(self._in_engine), sum(1 for e in self._in_engine.values() if e.batch)

    def pace_s(self) -> float:
        """The tightest pace that governs now: of the requests in the engine and the realtime
        requests that entered within ``memory_s``; the default pace when none did. A pace no
        engine step can keep even with one sequence is left out: that request cannot finish in
        time whatever the limit, and must not throttle everyone else's (one client stating an
        impossible deadline would otherwise close the engine for a minute)."""
        now = self.clock()
        with self._lock:
            while self._recent and now - self._recent[0][0] > self.memory_s:
                self._recent.popleft()
            batch = [e.pace_s for e in self._in_engine.values() if e.batch]
            realtime = [e.pace_s for e in self._in_engine.values() if not e.batch] + [p for _, p in self._recent]
        one = self.curve.step_s(1) or 0.0
        realtime = [p for p in realtime if self.safety * p >= one]
        # Realtime traffic not seen (or none that can be served): its defaults stand for it.
        return min(batch + (realtime or [self.default_pace_s]))

    def limit(self) -> int:
        """The most requests the engine may hold so that a step stays within ``safety`` × the
        governing pace; the whole engine while the curve is unknown or flat."""
        coef = self.curve.coefficients()
        if coef is None:
            return self.max_seqs
        budget = self.safety * self.pace_s()
        if not math.isfinite(budget):
            return self.max_seqs
        b = coef[1]
        if b <= 0:
            return self.max_seqs
        # A step's fixed part plus the prefill realtime arrivals bring; batch prefill is fitted into
        # the slack that leaves (earn_prefill), so it never lowers the limit.
        base = self.curve.step_s(0, self.curve.realtime_prompt_mean())
        return max(1, min(self.max_seqs, int((budget - base) / b)))

    def _realtime_here(self) -> bool:
        """Whether a realtime request is in the engine (the caller holds the lock)."""
        return any(not e.batch for e in self._in_engine.values())

    def step_budget_s(self) -> float:
        """The longest a step may take now: ``safety`` × the governing pace."""
        return self.safety * self.pace_s()

    def earn_prefill(self, steps: list[StepSample]) -> None:
        """Bank batch prefill credit from the steps just taken, while realtime runs: each step
        earns its slack, the step budget less what the step really took, in seconds of engine
        time. The bank fades (``BANK_KEEP``): it holds the slack of steps that the realtime requests
        in the engine now lived through, which they can give up and still finish in time."""
        budget = self.step_budget_s()
        with self._lock:
            if not self._realtime_here():
                self._credit_s = 0.0  # nobody to keep the slack for
            elif math.isfinite(budget):
                for step in steps:
                    self._credit_s = self._credit_s * BANK_KEEP + max(0.0, budget - step.seconds)

    def take_prefill(self, prompt_tokens: int) -> bool:
        """Whether a batch prompt of ``prompt_tokens`` may be prefilled now, its price by the curve
        being c × its tokens. Beside realtime once the bank holds that price, which it spends (a
        prompt the bank never holds waits until the realtime has left the engine); without
        realtime at once, but never more than one step budget of batch prefill at a time (or one
        prompt, if larger), so that realtime arriving meanwhile waits for one prefill, not for a
        wave of them in one long step."""
        coef = self.curve.coefficients()
        price = coef[2] if coef is not None else 0.0
        cost = price * max(0, prompt_tokens)
        pending = price * self.curve.batch_pending()
        if pending > 0 and pending + cost > self.step_budget_s():
            return False
        with self._lock:
            if self._realtime_here():
                if self._credit_s < cost:
                    return False
                self._credit_s -= cost
        self.curve.note_batch_prefill(prompt_tokens)
        return True

    def tokens_take_s(self, max_tokens: int) -> float | None:
        """Seconds ``max_tokens`` tokens take at the step time the engine gives with one sequence
        more than it holds (at most the limit); None while the curve is unknown."""
        total, _ = self.in_engine()
        step = self.curve.step_s(min(total + 1, self.limit()))
        return None if step is None else max_tokens * step

    def slot_wait_s(self, limit: int) -> float:
        """How long a request that finds the engine full waits for room, on average: requests in
        it are half done, and one of ``limit`` finishes every (half a request's tokens × a step)
        / ``limit`` seconds. 0 while there is room."""
        with self._lock:
            entries = list(self._in_engine.values())
        step = self.curve.step_s(limit)
        if len(entries) < limit or not entries or step is None:
            return 0.0
        return statistics.fmean(e.tokens for e in entries) / 2 * step / limit

    def batch_yields(self, realtime_queued: int) -> bool:
        """Batch work stops entering this engine while realtime waits for it: realtime is queued
        on this worker's realtime queues, or realtime runs here and the engine is at its limit."""
        total, batch = self.in_engine()
        return realtime_queued > 0 or (total - batch > 0 and total >= self.limit())

    def preempt(self, realtime_queued: int) -> list[str]:
        """Batch requests to take out of the engine now, newest first: as many as realtime needs,
        while the engine is over its limit or full with realtime queued."""
        limit = self.limit()
        with self._lock:
            total = len(self._in_engine)
            batch = sorted(((e.entered, rid) for rid, e in self._in_engine.items() if e.batch), reverse=True)
            realtime = total - len(batch)
        if not realtime and realtime_queued <= 0:
            return []
        # Room for the realtime requests waiting (at most the whole limit), and none over the limit.
        want = max(0, total - limit + min(max(0, realtime_queued), limit))
        return [rid for _, rid in batch[:want]]
