"""The worker's engine runtime: one engine, one event loop thread, many task threads.

Celery runs tasks on a thread pool. Each task thread calls :meth:`EngineRuntime.run`, which
hands the request to the engine's event loop and blocks until it finishes. All requests in
flight share the one engine, which batches them continuously.

Four housekeeping threads run beside it:
* the governor feeds every engine step into the step curve and keeps the in-engine limit
  (``workers/governor.py``): it hands the limit to ``on_limit`` (the worker sets its Celery
  prefetch count to it, so the excess stays in the broker), says whether batch work yields
  (``batch_open``, which the worker's queue order reads before each fetch) and takes batch
  requests out of the engine when realtime waits for room (handed back, requeued, no attempt
  charged: ``ended_by="preempted"``);
* the cancel watcher polls Redis for cancel flags of in-flight requests and aborts them in
  the engine (one round trip per poll for all of them);
* the heartbeat refreshes this worker's Redis key (with engine stats), whose expiry tells the
  sweep that this worker died and its running requests must be requeued. It waits on nothing
  the engine holds (not its event loop), so a saturated engine or a starved host never makes a
  live worker look dead;
* the watchdog checks each heartbeat interval that the engine's event loop still answers and
  that an engine with work scheduled still takes steps; if not it exits the process (status 70)
  instead of holding requests hostage; the process manager restarts the worker and the sweep
  requeues what it was running.

Stopping (SIGTERM: a deploy, Ctrl-C under `sluice up`, `docker stop`) drains: Celery stops
taking messages, requests in flight may finish within the stop grace (the time limit by
default, so any request that could still succeed does), and whatever is left when it runs out,
or at a second SIGTERM, is aborted and handed back (``ended_by="shutdown"``): requeued, not
failed, and not counted as an attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass

import redis

from core.admission.load import capacity_entry, capacity_key, room_key
from core.broker.queues import queue_lists, tier_list
from core.delivery.streams import TokenSink
from core.rediskeys import cancel_key, node_key, stalled_key, worker_key
from models.lifecycle import stored_logprobs
from workers.engines import Engine, GenerationOutput, GenerationRequest, SamplingParams
from workers.engines.base import WARMUP_PREFIX, EngineDead
from workers.governor import PRIORITY_SAFETY, Governor
from workers.preemption import Claims

log = logging.getLogger(__name__)

# How long past its time limit an aborted request's stream may take to end before we stop
# waiting for the engine's final output.
ABORT_GRACE_S = 10.0
# How often a request waiting to go into the engine (for prefill credit or room) looks again.
PREFILL_WAIT_S = 0.02
# A prompt counted pending prefill longer than this (or 20 of the slowest steps lately) is
# taken as never seen by the steps.
PENDING_MAX_S = 10.0
# How often the governor learns from the engine's steps and sets the in-engine limit.
GOVERN_S = 0.25
# An engine with a free seat that no take filled for this long tops its queues up from their fair
# lines itself (one Lua call a second while it has room): the floor that needs no load monitor.
TOP_UP_FLOOR_S = 1.0
# How long a request that stalled the loop stays marked for the sweep (which acts within seconds).
STALLED_TTL_S = 86400
# The watchdog's patience: a step may take this many times the slowest one seen lately ...
STEP_GRACE = 4.0
# ... and an engine that says it is working on one, this many times more.
HUNG_FACTOR = 10.0
# "Working" is the engine using the CPU in any round of the watchdog within this long: on a host
# whose CPUs other processes take, a working engine may go a heartbeat without any. A stopped one
# uses none for far longer than this.
BUSY_WINDOW_S = 5.0
# Sequences of the warm-up burst that shows the step curve's slope before the first request.
WARMUP_BURST = 16
# Words of the warm-up prompts that show the price of a prompt token before the first request.
WARMUP_PROMPTS = (32, 128, 64, 256)


@dataclass(frozen=True)
class RunResult:
    output: GenerationOutput | None  # the last output seen; None if none arrived
    # time.monotonic() when the first token was produced: the row's stamp is the claim's
    # database time plus the offset from the claim, so this host's wall clock never enters it.
    first_token_mono: float | None
    # "finished" | "timeout" | "deadline" | "unreachable" (not started: it could not finish by its
    # deadline) | "cancel" | "shutdown" | "preempted" | "engine_abort"
    ended_by: str
    # time.monotonic() when the engine's stream ended: the row's finished_at is stamped from it as
    # the first token's is, so a write that waited (a slow link, a retry) does not move it
    finished_mono: float | None = None

    def first_token_after(self, mono: float) -> float | None:
        """Seconds from ``mono`` (a time.monotonic() reading) to the first token, or None."""
        return None if self.first_token_mono is None else self.first_token_mono - mono

    def finished_after(self, mono: float) -> float | None:
        """Seconds from ``mono`` to the end of the engine's stream, or None."""
        return None if self.finished_mono is None else self.finished_mono - mono


class EngineRuntime:
    WATCHDOG_EXIT_CODE = 70

    def __init__(self, engine: Engine, redis_client: redis.Redis, worker_id: str, *,
                 heartbeat_s: float, dead_after_s: float, cancel_poll_s: float,
                 governor: Governor, watchdog_s: float = 30.0, info: dict | None = None,
                 poison_prompt: str | None = None) -> None:
        self.engine = engine
        self._poison = poison_prompt  # SLUICE_FAULT_POISON_PROMPT: fault injection, see _run
        self.worker_id = worker_id
        self._redis = redis_client
        self._heartbeat_s = heartbeat_s
        self._dead_after_s = dead_after_s
        self._cancel_poll_s = cancel_poll_s
        self._watchdog_s = watchdog_s
        self.info = info or {}  # static facts for /readyz: node, role, model, device, queues
        self._loop = asyncio.new_event_loop()
        self._in_flight: set[str] = set()
        self._cancelled: set[str] = set()
        self._handed_back: set[str] = set()  # aborted by a stop: requeued, not ended
        self.draining = threading.Event()  # told to stop: take no new request
        self._handing_back = False  # the stop ran out: nothing more starts in the engine
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._background: set[asyncio.Future] = set()
        self._threads: list[threading.Thread] = []
        self._loop_thread: threading.Thread | None = None  # runs the engine's event loop, once started
        self.cold_start_s: float | None = None
        self.seq_tps: float | None = None  # decode tokens per second one sequence gets, smoothed
        self._sink: TokenSink | None = None  # token increments of streaming requests, to Redis
        self.governor = governor  # also knows which requests in flight are batch work
        self.on_limit = lambda limit: None  # the worker sets its prefetch count here
        # Called (outside any lock) when the engine's room grew, a request having left it or the
        # limit risen: the worker tops up its queues from their fair lines (core/broker/fair.py).
        self.on_room = lambda: None
        self._room_seen = 0
        self._topped_up_at = 0.0  # monotonic: when on_room last ran
        # The seats batch work may hold here: set by a worker that serves realtime too and keeps
        # threads for it (workers/bootstrap.py BatchSlots); None: every seat.
        self.batch_cap: int | None = None
        self._arriving: set[str] = set()  # messages received, not yet in the governor's hands
        self.limit = self.governor.max_seqs
        # The highest limit governed since start: the engine never holds more than this (a lowered
        # limit takes nobody out; those in the engine finish), so max_batch_seen is checked against it.
        self.limit_peak = 0
        self.prefill_cap = 0  # prompt tokens a step may prefill, as last told to the engine (0: no cap)
        self._batch_open = True
        self._preempted: set[str] = set()
        self._slowest_step_s = 0.0
        # The broker's lists the messages of the realtime queues it reads wait in (one per service
        # tier's step), and of those the priority tier's: counted every governor round.
        realtime = [q for q in self.info.get("queues", ()) if q.startswith("realtime.")]
        self._realtime_lists = [key for queue in realtime for key in queue_lists(queue)]
        self._priority_lists = {tier_list(queue, "priority") for queue in realtime}
        # The classes this engine serves: where its room goes each time a request enters or leaves.
        model = self.info.get("model")
        queues = self.info.get("queues", ()) if model else ()
        heads = sorted({q.split(".", 1)[0] for q in queues} & {"realtime", "batch"})
        self._room_heads = heads
        self._room_keys = [room_key(head, model) for head in heads]
        # ... and where each heartbeat states what it drains: the promise's figures while the monitor is away.
        self._capacity_keys = [capacity_key(head, model) for head in heads]
        self._room_written: list[str] | None = None
        # Preemptions for queued realtime are claimed fleet-wide: one queued request, one worker
        # yields; those of default work for the priority tier's queued requests apart.
        self._claims = Claims(redis_client, worker_id, model, lists=self._realtime_lists) if model else None
        self._priority_claims = (Claims(redis_client, worker_id, model, tier="priority",
                                        lists=sorted(self._priority_lists)) if model else None)
        self._room_lock = threading.RLock()  # drain() may run in a signal handler
        self._learn_lock = threading.Lock()
        self._governing = False  # the governor thread runs: requests waiting to go in learn steps too
        self._gate_ticked = 0.0  # when a request waiting to go in last learned the steps for all

    # ------------------------------------------------------------------ lifecycle

    @property
    def node(self) -> str | None:
        """The Celery node name, which names this worker's direct queue."""
        return self.info.get("node")

    def start(self) -> None:
        """Start the loop, load the engine and run one warm-up generation; then start watchers."""
        began = time.monotonic()
        loop_thread = threading.Thread(target=self._loop.run_forever, name="engine-loop", daemon=True)
        loop_thread.start()
        self._threads.append(loop_thread)
        self._loop_thread = loop_thread
        self._call(self.engine.start())
        # Twice: the first run pays for lazy initialisation; the second measures a sequence's speed.
        for attempt in range(2):
            warmup = self._warm_request(f"{WARMUP_PREFIX}{attempt}-{self.worker_id}", "warm up")
            result = self._call(self._run(warmup, 120.0, "timeout"))
            if attempt == 0:
                self.engine.step_samples()  # its steps paid for the lazy start: not the engine's price
        self._learn_speed(result)
        self._call(self._warm_burst())
        self._call(self._warm_prefill())
        self.govern_once()  # the first heartbeat already reports the learned limit
        self.cold_start_s = time.monotonic() - began
        log.info("engine %s warm in %.2fs; %s", self.engine.name, self.cold_start_s, self._curve_text())
        self._governing = True
        for target, name in ((self._watch_cancels, "cancel-watcher"), (self._heartbeat, "heartbeat"),
                             (self._watchdog, "watchdog"), (self._govern, "governor")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    async def _warm_burst(self) -> None:
        """One batch of sequences decoding together: the step curve sees the price of a sequence
        before the first request does."""
        n = min(WARMUP_BURST, self.governor.max_seqs)
        if n < 2:
            return
        ids = [f"{WARMUP_PREFIX}burst-{i}-{self.worker_id}" for i in range(n)]
        await asyncio.gather(*(self._run(self._warm_request(rid, f"warm up {i}"), 120.0, "timeout")
                               for i, rid in enumerate(ids)))

    async def _warm_prefill(self) -> None:
        """Prompts of a few sizes, one after another, beside a sequence decoding all along (an
        engine times a step from the one before it, so a step after an idle spell shows nothing):
        the step curve sees the price of a prompt token (what the promise prices a request's
        prefill at) before the first request does. Words no two prompts share, so the prefix cache
        cannot hold them."""
        if self.engine.embeds or self.governor.max_seqs < 2:
            return
        carrier = GenerationRequest(request_id=f"{WARMUP_PREFIX}carrier-{self.worker_id}", prompt="carry on",
                                    params=SamplingParams(max_tokens=100_000, ignore_eos=True))
        beside = asyncio.ensure_future(self._run(carrier, 600.0, "timeout"))
        try:
            for _ in range(500):  # until it decodes
                if self.engine.stats().running > 0 or beside.done():
                    break
                await asyncio.sleep(0.01)
            for i, words in enumerate(WARMUP_PROMPTS):
                prompt = " ".join(f"w{i}x{k}" for k in range(words))
                request = GenerationRequest(request_id=f"{WARMUP_PREFIX}prefill-{i}-{self.worker_id}", prompt=prompt,
                                            prompt_tokens=words * 3,
                                            params=SamplingParams(max_tokens=2, ignore_eos=True))
                # Counted as batch prefill: not the prefill realtime traffic brings, which the limit
                # makes room for.
                self._learn_steps()
                self.governor.curve.note_prefill(words * 8, batch=True, request_id=request.request_id)
                try:
                    await self._run(request, 120.0, "timeout")
                    self._learn_steps()
                    # Counted generously (words of unknown tokens): what its steps did not take is
                    # not the start of the next prompt, whose chunks' offsets the curve follows.
                    self.governor.curve.forget(request.request_id)
                except Exception:  # a model whose context is shorter: its price is learned from traffic
                    log.info("warm-up prompt of %d words refused; the prefill price is learned from traffic", words)
                    return
        finally:
            await self.engine.abort(carrier.request_id)
            with contextlib.suppress(Exception):
                await beside
            self._learn_steps()  # its steps, while its prompts are still counted as batch prefill
            self.governor.curve.expire(time.monotonic() + 1)  # then nothing of the warm-up is pending
            self.governor.curve.hold_token_floor()  # measured idle: never priced below half of it

    def _warm_request(self, request_id: str, prompt: str) -> GenerationRequest:
        """A warm-up: eight tokens generated, or (an embedding model's engine) one text embedded."""
        if self.engine.embeds:
            return GenerationRequest(request_id=request_id, prompt="", params=SamplingParams(max_tokens=1),
                                     texts=(prompt,))
        return GenerationRequest(request_id=request_id, prompt=prompt, params=SamplingParams(max_tokens=8,
                                                                                             ignore_eos=True))

    def _curve_text(self) -> str:
        coef = self.governor.curve.coefficients()
        if coef is None:
            return "step curve unknown (the engine reports no steps): the whole engine is open"
        a, b, c = coef
        d = self.governor.curve.attention_s()
        return (f"step {a * 1e3:.2f} ms + {b * 1e3:.3f} ms/sequence + {c * 1e6:.1f} us/prompt token "
                f"+ {d * 1e9:.2f} ns/prompt token/token of context; in-engine limit {self.governor.limit()}")

    def stop(self) -> None:
        self._stop.set()
        # The heartbeat and the governor write what the cleanup below deletes: each finishes its
        # round first (a Redis call is bounded by its timeout), or a round under way would write
        # this worker's entries back after they were deleted.
        for thread in self._threads:
            if thread.name in ("heartbeat", "governor") and thread is not threading.current_thread():
                thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self._call(self.engine.shutdown(), timeout=30)
        with contextlib.suppress(Exception), self._room_lock:  # requests still ending write no room now
            for key in (*self._room_keys, *self._capacity_keys):
                self._redis.hdel(key, self.worker_id)
            self._redis.delete(worker_key(self.worker_id))
            owner = json.loads(self._redis.get(node_key(self.node)) or "{}") if self.node else {}
            if owner.get("worker") == self.worker_id:
                self._redis.delete(node_key(self.node))
        self._loop.call_soon_threadsafe(self._loop.stop)

    # ------------------------------------------------------------------ requests

    def run(self, request: GenerationRequest, time_limit_s: float, deadline_in_s: float | None = None,
            deadline_s: float | None = None) -> RunResult:
        """Run ``request`` to completion; abort it on cancel, on its time limit (``timeout``) or at
        its deadline when that comes first (``deadline``). Blocking.

        ``deadline_s`` is the whole deadline it was admitted with (creation to deadline): the pace
        it sets for the in-engine limit. Not what is left of it: the promise at arrival already
        counted the queue wait, and a limit set by what requests that waited have left would fall
        with every wait, slowing the engine's throughput just when a queue forms."""
        rid = request.request_id
        limit, ends_as = time_limit_s, "timeout"
        if deadline_in_s is not None and deadline_in_s < time_limit_s:
            limit, ends_as = max(0.0, deadline_in_s), "deadline"
        prompt_tokens = request.prompt_tokens or 1
        need_s = (self.governor.tokens_take_s(request.params.max_tokens, prompt_tokens, request.batch)
                  if ends_as == "deadline" else None)
        if need_s is not None and deadline_s is not None and limit < need_s <= deadline_s:
            # Its queue wait left too little: run, it would be aborted at the deadline with its
            # tokens computed for nobody, and slow everything beside it meanwhile. (One whose whole
            # deadline was too short by the curve runs: admission let it in to measure, and a
            # curve learned under load may be wrong.)
            if request.stream:
                self._token_sink().end(rid, "unreachable")
            return RunResult(None, None, "unreachable")
        with self._lock:
            if self._handing_back:  # claimed in the instant the stop ran out: never started
                return RunResult(None, None, "shutdown")
            self._in_flight.add(rid)
            self._arriving.discard(rid)  # its seat is counted in the governor from here
        # The limit counts sequences: n choices decode side by side, an embeddings request's texts
        # are embedded side by side.
        seqs = len(request.texts) if request.texts is not None else request.params.n
        self.governor.enter(rid, batch=request.batch, max_tokens=request.params.max_tokens,
                            deadline_s=next((d for d in (deadline_s, deadline_in_s) if d is not None), time_limit_s),
                            seqs=seqs, prompt_tokens=prompt_tokens, rank=request.priority, stream=request.stream)
        self.write_room()
        began = time.monotonic()
        try:
            ended = self._await_start(rid, prompt_tokens, request.batch, limit, ends_as)
            if ended is not None:
                # Never reached the engine: handed back (preempted, stopped), ended (cancelled) or
                # out of time before it could go in.
                if request.stream:
                    self._token_sink().end(rid, ended)
                return RunResult(None, None, ended)
            # The wait before the engine came out of its time: what is left is the engine's.
            limit -= time.monotonic() - began
            self.write_room()
            if limit <= 0:  # its deadline (or time limit) passed before it could go in
                if request.stream:
                    self._token_sink().end(rid, ends_as)
                return RunResult(None, None, ends_as)
            # The engine ends every stream by limit + ABORT_GRACE_S; past that the loop itself
            # is stuck and the watchdog is about to restart this worker.
            try:
                result = self._call(self._run(request, limit, ends_as), timeout=limit + ABORT_GRACE_S + 30)
            except EngineDead as exc:
                self._die(str(exc))
            if result.ended_by == "cancel":  # aborted in the engine: by whom?
                result = dataclasses.replace(result, ended_by=self._why_stopped(rid))
            self._learn_speed(result)
            if request.stream:
                self._token_sink().end(rid, result.ended_by)
            return result
        finally:
            self.governor.leave(rid)
            with self._lock:
                self._in_flight.discard(rid)
                self._cancelled.discard(rid)
                self._handed_back.discard(rid)
                self._preempted.discard(rid)
            self.write_room()

    def _why_stopped(self, rid: str) -> str:
        """How a request that was stopped ends: handed back by a stop (``shutdown``) or by a
        preemption (``preempted``), both requeued; cancelled by its client (``cancel``); else it was
        aborted by nobody here, so the engine is shutting down (``engine_abort``)."""
        with self._lock:
            if rid in self._handed_back:
                return "shutdown"
            if rid in self._cancelled:
                return "cancel"
            return "preempted" if rid in self._preempted else "engine_abort"

    def room(self) -> int:
        """Sequences this engine would take in now: its limit less the sequences it holds and the
        requests on their way to it (messages this worker received that have not entered yet)."""
        return max(0, self.limit - self.governor.seqs() - len(self._arriving))

    def arriving(self, request_id: str) -> None:
        """This worker received ``request_id``'s message: its seat is spoken for from now, not from
        when it enters the engine (the fair lines fill free seats, and must not fill this one twice)."""
        with self._lock:
            self._arriving.add(request_id)
        self.write_room()

    def arrived(self, request_id: str) -> None:
        """``request_id``'s message is done with (run, handed back, or never ours to run)."""
        with self._lock:
            if request_id not in self._arriving:
                return
            self._arriving.discard(request_id)
        self.write_room()

    def room_entries(self) -> list[str]:
        """What admission reads of this engine, live (``core/admission/load.py`` ROOM_PREFIX), one
        entry per class it serves (``_room_keys``' order): its room, the engine seconds of prefill
        ahead of a request of that class that came now, the speed a sequence would get if it
        came now (one more than it holds, tokens per second), the room a priority request
        would have (a realtime class's default and flex work leaves for it: ``Governor.preempt``),
        and the seats its class's fair line may fill (``core/broker/lua/fair.lua``): for a realtime
        class, those batch work does not keep from it either (batch yields to the realtime messages
        it sees queued, and is preempted for them), less the messages on their way here."""
        if self.draining.is_set():
            return ["0 0 0 0 0"] * len(self._room_heads)
        room = self.room()
        seq = self.governor.curve.seq_tps(min(self.governor.seqs() + 1, max(1, self.limit))) or 0.0
        ahead = max(0, self.limit - self.governor.kept_from_priority())
        realtime = max(0, self.limit - self.governor.realtime_seqs() - len(self._arriving))
        return [f"{room} {self.governor.backlog_s(head == 'batch'):.2f} {seq:.2f} "
                + (f"{room} {room}" if head == "batch" else f"{ahead} {realtime}")
                for head in self._room_heads]

    def write_room(self, force: bool = False) -> None:
        """Tell admission how many requests this engine would take in now (its limit less what it
        holds), when that changed: the promise then sees a full engine at once, not a heartbeat
        (seconds) later. Best effort: without Redis the heartbeat's figure stands."""
        if not self._room_keys:
            return
        with self._room_lock:  # computed and written in one go: a later figure never loses to an older
            if self._stop.is_set():  # stopped: its entries are deleted (stop), not written again
                return
            room = self.room_entries()
            seats = 0 if self.draining.is_set() else self.room()
            grew, self._room_seen = seats > self._room_seen, seats
            if room == self._room_written and not force:
                written = False
            else:
                try:
                    with self._redis.pipeline(transaction=False) as pipe:
                        for key, entry in zip(self._room_keys, room, strict=True):
                            pipe.hset(key, self.worker_id, entry)
                        pipe.execute()
                    self._room_written, written = room, True
                except redis.RedisError as exc:
                    self._room_written, written = None, False
                    log.warning("could not write the engine's room (%s)", type(exc).__name__)
        if grew and written:
            self._top_up()

    def _top_up(self) -> None:
        self._topped_up_at = time.monotonic()
        try:
            self.on_room()
        except Exception:  # the next governor round with room left, or the load monitor, tries again
            log.warning("could not top up the queues from their fair lines", exc_info=True)

    def _await_start(self, rid: str, prompt_tokens: int, batch: bool, limit_s: float, ends_as: str) -> str | None:
        """Wait until the governor lets this request into the engine (``Governor.take_prefill``:
        realtime first and in order, within the limit in sequences, a realtime burst's prompts one
        step budget at a time, batch prompts beside realtime once the slack of the engine's steps
        pays for them). While requests wait the steps are learned every poll, not every governor
        round: the prefill they wait for is seen done within a poll. None when it may go in; else
        how it ends without the engine: stopped while it waited (``_why_stopped``), or it waited
        ``limit_s``: a realtime request ends as ``ends_as`` (its deadline or time limit passed), a
        batch request goes back to its queue (``preempted``: no attempt spent)."""
        began = time.monotonic()
        while not self.governor.take_prefill(prompt_tokens, rid, batch):
            with self._lock:
                stopped = rid in self._cancelled or rid in self._preempted or self._handing_back
            if stopped:
                return self._why_stopped(rid)
            if time.monotonic() - began >= limit_s:
                return "preempted" if batch else ends_as
            time.sleep(PREFILL_WAIT_S)
            self._gate_tick()
        return None

    def _gate_tick(self) -> None:
        """What a poll at the gate does for all who wait, at most once a poll whoever many wait:
        learn the steps taken (the prefill they wait for) and tell admission the backlog left."""
        now = time.monotonic()
        with self._lock:
            if now - self._gate_ticked < PREFILL_WAIT_S:
                return
            self._gate_ticked = now
        if self._governing:
            self._learn_steps()
        self.write_room()

    def _token_sink(self) -> TokenSink:
        with self._lock:
            if self._sink is None:
                self._sink = TokenSink(self._redis)
            return self._sink

    def in_flight(self) -> int:
        """Requests this worker runs now (claimed, not finished)."""
        with self._lock:
            return len(self._in_flight)

    def realtime_in_flight(self) -> int:
        """Requests of realtime priority this worker runs now (claimed, not finished)."""
        total, batch = self.governor.in_engine()
        return total - batch

    def drain(self, grace_s: float) -> None:
        """Stop: take nothing new, let what runs finish for ``grace_s``, then hand the rest back.
        Called again (a second SIGTERM), it hands back what runs at once."""
        if self.draining.is_set():
            log.warning("stopping now: handing back %d requests in flight", len(self._in_flight))
            self.hand_back()
            return
        self.draining.set()
        self.write_room()  # none: it takes nothing new
        with contextlib.suppress(redis.RedisError):  # nor does it drain anything new
            for key in self._capacity_keys:
                self._redis.hdel(key, self.worker_id)
        log.warning("stopping: %d requests in flight may finish within %.0fs; the rest are requeued",
                    len(self._in_flight), grace_s)
        threading.Thread(target=self._drain, args=(grace_s,), name="drain", daemon=True).start()

    def _drain(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.2)
        if self._in_flight:
            log.warning("stop grace over: handing back %d requests in flight", len(self._in_flight))
        # Always: a request claimed as the stop began may reach run() only now; it must be handed
        # back at once, not run to its end after the grace (it was not in flight to be waited for).
        self.hand_back()

    def hand_back(self) -> None:
        """Abort every request in flight so its task requeues it (``ended_by="shutdown"``)."""
        with self._lock:
            self._handing_back = True
            ids = list(self._in_flight)
            self._handed_back.update(ids)
        for rid in ids:
            asyncio.run_coroutine_threadsafe(self.engine.abort(rid), self._loop)

    async def _run(self, request: GenerationRequest, time_limit_s: float, ends_as: str) -> RunResult:
        rid = request.request_id
        timed_out = False
        if self._poison and self._poison in request.prompt:
            log.error("poisoned (SLUICE_FAULT_POISON_PROMPT): request %s blocks the loop now", rid)
            while True:
                time.sleep(3600)  # blocks the event loop itself, inside this request's own code

        def over_limit() -> None:
            # Abort inside the engine: it frees the KV cache and ends the stream with a final
            # output that still carries what was generated so far.
            nonlocal timed_out
            timed_out = True
            task = asyncio.ensure_future(self.engine.abort(rid))
            self._background.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._background.discard)

        timer = asyncio.get_running_loop().call_later(time_limit_s, over_limit)
        last: GenerationOutput | None = None
        first_token_mono: float | None = None
        sink, sent = (self._token_sink() if request.stream else None), 0  # chars of text streamed
        marks: dict[int, tuple[int, int]] = {}  # per choice: (chars, logprobs) streamed
        try:
            # Backstop for an engine that never ends an aborted stream. aclosing: leaving early
            # must close the engine's generator now (aborting the sequence), not at GC time.
            async with asyncio.timeout(time_limit_s + ABORT_GRACE_S):
                async with contextlib.aclosing(self.engine.generate(request)) as stream:
                    async for out in stream:
                        if first_token_mono is None and out.output_tokens > 0:
                            first_token_mono = time.monotonic()
                            if out.first_token_time:  # the engine's own (wall-clock) stamp is earlier
                                first_token_mono -= max(0.0, time.time() - out.first_token_time)
                        if sink is not None and out.choices:  # n > 1 or logprobs: per choice
                            _push_choices(sink, rid, out.choices, marks)
                        elif sink is not None and len(out.text) > sent:
                            sink.push(rid, out.text[sent:], out.output_tokens)  # queued: never blocks
                            sent = len(out.text)
                        last = out
        except TimeoutError:
            await self.engine.abort(rid)
            timed_out = True
        finally:
            timer.cancel()
        ended = time.monotonic()
        if timed_out:
            return RunResult(last, first_token_mono, ends_as, ended)
        cancelled = last is not None and last.finish_reason == "abort"
        return RunResult(last, first_token_mono, "cancel" if cancelled else "finished", ended)

    def _learn_speed(self, result: RunResult) -> None:
        """Fold one run's decode speed (tokens after the first, per second) into ``seq_tps``,
        the speed one sequence gets, which the heartbeat reports to the load monitor."""
        out, first = result.output, result.first_token_mono
        # One sequence's tokens: n choices decode side by side, each at a sequence's speed.
        tokens = max((c.output_tokens for c in out.choices), default=out.output_tokens) if out else 0
        if first is None or tokens < 2:
            return
        elapsed = time.monotonic() - first
        if elapsed <= 0:
            return
        rate = (tokens - 1) / elapsed
        self.seq_tps = rate if self.seq_tps is None else 0.8 * self.seq_tps + 0.2 * rate

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _blame(self, why: str) -> str:
        """Mark the requests whose own code holds the stalled loop (``_stalling``) in Redis, so
        that the sweep fails them instead of requeueing them into the next worker (a schema that
        asks the engine for an unbounded answer would kill that one too); ``why``, naming them.
        A loop stuck in the engine's own step blames nobody: every request there is requeued."""
        culprits = self._stalling()
        for rid in culprits:
            try:
                self._redis.set(stalled_key(rid), why, ex=STALLED_TTL_S)
            except Exception:  # dying anyway: the sweep then requeues it, up to its attempts
                log.warning("could not mark %s as the request that stalled the loop", rid, exc_info=True)
        return f"{why}, inside request {', '.join(culprits)}" if culprits else why

    def _stalling(self) -> list[str]:
        """The requests in flight whose own code the engine loop's thread is in now: a frame of
        its stack holding a local ``request`` (a GenerationRequest) of one of them. Empty when the
        loop is stuck in code every request shares (the engine's step)."""
        thread = self._loop_thread
        frame = sys._current_frames().get(thread.ident) if thread is not None else None
        with self._lock:
            in_flight = set(self._in_flight)
        found: list[str] = []
        while frame is not None:
            request = frame.f_locals.get("request")
            rid = request.request_id.split("#", 1)[0] if isinstance(request, GenerationRequest) else None
            if rid in in_flight and rid not in found:
                found.append(rid)
            frame = frame.f_back
        return found

    def _die(self, why: str) -> None:
        """Exit now: rows stay `running`, the heartbeat stops, the sweep requeues them. The
        engine's own processes go first: a hung engine core (stopped, or stuck in a device call)
        would outlive the worker and hold its memory, on a GPU host the device's, so the restarted
        worker could not load its model."""
        log.critical("watchdog: %s; exiting so the worker restarts and its requests are requeued", why)
        _kill_descendants()
        os._exit(self.WATCHDOG_EXIT_CODE)

    # ------------------------------------------------------------------ housekeeping

    def _watch_cancels(self) -> None:
        while not self._stop.wait(self._cancel_poll_s):
            with self._lock:
                ids = list(self._in_flight)
                handed_back = list(self._handed_back)
            # A hand-back's abort, like a cancel's, is a no-op if the request had not reached the
            # engine yet: repeat it on every poll until the request is gone.
            for rid in handed_back:
                asyncio.run_coroutine_threadsafe(self.engine.abort(rid), self._loop)
            if not ids:
                continue
            try:
                flags = self._redis.mget([cancel_key(i) for i in ids])
            except Exception:  # this thread must outlive any error, or cancels stop working
                log.warning("cancel watcher: Redis unreachable; retrying", exc_info=True)
                continue
            for rid, flag in zip(ids, flags, strict=True):
                if flag is None:
                    continue
                # Abort again on every poll while the flag stands: if the request had not reached
                # the engine yet, the first abort was a no-op.
                with self._lock:
                    self._cancelled.add(rid)
                asyncio.run_coroutine_threadsafe(self.engine.abort(rid), self._loop)

    def _check_progress(self, stalled_s: float, busy: bool | None) -> None:
        """The engine has work scheduled and took no step for ``stalled_s``: exit if it is hung.

        Slow is not hung: while the engine says it is working on a step (``busy``: ``Engine.busy``
        in any of the watchdog's rounds within ``BUSY_WINDOW_S``, its processes using the CPU) the
        watchdog waits, up to ``HUNG_FACTOR`` times longer, and the limit is the longer of
        ``watchdog_s`` and ``STEP_GRACE`` times the slowest step seen lately, so a saturated or
        CPU-starved engine never trips it. An engine that
        works on nothing (a hung engine-core process) is restarted after ``watchdog_s``."""
        allowed = max(self._watchdog_s, STEP_GRACE * self._slowest_step_s)
        if stalled_s <= allowed:
            return
        if busy and stalled_s <= HUNG_FACTOR * allowed:
            log.warning("engine took no step for %.0fs but is working: slow, not hung", stalled_s)
            return
        self._die(f"engine made no progress for {stalled_s:.0f}s with work scheduled")

    def batch_open(self) -> bool:
        """Whether batch work may enter this engine now (read before each fetch from the broker)."""
        return self._batch_open

    def _learn_steps(self) -> None:
        with self._learn_lock:  # the governor thread and requests waiting to go in both call it
            samples = self.engine.step_samples()
            if samples:
                self._slowest_step_s *= 0.99 ** len(samples)  # the slowest step seen lately, fading
            for sample in samples:
                self.governor.curve.add(sample)
                self._slowest_step_s = max(self._slowest_step_s, sample.seconds)
            # What the step budget leaves for prompts now: the engine chunks them to it.
            self.prefill_cap = self.governor.prefill_cap_tokens()
            self.engine.set_prefill_cap(self.prefill_cap)
            # A prompt counted pending that no step showed for this long never reached the
            # prefill as counted (the engine took it in a way its steps do not report).
            self.governor.curve.expire(time.monotonic() - max(PENDING_MAX_S, 20 * self._slowest_step_s))

    def _realtime_queued(self) -> tuple[int, int]:
        """Realtime messages waiting in the broker on the realtime queues this worker reads, and
        of those the priority tier's (its step's list, core/broker/queues.py MESSAGE_PRIORITY):
        the broker's own lists, not the class counters (those can drift between the monitor's
        re-counts, and a stale count must never keep batch work out)."""
        if not self._realtime_lists:
            return 0, 0
        try:
            with self._redis.pipeline(transaction=False) as pipe:
                for key in self._realtime_lists:  # each service tier's messages wait in a list of their own
                    pipe.llen(key)
                counts = [int(n or 0) for n in pipe.execute()]
        except redis.RedisError:
            return 0, 0  # unknown: batch keeps its place; the level and the promise still protect realtime
        return sum(counts), sum(n for key, n in zip(self._realtime_lists, counts, strict=True)
                                if key in self._priority_lists)

    def govern_once(self) -> None:
        """One round: learn from the steps taken, set the limit, let batch in or not, preempt."""
        self._learn_steps()
        limit = self.governor.limit()
        if limit != self.limit:
            log.info("in-engine limit %d -> %d (%s)", self.limit, limit, self._curve_text())
        self.limit, self.limit_peak = limit, max(self.limit_peak, limit)
        self.write_room()
        # A take can leave a free seat unfilled: several takers at once each count a message in the
        # instant it is both pushed and still marked on its way, or one in a worker's hands before
        # it is received. No later take comes until a request leaves, or the load monitor's tick,
        # and without a monitor never: so an engine with room looks at its lines itself.
        if not self.draining.is_set() and self.room() > 0 and time.monotonic() - self._topped_up_at >= TOP_UP_FLOOR_S:
            self._top_up()
        try:
            self.on_limit(limit)
        except Exception:
            log.warning("could not set the prefetch count to the in-engine limit", exc_info=True)
        queued, priority = self._realtime_queued()
        self._batch_open = not self.governor.batch_yields(queued)
        with self._lock:
            leaving = set(self._preempted)
        claims, ahead = self._claims, self._priority_claims
        victims = [] if self._handing_back else self.governor.preempt(
            queued, claims.grant if claims else None, claims.exhausted if claims else None, leaving,
            priority_queued=priority, grant_priority=ahead.grant if ahead else None,
            exempt_realtime=ahead.exhausted if ahead else None)
        if claims and queued <= 0:
            claims.release()
        if ahead and priority <= 0:
            ahead.release()
        if victims:
            if claims:
                claims.count(victims)
            log.info("preempting %d request(s) (%d realtime queued, %d of the priority tier; limit %d)",
                     len(victims), queued, priority, limit)
            with self._lock:
                self._preempted.update(victims)
            for rid in victims:
                asyncio.run_coroutine_threadsafe(self.engine.abort(rid), self._loop)

    def _govern(self) -> None:
        while not self._stop.wait(GOVERN_S):
            try:
                self.govern_once()
            except Exception:  # this thread must outlive any error, or the limit freezes
                log.warning("governor round failed; retrying", exc_info=True)

    def engine_view(self) -> dict:
        """What the heartbeat reports of the limit: the monitor's promise is computed from it."""
        view = {"engine_limit": self.limit, "engine_limit_peak": self.limit_peak, "room": self.room(),
                "seqs": self.governor.seqs(),
                "slot_wait_s": round(self.governor.slot_wait_s(self.limit), 3),
                "batch_open": self._batch_open, "pace_ms": round(self.governor.pace_s() * 1e3, 2),
                "prefill_cap": self.prefill_cap}
        if self.batch_cap is not None:
            # The most batch work holds here: the monitor prices the batch class's drain by it
            # (core/admission/load.py decode_drain). Fewer batch requests may *start* while realtime
            # runs, but a backlog fills the seats in realtime's gaps and keeps them: beside a
            # realtime stream of 2 questions a second, batch held 47-48 of its 48.
            view["batch_seats"] = self.batch_cap
        curve = self.governor.curve
        coef = curve.coefficients()
        if coef is not None:
            # Each sequence's speed at the limit: the slowest a request admitted now will run. The
            # promise prices a request in engine time: its prompt of P tokens at P × prefill_s_tok
            # + P² × prefill_s_tok2 (its attention; the prefix cache's share taken off), its output
            # at what the engine decodes at the limit with no prefill in its steps (decode_tps);
            # backlog_s of prefill is ahead of it here.
            step_base, step_seq = self.governor.step_line()
            view.update(limit_seq_tps=round(curve.seq_tps(self.limit), 3), idle_seq_tps=round(curve.seq_tps(1), 3),
                        decode_tps=round(self.limit / curve.step_s(self.limit, 0), 3),
                        prefill_s_tok=round(self.governor.prompt_token_s(), 7),
                        prefill_s_tok2=float(f"{self.governor.prompt_square_s():.4g}"),
                        cached_share=round(curve.cached_share(), 3), slowdown=round(curve.slowdown(), 2),
                        backlog_s=round(self.governor.backlog_s(), 3),
                        realtime_backlog_s=round(self.governor.backlog_s(batch=False), 3),
                        # The limit's line (a step is step_base_s + step_seq_s × sequences) and the
                        # share of its deadline a priority request decodes in: the speed the
                        # priority tier is promised at (admit.lua).
                        step_base_s=float(f"{step_base:.4g}"), step_seq_s=float(f"{step_seq:.4g}"),
                        priority_safety=PRIORITY_SAFETY,
                        step_ms=[round(coef[0] * 1e3, 3), round(coef[1] * 1e3, 4), round(coef[2] * 1e6, 2),
                                 round(curve.attention_s() * 1e9, 3)])
        return view

    def _heartbeat(self) -> None:
        """Prove this worker alive every ``heartbeat_s``, from this thread alone. Nothing here waits
        on the engine's event loop (which a busy engine, or a host whose CPUs other processes take,
        can hold for seconds): a live worker must never look dead to the sweep, however loaded.
        Whether the loop and the engine still move is the watchdog's to judge (``_watchdog``)."""
        while True:
            try:
                stats = asdict(self.engine.stats())
                stats.update(self.info, worker=self.worker_id, in_flight=len(self._in_flight),
                             batch_in_flight=self.governor.in_engine()[1],
                             cold_start_s=self.cold_start_s, seq_tps=self.seq_tps, at=time.time(),
                             **self.engine_view())
                ttl = max(1, int(self._dead_after_s))
                seconds, micros = self._redis.time()  # the clock admission compares the entry with
                at_ms = seconds * 1000 + micros // 1000
                with self._redis.pipeline(transaction=False) as pipe:
                    pipe.set(worker_key(self.worker_id), json.dumps(stats), ex=ttl)
                    for head, key in zip(self._room_heads, self._capacity_keys, strict=True):
                        capacity = None if self.draining.is_set() else capacity_entry(stats, at_ms, head == "batch")
                        if capacity is None:
                            pipe.hdel(key, self.worker_id)
                        else:
                            pipe.hset(key, self.worker_id, capacity)
                    if self.node:
                        pipe.set(node_key(self.node), json.dumps(
                            {"worker": self.worker_id, "queues": self.info.get("queues", [])}), ex=ttl)
                    pipe.execute()
            except Exception:  # this thread must outlive any error, or the sweep declares us dead
                log.warning("heartbeat: Redis unreachable; retrying", exc_info=True)
            self.write_room(force=True)  # again, should the monitor have dropped it meanwhile
            if self._stop.wait(self._heartbeat_s):
                return

    def _watchdog(self) -> None:
        """Every heartbeat interval: does the engine's event loop still answer (within
        ``watchdog_s``), and does an engine with work scheduled still take steps? Exit if not
        (``_die``): the process manager restarts the worker and the sweep requeues its requests."""
        last_steps, last_progress = -1, time.monotonic()
        last_busy = -math.inf  # when the engine was last seen using the CPU
        while not self._stop.wait(self._heartbeat_s):
            answered = threading.Event()
            try:
                self._loop.call_soon_threadsafe(answered.set)
            except RuntimeError:  # the loop is closed: the worker is stopping
                return
            if not answered.wait(self._watchdog_s) and not self._stop.is_set():
                self._die(self._blame(f"engine loop unresponsive for {self._watchdog_s:.0f}s"))
            try:
                engine_stats = self.engine.stats()
                # Every round, so that it measures the last interval: asked only once a stall had
                # passed the patience, its first answer (None: no interval yet) let the first stall
                # of a busy vLLM engine core kill the worker.
                busy = self.engine.busy()
                if busy:
                    last_busy = time.monotonic()
                elif busy is not None:
                    busy = time.monotonic() - last_busy <= BUSY_WINDOW_S
                scheduled = self._in_flight or engine_stats.running + engine_stats.waiting > 0
                if engine_stats.steps != last_steps or not scheduled:
                    last_steps, last_progress = engine_stats.steps, time.monotonic()
                else:
                    self._check_progress(time.monotonic() - last_progress, busy)
            except Exception:  # this thread must outlive any error, or a hung engine keeps its requests
                log.warning("watchdog round failed; retrying", exc_info=True)


def _push_choices(sink: TokenSink, request_id: str, choices: tuple, marks: dict[int, tuple[int, int]]) -> None:
    """Push what each choice (an engine output's, cumulative) added since ``marks`` (per choice:
    characters and logprobs sent), and move the marks."""
    for i, choice in enumerate(choices):
        sent, logged = marks.get(i, (0, 0))
        logprobs = choice.logprobs or ()
        if len(choice.text) > sent or len(logprobs) > logged:
            sink.push(request_id, choice.text[sent:], choice.output_tokens, i,
                      None if choice.logprobs is None else stored_logprobs(logprobs[logged:]))
            marks[i] = (len(choice.text), len(logprobs))


def _kill_descendants() -> None:
    """SIGKILL every process this one started (vLLM's engine core and its helpers), even one that
    is stopped: SIGKILL needs no cooperation. Without psutil (installed with vLLM, the only engine
    that starts processes) there is nothing to kill."""
    try:
        import psutil
    except ImportError:
        return
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
