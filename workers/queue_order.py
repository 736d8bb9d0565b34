"""The order in which a worker's free thread reads its queues.

kombu's Redis transport asks a "queue cycle" which queues to BRPOP, in order, and tells it
which queue the last message came from. Its built-in cycles are either round-robin over all
queues (realtime and batch take turns) or a fixed order (``realtime.large`` would wait until
``realtime.small`` is empty, so long contexts starve behind short ones). This one is strict
between classes (maintenance, then the worker's direct queue, then realtime, then batch) and
round-robin inside a class. It is named in the ``queue_order_strategy`` transport option.

A worker closes its batch queues for a while (``set_batch_gate``): while realtime needs its engine
(``workers/governor.py``) or every thread batch work may hold is taken, the next fetch leaves the
batch queues out, so batch messages stay in the broker instead of being taken and handed back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from core.broker.queues import DIRECT_PREFIX, MAINTENANCE_QUEUE

_CLASSES = (MAINTENANCE_QUEUE, DIRECT_PREFIX, "realtime.", "batch.")


def _always() -> bool:
    return True


_batch_gate: Callable[[], bool] = _always


def set_batch_gate(gate: Callable[[], bool]) -> None:
    """Make ``gate()`` decide, before each fetch, whether this process reads its batch queues."""
    global _batch_gate
    _batch_gate = gate


def queue_class(queue: str) -> int:
    """Rank of a queue's class; lower is read first. Unknown queues come last."""
    return next((rank for rank, prefix in enumerate(_CLASSES) if queue.startswith(prefix)), len(_CLASSES))


class ClassPriorityCycle:
    """A kombu queue cycle (``update`` / ``consume`` / ``rotate``): strict between classes,
    round-robin within one."""

    def __init__(self, it: Iterable[str] | None = None) -> None:
        self.items: list[str] = []
        self.update(it or ())

    def update(self, it: Iterable[str]) -> None:
        self.items[:] = sorted(it, key=queue_class)  # stable: the given order within a class

    def consume(self, n: int) -> list[str]:
        try:
            open_ = _batch_gate()
        except Exception:  # the consumer's loop must never fail on it: batch reads as before
            open_ = True
        if open_:
            return self.items[:n]
        return [q for q in self.items if not q.startswith("batch.")][:n]

    def rotate(self, last_used: str) -> str:
        """Move the queue just read from to the back of its own class."""
        if last_used in self.items:
            self.items.remove(last_used)
            rank = queue_class(last_used)
            self.items.insert(sum(1 for q in self.items if queue_class(q) <= rank), last_used)
        return last_used
