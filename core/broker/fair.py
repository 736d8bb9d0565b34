"""Fair queuing across tenants: each tenant's excess waits in its own place in line, not in
everybody's queue (docs/fairness.md).

The Celery queues stay the transport: workers consume ``realtime.small`` and the rest as before.
What changes is what those queues hold. A request published to a class queue first joins that
queue's *line* in Redis (the broker's Redis, so it lives and dies with the messages), ordered by
start-time fair queuing across tenants in engine time (``lua/fair.lua``); the Celery queue holds
what the engines serving its class can start now (their free seats, as each engine states them
live; ``depth`` messages where none does), taken off the line in fair order:

* by the publisher itself, in the same step as its put (an idle class: the request goes straight
  through);
* by a worker each time it takes a message off the queue for good (``workers/tasks.py``; not one
  it hands back), and by its engine each time a seat comes free (``workers/bootstrap.py
  top_up``), so a seat goes to the line's next request, not to a message queued before it;
* by an engine that has had a seat free for a second since its last take (a take counts what
  others let through and have not pushed yet, so it can leave a seat unfilled, and with no
  monitor no later take might come);
* by the load monitor's leader every tick, the floor for a line nobody else topped up.

A tenant that floods a class queues far ahead in the line's virtual time, so another tenant's
request starts next; a priority request's line is served before a default one's (the tiers'
message priority steps rank the line as they rank the queue's lists).

Nothing is lost between the line and the queue: the row is the contract. A row is stamped
published when it joins the line; a request taken off the line by a process that dies before
publishing it is in neither place, and the sweep's lost-message check (which counts the lines as
queued) publishes it again. A request that ends while in the line (cancelled, expired) leaves it
(:meth:`FairQueues.drop`, a lifecycle hook).
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import redis
from kombu.transport.redis import PRIORITY_STEPS
from sqlalchemy import select

from core.admission.load import class_name, room_key, snapshot_key
from core.broker.queues import message_priority, publish_request, queue_lists
from core.ids import is_uuid
from models import Database, Tenant
from models.lifecycle import Moved
from models.request import Status

log = logging.getLogger(__name__)

PREFIX = "sluice:fair:"
QUEUES_KEY = PREFIX + "queues"  # the queues that have had a line
RESERVED_KEY = PREFIX + "reserved"  # tenant → its reserved share (sync_reservations)
_LUA = Path(__file__).with_name("lua")
# weight() and leave(), which fair.lua, drop.lua and the admission script share.
LINE_LUA = (_LUA / "line.lua").read_text()


def line_key(queue: str) -> str:
    return f"{PREFIX}{queue}:line"


def _items_key(queue: str) -> str:
    return f"{PREFIX}{queue}:items"


def state_key(queue: str) -> str:
    return f"{PREFIX}{queue}:state"


def seconds_key(queue: str) -> str:
    """What each tenant has in ``queue``'s line: '<tier>|<tenant>' → engine seconds."""
    return f"{PREFIX}{queue}:seconds"


def _parts(queue: str) -> tuple[str, str, str]:
    """A queue's priority, size class and model suffix ('' for the default model's):
    ``<priority>.<size>[.<model>]`` (``core/broker/queues.py``)."""
    priority, _, rest = queue.partition(".")
    size, _, model = rest.partition(".")
    return priority, size, model


def class_queues(queue: str) -> tuple[str, str]:
    """``queue`` and its class's queue of the other size (``realtime.small`` ↔ ``realtime.large``):
    the class's counters, which the promise reads, hold both. A queue of no size (an embed queue,
    none at all): itself, and a name with no line."""
    priority, size, model = _parts(queue)
    other = {"small": "large", "large": "small"}.get(size)
    return (queue or "-", f"{priority}.{other}{'.' + model if model else ''}" if other else "-")


def _counts_key(queue: str) -> str:
    return f"{PREFIX}{queue}:counts"


def sending_key(queue: str) -> str:
    """What a line let through that its taker has not published yet (``lua/fair.lua`` KEYS 10)."""
    return f"{PREFIX}{queue}:sending"


class FairQueues:
    """The fair lines in front of the class queues of one broker Redis (a client that decodes
    responses, ``core/rediskeys.py``); ``depth``: the messages a class queue is kept at while no
    engine serving its class states its room (0: no lines, every request is published straight to
    its queue);
    ``default_model``: the model whose queues carry no suffix (``core/registry.py``)."""

    def __init__(self, client: redis.Redis, depth: int, default_model: str) -> None:
        self.redis = client
        self.depth = depth
        self.default_model = default_model
        self._fair = client.register_script(LINE_LUA + (_LUA / "fair.lua").read_text())
        self._drop = client.register_script(LINE_LUA + (_LUA / "drop.lua").read_text())

    def handles(self, queue: str) -> bool:
        """Whether ``queue`` has a line: a class queue shared by tenants (not a worker's direct
        queue, the maintenance or webhooks queue)."""
        return self.depth > 0 and queue.startswith(("realtime.", "batch."))

    def put(self, rows: Iterable) -> list[tuple[str, str, str]]:
        """Put rows (``id``, ``queue``, ``tenant_id``, ``service_tier``, ``input_tokens``,
        ``reserved_tokens``; those without a tenant count as one tenant) in their queues' lines;
        what to publish now, in order: (request id, queue, tier)."""
        by_queue: dict[str, list] = defaultdict(list)
        for row in rows:
            by_queue[row.queue].append(row)
        out: list[tuple[str, str, str]] = []
        for queue, group in by_queue.items():
            args: list = []
            for row in group:
                tier = getattr(row, "service_tier", None) or ("batch" if queue.startswith("batch.") else "default")
                prompt = int(getattr(row, "input_tokens", 0) or 0)
                output = max(0, int(getattr(row, "reserved_tokens", 0) or 0) - prompt)
                args += [str(row.id), tier, message_priority(queue, tier), str(getattr(row, "tenant_id", "") or "-"),
                         prompt, output]
            out += self._run(queue, len(group), args)
        return out

    def take(self, queue: str) -> list[tuple[str, str, str]]:
        """What to publish to ``queue`` now to fill its room, in fair order: as many messages as the
        engines serving its class state free seats, or where none states its room, its depth
        (``lua/fair.lua``)."""
        return self._run(queue, 0, [])

    def take_all(self) -> list[tuple[str, str, str]]:
        """:meth:`take` for every queue with a line."""
        return [taken for queue in sorted(self.redis.smembers(QUEUES_KEY)) for taken in self.take(queue)]

    def publish(self, celery, taken: list[tuple[str, str, str | None]]) -> None:
        """Publish what a line let through (:meth:`put`, :meth:`take`): (request id, queue, tier),
        in order; then it is in the queue's lists, no longer on its way (the other takers count it
        there now, not twice)."""
        by_queue: dict[str, list[str]] = defaultdict(list)
        for request_id, queue, tier in taken:
            publish_request(celery, request_id, queue, tier)
            by_queue[queue].append(f"{message_priority(queue, tier)}:{request_id}")
        if by_queue:
            with self.redis.pipeline(transaction=False) as pipe:
                for queue, members in by_queue.items():
                    pipe.zrem(sending_key(queue), *members)
                pipe.execute()

    def drop(self, queue: str, request_id: str) -> bool:
        """Take a request that ended while queued out of its line; whether it was there."""
        return bool(self._drop(keys=[line_key(queue), _items_key(queue), seconds_key(queue), _counts_key(queue)],
                               args=[request_id]))

    def in_line(self, queue: str) -> set[str]:
        """The ids of the requests in ``queue``'s line."""
        return set(self.redis.zrange(line_key(queue), 0, -1))

    def size(self, queue: str) -> int:
        return int(self.redis.zcard(line_key(queue)))

    def tenants(self, queue: str) -> dict[str, tuple[int, float]]:
        """Each tenant with requests in ``queue``'s line, all tiers: (requests, engine seconds)."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(_counts_key(queue))
            pipe.hgetall(seconds_key(queue))
            counts, seconds = pipe.execute()
        out: dict[str, tuple[int, float]] = {}
        for field, n in counts.items():
            tenant = field.partition("|")[2]
            had = out.get(tenant, (0, 0.0))
            out[tenant] = (had[0] + int(n), had[1] + float(seconds.get(field) or 0))
        return out

    def _run(self, queue: str, puts: int, args: list) -> list[tuple[str, str, str]]:
        priority, _, model = _parts(queue)
        model = model or self.default_model
        keys = [line_key(queue), _items_key(queue), state_key(queue), seconds_key(queue), _counts_key(queue),
                snapshot_key(priority, model), QUEUES_KEY, RESERVED_KEY, room_key(priority, model),
                sending_key(queue), *queue_lists(queue)]
        ahead = "flex" if priority == "batch" else "priority"  # the tier served ahead of its class
        taken = self._fair(keys=keys, args=[self.depth, queue, ",".join(map(str, PRIORITY_STEPS)),
                                            message_priority(queue, ahead), puts, *args])
        return [(taken[i], queue, taken[i + 1] or None) for i in range(0, len(taken), 2)]


TOP_TENANTS = 10  # tenants named per line in views and metrics; the rest are summed as "other"


def weight(share: float | None, others: int) -> float:
    """A tenant's weight in a line, as ``lua/line.lua``'s weight() gives it to the scripts: 1, or
    for a reserved share r, r/(1 − r) times the other tenants with work there (at least 1), which
    gives it r while they all have work."""
    if share and 0 < share < 1:
        return max(1.0, share / (1 - share) * max(1, others))
    return 1.0


def _read_lines(client: redis.Redis) -> tuple[dict[str, float], list[tuple[str, dict, dict]]]:
    """The tenants' reserved shares, and each queue with a line: (queue, its counts hash, its
    seconds hash), every line in one round trip."""
    reserved = {k: float(v) for k, v in client.hgetall(RESERVED_KEY).items()}
    queues = sorted(client.smembers(QUEUES_KEY))
    with client.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.hgetall(_counts_key(queue))
            pipe.hgetall(seconds_key(queue))
        hashes = pipe.execute()
    return reserved, list(zip(queues, hashes[::2], hashes[1::2], strict=True))


def lines_view(client: redis.Redis, top: int = TOP_TENANTS) -> list[dict]:
    """Each class queue's fair line as the operator sees it (``GET /v1/admin/load``, ``sluice status
    --tenants``, the dashboard, the monitor's metrics): per tenant with work there, its requests
    and engine seconds, its reserved share, the share of the engines its weight gets while the
    tenants listed all have work, and how long its line takes to drain in fair order (its own
    work and the others' turns beside it, at the class's whole capacity). The ``top`` tenants with
    most work; the rest summed under ``tenant: "other"``."""
    reserved, lines = _read_lines(client)
    out = []
    for queue, counts, seconds in lines:
        work: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for field, n in counts.items():
            tenant = field.partition("|")[2]
            work[tenant][0] += int(n)
            work[tenant][1] += max(0.0, float(seconds.get(field) or 0))
        if not work:
            continue
        weights = {t: weight(reserved.get(t), len(work) - 1) for t in work}
        total = sum(weights.values())
        rows = [{"tenant": t, "requests": int(n), "seconds": round(s, 3), "reserved_share": reserved.get(t),
                 "share": round(weights[t] / total, 3),
                 "wait_s": round(sum(min(s2, s * weights[o] / weights[t]) for o, (_, s2) in work.items()), 3)}
                for t, (n, s) in work.items()]
        rows.sort(key=lambda r: -r["seconds"])
        if len(rows) > top:
            rest = rows[top:]
            rows = rows[:top] + [{"tenant": "other", "requests": sum(r["requests"] for r in rest),
                                  "seconds": round(sum(r["seconds"] for r in rest), 3), "reserved_share": None,
                                  "share": round(sum(r["share"] for r in rest), 3),
                                  "wait_s": max(r["wait_s"] for r in rest)}]
        out.append({"queue": queue, "tenants": rows})
    return out


@dataclass(frozen=True)
class Excess:
    """A class's fair lines as its level sees them (the load monitor, ``workers/monitor.py``)."""

    seconds: float  # engine seconds queued past each tenant's turn, summed over its tenants
    loud: frozenset[str]  # the tenants with work past their turn: each sees the class's whole wait
    # (tenant, its reserved share, its engine seconds in the lines, those past its turn) for each
    # loud tenant that holds a reservation: ``within`` decides whether it is inside it
    reserved: tuple[tuple[str, float, float, float], ...] = ()

    def within(self, deadline_s: float) -> Excess:
        """The excess as a class whose requests carry ``deadline_s`` judges it: a reserved tenant
        whose own line drains within the deadline at its share is inside its reservation, the
        test ``admit.lua`` makes (``inside``). It is not loud, so no level of the others' making
        reaches it, and its work past one turn stays in the fair wait: its weight puts that work
        before the others' next requests, so they do wait for it."""
        inside = {t: past for t, share, own, past in self.reserved if own <= share * deadline_s}
        if not inside:
            return self
        return Excess(max(0.0, self.seconds - sum(inside.values())), self.loud - inside.keys(),
                      tuple(r for r in self.reserved if r[0] not in inside))


def line_excess(client: redis.Redis, default_model: str) -> dict[str, Excess]:
    """Per class (``core/admission/load.py class_name``): how much of its lines' engine time only
    the tenants that queued it wait for. In each tier of a class's lines (both sizes together), a
    tenant's *turn* is what its weight gets beside one request of the mean cost there (the mean
    over the tier's requests): a tenant that queued more than its turn is *loud*, and the rest,
    its *excess*, goes after every other tenant's next request. The class's wait less the summed
    excess is the wait of a tenant whose next request is one turn away, the wait the class's fair
    level is judged on; a loud tenant is judged on the whole (``admit.lua``, ``ladder.py``). One
    round trip for every line."""
    reserved, lines = _read_lines(client)
    # class → tier → tenant → [requests, seconds]
    work: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(
        lambda: [0, 0.0])))
    for queue, counts, seconds in lines:
        priority, _, model = _parts(queue)
        tiers = work[class_name(priority, model or default_model)]
        for field, n in counts.items():
            tier, _, tenant = field.partition("|")
            tiers[tier][tenant][0] += int(n)
            tiers[tier][tenant][1] += max(0.0, float(seconds.get(field) or 0))
    out: dict[str, Excess] = {}
    for name, tiers in work.items():
        pasts: dict[str, float] = defaultdict(float)
        own: dict[str, float] = defaultdict(float)
        for tenants in tiers.values():
            requests = sum(n for n, _ in tenants.values())
            mean = sum(s for _, s in tenants.values()) / requests if requests else 0.0
            for tenant, (_, s) in tenants.items():
                own[tenant] += s
                past = s - mean * weight(reserved.get(tenant), len(tenants) - 1)
                if past > 1e-9:
                    pasts[tenant] += past
        out[name] = Excess(sum(pasts.values()), frozenset(pasts), tuple(
            (t, reserved[t], own[t], past) for t, past in pasts.items() if 0 < reserved.get(t, 0) < 1))
    return out


def name_tenants(session, lines: list[dict]) -> list[dict]:
    """``lines_view``'s rows with each tenant's name (``name``), read in ``session``."""
    ids = {r["tenant"] for line in lines for r in line["tenants"] if r["tenant"] != "other"}
    valid = [uuid.UUID(i) for i in ids if is_uuid(i)]
    names = {str(i): n for i, n in session.execute(select(Tenant.id, Tenant.name).where(Tenant.id.in_(valid)))} \
        if valid else {}
    for line in lines:
        for row in line["tenants"]:
            row["name"] = names.get(row["tenant"], row["tenant"])
    return lines


def sync_reservations(db: Database, client: redis.Redis) -> dict[str, float]:
    """Copy the tenants' reserved shares from Postgres to Redis (``RESERVED_KEY``), where the fair
    lines and the promise read them: the load monitor's leader does it every few seconds, the
    admin API as it changes one. In one transaction: no reader sees the hash half written."""
    with db.session() as session:
        shares = {str(tenant): float(share) for tenant, share in session.execute(
            select(Tenant.id, Tenant.reserved_share).where(Tenant.reserved_share.is_not(None)))}
    with client.pipeline() as pipe:
        pipe.delete(RESERVED_KEY)
        if shares:
            pipe.hset(RESERVED_KEY, mapping=shares)
        pipe.execute()
    return shares


class LineDrops:
    """A lifecycle ``on_move`` hook: a request that ends while queued leaves its queue's line, so
    the line holds only requests still waiting and each tenant's queued engine time stays true."""

    def __init__(self, fair: FairQueues, healthy=lambda: True) -> None:
        self.fair = fair
        self.healthy = healthy

    def __call__(self, moved: Moved) -> None:
        if (moved.source != Status.QUEUED or not moved.status.terminal or not self.fair.handles(moved.queue)
                or not self.healthy()):
            return
        try:
            self.fair.drop(moved.queue, str(moved.id))
        except redis.RedisError as exc:  # taken off later and dropped by the worker that finds it ended
            log.warning("fair line not updated (%s)", type(exc).__name__)
