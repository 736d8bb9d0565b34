"""The worker's row writes, against real Postgres, for outcomes an engine can really produce."""

from __future__ import annotations

import time
import uuid

from factories import request_row
from sqlalchemy import select

from models import InferenceRequest, Status, Tenant, utcnow
from models.lifecycle import Lifecycle
from web.services import services
from workers.engines import GenerationOutput
from workers.execution import finish
from workers.runtime import RunResult


def test_output_with_nul_bytes_is_stored(app):
    """A random model can emit U+0000, which PostgreSQL text refuses; the row must still finish."""
    db = services(app).db
    with db.session() as session:
        tenant = Tenant(name=f"nul-{uuid.uuid4().hex[:8]}")
        session.add(tenant)
        session.flush()
        row = request_row(tenant.id, status=Status.RUNNING, attempts=1, worker="w/1", started_at=utcnow())
        session.add(row)
    out = GenerationOutput(request_id=str(row.id), text="a\x00b", prompt_tokens=1, output_tokens=3, finished=True,
                           finish_reason="length")
    now = time.monotonic()
    assert finish(Lifecycle(db), row.id, "w/1", "m", RunResult(out, now, "finished"), now) is not None
    with db.session() as session:
        stored = session.scalar(select(InferenceRequest).where(InferenceRequest.id == row.id))
    assert stored.status == Status.SUCCEEDED and stored.output_text == "a\ufffdb"


def test_row_writes_wait_out_a_busy_connection_pool(database_url, monkeypatch):
    """A worker runs more threads than it has connections; a write that finds every pooled
    connection busy past pool_timeout is retried, not failed."""
    import threading
    from types import SimpleNamespace

    from core.settings import Settings
    from models.session import Database
    from workers import execution

    db = Database()
    db.configure(Settings(database_url=database_url).sqlalchemy_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    held, release = threading.Event(), threading.Event()

    def hold_the_only_connection() -> None:
        with db.session() as session:
            session.execute(select(1))
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold_the_only_connection)
    holder.start()
    assert held.wait(30)

    def backoff(_delay: float) -> None:  # the retry's pause: the other thread finishes meanwhile
        release.set()
        holder.join(30)

    # Only this module's view of `time`: other threads keep the real time.sleep.
    monkeypatch.setattr(execution, "time", SimpleNamespace(sleep=backoff))
    attempts = []

    def write() -> int:
        attempts.append(1)
        with db.session() as session:
            return session.scalar(select(1))

    try:
        assert execution.with_db_retries(write) == 1
        assert len(attempts) == 2  # the first timed out waiting for the pool
    finally:
        release.set()
        holder.join(30)
        db.dispose()
