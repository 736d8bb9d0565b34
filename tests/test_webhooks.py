"""Webhooks end to end: a real GPU worker (simulated engine), a real `sluice worker --role webhooks`,
beat and the feeder, on a Redis database of the module's own, posting to a receiver in this test
(an http.server on 127.0.0.2, let through by SLUICE_WEBHOOK_ALLOW) that verifies every delivery
with the standardwebhooks library. Backoff is a fifth of a second here, so retries come quickly.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import ROOT, BeatProcess, WorkerProcess, feeder_running, make_settings, service_env
from sqlalchemy import func, update
from standardwebhooks import Webhook, WebhookVerificationError
from werkzeug.serving import make_server

from core import ssrf
from core.rediskeys import SWEEP_LAST_KEY
from models import Delivery, DeliveryStatus
from web import create_app
from web.services import services

ENV = {"SLUICE_WEBHOOK_ALLOW": "127.0.0.2", "SLUICE_WEBHOOK_BACKOFF_S": "0.2", "SLUICE_WEBHOOK_TIMEOUT_S": "5",
       "SLUICE_WEBHOOK_RETRY_FOR_S": "30", "SLUICE_WEBHOOK_PROGRESS_S": "0.5", "SLUICE_SIM_SPEED": "4",
       "SLUICE_MAX_CONTEXT_TOKENS": "512", "SLUICE_FEEDER_INTERVAL_S": "0.2", "SLUICE_JOB_INFLIGHT_PER_WORKER": "2",
       # Above what any test but the limit's own asks of one tenant (a rotation and two redeliveries).
       "SLUICE_WEBHOOK_ACTIONS_PER_MINUTE": "5"}
PROMPT = {"prompt": "Say something about harbours.", "max_tokens": 8}


class Receiver:
    """A webhook receiver: records every POST; answers each path from its plan (a status, or
    ``(30x, location)``), then 200."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str], str]] = []
        self.plans: dict[str, list] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0))).decode()
                with receiver.lock:
                    receiver.calls.append((self.path, dict(self.headers.items()), body))
                    plan = receiver.plans.get(self.path) or [200]
                    answer = plan.pop(0) if len(plan) > 1 else plan[0]
                status, location = answer if isinstance(answer, tuple) else (answer, None)
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.2", 0), Handler)
        self.url = f"http://127.0.0.2:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def path(self, *answers) -> str:
        """A new path answering ``answers`` in turn (the last one for good); its URL."""
        path = f"/hook/{uuid.uuid4().hex[:8]}"
        self.plans[path] = list(answers) or [200]
        return path

    def seen(self, path: str) -> list[tuple[dict[str, str], str]]:
        with self.lock:
            return [(headers, body) for p, headers, body in self.calls if p == path]

    def wait(self, path: str, count: int, timeout: float = 60) -> list[tuple[dict[str, str], str]]:
        deadline = time.monotonic() + timeout
        while len(self.seen(path)) < count:
            assert time.monotonic() < deadline, f"{path}: {len(self.seen(path))} of {count} deliveries"
            time.sleep(0.05)
        return self.seen(path)


@dataclass
class Hooks:
    app: object
    receiver: Receiver
    url: str  # the app served over real HTTP, for the CLI
    tmp: Path
    keys: list[str] = field(default_factory=list)

    def client(self, new_client, secret: bool = True):
        client = new_client(self.app)
        if secret:
            answer = client.http.post("/v1/webhooks/secret/rotate", headers=client.headers)
            assert answer.status_code == 201
            client.secret = answer.get_json()["secret"]
        return client

    def deliveries(self, client, **query) -> list[dict]:
        answer = client.http.get("/v1/webhooks/deliveries", query_string=query, headers=client.headers)
        assert answer.status_code == 200, answer.get_json()
        return answer.get_json()["data"]

    def wait_delivery(self, client, status: str, timeout: float = 60, **query) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            found = [d for d in self.deliveries(client, **query) if d["status"] == status]
            if found:
                return found[0]
            assert time.monotonic() < deadline, self.deliveries(client, **query)
            time.sleep(0.1)

    def settled(self, client, count: int, timeout: float = 60, **query) -> list[dict]:
        """The deliveries once ``count`` of them are no longer pending (the receiver answers before
        the sender records its answer)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.deliveries(client, **query)
            if sum(d["status"] != "pending" for d in found) >= count:
                return found
            assert time.monotonic() < deadline, found
            time.sleep(0.1)

    def cli(self, key: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        env.update(SLUICE_URL=self.url, SLUICE_API_KEY=key)
        return subprocess.run([sys.executable, "-m", "launcher.cli", "webhooks", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def hooks(database_url, redis_dbs, tmp_path_factory):
    redis_url = redis_dbs()
    tmp = tmp_path_factory.mktemp("webhooks")
    app = create_app(make_settings(database_url, redis_url, ENV))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    worker = WorkerProcess(database_url, redis_url, tmp, extra_env=ENV, concurrency=8)
    log = open(tmp / "webhooks-worker.log", "w")  # noqa: SIM115 - closed below
    sender = subprocess.Popen([sys.executable, "-m", "launcher.cli", "worker", "--role", "webhooks",
                               "--concurrency", "4", "--name", f"webhooks-{uuid.uuid4().hex[:6]}@test"],
                              cwd=ROOT, env={**os.environ, **service_env(database_url, redis_url, ENV)},
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    beat = BeatProcess(database_url, redis_url, tmp)
    try:
        # Jobs' events come from the sweep: start once it runs (beat starts slowly on a busy host).
        deadline = time.monotonic() + 120
        while not services(app).redis.exists(SWEEP_LAST_KEY):
            assert time.monotonic() < deadline, "the sweep never ran"
            time.sleep(0.2)
        with feeder_running(app):
            yield Hooks(app, Receiver(), f"http://127.0.0.1:{server.server_port}", tmp)
    finally:
        beat.stop()
        os.killpg(sender.pid, signal.SIGTERM)
        sender.wait(30)
        log.close()
        worker.stop()
        server.shutdown()
        services(app).db.dispose()
        redis_dbs.release(redis_url)


def verified(secret: str, delivery: tuple[dict[str, str], str]) -> dict:
    headers, body = delivery
    return Webhook(secret).verify(body, headers)


def test_a_request_webhook_gets_started_and_completed_signed(hooks, new_client):
    client = hooks.client(new_client)
    path = hooks.receiver.path()
    answer = client.submit(**PROMPT, webhook_url=hooks.receiver.url + path, webhook_events=["started", "completed"])
    assert answer.status_code == 202, answer.get_json()
    request_id = answer.get_json()["id"]
    assert client.wait(request_id)["status"] == "succeeded"

    # Sent by parallel threads: in the order they happened, by their timestamps.
    events = sorted((verified(client.secret, d) for d in hooks.receiver.wait(path, 2)), key=lambda e: e["timestamp"])
    assert [e["type"] for e in events] == ["request.started", "request.completed"]
    assert {e["data"]["id"] for e in events} == {request_id}
    assert events[1]["data"]["status"] == "succeeded" and events[1]["data"]["output"]["text"]
    with pytest.raises(WebhookVerificationError):  # signed with this tenant's secret, not any other
        verified(hooks.client(new_client).secret, hooks.receiver.seen(path)[0])

    listed = hooks.settled(client, 2, request_id=request_id)
    assert {(d["event"], d["status"], d["attempts"], d["last_status_code"]) for d in listed} == {
        ("request.started", "succeeded", 1, 200), ("request.completed", "succeeded", 1, 200)}
    ids = {headers["webhook-id"] for headers, _ in hooks.receiver.seen(path)}
    assert ids == {d["id"] for d in listed}  # the webhook-id is the delivery's id
    first = client.http.get("/v1/webhooks/deliveries", query_string={"limit": 1}, headers=client.headers).get_json()
    assert first["has_more"] and first["data"][0]["id"] == first["next_before"] == listed[0]["id"]
    rest = hooks.deliveries(client, before=first["next_before"])
    assert [d["id"] for d in rest] == [listed[1]["id"]]
    # Another tenant sees none of them, and cannot resend them.
    other = hooks.client(new_client)
    assert hooks.deliveries(other, request_id=request_id) == []
    assert other.http.post(f"/v1/webhooks/deliveries/{listed[0]['id']}/redeliver",
                           headers=other.headers).status_code == 404


def test_a_failing_receiver_gets_retries_and_redeliveries_with_the_same_id(hooks, new_client):
    client = hooks.client(new_client)
    path = hooks.receiver.path(500, 503, 200)
    request_id = client.submit(**PROMPT, webhook_url=hooks.receiver.url + path).get_json()["id"]
    delivery = hooks.wait_delivery(client, "succeeded", request_id=request_id)
    seen = hooks.receiver.seen(path)
    assert delivery["attempts"] == len(seen) == 3 and delivery["last_status_code"] == 200
    assert {headers["webhook-id"] for headers, _ in seen} == {delivery["id"]}
    assert len({body for _, body in seen}) == 1  # every attempt sends the same event
    assert verified(client.secret, seen[0])["type"] == "request.completed"

    resent = client.http.post(f"/v1/webhooks/deliveries/{delivery['id']}/redeliver", headers=client.headers)
    assert resent.status_code == 202 and resent.get_json()["status"] == "pending"
    assert verified(client.secret, hooks.receiver.wait(path, 4)[3])["data"]["id"] == request_id

    run = hooks.cli(client.key, "redeliver", delivery["id"])
    assert run.returncode == 0, run.stderr
    assert delivery["id"] in run.stdout
    assert hooks.receiver.wait(path, 5)[4][0]["webhook-id"] == delivery["id"]
    listed = hooks.cli(client.key, "list", "--request", request_id, "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["data"][0]["attempts"] >= 5


def test_a_receiver_that_never_answers_2xx_fails_the_delivery_after_the_retry_window(hooks, new_client):
    client = hooks.client(new_client)
    path = hooks.receiver.path(500)
    request_id = client.submit(**PROMPT, webhook_url=hooks.receiver.url + path).get_json()["id"]
    delivery = hooks.wait_delivery(client, "failed", timeout=90, request_id=request_id)
    assert delivery["last_status_code"] == 500 and delivery["last_error"] == "HTTP 500"
    assert delivery["attempts"] == len(hooks.receiver.seen(path)) >= 3
    assert delivery["next_attempt_at"] is None and delivery["finished_at"]


def test_after_a_rotation_deliveries_verify_with_the_new_secret(hooks, new_client):
    client = hooks.client(new_client)
    old = client.secret
    run = hooks.cli(client.key, "rotate-secret")
    assert run.returncode == 0, run.stderr
    new = run.stdout.strip()
    assert new.startswith("whsec_") and new != old and "previous secret also signs until" in run.stderr
    path = hooks.receiver.path()
    client.submit(**PROMPT, webhook_url=hooks.receiver.url + path)
    delivery = hooks.receiver.wait(path, 1)[0]
    assert verified(new, delivery)["type"] == "request.completed"
    assert verified(old, delivery)  # the previous secret signs beside it during the grace
    assert len(delivery[0]["webhook-signature"].split(" ")) == 2


def test_a_job_webhook_gets_started_and_completed(hooks, new_client):
    client = hooks.client(new_client)
    path = hooks.receiver.path()
    lines = "".join(json.dumps({"custom_id": f"d{i}", "text": f"document {i} about meadows and copper {i}"}) + "\n"
                    for i in range(40))
    answer = client.http.post("/v1/jobs", query_string={"summary_tokens": 16, "webhook_url": hooks.receiver.url + path,
                                                        "webhook_events": "started,progress,completed"},
                              data=lines.encode(), headers={**client.headers, "Content-Type": "application/jsonl"})
    assert answer.status_code == 201, answer.get_json()
    job_id = answer.get_json()["id"]
    deadline = time.monotonic() + 120
    while not any(verified(client.secret, d)["type"] == "job.completed" for d in hooks.receiver.seen(path)):
        assert time.monotonic() < deadline, [verified(client.secret, d)["type"] for d in hooks.receiver.seen(path)]
        time.sleep(0.2)
    events = sorted((verified(client.secret, d) for d in hooks.receiver.seen(path)), key=lambda e: e["timestamp"])
    types = [e["type"] for e in events]
    assert types[0] == "job.started" and types[-1] == "job.completed" and types.count("job.completed") == 1
    assert events[-1]["data"]["id"] == job_id and events[-1]["data"]["status"] == "completed"
    assert events[-1]["data"]["counts"]["succeeded"] == 40
    progress = [e["data"]["done"] for e in events if e["type"] == "job.progress"]
    assert progress == sorted(progress) and all(0 < done <= 40 for done in progress)
    assert {d["event"] for d in hooks.deliveries(client, job_id=job_id)} >= {"job.started", "job.completed"}


@pytest.mark.parametrize("url, reason", [
    ("http://127.0.0.1/hook", "loopback"),
    ("https://127.0.0.1/hook", "loopback"),
    ("https://10.0.0.1/hook", "private"),
    ("https://169.254.169.254/latest/meta-data/", "metadata"),
    ("https://[fd00:ec2::254]/", "metadata"),
    ("https://[::ffff:127.0.0.1]/", "loopback"),
    # An IPv6 address that carries an IPv4 one reaches it: judged by it.
    ("https://[2002:a9fe:a9fe::]/latest/meta-data/", "metadata"),  # 6to4
    ("https://[2002:7f00:1::]/", "loopback"),
    ("https://[2002:0a00:0001::]/", "private"),
    ("https://[2001:0:4136:e378:8000:63bf:f5ff:fffe]/", "private"),  # Teredo, client 10.0.0.1
    ("https://[2001:0:4136:e378:8000:63bf:5601:5601]/", "metadata"),  # Teredo, client 169.254.169.254
    ("https://[64:ff9b::a9fe:a9fe]/", "metadata"),  # NAT64
    ("https://[fec0::1]/", "private"),  # site-local, which the standard library calls global
    ("http://[2002:808:808::]/hook", "not_https"),  # 6to4 of 8.8.8.8: public, so only the scheme refuses it
    ("https://localhost/hook", "loopback"),  # a name that resolves to a refused address
    ("https://0.0.0.0/", "unspecified"),
    ("http://8.8.8.8/hook", "not_https"),
    ("https://user:secret@8.8.8.8/", "credentials"),
    ("https://no-such-host.invalid/", "unresolvable"),
])
def test_ssrf_targets_are_refused_at_submit(hooks, new_client, url, reason):
    client = hooks.client(new_client)
    answer = client.submit(**PROMPT, webhook_url=url)
    assert answer.status_code == 422
    error = answer.get_json()["error"]
    assert error["code"] == "webhook_url_refused" and f"({reason})" in error["message"], error
    assert error["details"]["webhook_url"]
    job = client.http.post("/v1/jobs", query_string={"webhook_url": url}, data=b'{"custom_id": "a", "text": "b"}\n',
                           headers={**client.headers, "Content-Type": "application/jsonl"})
    assert job.status_code == 422 and job.get_json()["error"]["code"] == "webhook_url_refused"


@pytest.mark.parametrize("address, reason", [
    ("2002:a9fe:a9fe::", "metadata"), ("2002:7f00:1::", "loopback"), ("2002:a00:1::", "private"),
    ("2002:808:808::", None),  # 6to4 of a public address is public, on every Python version
    ("fec0::1", "private"),
    ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "private"),  # Teredo: server 65.54.227.120, client 10.0.0.1
    ("2001:0:a9fe:a9fe:0:0:f7f7:f7f7", "metadata"),  # Teredo: server 169.254.169.254, client 8.8.8.8
    ("2001:0:4136:e378:8000:63bf:f7f7:f7f7", "private"),  # Teredo of public addresses: the prefix refuses it
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:8.8.8.8", None),
    ("::127.0.0.1", "loopback"), ("::8.8.8.8", "reserved"),  # IPv4-compatible
    ("64:ff9b::a9fe:a9fe", "metadata"), ("64:ff9b::808:808", None),
    ("64:ff9b:1::a00:1", "private"), ("64:ff9b:1::808:808", "private"),  # local-use NAT64
    ("::1", "loopback"), ("::", "unspecified"), ("2606:4700::1111", None),
])
def test_the_ssrf_guard_judges_the_ipv4_address_an_ipv6_address_carries(address, reason):
    assert ssrf.refusal(ipaddress.ip_address(address)) == reason
    url = f"https://[{address}]/hook"
    if reason is None:
        assert str(ssrf.check(url, ssrf.AllowList()).address) == str(ipaddress.ip_address(address))
    else:
        with pytest.raises(ssrf.Refused) as refused:
            ssrf.check(url, ssrf.AllowList())
        assert refused.value.reason == reason
        # The operator's allow-list still lets an internal receiver through, as before.
        assert ssrf.check(url, ssrf.AllowList.parse(address)).port == 443


def test_a_webhook_url_must_be_short_and_the_tenant_must_have_a_secret(hooks, new_client):
    client = hooks.client(new_client)
    long = client.submit(**PROMPT, webhook_url="https://example.com/" + "a" * 2048)
    assert long.status_code == 422 and "webhook_url" in long.get_json()["error"]["details"]
    stray = client.submit(**PROMPT, webhook_events=["completed"])
    assert stray.status_code == 422 and "webhook_events" in stray.get_json()["error"]["details"]
    fresh = hooks.client(new_client, secret=False)
    missing = fresh.submit(**PROMPT, webhook_url=hooks.receiver.url + hooks.receiver.path())
    assert missing.status_code == 422 and missing.get_json()["error"]["code"] == "webhook_secret_missing"


def test_redirects_are_followed_and_a_redirect_to_a_refused_address_fails_the_delivery(hooks, new_client):
    client = hooks.client(new_client)
    final = hooks.receiver.path()
    hop = hooks.receiver.path((307, final))
    first = client.submit(**PROMPT, webhook_url=hooks.receiver.url + hop).get_json()["id"]
    assert hooks.wait_delivery(client, "succeeded", request_id=first)["attempts"] == 1
    assert len(hooks.receiver.seen(hop)) == 1 and len(hooks.receiver.seen(final)) == 1
    assert verified(client.secret, hooks.receiver.seen(final)[0])["data"]["id"] == first

    trap = hooks.receiver.path((302, f"http://127.0.0.1:{hooks.receiver.server.server_port}/steal"))
    second = client.submit(**PROMPT, webhook_url=hooks.receiver.url + trap).get_json()["id"]
    failed = hooks.wait_delivery(client, "failed", request_id=second)
    assert failed["attempts"] == 1 and len(hooks.receiver.seen(trap)) == 1
    assert failed["last_error"].startswith("refused (loopback): redirect to http://127.0.0.1:"), failed
    assert failed["last_status_code"] == 302


def test_a_delivery_whose_message_was_lost_is_sent_again_by_the_sweep(hooks, new_client):
    client = hooks.client(new_client)
    path = hooks.receiver.path()
    request_id = client.submit(**PROMPT, webhook_url=hooks.receiver.url + path).get_json()["id"]
    delivery = hooks.wait_delivery(client, "succeeded", request_id=request_id)
    # As if its retry had been scheduled and Redis then lost the message: pending, overdue, in no queue.
    with services(hooks.app).db.session() as session:
        session.execute(update(Delivery).where(Delivery.id == uuid.UUID(delivery["id"])).values(
            status=DeliveryStatus.PENDING, next_attempt_at=func.now() - timedelta(minutes=1)))
    assert hooks.receiver.wait(path, 2)[1][0]["webhook-id"] == delivery["id"]
    assert hooks.wait_delivery(client, "succeeded", request_id=request_id)["attempts"] == 2


def test_a_rotation_while_the_previous_secret_signs_is_refused_and_both_keep_signing(hooks, new_client):
    client = hooks.client(new_client)
    first = client.secret
    second = client.http.post("/v1/webhooks/secret/rotate", headers=client.headers)
    assert second.status_code == 201
    until = second.get_json()["previous_valid_until"]
    assert until is not None
    third = client.http.post("/v1/webhooks/secret/rotate", headers=client.headers)
    assert third.status_code == 409
    error = third.get_json()["error"]
    assert error["code"] == "rotation_in_progress" and "until" in error["message"], error
    assert datetime.fromisoformat(error["details"]["previous_valid_until"]) == datetime.fromisoformat(until)
    # The refused rotation changed nothing: the first secret still verifies beside the second.
    path = hooks.receiver.path()
    client.submit(**PROMPT, webhook_url=hooks.receiver.url + path)
    delivery = hooks.receiver.wait(path, 1)[0]
    new = second.get_json()["secret"]
    assert verified(new, delivery)["type"] == "request.completed" and verified(first, delivery)


def test_redeliveries_and_rotations_are_rate_limited_per_tenant(hooks, new_client):
    client = hooks.client(new_client)  # its first rotation: one of the five
    for _ in range(4):
        answer = client.http.post(f"/v1/webhooks/deliveries/{uuid.uuid4()}/redeliver", headers=client.headers)
        assert answer.status_code == 404  # counted all the same: asking is what the limit bounds
    for path in (f"/v1/webhooks/deliveries/{uuid.uuid4()}/redeliver", "/v1/webhooks/secret/rotate"):
        limited = client.http.post(path, headers=client.headers)
        assert limited.status_code == 429, limited.get_json()
        assert limited.get_json()["error"]["code"] == "rate_limited"
        assert 1 <= int(limited.headers["Retry-After"]) <= 60
    other = hooks.client(new_client)
    assert other.http.post(f"/v1/webhooks/deliveries/{uuid.uuid4()}/redeliver",
                           headers=other.headers).status_code == 404


@pytest.mark.parametrize("limit", ["\u00b2", "\u0661\u0662", "0", "101", "-1", " 5"])
def test_a_delivery_list_limit_must_be_ascii_digits_from_1_to_100(hooks, new_client, limit):
    client = hooks.client(new_client, secret=False)
    answer = client.http.get("/v1/webhooks/deliveries", query_string={"limit": limit}, headers=client.headers)
    assert answer.status_code == 422, answer.get_data(as_text=True)
    error = answer.get_json()["error"]
    assert error["code"] == "invalid_request" and "limit" in error["details"]
