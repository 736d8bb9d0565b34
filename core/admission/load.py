"""Load, as every process sees it through Redis: queue counters, class snapshots, the level.

Three kinds of keys, all per class (priority × model, the unit the promise at arrival and the
degradation ladder reason about):

* **Counters** (``sluice:load:queue:<priority>:<model>``, a hash) move with every lifecycle
  transition (:class:`QueueCounters`, a lifecycle hook): requests and reserved tokens queued,
  the *work* queued and claimed (their output: ``max_tokens`` × ``n``), the *prompts* queued
  (their input tokens), and tokens finished. Counters stay in tokens; the promise prices them in
  engine time with the engines' current prices (a prompt token at what prefill costs, an output
  token at what decoding at the limit costs), so a price learned later never unbalances a
  counter. They are live; the monitor re-counts the queued ones from Postgres now and then,
  since a process can die between a commit and its hook.
* **Snapshots** (``sluice:load:class:<priority>:<model>``, a hash with a short TTL), written by
  the load monitor every second: drain rate, per-sequence speed, room in the engines, estimated
  wait, level.
* **Room and capacity** (``sluice:load:room:…`` and ``sluice:load:capacity:…``, hashes worker id
  → figure), written by the workers themselves: the sequences each engine would take in now, the
  engine seconds of prefill already waiting in it and the speed a sequence would get there now
  (whenever a request enters or leaves it, and while prompts wait to go in) and, with each
  heartbeat, the output per second the engine decodes at its limit, the speed a sequence gets
  there and the price of a prompt token (:func:`capacity_entry`). They
  are what the promise falls back on while the monitor is away (its snapshots expired): the
  admission script sums the entries of workers whose heartbeat is recent, so a burst with the
  monitor dead is still refused in milliseconds, not queued for minutes.
* **The levels** (``LOAD_LEVEL_KEY``, a hash): each class's level under its class name, and the
  platform's (``level``: the highest realtime class's) for the operator. Admission judges a
  request by its own class's level (a batch request also by its model's realtime level, which
  ``reject_batch`` protects). A missing or stale level counts as NORMAL, so a dead monitor can
  never leave the platform shedding; the promise on the workers' own figures applies instead.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import redis

from core.rediskeys import LOAD_LEVEL_KEY, PAUSED_KEY
from core.settings import LADDER_STEPS
from models import Priority, Status
from models.lifecycle import Moved

log = logging.getLogger(__name__)

COUNTERS_PREFIX = "sluice:load:queue:"
SNAPSHOT_PREFIX = "sluice:load:class:"
# Hash worker id → "<room> <backlog s> <seq tps now> <priority room>" per class it serves: the
# sequences its engine would take in now, the engine seconds of prefill ahead of a request that
# came now, the speed a sequence would get, and the sequences a priority request could have (its
# limit less what the priority tier and streams hold: default work leaves for it); written by
# each worker whenever a request enters or leaves its engine and while prompts wait to go in
# (workers/runtime.py), so the promise sees a full engine and a prefill backlog at once instead of
# a heartbeat later; the monitor drops the fields of dead workers.
ROOM_PREFIX = "sluice:load:room:"
# Hash worker id → "<at ms> <drain tps> <seq tps> <slot wait s> <prefill s a prompt token>", per
# class it serves: written with each heartbeat (workers/runtime.py), read by admission while the
# monitor is away.
CAPACITY_PREFIX = "sluice:load:capacity:"
# A level written for every class at once (``write_level`` without classes: operators and tests).
ALL_CLASSES = "*"
# Before any backlog was measured, the share of threads × one sequence's speed taken as a
# class's capacity: a sequence's speed is measured at the batch sizes seen so far, and a full batch
# runs each sequence slower (H200 calibration, 8B decode at L=512: a step takes 4.6 ms at B=1,
# 8.3 ms at B=128, 11.5 ms at B=256).
PRIOR_SHARE = 0.6


class LoadLevel(enum.IntEnum):
    NORMAL = 0
    LIGHT_MODEL = 1
    SHORTER_OUTPUT = 2
    CACHED_ANSWERS = 3
    REJECT_BATCH = 4
    TIGHT_PROMISE = 5
    SHED = 6


def class_name(priority: Priority | str, model: str) -> str:
    return f"{Priority(priority).value}:{model}"


def counters_key(priority: Priority | str, model: str) -> str:
    return COUNTERS_PREFIX + class_name(priority, model)


def snapshot_key(priority: Priority | str, model: str) -> str:
    return SNAPSHOT_PREFIX + class_name(priority, model)


def room_key(priority: Priority | str, model: str) -> str:
    return ROOM_PREFIX + class_name(priority, model)


def capacity_key(priority: Priority | str, model: str) -> str:
    return CAPACITY_PREFIX + class_name(priority, model)


def decode_drain(beat: dict, batch: bool = False) -> float:
    """What a governed worker's heartbeat ``beat`` says its limit decodes a second, its prompts'
    prefill priced apart (``decode_tps``; a worker that does not state it: its limit × the speed a
    sequence gets there). For a batch class (``batch``), only the sequences batch work may hold
    there: a worker that serves realtime too keeps threads for it (``batch_seats``,
    workers/bootstrap.py ``BatchSlots``), each at the speed a sequence gets at the limit."""
    drain = float(beat.get("decode_tps") or beat.get("engine_limit", 0) * float(beat["limit_seq_tps"]))
    seats, limit = beat.get("batch_seats"), beat.get("engine_limit") or 0
    if batch and seats is not None and limit > 0:
        drain *= min(1.0, float(seats) / limit)
    return drain


def capacity_entry(beat: dict, at_ms: int, batch: bool = False) -> str | None:
    """A worker's capacity as its heartbeat ``beat`` states it, in the form admission's script
    reads (``at_ms drain_tps seq_tps slot_wait_s prefill_s_tok prefill_s_tok2 step_base_s step_seq_s
    priority_safety``); None while it knows no speed yet.

    A governed engine (it times its steps) decodes what its limit decodes with no prefill in its
    steps (``decode_tps``; prompts are priced apart, a prompt of P tokens at ``prefill_s_tok`` × P
    + ``prefill_s_tok2`` × P²), as the monitor
    counts it; one that cannot time its steps, each thread decoding one sequence at the speed its
    finished runs got, discounted for a full batch (PRIOR_SHARE)."""
    if beat.get("limit_seq_tps"):
        seq = float(beat["limit_seq_tps"])
        drain = decode_drain(beat, batch)
    elif beat.get("seq_tps"):
        seq = float(beat["seq_tps"])
        drain = beat.get("threads", 0) * seq * PRIOR_SHARE
    else:
        return None
    if drain <= 0:
        return None
    return (f"{at_ms} {drain:.3f} {seq:.3f} {float(beat.get('slot_wait_s') or 0.0):.3f} "
            f"{float(beat.get('prefill_s_tok') or 0.0):.7f} {float(beat.get('prefill_s_tok2') or 0.0):.4g} "
            f"{float(beat.get('step_base_s') or 0.0):.4g} {float(beat.get('step_seq_s') or 0.0):.4g} "
            f"{float(beat.get('priority_safety') or 0.0):.3g}")


def tier_place(tier: str) -> str:
    """Where a service tier stands in its class for the promise (``admit.lua`` ARGV 27): priority
    and flex are served ahead of the rest of theirs, default gives up a share to priority while
    priority comes, batch waits behind everything."""
    return {"priority": "ahead", "flex": "ahead", "default": "held"}.get(tier, "")


class QueueCounters:
    """A lifecycle ``on_move`` hook keeping each class's counters in Redis.

    accepted or requeued (→ queued)   queued_requests += 1, queued_tokens += reserved, queued_work += max_tokens,
                                       queued_prompt += input tokens, queued_prompt_sq += their square (a
                                       prompt's attention grows with it), queued_deadline_ms += its
                                       deadline (creation to deadline)
    claimed (queued → running)         queued_* −= …, claimed_work += max_tokens, claimed_prompt += input
                                       tokens, claimed_prompt_sq += their square
    ended while queued (cancel/expiry) queued_* −= …
    ended while running                finished_tokens += input + output actually processed

    A request of the tier served ahead of its class (priority, flex: ``tier_place``) also moves
    ``ahead_queued_work``, ``ahead_queued_prompt`` and ``ahead_queued_prompt_sq``: the queue its
    own promise sees; and ``ahead_claimed_work``, ``ahead_claimed_prompt`` and
    ``ahead_claimed_prompt_sq`` when claimed: the share of the engines it takes.
    """

    def __init__(self, client: redis.Redis, healthy: Callable[[], bool] = lambda: True) -> None:
        self.redis = client
        # While the caller knows Redis is away (admission's breaker is open), skip the call
        # instead of spending its timeout on every transition.
        self.healthy = healthy

    def __call__(self, moved: Moved) -> None:
        if not self.healthy() or moved.follows is not None:
            return  # a parked twin is on no queue: it adds no work
        key = counters_key(moved.priority, moved.model)
        # Before a request ran, reserved = admission's input estimate + max_tokens.
        work = moved.reserved_tokens - moved.input_tokens
        deadline_ms = int((moved.deadline_s or 0) * 1000)
        pipe = self.redis.pipeline(transaction=False)
        prefixes = ("", "ahead_") if tier_place(moved.service_tier) == "ahead" else ("",)
        for sign, moves in ((1, moved.status == Status.QUEUED), (-1, moved.source == Status.QUEUED)):
            if not moves:
                continue
            pipe.hincrby(key, "queued_requests", sign)
            pipe.hincrby(key, "queued_tokens", sign * moved.reserved_tokens)
            pipe.hincrby(key, "queued_deadline_ms", sign * deadline_ms)
            for prefix in prefixes:
                pipe.hincrby(key, f"{prefix}queued_work", sign * work)
                pipe.hincrby(key, f"{prefix}queued_prompt", sign * moved.input_tokens)
                pipe.hincrby(key, f"{prefix}queued_prompt_sq", sign * moved.input_tokens ** 2)
        if moved.source == Status.QUEUED and moved.status == Status.RUNNING:
            for prefix in prefixes:
                pipe.hincrby(key, f"{prefix}claimed_work", work)
                pipe.hincrby(key, f"{prefix}claimed_prompt", moved.input_tokens)
                pipe.hincrby(key, f"{prefix}claimed_prompt_sq", moved.input_tokens ** 2)
        if moved.source == Status.RUNNING and moved.status.terminal:
            pipe.hincrby(key, "finished_tokens", moved.input_tokens + (moved.output_tokens or 0))
        try:
            pipe.execute()
        except redis.RedisError as exc:  # the monitor re-counts queued work from Postgres
            log.warning("queue counters not updated (%s)", type(exc).__name__)


@dataclass(frozen=True)
class ClassLoad:
    """One class as the monitor last saw it."""

    priority: str
    model: str
    queued_tokens: int  # reserved (input + max_tokens): what admission priced
    queued_requests: int
    queued_work: int  # their max_tokens: what the wait is computed from
    drain_tps: float  # work (max_tokens) claimed off the queue per second (0: unknown)
    seq_tps: float  # tokens per second one running sequence gets (0: unknown)
    wait_s: float  # queued work / drain (0 when empty; -1 when unknown)
    level: int
    workers: int  # warm workers consuming this class's queues
    updated_at_ms: int
    deadline_s: float = 0.0  # what the level judges the wait against: the queued requests' mean
    # deadline, or the class default when that is shorter or nothing is queued
    room: int = -1  # sequences the serving engines would take in now (-1: unknown, no governed worker)
    slot_wait_s: float = 0.0  # while there is no room: how long a request waits for a slot
    queued_prompt: int = 0  # the queued requests' input tokens: their prefill, priced apart
    prefill_s_tok: float = 0.0  # engine seconds a prompt token costs (0: unknown, or no governed worker)
    engines: int = 0  # governed engines sharing the prefill ahead (0: unknown)
    backlog_s: float = 0.0  # engine seconds of prefill waiting inside the engines, summed
    queued_prompt_sq: int = 0  # Σ of the queued requests' input tokens squared: their attention
    prefill_s_tok2: float = 0.0  # engine seconds a prompt of P tokens costs beyond P × prefill_s_tok, per P²
    claimed_tps: float = 0.0  # work (max_tokens) claimed off the queue per second over the monitor's window
    ahead_tps: float = 0.0  # the same, of the tier served ahead (priority, flex)
    realtime_share: float = 0.0  # a batch class: the share of its engines its model's realtime work claimed
    # The share of the engines' time (0 to 1) the requests claimed over the window take: their
    # output at the drain, their prompts at the prefill prices. The class's, and its tier ahead's.
    claimed_share: float = 0.0
    ahead_share: float = 0.0
    # Work claimed per second while the class had queued work all along, past each backlog's first
    # seconds and faded over 30 s of such time (workers/monitor.py BUSY_MIN_S, FILL_S, BUSY_TAU_S):
    # what its engines and the stack around them really give it while busy (0: not measured yet).
    busy_tps: float = 0.0
    # The engines' limit line (a step: step_base_s + step_seq_s × sequences, the slowest worker's)
    # and the share of its deadline a priority request decodes in (workers/governor.py
    # PRIORITY_SAFETY): the speed the priority tier is promised at. 0: unknown.
    step_base_s: float = 0.0
    step_seq_s: float = 0.0
    priority_safety: float = 0.0
    # The wait, and its level, of a tenant whose next request is one turn away in the class's fair
    # lines (core/broker/fair.py line_excess): what every tenant but the loud ones is judged on.
    fair_wait_s: float = 0.0
    fair_level: int = 0

    def write(self, client: redis.Redis, ttl_s: float) -> None:
        with client.pipeline(transaction=False) as pipe:
            self.add_to(pipe, ttl_s)
            pipe.execute()

    def add_to(self, pipe, ttl_s: float) -> None:
        """Queue the snapshot's write on ``pipe`` (a Redis pipeline)."""
        key = snapshot_key(self.priority, self.model)
        pipe.hset(key, mapping={k: str(v) for k, v in asdict(self).items()})
        pipe.pexpire(key, int(ttl_s * 1000))

    @classmethod
    def read_all(cls, client: redis.Redis) -> list[ClassLoad]:
        keys = sorted(client.scan_iter(match=SNAPSHOT_PREFIX + "*", count=200))
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            hashes = pipe.execute()
        loads = []
        for raw in hashes:
            if raw:
                loads.append(cls(**{f.name: _typed(f.type, raw[f.name]) for f in fields(cls) if f.name in raw}))
        return loads


def _typed(kind: object, value: str):
    kind = str(kind)
    return int(value) if kind == "int" else float(value) if kind == "float" else value


def write_level(client: redis.Redis, level: LoadLevel, ttl_s: float = 60.0,
                classes: dict[str, int] | None = None, snapshots: list[ClassLoad] = ()) -> None:
    """Publish the levels now, replacing what was there: ``classes`` (class name → level) and
    ``level`` as the platform's (what the load monitor does), or, without ``classes``, ``level``
    for every class at once (operators and tests). ``snapshots``: the classes' figures, written in
    the same transaction, so that no reader sees a tick's figures without its levels.

    The timestamp comes from the Redis clock, the one the admission script compares it with.
    """
    seconds, micros = client.time()
    fields = {name: int(one) for name, one in (classes if classes is not None else {ALL_CLASSES: level}).items()}
    with client.pipeline(transaction=True) as pipe:  # readers never see a half-written set
        for snapshot in snapshots:
            snapshot.add_to(pipe, ttl_s)
        pipe.delete(LOAD_LEVEL_KEY)
        pipe.hset(LOAD_LEVEL_KEY, mapping={**fields, "level": int(level),
                                           "updated_at_ms": seconds * 1000 + micros // 1000})
        pipe.pexpire(LOAD_LEVEL_KEY, int(ttl_s * 1000))
        pipe.execute()


def class_level(levels: dict[str, str], priority: Priority | str, model: str, tenant: str | None = None) -> int:
    """A class's level in the published hash (``LOAD_LEVEL_KEY``): its own, or the level written
    for every class; for ``tenant``, its class's fair level where the monitor published one and
    does not name the tenant loud (``workers/monitor.py levels``: a flooder's excess raises only
    its own level). A batch class is also at its model's realtime level, whole (what
    ``reject_batch`` protects). 0 for a class the monitor does not know. Freshness is the
    caller's to check; ``admit.lua`` reads the same fields."""
    def one(name: str) -> int:
        raw = levels.get(name, levels.get(ALL_CLASSES))
        return int(raw) if raw is not None else 0
    name = class_name(priority, model)
    level = one(name)
    fair = levels.get(name + ":fair")
    if tenant is not None and fair is not None and f"{name}|{tenant}" not in levels:
        level = int(fair)
    if Priority(priority) == Priority.BATCH:
        level = max(level, one(class_name(Priority.REALTIME, model)))
    return level


def steps_in_force(level: int, enabled: tuple[str, ...]) -> list[str]:
    """The ladder's steps that ``level`` turns on, of those switched on in SLUICE_LADDER_STEPS."""
    return [step for rank, step in enumerate(LADDER_STEPS, start=1) if level >= rank and step in enabled]


def load_view(client: redis.Redis, enabled_steps: tuple[str, ...], reservations: list[dict]) -> dict:
    """What the operator sees (``GET /v1/admin/load``, ``sluice status``): the platform's level,
    the steps it turns on, every class as the monitor last published it, and the peak
    reservations in force or to come (``reservations``, from Postgres) with the workers paused
    for them now."""
    raw = client.hgetall(LOAD_LEVEL_KEY)
    level = int(raw["level"]) if raw else None
    paused = sorted(json.loads(v)["node"] for v in client.hvals(PAUSED_KEY))
    return {"level": level,
            "steps": steps_in_force(level or 0, enabled_steps),
            "monitor": "running" if raw else "not running: admission applies its local rules",
            "classes": [asdict(one) for one in ClassLoad.read_all(client)],
            "reservations": reservations,
            "paused_for_reservations": paused}
