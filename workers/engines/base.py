"""The engine boundary: one small interface every inference engine implements.

Plain frozen dataclasses cross the boundary in both directions, so the worker runtime
never sees engine internals and an engine never sees Celery, SQLAlchemy or Flask.

Contract shared by every engine:

* ``start()`` loads the model and returns only when the engine can generate. It is awaited
  once per worker process, before the worker takes any task (a warm engine).
* ``generate(request)`` is an async iterator; for a request with ``texts`` (an embedding model's
  engine) it yields one final output carrying the vectors. It honours every field of ``SamplingParams`` or
  raises ``RequestRefused`` naming the one it cannot (``ConstraintError`` for a constraint it
  cannot compile). Many calls run concurrently on the same event
  loop and the engine batches them together (continuous batching); it never serves them one
  at a time. Each yielded :class:`GenerationOutput` is cumulative (the text so far); the last
  one has ``finished=True``. An engine may yield only that last one if it reports
  ``first_token_time`` on it. A request whose ``request_id`` is already in flight is a
  programming error and raises ``ValueError``.
* ``abort(request_id)`` stops a request wherever it is (waiting or running) and frees its KV
  cache; its ``generate`` iterator then yields a final output with ``finish_reason="abort"``.
  Aborting an unknown or finished id is a no-op.
* ``stats()`` is cheap and thread-safe enough to be read from a metrics thread; so is
  ``step_samples()``, which hands over the steps taken since it was last called.
* ``shutdown()`` aborts everything in flight and releases the device.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


class EngineDead(RuntimeError):
    """The engine can serve nothing more (its loop or process died). Fatal for the worker."""


class RequestRefused(ValueError):
    """The engine refuses the request as given (a limit of its model: a prompt over its length, a
    token id outside its vocabulary); the message says why. The request fails; the engine is fine."""


class ConstraintError(RequestRefused):
    """The engine cannot decode under the request's constraint (a schema its grammar library
    cannot compile); the message says why."""


@dataclass(frozen=True)
class Constraint:
    """Structured decoding: the output must match ``spec``. ``kind``: ``json`` (``spec`` a JSON
    schema, as text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of ``spec``)."""

    kind: str
    spec: str | tuple[str, ...] | None = None


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # keep going past end-of-sequence (fixed-length benchmarks and tests)
    n: int = 1  # choices, decoded from one prompt (its KV shared)
    top_k: int | None = None  # None: every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0
    logprobs: int | None = None  # each output token's logprob and this many alternatives; None: none
    constraint: Constraint | None = None
    # Special tokens stay in the text: a tool parser reads calls by one (mistral's [TOOL_CALLS]).
    keep_special_tokens: bool = False

    @property
    def detailed(self) -> bool:
        """Whether the answer needs ``GenerationOutput.choices``: more than one text, or logprobs."""
        return self.n > 1 or self.logprobs is not None


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # the likeliest alternatives, most likely first


@dataclass(frozen=True)
class Choice:
    """One of a request's ``n`` answers."""

    text: str
    output_tokens: int
    finish_reason: str | None
    # Each token's; while a request streams, the engine's growing list itself (a consumer reads
    # it before the next output): a copy per step would cost O(tokens²).
    logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob] | None = None


# Each service tier's engine priority (docs/tiers.md). The first two are realtime, the rest batch.
TIER_RANK = {"priority": 0, "default": 1, "flex": 2, "batch": 3}
BATCH_RANK = TIER_RANK["flex"]


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: str
    params: SamplingParams
    # Lower runs first (vLLM's convention): the service tier's rank (``TIER_RANK``), so priority
    # work goes before default, realtime before batch, flex before batch.
    priority: int = 0
    # Input tokens as counted by the caller; an engine with its own tokenizer recounts.
    prompt_tokens: int | None = None
    # Chat requests carry their messages too: an engine with a chat template renders them
    # itself; others use `prompt`, a plain flattening of the same messages.
    messages: tuple[dict[str, str], ...] | None = None
    # A client reads its tokens as they come: the engine yields an output (cumulative text) per
    # token instead of only the first and the last.
    stream: bool = False
    # Tools the chat template renders beside the messages (OpenAI's function tools).
    tools: tuple[dict, ...] | None = None
    # With tools and ``tool_choice: auto``, the parser that reads the model's calls out of its text
    # (core/registry.py TOOL_PARSERS): a simulated model writes the calls it makes in that form.
    calls_as: str | None = None
    # An embeddings request: embed each text (an embedding model's engine), ``dimensions`` long
    # (None: the model's own); nothing is generated.
    texts: tuple[str, ...] | None = None
    dimensions: int | None = None

    @property
    def batch(self) -> bool:
        """Batch work (flex or batch): it yields the engine to realtime work."""
        return self.priority >= BATCH_RANK

    def __repr__(self) -> str:  # never put prompt text in logs or reprs
        return (f"GenerationRequest(request_id={self.request_id!r}, prompt=<{len(self.prompt)} chars>, "
                f"params={self.params!r}, priority={self.priority})")


@dataclass(frozen=True)
class GenerationOutput:
    request_id: str
    text: str
    prompt_tokens: int
    output_tokens: int
    finished: bool
    # "stop" (stop string or end of sequence), "length" (max_tokens), "abort"; None while running
    finish_reason: str | None = None
    cached_tokens: int = 0
    # Wall-clock time (epoch seconds) of the first generated token, when the engine knows it.
    # An engine that yields only final outputs must set it; otherwise the caller uses the
    # arrival time of the first output that carries tokens.
    first_token_time: float | None = None
    # The final output of a request whose params are ``detailed``: every choice, the first being
    # ``text``'s; ``output_tokens`` is then their sum.
    choices: tuple[Choice, ...] = ()
    # The final output of an embeddings request: one vector per text, in order, float32
    # little-endian end to end (``text`` is empty, ``output_tokens`` 0).
    embedding: bytes | None = None

    def __repr__(self) -> str:
        return (f"GenerationOutput(request_id={self.request_id!r}, text=<{len(self.text)} chars>, "
                f"prompt_tokens={self.prompt_tokens}, output_tokens={self.output_tokens}, "
                f"finished={self.finished}, finish_reason={self.finish_reason!r})")


@dataclass(frozen=True)
class EngineStats:
    engine: str
    model: str
    simulated: bool
    running: int = 0  # sequences in the current batch
    waiting: int = 0  # sequences admitted but not yet scheduled (e.g. no KV room)
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    steps: int = 0
    max_batch_seen: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    aborted: int = 0
    extra: dict = field(default_factory=dict)


# The ids of the requests a worker's warm-up sends its engine begin with this (workers/runtime.py).
WARMUP_PREFIX = "warmup-"


@dataclass(frozen=True)
class StepSample:
    """One engine step, as the worker's step curve learns from it (``workers/governor.py``)."""

    seconds: float  # wall time the step took
    seqs: int  # sequences in the step (decoding or prefilling)
    prompt_tokens: int = 0  # prompt tokens the step prefilled (computed: prefix-cache hits not included)
    cached_tokens: int = 0  # prompt tokens of the prompts it finished that the prefix cache held
    at: float = 0.0  # time.monotonic() when it ended (0: unknown); seconds 0: a step not timed


class StepLog:
    """The steps an engine took since its worker last asked: appended on the engine's loop, drained
    from the governor's thread (a deque's appends and pops are atomic)."""

    def __init__(self, keep: int = 4096) -> None:
        self._steps: deque[StepSample] = deque(maxlen=keep)

    def add(self, sample: StepSample) -> None:
        self._steps.append(sample)

    def drain(self) -> list[StepSample]:
        out = []
        while self._steps:
            out.append(self._steps.popleft())
        return out


class Engine(abc.ABC):
    """An inference engine owned by exactly one worker process."""

    name: str = "engine"
    simulated: bool = False
    embeds: bool = False  # an embedding model's engine: it takes requests with texts, and only those

    def __init__(self) -> None:
        self.step_log = StepLog()  # an engine that can time its steps adds each one here

    @abc.abstractmethod
    async def start(self) -> None:
        """Load weights and warm up; return when ``generate`` can be called."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """Yield cumulative outputs for ``request`` until one has ``finished=True``."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop ``request_id`` and free its KV cache; a no-op if it is unknown or done."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """A snapshot of the engine's state."""

    def busy(self) -> bool | None:
        """Whether the engine is working on a step right now, however slowly (a step under way,
        its process using the CPU); None where it cannot tell. The watchdog never restarts a busy
        engine for slowness: a saturated or CPU-starved engine is slow, not hung."""
        return None

    def set_prefill_cap(self, tokens: int) -> None:
        """The most prompt tokens one step may prefill from now on (0: no cap beyond the engine's
        own token budget). An engine that honours it chunks long prompts to the cap and prefills
        the better priority's prompts first, so that no step outlasts what the realtime
        requests decoding in it can afford (``Governor.prefill_cap_tokens``). By default ignored:
        such an engine prefills each prompt as its own scheduler does."""
        return None

    def step_samples(self) -> list[StepSample]:
        """The steps taken since the last call, oldest first (an engine that cannot time its
        steps returns none: its worker then keeps the whole engine open)."""
        return self.step_log.drain()

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Abort everything in flight and release the device."""
