"""Nothing accepted is lost: cancels before start, web crashes before publish, SIGKILLed workers.

These tests use their own Redis database, so the session's shared worker never sees their
queues and each test decides exactly which worker runs (or does not run) what.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
from conftest import ApiClient, BeatProcess, WorkerProcess
from factories import request_row
from sqlalchemy import select, update

from core.broker.fair import line_key
from core.broker.queues import queue_lists
from models import InferenceRequest, Status, utcnow
from web.services import services
from workers.sweep import sweep


def run_sweep(application) -> dict:
    return sweep(services(application))


def rows(application, ids) -> dict[str, InferenceRequest]:
    with services(application).db.session() as session:
        found = session.scalars(select(InferenceRequest).where(InferenceRequest.id.in_(
            [uuid.UUID(i) for i in ids]))).all()
    return {str(r.id): r for r in found}


def test_cancelled_while_queued_never_runs(isolated, database_url, tmp_path):
    application, client, redis_url = isolated
    request_id = client.submit(prompt="to be cancelled", max_tokens=8).get_json()["id"]
    response = client.cancel(request_id)
    assert response.status_code == 200 and response.get_json()["status"] == "cancelled"
    control = client.submit(prompt="control", max_tokens=8).get_json()["id"]
    worker = WorkerProcess(database_url, redis_url, tmp_path)
    try:
        assert client.wait(control)["status"] == "succeeded"  # the worker drained the queue
    finally:
        worker.stop()
    row = rows(application, [request_id])[request_id]
    assert row.status == Status.CANCELLED and row.started_at is None and row.attempts == 0


def test_request_past_its_deadline_is_dropped_not_computed(isolated, database_url, tmp_path):
    application, client, redis_url = isolated
    late = client.submit(prompt="too late", max_tokens=8, deadline_s=0.2).get_json()["id"]
    swept = client.submit(prompt="too late too", max_tokens=8, deadline_s=0.2).get_json()["id"]
    control = client.submit(prompt="in time", max_tokens=8).get_json()["id"]
    time.sleep(0.5)
    # The sweep expires what it finds; a worker dequeuing a late request drops it too. ``late``
    # is out of the sweep's reach while it runs (a deadline an hour away: a sweep on a loaded
    # machine once outlasted a 1 s one), and past its deadline again before a worker sees it.
    def set_deadline(seconds: float) -> None:
        with services(application).db.session() as session:
            session.execute(update(InferenceRequest).where(InferenceRequest.id == uuid.UUID(late))
                            .values(deadline_at=utcnow() + timedelta(seconds=seconds)))

    set_deadline(3600)
    # The sweep is global: other tests' leftovers in the shared database may expire with it.
    assert run_sweep(application)["expired"] >= 1
    assert client.get(swept).get_json()["status"] == "expired"
    assert client.get(late).get_json()["status"] == "queued"
    set_deadline(-1)
    worker = WorkerProcess(database_url, redis_url, tmp_path)
    try:
        assert client.wait(control)["status"] == "succeeded"
        for request_id in (late, swept):
            view = client.wait(request_id)
            assert view["status"] == "expired" and view["error"]["code"] == "deadline_exceeded"
            assert view["timings"]["started_at"] is None and view["output"] is None
    finally:
        worker.stop()


def test_row_committed_but_never_published_is_published_by_the_sweep(isolated, database_url, tmp_path):
    application, client, redis_url = isolated
    tenant_id = client_tenant(application, client)
    stranded = request_row(tenant_id, created_at=utcnow() - timedelta(minutes=1))
    with services(application).db.session() as session:
        session.add(stranded)
    request_id = str(stranded.id)
    worker = WorkerProcess(database_url, redis_url, tmp_path)
    try:
        assert run_sweep(application)["published"] >= 1
        view = client.wait(request_id)
        assert view["status"] == "succeeded" and view["timings"]["enqueued_at"] is not None
        assert run_sweep(application)["published"] == 0
    finally:
        worker.stop()


def test_message_taken_by_a_worker_that_died_before_claiming_is_republished(isolated, database_url, tmp_path):
    """The gap between a worker taking a message and claiming its row, closed by the sweep.

    Set up exactly what a SIGKILL in that gap leaves: a queued, published row whose message
    sits in the broker's unacked set (not in any queue), reserved by a worker with no heartbeat.
    """
    from core.rediskeys import RESERVED_KEY

    application, client, redis_url = isolated
    tenant_id = client_tenant(application, client)
    lost = request_row(tenant_id, enqueued_at=utcnow(), broker_epoch=services(application).epoch.current())
    with services(application).db.session() as session:
        session.add(lost)
    services(application).redis.hset(RESERVED_KEY, str(lost.id), "all@gone/1.dead")
    worker = WorkerProcess(database_url, redis_url, tmp_path)
    try:
        assert run_sweep(application)["unreserved"] == 1
        assert client.wait(str(lost.id))["status"] == "succeeded"
        # The task clears its reservation in its `finally`, just after the row's end: a poll can
        # see the end first.
        deadline = time.monotonic() + 10
        while services(application).redis.hexists(RESERVED_KEY, str(lost.id)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not services(application).redis.hexists(RESERVED_KEY, str(lost.id))
    finally:
        worker.stop()


def test_sigkilled_worker_loses_nothing_and_runs_nothing_twice(isolated, database_url, tmp_path, request):
    application, client, redis_url = isolated
    first = WorkerProcess(database_url, redis_url, tmp_path)
    request.addfinalizer(first.stop)
    quick = [client.submit(prompt=f"quick {i}", max_tokens=4).get_json()["id"] for i in range(10)]
    for request_id in quick:
        assert client.wait(request_id)["status"] == "succeeded"
    done_before = {i: (r.finished_at, r.attempts) for i, r in rows(application, quick).items()}

    # ~2,000 decode steps of a batch of 40 take several seconds: they are mid-flight at the kill.
    slow = [client.submit(prompt=f"slow {i}", max_tokens=2000).get_json()["id"] for i in range(40)]
    for request_id in slow[:5]:
        client.wait(request_id, statuses={"running", "succeeded"})
    first.kill()
    running_at_kill = [i for i, r in rows(application, slow).items() if r.status == Status.RUNNING]
    assert running_at_kill, "nothing was in flight when the worker died"

    # Recovery is the platform's own: beat schedules the sweep, the new worker runs it.
    second = WorkerProcess(database_url, redis_url, tmp_path)
    beat = BeatProcess(database_url, redis_url, tmp_path)
    try:
        for request_id in slow:
            client.wait(request_id, timeout=120)
        current = rows(application, slow)
        assert len(current) == len(slow)
        assert {r.status for r in current.values()} == {Status.SUCCEEDED}
        for request_id in running_at_kill:
            row = current[request_id]
            assert row.attempts == 2 and row.worker != first.worker_key
        # Requests finished before the crash were not run again.
        assert {i: (r.finished_at, r.attempts) for i, r in rows(application, quick).items()} == done_before
    finally:
        beat.stop()
        second.stop()


def client_tenant(application, client: ApiClient) -> uuid.UUID:
    from models import ApiKey, hash_key

    with services(application).db.session() as session:
        return session.scalar(select(ApiKey.tenant_id).where(ApiKey.key_hash == hash_key(client.key)))


def test_worker_whose_engine_cannot_start_exits_instead_of_eating_messages(isolated, database_url, tmp_path):
    application, client, redis_url = isolated
    request_id = client.submit(prompt="must survive a broken worker", max_tokens=4).get_json()["id"]
    with pytest.raises(RuntimeError, match="exited early"):
        WorkerProcess(database_url, redis_url, tmp_path, extra_env={"SLUICE_ENGINE": "vllm"})  # no model path
    assert client.get(request_id).get_json()["status"] == "queued"
    worker = WorkerProcess(database_url, redis_url, tmp_path)
    try:
        assert client.wait(request_id)["status"] == "succeeded"
    finally:
        worker.stop()


def _backdate_enqueued(application, ids, seconds: float) -> None:
    with services(application).db.session() as session:
        session.execute(update(InferenceRequest).where(InferenceRequest.id.in_([uuid.UUID(i) for i in ids]))
                        .values(enqueued_at=utcnow() - timedelta(seconds=seconds)))


def _copies(redis_client, request_id: str) -> int:
    """Where ``request_id`` waits to run: messages in the small queues, plus its place in their
    fair lines. Other tests' rows wait there too (the sweep republishes every lost row of the
    shared database into this test's Redis), and a line lets only a few of them into a queue that
    no engine states room for: a row published again may wait in its line, not yet in the queue."""
    queues = ("realtime.small", "batch.small")
    return (sum(request_id in message for queue in queues for key in queue_lists(queue)
                for message in redis_client.lrange(key, 0, -1))
            + sum(redis_client.zscore(line_key(queue), request_id) is not None for queue in queues))


def test_messages_lost_with_their_queue_are_published_again(isolated, database_url, tmp_path):
    """The issue's reproduction: batch requests queued, their queue list deleted in Redis (what an
    eviction or a failover does). The sweep finds rows queued past the grace whose message is in
    no list and held by no worker, and publishes them again; a row whose message is there is left."""
    from core.broker.queues import messages_queued

    application, client, redis_url = isolated
    redis_client = services(application).redis
    lost = [client.submit(prompt=f"lost {i}", max_tokens=4, priority="batch").get_json()["id"] for i in range(3)]
    kept = client.submit(prompt="kept", max_tokens=4).get_json()["id"]
    fair = services(application).fair
    # Those the queue held (its depth; the rest wait in its fair line, docs/fairness.md) are lost.
    gone = set(lost) - fair.in_line("batch.small")
    assert gone and redis_client.delete(*queue_lists("batch.small")) == 1  # (its tier's list: docs/tiers.md)
    _backdate_enqueued(application, [*lost, kept], application.extensions["sluice"].settings.lost_message_grace_s + 5)

    # Published into the broker's present epoch, so only the message-by-message check can find
    # them (the report's epoch count is the whole database's: other tests' rows, other Redis dbs).
    assert {r.broker_epoch for r in rows(application, lost).values()} == {services(application).epoch.current()}
    report = run_sweep(application)
    assert report["lost_missing"] >= len(gone)
    assert set(lost) <= messages_queued(redis_client, {"batch.small"}) | fair.in_line("batch.small")
    assert _copies(redis_client, kept) == 1  # not published twice
    worker = WorkerProcess(database_url, redis_url, tmp_path)
    try:
        for request_id in (*lost, kept):
            assert client.wait(request_id)["status"] == "succeeded"
        assert {r.attempts for r in rows(application, [*lost, kept]).values()} == {1}
    finally:
        worker.stop()


def test_messages_lost_with_the_brokers_data_are_published_again_at_once(isolated, database_url, tmp_path):
    """Redis restarted without its data (or failed over to an empty replica): the epoch the rows
    were published into is gone, so the sweep publishes them again without waiting for a grace."""
    application, client, redis_url = isolated
    redis_client = services(application).redis
    ids = [client.submit(prompt=f"before the loss {i}", max_tokens=4, priority=p).get_json()["id"]
           for i, p in enumerate(("realtime", "batch", "realtime"))]
    old_epoch = {r.broker_epoch for r in rows(application, ids).values()}
    assert len(old_epoch) == 1 and None not in old_epoch
    redis_client.flushdb()
    services(application).epoch._read_at = float("-inf")  # this process looks again now, not in a second

    # The counts are the whole database's: rows other tests left queued on other Redis databases
    # are in an epoch of their own, so only this test's rows are checked exactly.
    assert run_sweep(application)["lost_epoch"] >= 3
    assert {r.broker_epoch for r in rows(application, ids).values()}.isdisjoint(old_epoch)
    run_sweep(application)
    assert [_copies(redis_client, i) for i in ids] == [1, 1, 1]  # published again once, not at each sweep
    worker = WorkerProcess(database_url, redis_url, tmp_path)
    try:
        for request_id in ids:
            assert client.wait(request_id)["status"] == "succeeded"
        assert {r.attempts for r in rows(application, ids).values()} == {1}
    finally:
        worker.stop()


def test_retention_deletes_old_prompts_and_outputs_and_keeps_the_accounting(isolated, database_url):
    from datetime import timedelta

    from models import utcnow

    application, client, redis_url = isolated
    settings = services(application).settings.replace(retention_days=30)
    svc = services(application)
    tenant_id = client_tenant(application, client)
    old = request_row(tenant_id, status=Status.SUCCEEDED, output_text="an old answer", output_tokens=3,
                      finished_at=utcnow() - timedelta(days=31), input={"prompt": "an old secret"})
    recent = request_row(tenant_id, status=Status.SUCCEEDED, output_text="a recent answer", output_tokens=3,
                         finished_at=utcnow() - timedelta(days=29), input={"prompt": "a recent secret"})
    with svc.db.session() as session:
        session.add_all([old, recent])
    from workers.sweep import _redact_old

    assert _redact_old(svc.db, settings) >= 1

    kept = rows(application, [str(old.id), str(recent.id)])
    assert kept[str(old.id)].input == {"redacted": True} and kept[str(old.id)].output_text is None
    assert kept[str(old.id)].output_tokens == 3 and kept[str(old.id)].status == Status.SUCCEEDED
    assert kept[str(recent.id)].output_text == "a recent answer" and kept[str(recent.id)].redacted_at is None
    view = client.get(str(old.id)).get_json()
    assert view["output"] is None and view["redacted_at"] is not None and view["usage"]["output_tokens"] == 3
    assert services(application).settings.retention_days is None  # off unless configured


def test_retention_deletes_old_job_documents_and_results(isolated):
    from datetime import timedelta

    from models import Job, JobItem, JobStatus, utcnow
    from models.job import ItemStatus
    from workers.sweep import _redact_old_jobs

    application, client, _ = isolated
    svc = services(application)
    settings = svc.settings.replace(retention_days=30)
    tenant_id = client_tenant(application, client)
    jobs = {}
    for name, days in (("old", 31), ("recent", 29)):
        job = Job(tenant_id=tenant_id, status=JobStatus.COMPLETED, model="m", priority="batch", instruction="i",
                  summary_tokens=8, completion_window_s=3600, meta={}, total_items=1, invalid_lines=0,
                  input_bytes=10, estimated_tokens=10, finished_at=utcnow() - timedelta(days=days))
        with svc.db.session() as session:
            session.add(job)
            session.flush()
            session.add(JobItem(job_id=job.id, line=1, custom_id="a", status=ItemStatus.SUCCEEDED, text="a secret",
                                result="its summary", output_tokens=4, estimated_tokens=3, chunks=1, depth=0,
                                final=True, requests=[], request_count=1, input_tokens=3))
        jobs[name] = job.id
    assert _redact_old_jobs(svc.db, settings) >= 1
    with svc.db.session() as session:
        items = {name: session.get(JobItem, (job_id, 1)) for name, job_id in jobs.items()}
        assert items["old"].text is None and items["old"].result is None and items["old"].output_tokens == 4
        assert items["recent"].result == "its summary"
        assert session.get(Job, jobs["old"]).redacted_at is not None
    view = client.http.get(f"/v1/jobs/{jobs['old']}", headers=client.headers).get_json()
    assert view["redacted_at"] is not None and view["counts"]["succeeded"] == 1
