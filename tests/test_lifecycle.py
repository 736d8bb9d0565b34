"""HTTP in, rows out, through a real Celery worker running the simulated engine."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.usefixtures("worker")


def test_submit_runs_to_success_with_timings(client):
    response = client.submit(prompt="Explain continuous batching.", max_tokens=32, metadata={"ticket": "7"})
    assert response.status_code == 202
    accepted = response.get_json()
    assert response.headers["Location"] == accepted["status_url"]
    assert accepted["status"] == "queued" and accepted["size_class"] == "small"

    view = client.wait(accepted["id"])
    assert view["status"] == "succeeded", view
    assert view["output"]["text"].startswith("[simulated] ")
    assert view["output"]["finish_reason"] == "length"
    assert view["usage"]["output_tokens"] == 32
    assert view["usage"]["input_tokens"] >= 1
    assert view["model_used"] == "simulated-llama-8b"
    assert view["queue"] == "realtime.small" and view["attempts"] == 1
    assert view["metadata"] == {"ticket": "7"}
    t = view["timings"]
    assert t["created_at"] <= t["enqueued_at"] and t["created_at"] <= t["started_at"]
    assert t["started_at"] <= t["first_token_at"] <= t["finished_at"]
    assert t["queue_wait_s"] >= 0 and t["inference_s"] > 0 and t["time_to_first_token_s"] >= 0


def test_chat_messages_and_stop(client):
    view = client.wait(client.submit(messages=[{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hi"}],
                                     max_tokens=8, temperature=0, seed=3).get_json()["id"])
    assert view["status"] == "succeeded" and view["usage"]["output_tokens"] == 8


def test_size_class_and_priority_pick_the_queue(client):
    large = client.submit(prompt="long " * 2000, max_tokens=16, priority="batch").get_json()
    assert large["size_class"] == "large"
    view = client.wait(large["id"])
    assert view["status"] == "succeeded" and view["queue"] == "batch.large"
    small_batch = client.wait(client.submit(prompt="short", max_tokens=4, priority="batch").get_json()["id"])
    assert small_batch["queue"] == "batch.small"


def test_running_request_is_cancelled_and_aborted_in_the_engine(client, worker):
    aborted_before = worker.stats().get("aborted", 0)
    # Deadlines of their own, as in test_admission: a loaded host's measured speed must not refuse them.
    request_id = client.submit(prompt="a long story", max_tokens=8000, deadline_s=3600).get_json()["id"]
    client.wait(request_id, statuses={"running"})
    response = client.cancel(request_id)
    assert response.status_code == 200 and response.get_json()["cancel_requested"] is True
    view = client.wait(request_id, timeout=15)
    assert view["status"] == "cancelled" and view["error"]["code"] == "cancelled"
    assert view["output"] is None or view["usage"]["output_tokens"] < 8000
    assert worker.wait_stats(lambda s: s["aborted"] > aborted_before)["aborted"] > aborted_before
    assert worker.wait_stats(lambda s: s["kv_used_tokens"] == 0)["kv_used_tokens"] == 0, "KV not freed"
    assert client.cancel(request_id).status_code == 409


def test_time_limit_aborts_and_the_worker_goes_on(client, worker):
    request_id = client.submit(prompt="never ending", max_tokens=8000, time_limit_s=0.5,
                               deadline_s=3600).get_json()["id"]
    view = client.wait(request_id, timeout=30)
    assert view["status"] == "timed_out", view
    assert view["error"]["code"] == "time_limit_exceeded"
    assert view["usage"]["output_tokens"] < 8000
    assert worker.wait_stats(lambda s: s["kv_used_tokens"] == 0)["kv_used_tokens"] == 0, "KV not freed"
    after = client.wait(client.submit(prompt="next", max_tokens=4).get_json()["id"])
    assert after["status"] == "succeeded"


def test_burst_is_batched_by_one_engine(client, worker):
    with ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(lambda i: client.__class__(client.http.application, client.key)
                            .submit(prompt=f"question {i}", max_tokens=64).get_json()["id"], range(48)))
    views = [client.wait(i) for i in ids]
    assert all(v["status"] == "succeeded" for v in views)
    assert worker.wait_stats(lambda s: s["max_batch_seen"] > 1)["max_batch_seen"] > 1


def test_300_concurrent_mixed_submissions_all_finish(client):
    def submit(i: int) -> tuple[str, bool]:
        large = i % 5 == 0
        body = {"prompt": ("context " * 1500 if large else f"q{i}"), "max_tokens": 16 + (i % 4) * 16,
                "priority": "batch" if i % 3 == 0 else "realtime"}
        response = client.__class__(client.http.application, client.key).submit(**body)
        assert response.status_code == 202, response.get_json()
        return response.get_json()["id"], large

    with ThreadPoolExecutor(16) as pool:
        submitted = list(pool.map(submit, range(300)))
    views = {rid: client.wait(rid, timeout=120) for rid, _ in submitted}
    assert len(views) == 300
    assert {v["status"] for v in views.values()} == {"succeeded"}
    for rid, large in submitted:
        assert views[rid]["queue"].endswith(".large" if large else ".small"), views[rid]["queue"]


def test_one_request_is_followed_by_its_id_through_web_log_worker_log_and_row(client, worker):
    import logging

    from core.observe.logs import _FORMAT, ContextFilter

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(handler.format(record))
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(ContextFilter())
    logging.getLogger().addHandler(handler)
    try:
        response = client.submit(prompt="follow me", max_tokens=4)
        rid, call = response.get_json()["id"], response.headers["X-Request-Id"]
        view = client.wait(rid)
    finally:
        logging.getLogger().removeHandler(handler)
    assert view["status"] == "succeeded" and view["id"] == rid
    accepted = [line for line in lines if f"req={rid}" in line and "accepted into realtime.small" in line]
    assert accepted and f"call={call}" in accepted[0]
    deadline = time.monotonic() + 10
    while True:  # the worker's log is written by another process
        worker_lines = [line for line in worker.log_path.read_text().splitlines() if f"req={rid}" in line]
        if any(line.endswith(": succeeded") for line in worker_lines) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert any(": running on " in line for line in worker_lines), worker_lines
    assert any(line.endswith(": succeeded") for line in worker_lines), worker_lines
