"""The web process's own second try at publishing (core/broker/republish.py), its logic alone:
backoff while publishing fails, nothing dropped that is younger than the sweep's grace, nothing
kept that is older. The real Redis cases are in test_local_floor.py."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

from core.broker.republish import KEEP_AT_LEAST_S, Republisher


def rows(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(id=uuid.uuid4(), queue="realtime.small") for _ in range(n)]


def wait_for(predicate, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_rows_are_published_once_publishing_works_again_and_each_once():
    published: list[uuid.UUID] = []
    failing = {"left": 3}

    def publish(batch) -> None:
        if failing["left"]:
            failing["left"] -= 1
            raise ConnectionError("Redis away")
        published.extend(r.id for r in batch)

    republisher = Republisher(publish, give_up_s=1)
    kept = rows(5)
    republisher.add(kept)
    assert wait_for(lambda: republisher.pending() == 0)
    assert sorted(published) == sorted(r.id for r in kept) and republisher.published == 5
    # It goes on working after it went idle.
    later = rows(2)
    republisher.add(later)
    assert wait_for(lambda: republisher.published == 7)
    assert set(published) >= {r.id for r in later}


def test_rows_past_the_grace_are_left_to_the_sweep():
    now = {"t": 0.0}
    republisher = Republisher(lambda batch: (_ for _ in ()).throw(ConnectionError("away")), give_up_s=5,
                              clock=lambda: now["t"])
    republisher.add(rows(3))
    time.sleep(0.3)
    assert republisher.pending() == 3  # failing, but young: kept
    now["t"] = KEEP_AT_LEAST_S + 1
    assert wait_for(lambda: republisher.pending() == 0, timeout_s=10)
    assert republisher.published == 0
