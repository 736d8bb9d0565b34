"""How many requests a worker lets into its engine: a limit learned from the engine's own steps
and governed by the deadlines of what runs in it.

Continuous batching trades each sequence's speed for throughput: every sequence added to a step
makes the step longer, on a CPU (compute-bound from the first sequence) or at large batches on a
GPU. A worker that takes in whatever its threads can hold turns the engine into the queue: every
request starts at once, then crawls, and the wait the promise at arrival watches stays at zero.

So the worker learns its engine's **step curve** (:class:`StepCurve`: a step's time against the
sequences in it, the prompt tokens it prefills and the attention those tokens pay to the context
before them, fitted online from every step the engine reports, with older steps forgotten) and the
:class:`Governor` keeps in the engine only as many requests as let each of them finish by its
deadline: a request admitted with a deadline of ``d`` seconds for ``m`` tokens needs a step at most
``d / m`` long (its *pace*; the whole deadline, not what a queue wait left of it: the promise at
arrival counts the wait), so the tightest pace among the requests in flight, and among those that
entered in the last ``MEMORY_S`` (the traffic that is coming), caps the step time and with it the
number of sequences. The excess stays in the broker, where the promise at arrival sees it as queued
work and refuses what cannot be served in time.

This is the adaptive-concurrency idea (a limit measured, not configured, as in gradient/AIMD
limiters) with the SLA-aware twist of dynamic batching research: the limit is the largest batch at
which every request in it meets its own deadline, not the one with the best throughput.

The worker carries the limit out as its Celery prefetch count (the consumer holds at most that
many unacknowledged messages: each one is a request in the engine), and tells batch work to yield
(:meth:`Governor.batch_yields`, :meth:`Governor.preempt`) while realtime needs the engine. On a
compute-bound engine one prompt in a step can cost the realtime decoding in it more than its whole
margin, so prompts are prefilled in the slack: the engine is told how many prompt tokens a step may
prefill (:meth:`Governor.prefill_cap_tokens`: the step budget less what the step's decodes take,
at the curve's price per token) and chunks long prompts to that, realtime prompts first (Sarathi's
chunked prefill, with the chunk set by the tightest deadline instead of a fixed size).
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

from workers.engines.base import TIER_RANK, StepSample

# A step is ~0.5× as long as the fit says about this many steps later (older steps fade out).
HALF_LIFE_STEPS = 300
# Feature scales, so that the ridge pull and the numbers stay in the same range whatever the engine.
SEQ_SCALE = 64.0
TOKEN_SCALE = 1024.0
ATTENTION_SCALE = TOKEN_SCALE * TOKEN_SCALE
# Pull of the per-sequence, per-prompt-token and attention slopes toward 0 (flat: one sequence costs nothing
# more than none) where the steps seen so far cannot tell: with only one batch size seen, the
# curve stays flat until a bigger batch shows its price.
RIDGE = 1e-5
# How fast the curve follows a slowdown the fit has not caught up with (a host whose CPUs the web
# tier's spike takes): each decode step moves it this share of the way to that step's time over
# the fit's prediction (about the last ten steps count), once this many steps were fitted and
# only for batch sizes the fit has seen (a bigger batch is the fit's to learn, not a slowdown); a
# step counts at most this many times its prediction (one stall is not the engine's speed). An
# idle engine shows no speed: what was measured fades with this time constant once it has been
# idle a second.
SLOWDOWN_WEIGHT = 0.1
SLOWDOWN_AFTER = 20
SLOWDOWN_CLIP = 4.0
SLOWDOWN_IDLE_S = 5.0
# The least a prompt token is priced at, as a share of the price the warm-up measured (an idle
# engine): half, for the noise of those few warm-up steps.
TOKEN_FLOOR_SHARE = 0.5
# The share of a request's pace its steps may take: the rest is left for its prefill, its queue
# wait and the noise of a shared machine.
SAFETY = 0.7
# The share of its deadline a priority-tier request's decode may take (its pace governs the limit
# at this, not SAFETY, while it is in the worker's hands): the rest is for its wait and prefill,
# which the promise at 0.8 of the deadline (SLUICE_PROMISE_FACTOR) must also hold.
PRIORITY_SAFETY = 0.6
# The paces of requests that entered this long ago still count: the traffic they came with is
# likely still arriving.
MEMORY_S = 60.0
# The fewest prompt tokens a step may prefill, however little slack the realtime pace leaves: a
# prompt always moves on.
MIN_PREFILL_CHUNK = 32
# A prompt released to the engine is looked for in the steps that began after its release; after
# this many such steps that prefilled none of the prompts counted pending, it is taken as never
# prefilled as counted (the workers also forget a request's prompt when it leaves, and expire what
# no step showed for seconds).
PENDING_STEPS = 4


@dataclass(slots=True)
class _Pending:
    """A prompt let into the engine and not yet seen prefilled in full."""

    request_id: str | None
    length: int  # its tokens, as counted when it was let in
    left: int  # of which no step has shown prefilled yet
    batch: bool
    released: float  # time.monotonic() when it was let in
    steps: int = 0  # steps begun since that prefilled none of the prompts pending


class StepCurve:
    """Step time ≈ a + b·seqs + c·prompt_tokens + d·attention, by weighted least squares with
    exponential forgetting and a ridge pull of b, c and d toward zero. Thread-safe.

    ``attention`` is what a step's prompt tokens attend to: a chunk of ``k`` tokens that starts
    ``o`` tokens into its prompt attends to ``k·(o + k/2)`` positions (causal attention), so a
    prompt of ``P`` tokens costs ``c·P + d·P²/2`` however the engine chunks it. The linear price
    alone runs short on long prompts (about a quarter at 3,000 tokens on the 92M test model on a
    CPU); the offsets come from the prompts the curve already follows through their chunks."""

    def __init__(self, half_life_steps: float = HALF_LIFE_STEPS) -> None:
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._xx = [[0.0] * 4 for _ in range(4)]  # Σ w·x·xᵀ
        self._xt = [0.0] * 4  # Σ w·x·t
        self._weight = 0.0
        self._coef: tuple[float, float, float, float] | None = None
        self._prompt_mean = 0.0  # prompt tokens per step, smoothed: the prefill share of a step
        self._batch_mean = 0.0  # of which batch prompts, smoothed the same way
        # The context a prefilled token attends to, on average over the tokens prefilled lately
        # (Σ attention / Σ tokens, both fading): what a step's prompt tokens cost beyond their
        # linear price (d × this, a token).
        self._attention_sum = self._token_sum = 0.0
        # Prompts let into the engine and not yet seen prefilled, oldest first. The steps' prefilled
        # tokens (computed and cached) are taken off the head; what was taken says where a chunk starts.
        self._pending: deque[_Pending] = deque()
        self._cached_share = 0.0  # of the prompt tokens prefilled lately, the share the prefix cache held
        self.samples = 0
        self._lock = threading.Lock()
        # The least a prompt token is priced at: a share of what the warm-up measured on an idle
        # engine (``hold_token_floor``). A host whose CPUs other processes take slows every step;
        # the fit can then put that in the intercept and price a prompt token near zero (one test
        # run saw a prefill cap of 26,771 tokens): the promise would count prompts as free.
        self._token_floor = 0.0
        # Recent decode steps' time over what the fit predicted for them, smoothed over about ten
        # steps: the fit forgets over hundreds of steps, so a host that slows all at once (the
        # platform's own spike on shared cores) would otherwise be priced at its calm speed for
        # seconds, and requests admitted meanwhile run into their deadlines.
        self._slowdown = 1.0
        self._slowdown_at = 0.0  # time.monotonic() of the last step that moved it
        self._seqs_seen = 0  # the largest batch among the steps fitted

    def add(self, sample: StepSample) -> None:
        attention = self._prefilled(sample)
        if sample.seconds <= 0 or sample.seqs <= 0:
            return  # not timed: it teaches the fit nothing
        if sample.prompt_tokens == 0 and self.samples >= SLOWDOWN_AFTER and sample.seqs <= self._seqs_seen:
            coef = self._coefficients()  # before this step teaches it: a prediction, not a fit
            ratio = min(SLOWDOWN_CLIP, sample.seconds / max(1e-4, coef[0] + coef[1] * sample.seqs))
            now = time.monotonic()
            with self._lock:
                excess = self._faded(now)
                self._slowdown = 1.0 + excess + SLOWDOWN_WEIGHT * (ratio - 1.0 - excess)
                self._slowdown_at = now
        x = (1.0, sample.seqs / SEQ_SCALE, sample.prompt_tokens / TOKEN_SCALE, attention / ATTENTION_SCALE)
        with self._lock:
            for i in range(4):
                self._xt[i] = self._xt[i] * self._decay + x[i] * sample.seconds
                for j in range(4):
                    self._xx[i][j] = self._xx[i][j] * self._decay + x[i] * x[j]
            self._weight = self._weight * self._decay + 1.0
            self._seqs_seen = max(self._seqs_seen, sample.seqs)
            self._prompt_mean = 0.98 * self._prompt_mean + 0.02 * sample.prompt_tokens
            if sample.prompt_tokens:
                self._attention_sum = 0.95 * self._attention_sum + attention
                self._token_sum = 0.95 * self._token_sum + sample.prompt_tokens
            self.samples += 1
            self._coef = None

    def _prefilled(self, sample: StepSample) -> float:
        """Take what ``sample`` prefilled (computed and cached) off the prompts pending: realtime
        ones first, then batch, oldest first in each, the order the engine prefills them in (a
        long prompt over many steps, in chunks). A prompt still pending after ``PENDING_STEPS``
        steps that began after it was let in and prefilled none of the prompts pending was not
        prefilled as counted (its count was high, or the engine took it some other way) and is
        dropped. A step of unknown time (``at`` 0) counts as after every release.

        Returns the attention of the tokens the step computed: each chunk's tokens times where it
        starts in its prompt plus half its length; tokens no pending prompt accounts for count as
        a prompt of their own from its start; the share the prefix cache held costs nothing."""
        seen = total = sample.prompt_tokens + sample.cached_tokens
        began = sample.at - max(0.0, sample.seconds) if sample.at else math.inf
        attention = 0.0
        with self._lock:
            if seen:
                self._cached_share = 0.9 * self._cached_share + 0.1 * sample.cached_tokens / seen
            batch = 0
            for entry in sorted(self._pending, key=lambda p: p.batch) if seen else ():  # stable: oldest first
                taken = min(seen, entry.left)
                attention += taken * (entry.length - entry.left + taken / 2)
                entry.left -= taken
                seen -= taken
                batch += taken if entry.batch else 0
                if seen <= 0:
                    break
            if seen > 0:
                attention += seen * seen / 2
            if total:
                attention *= sample.prompt_tokens / total
            if any(p.left <= 0 for p in self._pending):
                self._pending = deque(p for p in self._pending if p.left > 0)
            if not total:
                for entry in self._pending:
                    if entry.released <= began:
                        entry.steps += 1
                if any(p.steps > PENDING_STEPS for p in self._pending):
                    self._pending = deque(p for p in self._pending if p.steps <= PENDING_STEPS)
            # The batch share of what this step computed (cached tokens cost it nothing).
            if sample.seconds > 0:
                self._batch_mean = 0.98 * self._batch_mean + 0.02 * min(batch, sample.prompt_tokens)
        return attention

    def note_prefill(self, prompt_tokens: int, batch: bool, request_id: str | None = None,
                     now: float | None = None) -> None:
        """A prompt of ``prompt_tokens`` was let into the engine: the prefill of the next steps
        holds it until a step is seen prefilling that many tokens. Batch prompts are paced by the
        slack realtime leaves, not traffic the in-engine limit must make room for."""
        if prompt_tokens <= 0:
            return
        with self._lock:
            self._pending.append(_Pending(request_id, prompt_tokens, prompt_tokens, batch,
                                          time.monotonic() if now is None else now))

    def forget(self, request_id: str) -> None:
        """The request left the engine: whatever of its prompt is still counted pending never will
        be prefilled (it was aborted first, or its prefill was counted against another's)."""
        with self._lock:
            self._pending = deque(p for p in self._pending if p.request_id != request_id)

    def expire(self, older_than: float) -> None:
        """Drop pending prompts released before ``older_than`` (monotonic): a step would have
        shown them long ago, so they never reached the engine's prefill as counted."""
        with self._lock:
            while self._pending and self._pending[0].released < older_than:
                self._pending.popleft()

    def pending(self) -> int:
        """Prompt tokens let into the engine and not yet seen prefilled."""
        with self._lock:
            return sum(p.left for p in self._pending)

    def pending_squares(self, batch: bool = True) -> float:
        """What the prompts pending (realtime ones only unless ``batch``) add to Σ P² as
        :meth:`prefill_s` prices them: ``L² − (L − r)²`` for a prompt of ``L`` tokens with ``r``
        still to prefill (the attention of its rest, doubled)."""
        with self._lock:
            return sum(p.length ** 2 - (p.length - p.left) ** 2 for p in self._pending if batch or not p.batch)

    def realtime_pending(self) -> int:
        """Realtime prompt tokens let into the engine and not yet seen prefilled."""
        with self._lock:
            return sum(p.left for p in self._pending if not p.batch)

    def batch_pending(self) -> int:
        """Batch prompt tokens let into the engine and not yet seen prefilled."""
        with self._lock:
            return sum(p.left for p in self._pending if p.batch)

    def cached_share(self) -> float:
        """The share of the prompt tokens prefilled lately that the prefix cache held."""
        with self._lock:
            return self._cached_share

    def slowdown(self, now: float | None = None) -> float:
        """How much slower than the fit the engine's decode steps ran lately (1: as fitted, or
        faster: the prices never fall below the fit's), fading while the engine is idle."""
        with self._lock:
            return 1.0 + max(0.0, self._faded(time.monotonic() if now is None else now))

    def _faded(self, now: float) -> float:
        """The slowdown's excess over 1 (negative: faster than fitted), faded by the idle time."""
        idle = now - self._slowdown_at - 1.0
        return (self._slowdown - 1.0) * (math.exp(-idle / SLOWDOWN_IDLE_S) if idle > 0 else 1.0)

    def prompt_token_s(self) -> float:
        """Engine seconds one prompt token costs as admission counts them (cached ones too), its
        linear part: the curve's price of a computed token, discounted by the share the prefix
        cache held lately, at the engine's speed lately (:meth:`slowdown`)."""
        coef = self.coefficients()
        return 0.0 if coef is None else coef[2] * (1.0 - self.cached_share()) * self.slowdown()

    def prompt_square_s(self) -> float:
        """Engine seconds a prompt of ``P`` tokens costs beyond its linear price, per ``P²``: half
        the attention slope, the prefix cache's share (the prompt's head, ``h·P`` tokens) taken
        off as ``(1 − h²)``, at the engine's speed lately."""
        share = self.cached_share()
        return self.attention_s() * (1.0 - share * share) / 2 * self.slowdown()

    def prefill_s(self, prompt_tokens: float, squares: float | None = None) -> float:
        """Engine seconds the prefill of prompts of ``prompt_tokens`` tokens in all takes, with
        ``squares`` their Σ P² (one prompt's when omitted)."""
        squares = prompt_tokens * prompt_tokens if squares is None else squares
        return prompt_tokens * self.prompt_token_s() + squares * self.prompt_square_s()

    def attention_s(self) -> float:
        """``d``: seconds per prompt token per token of context before it (0 before any step)."""
        coef = self._coefficients()
        return 0.0 if coef is None else coef[3]

    def token_s(self, fitted: bool = False) -> float:
        """Seconds a prompt token costs a step as prompts come lately: ``c`` and the attention to
        the context such tokens have had on average (what a prefill cap is counted in), at the
        engine's speed lately unless ``fitted`` (the fit's alone)."""
        coef = self._coefficients()
        if coef is None:
            return 0.0
        with self._lock:
            context = self._attention_sum / self._token_sum if self._token_sum > 0 else 0.0
        return (coef[2] + coef[3] * context) * (1.0 if fitted else self.slowdown())

    def realtime_prompt_mean(self) -> float:
        """Prompt tokens per step, smoothed, less those of batch prompts: the prefill that comes
        with the traffic the limit is set for."""
        with self._lock:
            return max(0.0, self._prompt_mean - self._batch_mean)

    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c) in seconds, seconds per sequence and seconds per prompt token (its linear
        part: :meth:`attention_s` is the rest); None before any step was seen."""
        coef = self._coefficients()
        return None if coef is None else coef[:3]

    def _coefficients(self) -> tuple[float, float, float, float] | None:
        with self._lock:
            if self.samples == 0:
                return None
            if self._coef is None:
                m = [row[:] for row in self._xx]
                ridge = RIDGE * self._weight
                for i in (1, 2, 3):
                    m[i][i] += ridge
                a, b, c, d = _solve(m, self._xt[:])
                self._coef = (a, max(0.0, b) / SEQ_SCALE, max(self._token_floor, max(0.0, c) / TOKEN_SCALE),
                              max(0.0, d) / ATTENTION_SCALE)
            return self._coef

    def hold_token_floor(self, share: float = TOKEN_FLOOR_SHARE) -> None:
        """From now on, never price a prompt token below ``share`` of what the fit prices it at
        now (called once the warm-up measured it on an idle engine: an engine does not prefill
        faster than that later, whatever the fit makes of noisy steps). The floor holds the
        linear part at ``share`` of the whole price a token paid then, its attention included."""
        price = self.token_s(fitted=True)
        with self._lock:
            self._token_floor = share * price
            self._coef = None

    def step_s(self, seqs: float, prompt_tokens: float | None = None) -> float | None:
        """Predicted seconds of a step with ``seqs`` sequences (and ``prompt_tokens`` prefilled,
        at the context such tokens have had lately: by default the mean a step has prefilled
        lately), at the engine's speed lately; None before any step was seen."""
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, _ = coef
        tokens = self._prompt_mean if prompt_tokens is None else prompt_tokens
        return max(1e-4, (a + b * seqs + self.token_s(fitted=True) * tokens) * self.slowdown())

    def seq_tps(self, seqs: float) -> float | None:
        """Tokens per second each of ``seqs`` running sequences gets (one token per step)."""
        step = self.step_s(max(1.0, seqs))
        return None if step is None else 1.0 / step


def _solve(m: list[list[float]], v: list[float]) -> tuple[float, ...]:
    """Gaussian elimination with partial pivoting for an n×n system; zeros where singular."""
    n = len(v)
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
    return tuple(x)


@dataclass
class _Entry:
    pace_s: float  # seconds a step may take for this request to finish by its deadline
    batch: bool
    entered: float
    tokens: int  # its max_tokens
    seqs: int = 1  # the sequences it decodes side by side: its n, or an embeddings request's texts
    prompt: int = 0  # its prompt tokens, as the caller counted them
    started: bool = False  # let into the engine (its prompt released for prefill)
    ticket: int = 0  # arrival order, for the wait before the engine (first come, first served)
    rank: int = 0  # its service tier's engine priority (workers/engines/base.py TIER_RANK): lower goes first
    stream: bool = False  # its client reads tokens as they come: never taken out for a better tier


class Governor:
    """The in-engine limit of one worker.

    ``enter`` and ``leave`` bracket each request's time in the worker's hands; ``take_prefill``
    is its gate into the engine proper (realtime first, first come first served, within the
    limit in sequences and the prefill a step may carry); ``limit()`` is the number of sequences
    the engine may hold now. ``default_pace_s`` stands for traffic not seen yet (the realtime
    class's default deadline over its default ``max_tokens``)."""

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
        self._tickets = 0
        self._lock = threading.Lock()

    def enter(self, request_id: str, *, batch: bool, deadline_s: float | None, max_tokens: int,
              seqs: int = 1, prompt_tokens: int = 0, rank: int | None = None, stream: bool = False) -> None:
        """``rank``: its tier's engine priority (by default its class's plain tier's: default or batch)."""
        now = self.clock()
        pace = math.inf if deadline_s is None else max(0.0, deadline_s) / max(1, max_tokens)
        rank = TIER_RANK["batch" if batch else "default"] if rank is None else rank
        with self._lock:
            self._tickets += 1
            self._in_engine[request_id] = _Entry(pace, batch, now, max(1, max_tokens), max(1, seqs),
                                                 max(0, prompt_tokens), ticket=self._tickets, rank=rank,
                                                 stream=stream)
            if not batch and math.isfinite(pace):
                self._recent.append((now, pace))

    def leave(self, request_id: str) -> None:
        with self._lock:
            self._in_engine.pop(request_id, None)
        self.curve.forget(request_id)

    def in_engine(self) -> tuple[int, int]:
        """(requests in the worker's hands, of which batch)."""
        with self._lock:
            return len(self._in_engine), sum(1 for e in self._in_engine.values() if e.batch)

    def seqs(self) -> int:
        """Sequences of the requests in the worker's hands: what the limit counts."""
        with self._lock:
            return sum(e.seqs for e in self._in_engine.values())

    def realtime_seqs(self) -> int:
        """Sequences of the realtime requests in the worker's hands: what batch work cannot keep
        from realtime (``preempt`` takes batch out for it)."""
        with self._lock:
            return sum(e.seqs for e in self._in_engine.values() if not e.batch)

    def kept_from_priority(self) -> int:
        """Sequences a priority request could not take from the requests in the worker's hands:
        the priority tier's own and the streams (``preempt`` takes the rest out for it)."""
        with self._lock:
            return sum(e.seqs for e in self._in_engine.values() if e.rank == 0 or e.stream)

    def pace_s(self) -> float:
        """The pace that governs now: the tightest of the batch requests in the engine and of the
        realtime class (its requests in the engine and those that entered within ``memory_s``).
        Among ten or more realtime paces the class's is its tenth percentile, not its single
        tightest: one tenant's tight deadline must not throttle every request on the worker.
        The default pace when none entered. A pace no engine step can keep even with one sequence
        is left out: that request cannot finish in time whatever the limit, and must not throttle
        everyone else's (one client stating an impossible deadline would otherwise close the
        engine for a minute)."""
        now = self.clock()
        with self._lock:
            while self._recent and now - self._recent[0][0] > self.memory_s:
                self._recent.popleft()
            batch = [e.pace_s for e in self._in_engine.values() if e.batch]
            realtime = [e.pace_s for e in self._in_engine.values() if not e.batch] + [p for _, p in self._recent]
            # A priority-tier request's own pace governs whatever the others', at its tighter share
            # of its deadline: the speed its promise was made at (admit.lua).
            ahead = [e.pace_s * PRIORITY_SAFETY / self.safety for e in self._in_engine.values()
                     if e.rank == TIER_RANK["priority"]]
        one = self.curve.step_s(1) or 0.0
        realtime = sorted(p for p in realtime if self.safety * p >= one)
        ahead = [p for p in ahead if self.safety * p >= one]
        # Realtime traffic not seen (or none that can be served): its defaults stand for it.
        tightest = realtime[len(realtime) // 10] if len(realtime) >= 10 else (realtime or [self.default_pace_s])[0]
        return min(batch + ahead + [tightest])

    def limit(self) -> int:
        """The most sequences the engine may hold so that a step stays within ``safety`` × the
        governing pace; the whole engine while the curve is unknown or flat."""
        return self._limit_at(self.pace_s())

    def _limit_at(self, pace_s: float) -> int:
        """``limit()`` for a governing pace of ``pace_s``."""
        coef = self.curve.coefficients()
        if coef is None:
            return self.max_seqs
        budget = self.safety * pace_s
        if not math.isfinite(budget):
            return self.max_seqs
        base, b = self.step_line()
        if b <= 0:
            return self.max_seqs
        return max(1, min(self.max_seqs, int((budget - base) / b)))

    def step_line(self) -> tuple[float, float]:
        """(base, per sequence): a step's seconds as the limit counts them, base + per sequence ×
        sequences. The base is a step's fixed part plus the prefill realtime arrivals bring (batch
        prefill is fitted into the slack that leaves, prefill_cap_tokens, so it never lowers the
        limit); a sequence is priced at the engine's speed lately. (0, 0) while the curve is unknown."""
        coef = self.curve.coefficients()
        if coef is None:
            return 0.0, 0.0
        return self.curve.step_s(0, self.curve.realtime_prompt_mean()), coef[1] * self.curve.slowdown()

    def step_budget_s(self) -> float:
        """The longest a step may take now: ``safety`` × the governing pace."""
        return self.safety * self.pace_s()

    def prefill_cap_tokens(self) -> int:
        """The most prompt tokens a step may prefill now (``Engine.set_prefill_cap``): what the
        step budget leaves beside the decodes of the sequences in the engine, at the curve's price
        per computed prompt token; at least ``MIN_PREFILL_CHUNK``. 0 (no cap) while the curve has
        no price for a prompt token or no pace governs."""
        return self._cap_at(self.step_budget_s())

    def _cap_at(self, budget: float) -> int:
        """``prefill_cap_tokens()`` for a step budget of ``budget`` seconds."""
        price = self.curve.token_s()
        if price <= 0 or not math.isfinite(budget):
            return 0
        decodes = self.curve.step_s(max(1, self.seqs()), 0) or 0.0
        return max(MIN_PREFILL_CHUNK, int((budget - decodes) / price))

    def take_prefill(self, prompt_tokens: int, request_id: str | None = None, batch: bool = True) -> bool:
        """Whether a prompt of ``prompt_tokens`` may go into the engine now; if so it is counted
        pending prefill until steps show it prefilled (``StepCurve.note_prefill``).

        Realtime first: a batch prompt waits while a realtime request waits here, and realtime
        requests go in the order they came. The limit counts sequences: a request whose sequences
        would take the engine past it waits for room (unless the engine is empty). A realtime
        prompt goes in while the prompts pending prefill cost less than a step budget (so a burst
        is prefilled a step budget at a time, in order); there is always one going in. A batch
        prompt goes in while the batch prompts pending cost less than a step budget with it, or
        alone when it costs more: beside realtime as without, since the engine prefills it in
        the slack of its steps, chunked at ``prefill_cap_tokens`` and after realtime's prompts.
        ``request_id`` None: a prompt not entered (tests of the gate alone)."""
        price = self.curve.token_s()
        cost = price * max(0, prompt_tokens)
        pace = self.pace_s()  # once: it sorts the realtime paces of the last minute
        budget, limit = self.safety * pace, self._limit_at(pace)
        with self._lock:  # the curve never calls the governor: its lock may be taken inside this one
            # What is already let in and not yet prefilled, of the request's own class: the engine
            # prefills realtime's prompts first and batch's in the slack.
            pending = price * (self.curve.batch_pending() if batch else self.curve.realtime_pending())
            me = self._in_engine.get(request_id) if request_id is not None else None
            if me is not None:
                if me.started:
                    return True
                waiting = [e for e in self._in_engine.values() if not e.started and e is not me]
                if any(not e.batch and (batch or (e.rank, e.ticket) < (me.rank, me.ticket)) for e in waiting):
                    return False  # realtime first, a better tier first, in the order it came
                started = sum(e.seqs for e in self._in_engine.values() if e.started)
                if started and started + me.seqs > limit:
                    return False
            if batch:
                if pending > 0 and pending + cost > budget:
                    return False
            elif pending > 0 and pending >= budget:
                return False
            if me is not None:
                me.started = True
        self.curve.note_prefill(prompt_tokens, batch, request_id)
        return True

    def stretch(self) -> float:
        """How much longer prefill takes on the clock than in engine time, as the engine is told
        to prefill: a step (about a step budget long while it carries prefill) takes at most
        ``prefill_cap_tokens``, so a token takes at least the step budget over the cap, more than
        the curve's price when the decodes beside it leave the prompts little of each step."""
        price = self.curve.token_s()
        budget = self.step_budget_s()  # once: it sorts the realtime paces of the last minute
        cap = self._cap_at(budget)
        if cap <= 0 or price <= 0:
            return 1.0
        return max(1.0, budget / cap / price)

    def prompt_token_s(self) -> float:
        """Seconds a prompt token takes to prefill now, its linear part (the curve's, prefix cache
        share off), stretched as the engine is told to prefill (:meth:`stretch`)."""
        return self.curve.prompt_token_s() * self.stretch()

    def prompt_square_s(self) -> float:
        """Seconds a prompt of ``P`` tokens takes beyond ``P`` × :meth:`prompt_token_s`, per
        ``P²``: its attention (``StepCurve.prompt_square_s``), stretched the same way."""
        return self.curve.prompt_square_s() * self.stretch()

    def prefill_s(self, prompt_tokens: float, squares: float | None = None) -> float:
        """Seconds the prefill of prompts of ``prompt_tokens`` tokens in all (Σ P² ``squares``;
        one prompt's when omitted) takes now, as the engine is told to prefill."""
        return self.curve.prefill_s(prompt_tokens, squares) * self.stretch()

    def backlog_s(self, batch: bool = True) -> float:
        """Engine seconds of prefill ahead of a request that comes now: the prompts let into the
        engine and not yet prefilled, and those of the requests waiting to go in that go before
        it (for a realtime request, the realtime ones only: realtime goes in first, and the engine
        prefills its prompts first)."""
        with self._lock:
            waiting = [e.prompt for e in self._in_engine.values() if not e.started and (batch or not e.batch)]
        pending = self.curve.pending() if batch else self.curve.realtime_pending()
        return self.prefill_s(pending + sum(waiting), self.curve.pending_squares(batch) + sum(p * p for p in waiting))

    def tokens_take_s(self, max_tokens: int, prompt_tokens: int = 0, batch: bool = False) -> float | None:
        """Seconds a request entering now takes to finish: the prefill ahead of it and its own,
        then ``max_tokens`` tokens at the step time the engine gives with one sequence more than
        it holds (at most the limit); None while the curve is unknown."""
        step = self.curve.step_s(min(self.seqs() + 1, self.limit()))
        if step is None:
            return None
        return self.backlog_s(batch) + self.prefill_s(prompt_tokens) + max_tokens * step

    def slot_wait_s(self, limit: int) -> float:
        """How long a request that finds the engine full waits for room, on average: requests in
        it are half done, and one of ``limit`` sequences finishes every (half a request's tokens ×
        a step) / ``limit`` seconds. 0 while there is room."""
        with self._lock:
            entries = list(self._in_engine.values())
        step = self.curve.step_s(limit)
        if sum(e.seqs for e in entries) < limit or not entries or step is None:
            return 0.0
        return statistics.fmean(e.tokens for e in entries) / 2 * step / limit

    def batch_yields(self, realtime_queued: int) -> bool:
        """Batch work stops entering this engine while realtime waits for it: realtime is queued
        on this worker's realtime queues, or realtime runs here and the engine is at its limit."""
        with self._lock:
            realtime = any(not e.batch for e in self._in_engine.values())
        return realtime_queued > 0 or (realtime and self.seqs() >= self.limit())

    def preempt(self, realtime_queued: int, grant: Callable[[int, int], int] | None = None,
                exempt: Callable[[list[str]], set[str]] | None = None, leaving: set[str] = frozenset(),
                priority_queued: int = 0, grant_priority: Callable[[int, int], int] | None = None,
                exempt_realtime: Callable[[list[str]], set[str]] | None = None) -> list[str]:
        """Requests to take out of the engine now, newest first: batch work as realtime needs,
        while the engine is over its limit (in sequences) or full with realtime queued; then the
        default tier's work (never a stream: its client has read tokens that a second run would
        repeat) that is over the limit while a priority-tier request is in the worker's hands (its
        pace set the limit), or that fills the room the ``priority_queued`` requests of the
        priority tier among those queued still need.

        ``leaving``: requests already being taken out (preempted earlier, not gone yet): neither
        counted nor chosen again. ``exempt(ids)``, ``exempt_realtime(ids)``: batch and default
        requests not to be preempted again (their caps). ``grant(slots, queued)``: of the slots
        this engine could free for the ``queued`` realtime requests, how many it may (the fleet's
        claims, ``workers/preemption.py``: one queued request makes one worker yield); by default
        all; ``grant_priority`` the same for the priority tier's. What is over the limit always
        leaves."""
        limit = self.limit()
        with self._lock:
            staying = {rid: e for rid, e in self._in_engine.items() if rid not in leaving}
        total = sum(e.seqs for e in staying.values())
        realtime = any(not e.batch for e in staying.values())
        if not realtime and realtime_queued <= 0:
            return []
        over = max(0, total - limit)
        # Room for the realtime requests waiting (at most the whole limit), and none over the limit.
        for_queued = max(0, total - limit + min(max(0, realtime_queued), limit)) - over
        victims = self._victims([(e.entered, rid, e.seqs) for rid, e in staying.items() if e.batch],
                                over, for_queued, grant, realtime_queued, exempt)
        # While a priority-tier request is in the worker's hands its pace sets the limit, and the
        # default work over it leaves; the priority requests queued that still find no room once
        # that batch work has left get it from the default tier's newest too.
        freed = sum(staying[rid].seqs for rid in victims)
        ahead_in = any(e.rank == TIER_RANK["priority"] for e in staying.values())
        over_left = max(0, total - freed - limit) if ahead_in else 0
        for_priority = (max(0, total - freed - limit + min(priority_queued, limit)) - over_left
                        if priority_queued > 0 else 0)
        default = [(e.entered, rid, e.seqs) for rid, e in staying.items()
                   if not e.batch and e.rank > TIER_RANK["priority"] and not e.stream]
        return victims + self._victims(default, over_left, for_priority, grant_priority, priority_queued,
                                       exempt_realtime)

    @staticmethod
    def _victims(candidates: list[tuple[float, str, int]], over: int, for_queued: int,
                 grant: Callable[[int, int], int] | None, queued: int,
                 exempt: Callable[[list[str]], set[str]] | None) -> list[str]:
        """Of ``candidates`` ((entered, id, sequences)), the newest that free ``over`` sequences
        plus the ``for_queued`` the ``queued`` requests need, as far as ``grant`` allows."""
        if not candidates or over + for_queued <= 0:
            return []  # nothing wanted: the cap is not looked up
        candidates = sorted(candidates, reverse=True)
        skip = exempt([rid for _, rid, _ in candidates]) if exempt is not None else set()
        candidates = [c for c in candidates if c[1] not in skip]
        # Never more for the queued than these candidates can free (a claim it could not honour
        # would stop another worker from yielding).
        for_queued = min(for_queued, max(0, sum(seqs for _, _, seqs in candidates) - over))
        if for_queued and grant is not None:
            for_queued = grant(for_queued, queued)
        want = over + for_queued
        victims = []
        for _, rid, seqs in candidates:
            if want <= 0:
                break
            victims.append(rid)
            want -= seqs
        return victims
