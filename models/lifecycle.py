"""Every status change of a request row, in one place.

    (new) ──accept──► queued ──claim──► running ──finish──► succeeded | failed | timed_out | cancelled | expired
      │                │  ▲                │                                    (still running at its deadline)
      │                │  └─requeue / hand back─┘  (its worker died, attempts left / its worker stopped)
      │                ├──cancel──► cancelled
      │                ├──expire──► expired   (its deadline passed before it started)
      │                └──follow──► succeeded (a parked twin takes the answer of the request it followed)
      └──answer──► succeeded  (the hot answer cache had its twin: inserted already ended)

Each transition is one conditional ``UPDATE … WHERE status = <from>``, so two processes racing
on one row (a duplicate delivery, a cancel against a claim, the sweep against a slow worker)
can never both win, and a row reaches exactly one terminal status. Every timestamp a
transition writes comes from the database clock (``statement_timestamp()``), the clock
``created_at`` uses, so ``queue_wait_s`` and ``inference_s`` never mix two hosts' clocks.

Work that must follow "this request ended" attaches with :meth:`Lifecycle.on_end` (today:
releasing its admission reservation, the end metrics, the twins parked on it); work that follows
every move, acceptance (``None → queued``) included, with :meth:`Lifecycle.on_move` (the class
queue counters, the move announcements that wake waits and streams, webhooks). The hooks are
attached in ``core/services.py build_services``. Hooks run once per transition, after its
transaction committed, in the process that made it.

``rejected`` is declared in the status enum and the table's CHECK but nothing writes it yet:
refusals touch no Postgres (a refused request has no row).
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, Float, cast, func, or_, select, update
from sqlalchemy.orm import Session

from models.request import InferenceRequest, Priority, Status, storable_text
from models.session import Database

log = logging.getLogger(__name__)

ALLOWED: dict[Status, frozenset[Status]] = {
    # queued → succeeded only for a parked twin (follows_id set), answered by the request it followed.
    Status.QUEUED: frozenset({Status.RUNNING, Status.CANCELLED, Status.EXPIRED, Status.SUCCEEDED}),
    Status.RUNNING: frozenset({Status.SUCCEEDED, Status.FAILED, Status.TIMED_OUT, Status.CANCELLED,
                               Status.EXPIRED, Status.QUEUED}),
}


class End(NamedTuple):
    """How a request ended: its terminal status and the error code and message on the row."""

    status: Status
    code: str | None = None
    message: str | None = None


SUCCEEDED = End(Status.SUCCEEDED)
TIME_LIMIT = End(Status.TIMED_OUT, "time_limit_exceeded",
                 "Inference ran past the request's time limit and was stopped.")
CANCELLED_QUEUED = End(Status.CANCELLED, "cancelled", "Cancelled by the client before it started.")
CANCELLED_RUNNING = End(Status.CANCELLED, "cancelled", "Cancelled by the client while running.")
CANCELLED_ORPHAN = End(Status.CANCELLED, "cancelled", "Cancelled by the client; its worker died while running it.")
ENGINE_SHUTDOWN = End(Status.FAILED, "engine_shutdown", "The worker shut down while this ran; retry.")
ENGINE_ERROR = End(Status.FAILED, "engine_error", "The inference engine failed on this request.")
RESULT_NOT_STORABLE = End(Status.FAILED, "result_not_storable",
                          "The engine's result could not be stored; retry the request.")
DEADLINE_EXCEEDED = End(Status.EXPIRED, "deadline_exceeded",
                        "Not started before its deadline; dropped instead of computing an answer too late.")
DEADLINE_RUNNING = End(Status.EXPIRED, "deadline_exceeded",
                       "Still running at its deadline; aborted instead of computing an answer too late.")
DEADLINE_UNREACHABLE = End(Status.EXPIRED, "deadline_exceeded",
                           "Its queue wait left too little time to finish by its deadline at the engine's speed; "
                           "dropped before it started instead of computing an answer too late.")


def invalid_constraint(reason: str) -> End:
    """The engine could not compile the request's structured-output constraint."""
    return End(Status.FAILED, "invalid_response_format",
               f"The engine cannot decode under this response_format or tool schema: {reason}"[:500])


def engine_refused(reason: str) -> End:
    """The engine refused the request as given (a limit of its model); the reason is its own."""
    return End(Status.FAILED, "engine_refused", f"The engine refused this request: {reason}"[:500])


STALLED_WORKER = End(Status.FAILED, "stalled_worker",
                     "Running it held its worker's event loop until the watchdog restarted the worker; "
                     "it is not run again.")


def worker_lost(attempts: int) -> End:
    return End(Status.FAILED, "worker_lost", f"The worker running this died {attempts} times; gave up.")


class TransitionRefused(Exception):
    """The row is in a status the asked-for transition cannot start from: a request's, a job's,
    an item's or a delivery's (each state owner raises this one, so one ``except`` catches any)."""

    def __init__(self, status: StrEnum, target: StrEnum, what: str = "request") -> None:
        super().__init__(f"a {status.value} {what} cannot become {target.value}")
        self.status = status
        self.target = target


@dataclass(frozen=True)
class Moved:
    """What a hook learns of one transition: the row's identity, class, outcome and token
    columns (enough for the limiter to settle a reservation and the queue counters to move)."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    source: Status | None  # None: the row was just accepted
    status: Status
    error_code: str | None
    priority: Priority
    model: str  # the model whose queues carry it (routed, else requested)
    reserved_tokens: int
    input_tokens: int
    output_tokens: int | None
    started_at: datetime | None
    follows: uuid.UUID | None = None  # a parked twin: off every queue, its leader's id
    deadline_s: float | None = None  # from its creation to its deadline
    webhook: bool = False  # it has a webhook URL: the webhook hook reads the row, every other row costs nothing
    # What its budgets keep of their reservation (core/usage/budgets.py used_units): an answer no
    # engine computed for it costs nothing; else its cost, which Postgres worked out.
    cache_hit: bool = False
    cost: Decimal = Decimal(0)
    service_tier: str = "default"  # its service tier: the tier ahead in its class has counters of its own
    queue: str = ""  # the queue it is published to: one it ends queued in leaves that queue's fair line


Ended = Moved  # what on_end hooks receive: a Moved whose status is terminal


@dataclass(frozen=True)
class Claimed:
    """The columns a worker needs to run a request it just claimed."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    input: dict[str, Any]
    params: dict[str, Any]
    priority: Priority
    max_tokens: int
    time_limit_s: float
    input_tokens: int
    conversation_id: str | None
    deadline_in_s: float | None  # seconds left until its deadline, on the database clock
    queue_wait_s: float = 0.0  # from its creation to this claim, on the database clock
    service_tier: str | None = None  # its tier (docs/tiers.md): its place in the engine


class Orphan(NamedTuple):
    """A running row whose worker is gone, as the sweep found it."""

    id: uuid.UUID
    queue: str
    worker: str | None
    attempts: int
    cancel_requested_at: datetime | None


class Requeued(NamedTuple):
    id: uuid.UUID
    queue: str
    service_tier: str | None = None  # its message's place in line (core/broker/queues.py MESSAGE_PRIORITY)
    # Its tenant and tokens: its place in its queue's fair line (core/broker/fair.py).
    tenant_id: uuid.UUID | None = None
    input_tokens: int = 0
    reserved_tokens: int = 0

    @classmethod
    def of(cls, row: Any) -> Requeued:
        """From a row of ``_MOVED_COLUMNS``."""
        return cls(row.id, row.queue, row.service_tier, row.tenant_id, row.input_tokens, row.reserved_tokens)


_t = InferenceRequest
_MOVED_COLUMNS = (_t.id, _t.tenant_id, _t.status, _t.error_code, _t.priority, func.coalesce(_t.model_routed,
                  _t.model_requested), _t.reserved_tokens, _t.input_tokens, _t.output_tokens, _t.started_at,
                  _t.follows_id, cast(func.extract("epoch", _t.deadline_at - _t.created_at), Float),
                  _t.webhook_url.is_not(None), _t.cache_hit, _t.cost, _t.service_tier, _t.queue)


def _moved(source: Status | None, row: Any) -> Moved:
    """A Moved from a row of ``_MOVED_COLUMNS`` (or a loaded InferenceRequest)."""
    if isinstance(row, InferenceRequest):
        deadline = (row.deadline_at - row.created_at).total_seconds() if row.deadline_at and row.created_at else None
        row = (row.id, row.tenant_id, row.status, row.error_code, row.priority, row.target_model,
               row.reserved_tokens, row.input_tokens, row.output_tokens, row.started_at, row.follows_id, deadline,
               row.webhook_url is not None, bool(row.cache_hit), Decimal(0),  # born, or cancelled queued: no engine ran
               row.service_tier or "default", row.queue or "")
    return Moved(row[0], row[1], source, *row[2:])


def stored_choices(output: Any) -> list[dict[str, Any]] | None:
    """The engine output's choices (``GenerationOutput.choices``: n > 1, or logprobs asked) as the
    ``choices`` column keeps them; None for a plain answer."""
    if not getattr(output, "choices", None):
        return None
    return [{"text": storable_text(c.text), "finish_reason": c.finish_reason, "output_tokens": c.output_tokens,
             "logprobs": None if c.logprobs is None else stored_logprobs(c.logprobs)}
            for c in output.choices]


def stored_logprobs(tokens: Any) -> list[dict[str, Any]]:
    """Engine ``TokenLogprob``s as a row's choices (and a stream's increments) keep them."""
    return [{"token": storable_text(t.token), "logprob": t.logprob,
             "top": [[storable_text(token), logprob] for token, logprob in t.top]} for t in tokens]


def about(request_id: uuid.UUID) -> dict[str, str]:
    """``extra=`` for a log line about one request, from code that may run outside its context
    (the sweep acts on many rows): the log format shows it as the line's request id."""
    return {"request_id": str(request_id)}


def db_now() -> ColumnElement[datetime]:
    """The database's clock when the statement began (not the transaction's start): one value
    for every stamp a transition writes, so they compare exactly."""
    return func.statement_timestamp()


class Lifecycle:
    """The transitions of request rows in one database, and the hooks that follow them."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._on_move: list[tuple[Callable[[Moved], None], bool]] = []

    def on_end(self, hook: Callable[[Moved], None]) -> Callable[[Moved], None]:
        """Call ``hook(moved)`` after every terminal transition this process commits."""
        self._on_move.append((hook, True))
        return hook

    def on_move(self, hook: Callable[[Moved], None]) -> Callable[[Moved], None]:
        """Call ``hook(moved)`` after every transition this process commits, acceptance included."""
        self._on_move.append((hook, False))
        return hook

    def accept(self, row: InferenceRequest, also: Callable[[Session], None] | None = None) -> None:
        """Insert a new row (born ``queued``) and run ``also(session)`` in the same transaction
        (claiming its idempotency key); from the commit on, the request must reach a terminal status."""
        self._insert(row, also)

    def answer(self, row: InferenceRequest, answer: dict[str, Any],
               also: Callable[[Session], None] | None = None) -> None:
        """Insert a new row born ``succeeded`` with ``answer`` (text, finish_reason, input and
        output tokens) from the hot answer cache: no engine ran, no queue held it."""
        row.status, row.cache_hit, row.model_used = Status.SUCCEEDED, True, row.target_model
        row.started_at = row.first_token_at = row.finished_at = db_now()
        row.output_text, row.finish_reason = answer["text"], answer.get("finish_reason")
        row.choices = answer.get("choices")
        row.embedding = base64.b64decode(answer["embedding"]) if answer.get("embedding") else None
        row.device = answer.get("device")  # what computed the answer (no worker ran this row)
        row.input_tokens, row.output_tokens = answer.get("input_tokens", row.input_tokens), answer["output_tokens"]
        # No engine time: admission refunds the whole reservation (started_at is what says so).
        self._insert(row, also, ran=False)

    def _insert(self, row: InferenceRequest, also: Callable[[Session], None] | None, ran: bool = True) -> None:
        with self._moving() as moved, self.db.session() as session:
            session.add(row)
            if also is not None:
                also(session)
            session.flush()
            born = _moved(None, row)
            moved.append(born if ran else dataclasses.replace(born, started_at=None))

    # ------------------------------------------------------------------ queued → …

    def claim(self, request_id: uuid.UUID, worker: str, device: str) -> Claimed | None:
        """queued → running for ``worker``, or None when the row is not its to run.

        A row whose deadline passed becomes ``expired`` here instead: it is never computed.
        """
        with self._moving() as moved, self.db.session() as session:
            row = session.execute(
                _transition(Status.QUEUED, Status.RUNNING, _t.id == request_id, _t.cancel_requested_at.is_(None),
                            or_(_t.deadline_at.is_(None), _t.deadline_at > db_now()))
                .values(started_at=db_now(), worker=worker, device=device, attempts=_t.attempts + 1)
                .returning(_t.input, _t.params, _t.max_tokens, _t.time_limit_s, _t.conversation_id,
                           func.extract("epoch", _t.deadline_at - db_now()),
                           func.extract("epoch", db_now() - _t.created_at), *_MOVED_COLUMNS)).one_or_none()
            if row is None:
                moved += _expire(session, _t.id == request_id)
                if not moved:
                    status = session.scalar(select(_t.status).where(_t.id == request_id))
                    log.info("not running: row is %s", status.value if status else "missing")
                return None
            claim = _moved(Status.QUEUED, row[7:])
            moved.append(claim)
        log.info("running on %s", worker)
        deadline_in = row[5]
        return Claimed(claim.id, claim.tenant_id, row.input, row.params, claim.priority, row.max_tokens,
                       row.time_limit_s, claim.input_tokens, row.conversation_id,
                       None if deadline_in is None else float(deadline_in), float(row[6]), claim.service_tier)

    def cancel(self, tenant_id: uuid.UUID, request_id: uuid.UUID) -> InferenceRequest | None:
        """A client's cancel: queued → cancelled at once; a running row is flagged for its worker.

        Returns the row after the change (None if the tenant has no such request); raises
        :class:`TransitionRefused` for a finished one. The row lock makes a concurrent claim
        wait, so a request is either cancelled before it starts or flagged, never neither.
        """
        with self._moving() as moved, self.db.session() as session:
            status = session.scalar(select(_t.status).where(_t.id == request_id, _t.tenant_id == tenant_id)
                                    .with_for_update())
            if status is None:
                return None
            if status.terminal:
                raise TransitionRefused(status, Status.CANCELLED)
            flag = {"cancel_requested_at": func.coalesce(_t.cancel_requested_at, db_now())}
            if status == Status.QUEUED:
                statement = _ending(Status.QUEUED, CANCELLED_QUEUED, _t.id == request_id).values(**flag)
            else:
                statement = update(_t).where(_t.id == request_id).values(**flag)
            row = session.scalars(statement.returning(_t).execution_options(populate_existing=True)).one()
            if row.status.terminal:
                moved.append(_moved(status, row))
        log.info("cancel requested while %s", status.value)
        return row

    def expire_late(self, *where: ColumnElement[bool]) -> int:
        """queued → expired for rows matching ``where`` whose deadline has passed; how many."""
        with self._moving() as moved, self.db.session() as session:
            moved += _expire(session, *where)
        return len(moved)

    def follow_up(self, leader_id: uuid.UUID) -> list[Requeued]:
        """The request ``leader_id`` ended: settle the twins parked on it.

        Succeeded: each takes its answer (queued → succeeded, ``cache_hit``; no engine ran for it,
        so admission refunds its whole reservation). Anything else: each is un-parked, a plain
        queued request again, returned for the caller to publish (committed by then). A no-op
        while the leader has not ended, so anyone may call it at any time; the conditional
        updates make two callers settle each twin once.
        """
        leader = _t.__table__.alias("leader")
        parked = (_t.follows_id == leader_id, _t.status == Status.QUEUED)
        with self._moving() as moved, self.db.session() as session:
            status = session.scalar(select(leader.c.status).where(leader.c.id == leader_id))
            if status is None or not Status(status).terminal:
                return []
            status = Status(status)
            if status == Status.SUCCEEDED:
                rows = session.execute(
                    _ending(Status.QUEUED, SUCCEEDED, *parked, leader.c.id == _t.follows_id)
                    .values(cache_hit=True, model_used=leader.c.model_used, output_text=leader.c.output_text,
                            choices=leader.c.choices, embedding=leader.c.embedding, device=leader.c.device,
                            input_tokens=leader.c.input_tokens, output_tokens=leader.c.output_tokens,
                            finish_reason=leader.c.finish_reason, started_at=db_now(), first_token_at=db_now())
                    .returning(*_MOVED_COLUMNS)).all()
                moved += [dataclasses.replace(_moved(Status.QUEUED, r), started_at=None) for r in rows]
                return []
            rows = session.execute(update(_t).where(*parked).values(follows_id=None)
                                   .returning(*_MOVED_COLUMNS)).all()
            # Un-parked: to the queue counters, as good as just accepted.
            moved += [_moved(None, r) for r in rows]
        for row in rows:
            log.info("un-parked: the request it followed ended %s", status.value, extra=about(row.id))
        return [Requeued.of(r) for r in rows]

    def stamp_enqueued(self, request_id: uuid.UUID, epoch: str | None) -> None:
        """Record that the row's message was published into broker ``epoch`` (``enqueued_at`` once:
        a re-publish keeps the first stamp unless the row was requeued). Not conditional on
        ``queued``: an idle worker often claims the row before this stamp, and the row must still
        say when it was published."""
        with self.db.session() as session:
            session.execute(update(_t).where(_t.id == request_id).values(
                enqueued_at=func.coalesce(_t.enqueued_at, db_now()), broker_epoch=epoch))

    # ------------------------------------------------------------------ running → …

    def finish(self, request_id: uuid.UUID, worker: str, end: End, *, model: str | None = None,
               output: Any = None, first_token_after_s: float | None = None,
               finished_after_s: float | None = None) -> Moved | None:
        """running → ``end`` if ``worker`` still owns the row; what ended, or None if not its.

        ``output`` is the engine's last :class:`GenerationOutput` (or None). The first-token
        stamp is ``started_at`` (the database's clock at the claim) plus ``first_token_after_s``,
        the time from claim to first token the worker measured on its own monotonic clock: one
        clock for every stamp, and no error from how long the write itself waited. It is never
        after ``finished_at``, which ``finished_after_s`` (the engine's end, measured the same way)
        stamps likewise: a result computed before its deadline whose write came after is recorded
        as computed when it was.
        """
        values: dict[str, Any] = {}
        if model is not None:
            values["model_used"] = model
        for stamp, after_s in (("first_token_at", first_token_after_s), ("finished_at", finished_after_s)):
            if after_s is not None:  # the claim's database time plus the worker's offset, never after the write
                values[stamp] = func.least(_t.started_at + timedelta(seconds=max(0.0, after_s)), db_now())
        if output is not None:
            values.update(output_text=storable_text(output.text), output_tokens=output.output_tokens,
                          input_tokens=output.prompt_tokens, cached_tokens=output.cached_tokens,
                          finish_reason=output.finish_reason, choices=stored_choices(output),
                          embedding=getattr(output, "embedding", None))
        with self._moving() as moved, self.db.session() as session:
            row = session.execute(_ending(Status.RUNNING, end, _t.id == request_id, _t.worker == worker)
                                  .values(**values).returning(*_MOVED_COLUMNS)).one_or_none()
            if row is not None:
                moved.append(_moved(Status.RUNNING, row))
        if row is None:
            log.warning("outcome %s discarded: this worker no longer owns the row", end.status.value)
            return None
        return moved[0]

    def hand_back(self, request_id: uuid.UUID, worker: str, why: str = "its worker stopped before it finished"
                  ) -> Requeued | None:
        """running → queued for a worker that stops before it finished the row (a deploy, a
        shutdown) or took it out of its engine to make room for realtime work (a preempted batch
        request): not a failure, so the attempt is given back. The caller publishes the returned
        row. None if the row is not this worker's or the client asked to cancel it (the caller
        then ends it as cancelled)."""
        with self._moving() as moved, self.db.session() as session:
            row = session.execute(
                _transition(Status.RUNNING, Status.QUEUED, _t.id == request_id, _t.worker == worker,
                            _t.cancel_requested_at.is_(None))
                .values(worker=None, device=None, started_at=None, enqueued_at=None,
                        attempts=func.greatest(_t.attempts - 1, 0))
                .returning(*_MOVED_COLUMNS)).one_or_none()
            if row is None:
                return None
            moved.append(_moved(Status.RUNNING, row))
        log.warning("handed back: %s", why, extra=about(request_id))
        return Requeued.of(row)

    def recover_orphans(self, *where: ColumnElement[bool], max_attempts: int, limit: int,
                        stalled: frozenset[uuid.UUID] = frozenset()) -> tuple[dict[str, int], list[Requeued]]:
        """Rows ``running`` on a dead worker (``where`` says which): cancelled if the client asked
        for that, ``stalled_worker`` if its worker's watchdog found the loop inside it (``stalled``),
        ``worker_lost`` once they used every attempt, else back to ``queued``.

        Rows another sweep holds are skipped. Returns counts and the requeued rows, which the
        caller publishes (they are committed by then).
        """
        counts = {"requeued": 0, "worker_lost": 0, "cancelled_orphans": 0, "stalled_worker": 0}
        requeued: list[Requeued] = []
        with self._moving() as moved, self.db.session() as session:
            orphans = [Orphan(*r) for r in session.execute(
                select(_t.id, _t.queue, _t.worker, _t.attempts, _t.cancel_requested_at)
                .where(_t.status == Status.RUNNING, *where)
                .order_by(_t.started_at).limit(limit).with_for_update(skip_locked=True))]
            for orphan in orphans:
                owned = (_t.id == orphan.id, _t.worker == orphan.worker)  # None: IS NULL
                if (orphan.cancel_requested_at is not None or orphan.id in stalled
                        or orphan.attempts >= max_attempts):
                    end = (CANCELLED_ORPHAN if orphan.cancel_requested_at is not None else
                           STALLED_WORKER if orphan.id in stalled else worker_lost(orphan.attempts))
                    row = session.execute(_ending(Status.RUNNING, end, *owned).returning(*_MOVED_COLUMNS)).one()
                    moved.append(_moved(Status.RUNNING, row))
                    counts["cancelled_orphans" if end is CANCELLED_ORPHAN else
                           "stalled_worker" if end is STALLED_WORKER else "worker_lost"] += 1
                else:
                    row = session.execute(_transition(Status.RUNNING, Status.QUEUED, *owned).values(
                        worker=None, device=None, started_at=None, enqueued_at=None).returning(*_MOVED_COLUMNS)).one()
                    moved.append(_moved(Status.RUNNING, row))
                    requeued.append(Requeued.of(row))
                    counts["requeued"] += 1
        for orphan in requeued:
            log.warning("requeued: its worker died while running it", extra=about(orphan.id))
        return counts, requeued

    # ------------------------------------------------------------------ hooks

    @contextmanager
    def _moving(self) -> Iterator[list[Moved]]:
        """Collect the transitions made inside; log the terminal ones and run the hooks once the
        block (and so its transaction) completed without error."""
        moved: list[Moved] = []
        yield moved
        for row in moved:
            if row.status.terminal:
                log.info("%s%s", row.status.value, f" ({row.error_code})" if row.error_code else "",
                         extra=about(row.id))
            for hook, only_ends in self._on_move:
                if only_ends and not row.status.terminal:
                    continue
                try:
                    hook(row)
                except Exception:  # a hook must never undo or hide a committed transition
                    log.exception("lifecycle hook %s failed", getattr(hook, "__qualname__", hook), extra=about(row.id))


def reroute(request_id: uuid.UUID, queue: str):
    """A queued row moved to another queue (the node its conversation was pinned to died): the
    statement the sweep runs under its row lock. ``enqueued_at`` is cleared, so the row counts as
    never published until the sweep publishes it there (``stamp_enqueued``)."""
    return (update(InferenceRequest).where(InferenceRequest.id == request_id, InferenceRequest.status == Status.QUEUED)
            .values(queue=queue, enqueued_at=None))


def allowed(source: Status, target: Status) -> bool:
    return target in ALLOWED.get(source, ())


def _transition(source: Status, target: Status, *where: ColumnElement[bool]):
    """``UPDATE requests SET status = target WHERE status = source AND where``, if allowed."""
    if not allowed(source, target):
        raise TransitionRefused(source, target)
    return update(_t).where(_t.status == source, *where).values(status=target)


def _ending(source: Status, end: End, *where: ColumnElement[bool]):
    """A transition to a terminal status: stamps ``finished_at`` and the error code and message."""
    return _transition(source, end.status, *where).values(finished_at=db_now(), error_code=end.code,
                                                         error_message=end.message)


def _expire(session: Session, *where: ColumnElement[bool]) -> list[Moved]:
    rows = session.execute(_ending(Status.QUEUED, DEADLINE_EXCEEDED, *where, _t.deadline_at <= db_now())
                           .returning(*_MOVED_COLUMNS)).all()
    return [_moved(Status.QUEUED, row) for row in rows]
