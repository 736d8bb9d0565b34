"""Delivery: `Prefer: wait`, token streams over SSE, and abandonment (a client that left stops
costing GPU time). Real worker (simulated engine), real Redis notifications; the connection
tests run the real gunicorn web tier."""

from __future__ import annotations

import json
import socket
import time

import pytest
from conftest import TERMINAL, service_env, sse_events

from core.delivery import streams, waits
from core.delivery.streams import TokenSink
from launcher.harness import WebProcess
from web.services import services

# ~20 s of simulated H200 decoding: still running when we look. Its own deadline, far past that: with
# a wait's 30 s, a spread run's starved engine was promised too slow for it and the request refused,
# so the hang-up test never saw it run.
LONG = {"max_tokens": 4000, "ignore_eos": True, "deadline_s": 600}


def wait_for(predicate, timeout: float = 30, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout}s")
        time.sleep(0.05)


def test_prefer_wait_answers_with_the_result(client, worker):
    response = client.http.post("/v1/requests", json={"prompt": "wait for me", "max_tokens": 16},
                                headers={**client.headers, "Prefer": "wait=30"})
    assert response.status_code == 200, response.get_json()
    assert response.headers["Preference-Applied"] == "wait=30"
    view = response.get_json()
    assert view["status"] == "succeeded" and view["usage"]["output_tokens"] == 16 and view["output"]["text"]


def test_prefer_wait_times_out_with_202_and_get_can_wait_too(client, worker):
    response = client.http.post("/v1/requests", json={"prompt": "too long to wait for", **LONG},
                                headers={**client.headers, "Prefer": "respond-async, wait=1"})
    assert response.status_code == 202 and response.headers["Preference-Applied"] == "wait=1"
    request_id = response.get_json()["id"]
    # A GET may wait as well; a cancel ends the request, which wakes the waiting GET.
    polled = client.http.get(f"/v1/requests/{request_id}", headers={**client.headers, "Prefer": "wait=1"})
    assert polled.status_code == 200 and polled.get_json()["status"] in ("queued", "running")
    assert client.cancel(request_id).status_code == 200
    ended = client.http.get(f"/v1/requests/{request_id}", headers={**client.headers, "Prefer": "wait=30"})
    assert ended.get_json()["status"] == "cancelled"


def test_wait_above_the_maximum_is_clamped_and_a_malformed_prefer_ignored(client, worker):
    maximum = int(services(client.http.application).settings.wait_max_s)
    clamped = client.http.post("/v1/requests", json={"prompt": "clamp", "max_tokens": 4},
                               headers={**client.headers, "Prefer": "wait=100000"})
    assert clamped.status_code == 200 and clamped.headers["Preference-Applied"] == f"wait={maximum}"
    for malformed in ("wait=soon", "wait", "wait=-3, handling=strict", "=5"):
        response = client.http.post("/v1/requests", json={"prompt": "ignored", "max_tokens": 4},
                                    headers={**client.headers, "Prefer": malformed})
        assert response.status_code == 202 and "Preference-Applied" not in response.headers, malformed


def test_a_stream_delivers_tokens_in_order_then_usage(client, worker):
    response = client.http.post("/v1/requests", json={"prompt": "stream it", "max_tokens": 48, "ignore_eos": True,
                                                      "stream": True}, headers=client.headers, buffered=False)
    assert response.status_code == 200 and response.mimetype == "text/event-stream"
    events = sse_events(response.response)
    response.close()
    names = [name for name, _ in events]
    assert names[:2] == ["accepted", "started"] and names[-1] == "done", names
    assert events[1][1]["queue_wait_s"] >= 0
    tokens = [data for name, data in events if name == "token"]
    assert len(tokens) > 10  # increments, not one block at the end
    counts = [t["output_tokens"] for t in tokens]
    assert counts == sorted(counts) and counts[-1] == 48
    done = events[-1][1]
    assert done["status"] == "succeeded" and done["usage"]["output_tokens"] == 48
    assert "".join(t["text"] for t in tokens) == done["output"]["text"]


def test_stream_increments_add_up_to_the_text_the_row_keeps(app):
    """A model may write NUL, which the row keeps as U+FFFD (PostgreSQL text refuses NUL): the
    increments say the same, so a stream's last events, checked against the row, never repeat it."""
    redis = services(app).redis
    sink = TokenSink(redis)
    rid = f"nul-{time.monotonic_ns()}"
    sink.push(rid, "a\x00b", 2, 1, [{"token": "b", "logprob": -1.0, "top": []}])
    sink.close()
    ((_, fields),) = streams.read(redis, rid, "0", 1000)
    assert fields["t"] == "a\ufffdb" and fields["i"] == "1" and json.loads(fields["lp"])[0]["token"] == "b"
    redis.delete(streams.stream_key(rid))


def test_closing_a_stream_cancels_the_request_and_frees_its_kv(client, worker):
    response = client.http.post("/v1/requests", json={"prompt": "leave early", **LONG, "stream": True},
                                headers=client.headers, buffered=False)
    chunks = iter(response.response)
    seen = b""
    while b"event: token" not in seen:
        seen += next(chunks)
    request_id = sse_events([seen])[0][1]["id"]
    response.close()  # the client goes away mid-stream
    view = client.wait(request_id)
    assert view["status"] == "cancelled" and view["usage"]["output_tokens"] < LONG["max_tokens"]
    stats = worker.wait_stats(lambda s: s["running"] == 0 and s["kv_used_tokens"] == 0)
    assert stats["running"] == 0 and stats["kv_used_tokens"] == 0


def test_a_detached_stream_keeps_computing(client, worker):
    response = client.http.post("/v1/requests", json={"prompt": "keep going", "max_tokens": 200, "ignore_eos": True,
                                                      "stream": True, "detach": True},
                                headers=client.headers, buffered=False)
    first = next(iter(response.response))
    request_id = sse_events([first])[0][1]["id"]
    response.close()
    assert client.wait(request_id)["status"] == "succeeded"


def test_a_poller_that_stops_polling_has_left(client, worker, app):
    gone = client.submit(prompt="poll me", abandon_after_s=1, **LONG).get_json()["id"]
    kept = client.submit(prompt="poll me too", abandon_after_s=1, max_tokens=200, ignore_eos=True).get_json()["id"]
    deadline = time.monotonic() + 1.6
    while time.monotonic() < deadline:  # only `kept` is polled
        client.get(kept)
        time.sleep(0.2)
    assert waits.abandon_idle_pollers(services(app)) >= 1
    assert client.wait(gone)["status"] == "cancelled"
    assert client.wait(kept)["status"] == "succeeded"


@pytest.fixture(scope="module")
def web(database_url, redis_url, tmp_path_factory):
    proc = WebProcess(service_env(database_url, redis_url), tmp_path_factory.mktemp("web"))
    yield proc
    proc.stop()


def raw_post(port: int, key: str, body: dict, headers: dict[str, str]) -> socket.socket:
    """Send a POST over a plain socket and leave the answer unread (a client that may hang up)."""
    payload = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "127.0.0.1", "Authorization": f"Bearer {key}",
                                                   "Content-Type": "application/json",
                                                   "Content-Length": str(len(payload)), **headers}.items())
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST /v1/requests HTTP/1.1\r\n{head}\r\n".encode() + payload)
    return sock


def test_hanging_up_on_a_wait_cancels_the_request(client, worker, web):
    marker = f"hang up {time.monotonic_ns()}"
    sock = raw_post(web.port, client.key, {"prompt": marker, **LONG}, {"Prefer": "wait=60"})
    try:
        running = wait_for(lambda: [r for r in _listed(client) if r["status"] == "running"], what="a running request")
    finally:
        sock.close()
    request_id = running[0]["id"]
    view = client.wait(request_id, timeout=30)
    assert view["status"] == "cancelled" and view["usage"]["output_tokens"] < LONG["max_tokens"]


def test_a_wait_over_gunicorn_returns_the_result(client, worker, web):
    sock = raw_post(web.port, client.key, {"prompt": "over the wire", "max_tokens": 8}, {"Prefer": "wait=30"})
    with sock, sock.makefile("rb") as answer:
        status_line = answer.readline().decode()
        assert " 200 " in status_line, status_line
        headers = {}
        while (line := answer.readline().decode().strip()):
            name, value = line.split(":", 1)
            headers[name.lower()] = value.strip()
        assert headers["preference-applied"] == "wait=30"
        view = json.loads(answer.read(int(headers["content-length"])))
    assert view["status"] in TERMINAL and view["usage"]["output_tokens"] == 8


def _listed(client) -> list[dict]:
    """The client's tenant's requests (a fresh tenant per test), read from their rows."""
    from sqlalchemy import select

    from models import InferenceRequest
    from models.tenant import ApiKey, hash_key

    svc = services(client.http.application)
    with svc.db.session() as session:
        tenant_id = session.scalar(select(ApiKey.tenant_id).where(ApiKey.key_hash == hash_key(client.key)))
        rows = session.scalars(select(InferenceRequest).where(InferenceRequest.tenant_id == tenant_id)).all()
        return [{"id": str(r.id), "status": r.status.value} for r in rows]


def test_a_stream_over_gunicorn_arrives_as_it_is_produced(client, worker, web):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=60)
    conn.request("POST", "/v1/requests", json.dumps({"prompt": "over the wire, token by token", "max_tokens": 400,
                                                     "ignore_eos": True, "stream": True}),
                 {**client.headers, "Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    arrivals, events = [], []
    while not events or events[-1][0] != "done":
        chunk = response.read1(65536)
        assert chunk, "the stream ended before its done event"
        arrivals.append(time.monotonic())
        events += sse_events([chunk])
    conn.close()
    tokens = [data for name, data in events if name == "token"]
    assert events[-1][1]["status"] == "succeeded"
    assert "".join(t["text"] for t in tokens) == events[-1][1]["output"]["text"]
    # Pieces, not one body at the end: ~2 s of decoding reached the client in many reads.
    assert len(arrivals) > 10 and len(tokens) > 10
