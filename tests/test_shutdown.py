"""Stopping a worker loses no work: it drains within its stop grace and requeues the rest.

A deploy, `docker stop` or Ctrl-C under `sluice up` sends SIGTERM. The worker stops taking
messages, lets what runs finish within SLUICE_WORKER_STOP_GRACE_S (the time limit by default),
and hands back what it cannot finish: requeued, not failed, and not counted as an attempt, so
any number of deploys during one long request never ends it as `worker_lost`.
"""

from __future__ import annotations

import os
import signal
import time

from conftest import WorkerProcess
from test_recovery import rows

from models import Status

# The simulated engine at a twentieth of an H200's speed: ~0.1 s per token for one sequence.
SLOW = {"SLUICE_SIM_SPEED": "0.05"}


def _sigterm(worker: WorkerProcess) -> None:
    os.kill(worker.proc.pid, signal.SIGTERM)  # the worker, not its group: see launcher/supervisor.py


def _exit_code(worker: WorkerProcess, timeout: float) -> int:
    worker.proc.wait(timeout)
    return worker.proc.returncode


def test_a_stopping_worker_finishes_what_it_runs_and_takes_nothing_new(isolated, database_url, tmp_path):
    application, client, redis_url = isolated
    worker = WorkerProcess(database_url, redis_url, tmp_path, extra_env=SLOW)
    try:
        long = client.submit(prompt="a long one", max_tokens=60, ignore_eos=True).get_json()["id"]
        client.wait(long, statuses={"running"})
        # The row reads running once the task claims it, a moment before the worker counts it in
        # flight; a stop in that moment hands it back (by design: it was not in flight to wait
        # for), which a loaded host once hit. The heartbeat says when it is in the worker's hands.
        worker.wait_stats(lambda s: s.get("in_flight", 0) >= 1, timeout=30)
        _sigterm(worker)
        time.sleep(1.0)
        later = client.submit(prompt="arrives during the stop", max_tokens=4).get_json()["id"]
        assert _exit_code(worker, 60) == 0
    finally:
        worker.stop()
    done = rows(application, [long, later])
    assert done[long].status == Status.SUCCEEDED and done[long].attempts == 1
    assert done[later].status == Status.QUEUED and done[later].attempts == 0
    successor = WorkerProcess(database_url, redis_url, tmp_path)
    try:
        assert client.wait(later)["status"] == "succeeded"
    finally:
        successor.stop()


def test_three_deploys_during_one_long_request_never_fail_it(isolated, database_url, tmp_path):
    """Each stop's grace is shorter than the request: each hands it back, none charges an attempt."""
    application, client, redis_url = isolated
    long = None
    for deploy in range(3):
        worker = WorkerProcess(database_url, redis_url, tmp_path,
                               extra_env={**SLOW, "SLUICE_WORKER_STOP_GRACE_S": "1"})
        try:
            if long is None:
                long = client.submit(prompt="outlives deploys", max_tokens=400, ignore_eos=True).get_json()["id"]
            client.wait(long, statuses={"running"})
            _sigterm(worker)
            assert _exit_code(worker, 30) == 0
        finally:
            worker.stop()
        row = rows(application, [long])[long]
        assert row.status == Status.QUEUED, f"deploy {deploy}: {row.status}"
        assert row.attempts == 0 and row.enqueued_at is not None and row.worker is None
    final = WorkerProcess(database_url, redis_url, tmp_path)
    try:
        assert client.wait(long)["status"] == "succeeded"
    finally:
        final.stop()
    assert rows(application, [long])[long].attempts == 1


def test_a_second_sigterm_requeues_at_once(isolated, database_url, tmp_path):
    application, client, redis_url = isolated
    worker = WorkerProcess(database_url, redis_url, tmp_path, extra_env=SLOW)  # grace: the 120 s time limit
    try:
        ids = [client.submit(prompt=f"in flight {i}", max_tokens=400, ignore_eos=True).get_json()["id"]
               for i in range(3)]
        for request_id in ids:
            client.wait(request_id, statuses={"running"})
        _sigterm(worker)
        time.sleep(0.5)
        _sigterm(worker)
        assert _exit_code(worker, 30) == 0
    finally:
        worker.stop()
    assert {(r.status, r.attempts) for r in rows(application, ids).values()} == {(Status.QUEUED, 0)}
    successor = WorkerProcess(database_url, redis_url, tmp_path)
    try:
        for request_id in ids:
            view = client.wait(request_id, timeout=120)
            assert view["status"] == "succeeded"
    finally:
        successor.stop()
