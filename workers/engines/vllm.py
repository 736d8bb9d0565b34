"""vLLM behind the engine interface: the only module in Sluice that imports vllm.

One ``AsyncLLM`` per worker process, with prefix caching and priority scheduling on. All
calls run on the runtime's event loop thread; vLLM's engine core runs in a child process it
spawns itself and batches every request in flight continuously (``max_num_seqs`` sequences and
``max_num_batched_tokens`` tokens per step at most). Its scheduler is vLLM's own with the worker's
prefill cap (``_Governed``): long prompts chunked so that no step outlasts what the realtime
requests decoding in it can afford, the better priority's prompts prefilled first.

Engine statistics come from a stat logger that vLLM calls on the event loop after every step
(and after aborts), so ``stats()`` reads plain attributes and is safe from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import struct
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from workers.engines.base import (
    Choice,
    ConstraintError,
    Engine,
    EngineDead,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    RequestRefused,
    SamplingParams,
    StepSample,
    TokenLogprob,
)

# Keep the model inside vLLM's engine-core process instead of a third worker process: on one
# device that saves a process and ~1 GB. Must be set before vllm is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# How the engine core starts: forked unless the operator says otherwise (read before vLLM's CPU
# platform overwrites the variable with "spawn" as it checks a config).
START_METHOD = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork")

import torch  # noqa: E402
import vllm.plugins  # noqa: E402
from vllm import AsyncEngineArgs, PoolingParams  # noqa: E402
from vllm import SamplingParams as VllmSamplingParams  # noqa: E402
from vllm.config import StructuredOutputsConfig  # noqa: E402
from vllm.exceptions import VLLMClientError  # noqa: E402
from vllm.renderers.inputs.preprocess import parse_model_prompt  # noqa: E402
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams  # noqa: E402
from vllm.usage.usage_lib import UsageContext  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.engine.exceptions import EngineDeadError  # noqa: E402
from vllm.v1.executor import Executor  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerBase  # noqa: E402

log = logging.getLogger(__name__)


def _plugins_again_in_child() -> None:
    """A forked engine core inherits this process's "plugins loaded" and would skip vLLM's general
    plugins; it runs them as a spawned one does. Sluice's (workers/engines/vllm_plugin.py) asks
    the kernel to kill the core with its worker: without it a SIGKILLed worker left its core
    running (tests/faults/test_vllm_faults.py)."""
    vllm.plugins.plugins_loaded = False


os.register_at_fork(after_in_child=_plugins_again_in_child)

# Where the engine-core process finds the prefill cap its worker sets (a file of one int64, mapped
# by both): set in the environment only while the engine is built, so the core inherits it.
PREFILL_CAP_ENV = "SLUICE_VLLM_PREFILL_CAP_FILE"
_CAP = struct.Struct("<q")


class _PrefillCap:
    """The worker's prefill cap, shared with vLLM's engine-core process through a mapped file: the
    worker writes it each governor round, the scheduler reads it each step (no message, no lock:
    one aligned 8-byte word)."""

    def __init__(self, path: str, create: bool = False) -> None:
        self.path = path
        if create:
            with open(path, "wb") as f:
                f.write(bytes(_CAP.size))
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), _CAP.size)

    def get(self) -> int:
        return _CAP.unpack_from(self._map)[0]

    def set(self, tokens: int) -> None:
        _CAP.pack_into(self._map, 0, max(0, int(tokens)))

    def remove(self) -> None:
        """Unmap and delete the file (a process that mapped it keeps its mapping)."""
        self._map.close()
        os.unlink(self.path)


class _Governed:
    """vLLM's scheduler with Sluice's prefill cap (mixed into vLLM's own scheduler class, sync or
    async, whichever the engine's configuration picks; ``governed_scheduler``).

    With a cap of ``c`` tokens set, a step prefills at most about ``c`` prompt tokens (its token
    budget is one per running request for the decodes, plus ``c``; a prompt is chunked at ``c``),
    and the better priority prefills first: a prompt of a worse priority that is part way through
    its prefill sits a step out while one of a better priority waits to start or is part way
    through its own (the running requests are taken in priority order, so realtime decodes first).
    Without a cap (0, or no cap file) it is vLLM's scheduler unchanged."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        path = os.environ.get(PREFILL_CAP_ENV)
        self._sluice_cap = _PrefillCap(path) if path and os.path.exists(path) else None
        self._sluice_budget = self.max_num_scheduled_tokens
        self._sluice_threshold = self.scheduler_config.long_prefill_token_threshold

    def schedule(self, *args, **kwargs):
        cap = self._sluice_cap.get() if self._sluice_cap is not None else 0
        held: list = []
        if cap > 0:
            self.running.sort(key=lambda r: r.priority)  # stable: arrival order within a priority
            chunks = [r for r in self.running if r.is_prefill_chunk]
            if chunks:
                waiting = [self.waiting.peek_request().priority] if self.waiting else []
                best = min([r.priority for r in chunks] + waiting)
                held = [r for r in chunks if r.priority > best]
                if held:
                    self.running[:] = [r for r in self.running if r.priority <= best or not r.is_prefill_chunk]
            self.max_num_scheduled_tokens = min(self._sluice_budget, len(self.running) + cap)
            self.scheduler_config.long_prefill_token_threshold = cap
        else:
            self.max_num_scheduled_tokens = self._sluice_budget
            self.scheduler_config.long_prefill_token_threshold = self._sluice_threshold
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.running.extend(held)


class _GovernedScheduler(_Governed, Scheduler):
    pass


class _GovernedAsyncScheduler(_Governed, AsyncScheduler):
    pass


def governed_scheduler(*args, **kwargs):
    """vLLM's ``scheduler_cls`` for a Sluice worker: its own scheduler (async when the engine
    schedules asynchronously) with the prefill cap (``_Governed``)."""
    config = kwargs["vllm_config"].scheduler_config
    return (_GovernedAsyncScheduler if config.async_scheduling else _GovernedScheduler)(*args, **kwargs)


@dataclass(frozen=True)
class VllmConfig:
    model_path: str
    model_name: str
    max_num_seqs: int = 256  # max batch size
    max_num_batched_tokens: int = 8192  # token budget of one engine step (prefill chunks + decodes)
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    enforce_eager: bool = False
    kv_cache_memory_bytes: int | None = None  # fixed KV size (CPU hosts, tests); else from utilization
    embed: bool = False  # an embedding model: vLLM's pooling runner (a decoder model is converted)
    dimensions: int | None = None  # its vectors' length, as the registry states it (checked at start)


def _first_token_time(out: Any) -> float | None:
    """Wall-clock first-token time from vLLM's per-request stats (on while a stat logger is)."""
    metrics = getattr(out, "metrics", None)
    if metrics is None or not getattr(metrics, "first_token_latency", 0):
        return None
    return metrics.arrival_time + metrics.first_token_latency


def sampling_params(p: SamplingParams, stream: bool) -> VllmSamplingParams:
    """Sluice's sampling parameters as vLLM's."""
    constraint = None
    if p.constraint is not None:
        c = p.constraint
        form = {"json": {"json": c.spec}, "json_object": {"json_object": True}, "regex": {"regex": c.spec},
                "choice": {"choice": list(c.spec or ())}}[c.kind]
        constraint = StructuredOutputsParams(**form)
    return VllmSamplingParams(
        n=p.n, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or 0, min_p=p.min_p,
        seed=p.seed, stop=list(p.stop),
        ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias) or None, min_tokens=p.min_tokens,
        logprobs=p.logprobs, structured_outputs=constraint, skip_special_tokens=not p.keep_special_tokens,
        # Stop strings need text every step, and logprobs their tokens' text; otherwise the text
        # is decoded once at the end (less frontend CPU). Kept special tokens take vLLM's own
        # detokenizer too: the token ids end with the end-of-sequence token it leaves out.
        detokenize=bool(p.stop) or stream or p.logprobs is not None or p.keep_special_tokens,
        # One output per request, not one per step: the caller needs only the result and the
        # first-token time; a streaming client needs the text after every step.
        output_kind=RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY)


# What vLLM's refusal of a constrained request says when the constraint is its reason.
_CONSTRAINT_WORDS = ("grammar", "schema", "regex", "xgrammar", "structured", "json", "choice", "guided")


def refusal(exc: Exception, constrained: bool) -> RequestRefused:
    """vLLM's refusal of a request as the engine boundary names it: the constraint's fault
    (ConstraintError) when the request has one and the reason is about it, else the request's."""
    reason = str(exc)[:300]
    if constrained and any(word in reason.lower() for word in _CONSTRAINT_WORDS):
        return ConstraintError(reason)
    return RequestRefused(reason)


def _choice(seen: tuple[str, Any] | None, logprobs: Any) -> Choice:
    """One choice of an output: its text and completion as last seen (None: not begun), and its
    logprobs so far (a tuple, or a stream's growing list)."""
    if seen is None:
        return Choice("", 0, None, logprobs)
    text, completion = seen
    return Choice(text, len(completion.token_ids), completion.finish_reason, logprobs)


def _logprobs(completion: Any, top: int, start: int = 0) -> list[TokenLogprob]:
    """Each generated token's log probability (from the ``start``-th) and its ``top`` likeliest
    alternatives (vLLM gives the top ranks plus the sampled token wherever it ranked)."""
    out = []
    pairs = zip(completion.token_ids[start:], (completion.logprobs or ())[start:], strict=False)
    for token_id, position in pairs:
        chosen = position.get(token_id)
        ranked = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top),
                        key=lambda lp: lp.rank)
        out.append(TokenLogprob(_token(chosen), _finite(chosen), tuple((_token(lp), _finite(lp)) for lp in ranked)))
    return out


def _token(logprob: Any) -> str:
    return (logprob.decoded_token if logprob is not None else None) or ""


def _finite(logprob: Any) -> float:
    """A log probability JSON can carry (-inf for a token the constraint ruled out)."""
    value = logprob.logprob if logprob is not None else float("-inf")
    return max(value, -9999.0) if value == value else -9999.0


def bound_cpus(environ=os.environ) -> set[int] | None:
    """The CPUs ``VLLM_CPU_OMP_THREADS_BIND`` names for the engine ("0", "0-3", "0,2"; the first
    rank's list), or None when it names none ("auto", "nobind", unset)."""
    value = environ.get("VLLM_CPU_OMP_THREADS_BIND", "").split("|")[0].strip()
    if value in ("", "auto", "nobind"):
        return None
    cpus: set[int] = set()
    for part in value.split(","):
        low, _, high = part.strip().partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def _build_in(cpus: set[int] | None, build):
    """Run ``build`` (which spawns vLLM's engine-core process) with this thread's CPU mask set to
    ``cpus``, so the engine core starts on them; the thread's own mask is restored after.

    vLLM binds its CPU threads only in its multiprocess executor. A Sluice worker runs the model
    inside the engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0), which no binding reaches:
    it would inherit the worker's mask and share the cores of the web tier and the worker's own
    threads, whatever VLLM_CPU_OMP_THREADS_BIND says."""
    if not cpus:
        return build()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return build()
    finally:
        os.sched_setaffinity(0, before)


class _StatsProbe(StatLoggerBase):
    """vLLM calls ``record`` on the event loop after each step; it copies what Sluice shows."""

    def __init__(self, engine: VllmEngine) -> None:
        self._engine = engine

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        e = self._engine
        if scheduler_stats is not None:
            # A step's time is the gap since the previous step's record while the engine was busy
            # (after an idle spell the gap holds the idleness, not a step).
            now = time.monotonic()
            # What the step computed is what it cost; what the prefix cache held was free. A step
            # after an idle spell cannot be timed (the gap holds the idleness), but what it
            # prefilled still counts: the worker waits for prompts to be seen prefilled.
            # The prompt tokens the step computed are the scheduler's context tokens (a chunk of a
            # long prompt counts in the step that ran it); vLLM's prompt figures come once a prompt
            # is done, with what the prefix cache held of it.
            prompt = iteration_stats.prompt_token_stats if iteration_stats is not None else None
            details = scheduler_stats.iteration_details
            computed = details.num_ctx_tokens if details is not None else (prompt.computed if prompt else 0)
            cached = prompt.cached_tokens if prompt else 0
            timed = e._last_record is not None and e._running > 0 and scheduler_stats.num_running_reqs > 0
            if timed or computed or cached:
                e.step_log.add(StepSample(now - e._last_record if timed else 0.0, scheduler_stats.num_running_reqs,
                                          computed, cached, at=now))
            e._last_record = now
            e._steps += 1
            e._running = scheduler_stats.num_running_reqs
            e._waiting = scheduler_stats.num_waiting_reqs
            e._kv_usage = scheduler_stats.kv_cache_usage
            e._max_batch = max(e._max_batch, scheduler_stats.num_running_reqs)
            # Per-step deltas, summed into running totals.
            e._prefix_queries += scheduler_stats.prefix_cache_stats.queries
            e._prefix_hits += scheduler_stats.prefix_cache_stats.hits
        if iteration_stats is not None:
            e._generated += iteration_stats.num_generation_tokens
            e._prompt_tokens += iteration_stats.num_prompt_tokens

    def log_engine_initialized(self) -> None:
        pass


class VllmEngine(Engine):
    name = "vllm"
    simulated = False

    def __init__(self, config: VllmConfig) -> None:
        super().__init__()
        self.config = config
        self.embeds = config.embed
        self._llm: AsyncLLM | None = None
        self._in_flight: set[str] = set()
        self._children: dict[str, list[str]] = {}  # an embeddings request → its texts' engine ids
        self._kv_capacity = 0
        self._steps = self._max_batch = self._running = self._waiting = 0
        self._generated = self._prompt_tokens = self._aborted = 0
        self._prefix_queries = self._prefix_hits = 0
        self._kv_usage = 0.0
        self._last_record: float | None = None
        self._core_cpu_s: dict[int, float] | None = None  # CPU seconds per engine process, last read
        self._cap: _PrefillCap | None = None

    async def start(self) -> None:
        c = self.config
        args = AsyncEngineArgs(
            model=c.model_path, served_model_name=c.model_name, enable_prefix_caching=not c.embed,
            runner="pooling" if c.embed else "auto",
            scheduling_policy="priority", max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=c.max_model_len,
            gpu_memory_utilization=c.gpu_memory_utilization, tensor_parallel_size=c.tensor_parallel_size,
            dtype=c.dtype, enforce_eager=c.enforce_eager, kv_cache_memory_bytes=c.kv_cache_memory_bytes,
            # Compact JSON under a schema: a model free to add whitespace between JSON tokens can
            # spend its whole max_tokens on it (a small one often does). vLLM allows that only with
            # a named backend: xgrammar, its default (a schema xgrammar cannot compile fails its
            # request with invalid_response_format instead of falling back to guidance).
            structured_outputs_config=StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True),
            # The prefill cap (set_prefill_cap) and each step's prefill as the scheduler ran it.
            scheduler_cls=None if c.embed else f"{__name__}.governed_scheduler",
            enable_logging_iteration_details=True, disable_log_stats=True)
        # Built in a thread: loading takes seconds to minutes and the loop must keep answering
        # the watchdog meanwhile.
        from vllm.platforms import current_platform

        cpus = bound_cpus() if current_platform.is_cpu() else None
        fd, path = tempfile.mkstemp(prefix="sluice-prefill-cap-")
        os.close(fd)
        self._cap = _PrefillCap(path, create=True)

        def build() -> AsyncLLM:
            os.environ[PREFILL_CAP_ENV] = path  # the engine core inherits it as it starts
            try:
                config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
                # vLLM's CPU platform asks for a spawned engine core as it checks the config: the
                # child would import torch and vLLM again, ~11 of the ~29 CPU-seconds a worker
                # with a tiny model took to start on a 2-core VM (18 forked). Forked, it starts
                # with what this process already loaded.
                os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = START_METHOD
                return AsyncLLM(vllm_config=config, executor_class=Executor.get_class(config), log_stats=False,
                                stat_loggers=[lambda cfg, idx: _StatsProbe(self)])
            finally:
                os.environ.pop(PREFILL_CAP_ENV, None)

        try:
            self._llm = await asyncio.get_running_loop().run_in_executor(None, lambda: _build_in(cpus, build))
        except BaseException:
            self._cap.remove()
            self._cap = None
            raise
        if c.embed and c.dimensions is not None and self._llm.model_config.get_hidden_size() != c.dimensions:
            raise RuntimeError(f"model {c.model_name} embeds in {self._llm.model_config.get_hidden_size()} "
                               f"dimensions, not the {c.dimensions} the registry says: fix its dimensions")
        cache = self._llm.vllm_config.cache_config
        self._kv_capacity = (cache.num_gpu_blocks or 0) * cache.block_size
        log.info("vLLM engine ready: model %s, KV capacity %d tokens", c.model_name, self._kv_capacity)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        llm = self._require()
        rid = request.request_id
        if rid in self._in_flight:
            # vLLM would accept it (suffixing the id) and abort(rid) would then hit both.
            raise ValueError(f"request {rid} is already in flight")
        if request.texts is not None:
            yield await self._embed(request)
            return
        self._in_flight.add(rid)
        p = request.params
        try:
            detailed = p.detailed
            # Each choice as last seen, by index: a stream of n > 1 gets one choice's output at a
            # time (vLLM's ParentRequest), cumulative for that choice; a final-only one gets all n.
            latest: dict[int, tuple[str, Any]] = {}
            converted: dict[int, list[TokenLogprob]] = {}  # each choice's logprobs so far
            try:
                params = sampling_params(p, request.stream)
                prompt = await self._prompt(request)
                (engine_input,) = await llm.renderer.render_cmpl_async(
                    [parse_model_prompt(llm.model_config, prompt)])
                stream = llm.generate(engine_input, params, request_id=rid, priority=request.priority)
                async for out in stream:
                    for c in out.outputs:
                        latest[c.index] = (c.text if params.detokenize else await self._decode(c.token_ids), c)
                        if p.logprobs is not None:  # converted once each: the outputs are cumulative
                            have = converted.setdefault(c.index, [])
                            have.extend(_logprobs(c, p.logprobs, len(have)))
                    if not latest:
                        continue
                    choices = ()
                    if detailed and (out.finished or request.stream):  # a stream's: every choice so far
                        # A stream's logprobs are the growing lists themselves (read before the next
                        # output, on this loop): copying them every step would cost O(tokens²).
                        choices = tuple(_choice(latest.get(i), None if p.logprobs is None else
                                                tuple(converted.get(i, ())) if out.finished else
                                                converted.setdefault(i, []))
                                        for i in range(p.n))
                    text, first = latest.get(0, ("", None))
                    # An abort ends the choices still running only: any aborted one makes it one.
                    aborted = any(c.finish_reason == "abort" for _, c in latest.values())
                    yield GenerationOutput(
                        request_id=rid, text=text, prompt_tokens=len(out.prompt_token_ids or ()),
                        output_tokens=sum(len(c.token_ids) for _, c in latest.values()), finished=out.finished,
                        finish_reason=("abort" if aborted else first.finish_reason if first is not None else None)
                        if out.finished else None,
                        cached_tokens=out.num_cached_tokens or 0, first_token_time=_first_token_time(out),
                        choices=choices)
            except EngineDeadError as exc:
                raise EngineDead("vLLM's engine core died") from exc
            except (VLLMClientError, ValueError) as exc:  # refused as given: the request's fault
                raise refusal(exc, p.constraint is not None) from exc
        finally:
            self._in_flight.discard(rid)

    async def _embed(self, request: GenerationRequest) -> GenerationOutput:
        """Each text through the pooling runner (one engine request each, ``<id>#<n>``, batched by
        the engine), the vectors end to end as float32. An abort of the request aborts them all."""
        llm = self._require()
        rid = request.request_id
        if not self.config.embed:
            raise RequestRefused("this worker's model is not an embedding model")
        ids = [f"{rid}#{i}" for i in range(len(request.texts or ()))]
        self._in_flight.add(rid)
        self._children[rid] = ids
        params = PoolingParams(task="embed", dimensions=request.dimensions)

        async def one(child: str, text: str):
            last = None
            async for out in llm.encode(text, params, request_id=child, priority=request.priority):
                last = out
            return last

        try:
            outs = await asyncio.gather(*(one(child, text) for child, text in zip(ids, request.texts or (),
                                                                                  strict=True)))
        except asyncio.CancelledError:
            await llm.abort(ids)
            raise
        except EngineDeadError as exc:
            raise EngineDead("vLLM's engine core died") from exc
        except (VLLMClientError, ValueError) as exc:
            raise refusal(exc, False) from exc
        finally:
            self._in_flight.discard(rid)
            self._children.pop(rid, None)
        # An aborted text ends without a vector (vLLM's last output for it holds an empty tensor).
        if any(out is None or not out.finished or out.outputs.data.numel() == 0 for out in outs):
            return GenerationOutput(request_id=rid, text="", prompt_tokens=0, output_tokens=0, finished=True,
                                    finish_reason="abort")
        vectors = b"".join(out.outputs.data.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
                           for out in outs)
        return GenerationOutput(request_id=rid, text="", prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
                                output_tokens=0, finished=True, finish_reason="stop", embedding=vectors)

    async def _decode(self, token_ids) -> str:
        tokenizer = self._require().get_tokenizer()
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: tokenizer.decode(list(token_ids), skip_special_tokens=True))

    async def _prompt(self, request: GenerationRequest) -> Any:
        if request.messages is None:
            return request.prompt
        # The model's own chat template, tokenized as the template says (it carries its own
        # special tokens): the same count the web tier priced the request with. In a thread:
        # a long conversation must not stall every other stream on the loop.
        tokenizer = self._require().get_tokenizer()

        def render() -> list[int]:
            text = tokenizer.apply_chat_template(list(request.messages), tokenize=False, add_generation_prompt=True,
                                                 tools=list(request.tools) if request.tools else None)
            return tokenizer.encode(text, add_special_tokens=False)

        return {"prompt_token_ids": await asyncio.get_running_loop().run_in_executor(None, render)}

    async def abort(self, request_id: str) -> None:
        if self._llm is not None and request_id in self._in_flight:
            self._aborted += 1
            await self._llm.abort(self._children.get(request_id) or request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            engine=self.name, model=self.config.model_name, simulated=False, running=self._running,
            waiting=self._waiting, kv_used_tokens=round(self._kv_usage * self._kv_capacity),
            kv_capacity_tokens=self._kv_capacity, steps=self._steps, max_batch_seen=self._max_batch,
            generated_tokens=self._generated, prompt_tokens=self._prompt_tokens, aborted=self._aborted,
            extra={"prefix_cache_hit_tokens": self._prefix_hits, "prefix_cache_query_tokens": self._prefix_queries,
                   "kv_cache_usage": round(self._kv_usage, 4), "in_flight": len(self._in_flight)})

    def set_prefill_cap(self, tokens: int) -> None:
        if self._cap is not None:
            self._cap.set(tokens)

    def busy(self) -> bool | None:
        """Whether vLLM's engine-core process used the CPU since the last call (on a GPU host a
        host thread waiting on the device counts too). None without such a process."""
        try:
            import psutil

            used = {}
            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):  # one that exited meanwhile
                    used[child.pid] = sum(child.cpu_times()[:2])
        except Exception:
            return None
        before, self._core_cpu_s = self._core_cpu_s, used
        if before is None:
            return None
        # Per process: a helper that exited takes its CPU time out of any sum (a compile's worker
        # processes, say), and a new one is work started.
        return any(pid not in before or seconds > before[pid] + 0.01 for pid, seconds in used.items())

    async def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        cap, self._cap = self._cap, None
        if cap is not None:
            cap.remove()
        if llm is None:
            return
        if self._in_flight:
            await llm.abort(list(self._in_flight))
            for _ in range(200):  # let generate() iterators deliver their final "abort" output
                if not self._in_flight:
                    break
                await asyncio.sleep(0.01)
        # Stop the output handler before the core exits, or it logs the core's death as an error.
        handler, llm.output_handler = llm.output_handler, None
        if handler is not None:
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)

    def _require(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("vLLM engine is not started")
        return self._llm
