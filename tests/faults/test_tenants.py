"""One tenant's abuse, another tenant's service: the platform's shared pieces stay shared.

Each scenario runs the real processes (`sluice web` under gunicorn where a socket matters, a
worker, Postgres, Redis), lets tenant A do its worst, and checks that tenant B is served while it
does: every request B had accepted ends, and B's calls are answered. Each appends its ledger line,
with its recovery bound beside what it measured, to ``$SLUICE_FAULT_REPORT`` like ``test_ledger.py``.
"""

from __future__ import annotations

import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
from conftest import WorkerProcess, service_env
from test_ledger import SLACK_S, ledger, settle

from core.settings import Settings
from core.tenants.manage import find_tenant, update_tenant
from launcher.database import create_key
from launcher.harness import WebProcess
from models import InferenceRequest
from web import create_app
from web.services import services

TRICKLERS = 30
UPLOAD_STALL_S = 4  # SLUICE_UPLOAD_STALL_S in the trickling scenario
# Every trickler cut (its stall limit) and every request the neighbour had accepted ended: the
# neighbour's are 4-token requests on an idle worker, so beyond the stall only a loaded CI's slack.
TRICKLE_BOUND_S = UPLOAD_STALL_S + SLACK_S
# The twins cancelled, the neighbour's 8-token requests ended: nothing to wait for but the slack.
TWINS_BOUND_S = SLACK_S


def trickle(port: int, key: str, path: str, content_type: str) -> socket.socket:
    """A client that sends a valid head announcing 100,000 bytes, then a few of them, then waits."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: {content_type}\r\nContent-Length: 100000\r\n\r\n".encode() + b'{"custom_id": ')
    return sock


def answer_of(sock: socket.socket) -> str:
    """The status line and body the server sent before closing (it must close: the body is unread)."""
    chunks = []
    while True:
        data = sock.recv(65536)
        if not data:
            break
        chunks.append(data)
    sock.close()
    return b"".join(chunks).decode(errors="replace")


def test_trickling_uploads_hold_no_connection_and_are_cut_off(database_url, redis_dbs, tmp_path):
    """Tenant A opens 30 job and file uploads and trickles them; the web process has a pool of 2
    connections. Bodies are spooled before the database is touched, so tenant B's submits and
    /healthz keep answering while they trickle, and every trickler gets 408 once it stalls."""
    redis_url = redis_dbs()
    env = service_env(database_url, redis_url, {"SLUICE_DB_POOL_SIZE": "2", "SLUICE_DB_MAX_OVERFLOW": "0",
                                                 "SLUICE_UPLOAD_STALL_S": str(UPLOAD_STALL_S),
                                                 "SLUICE_DATA_DIR": str(tmp_path)})
    url = Settings(database_url=database_url).sqlalchemy_url
    names = [f"{who}-{uuid.uuid4().hex[:8]}" for who in ("trickler", "neighbour")]
    abuser, other = (create_key(url, name) for name in names)
    web = WebProcess(env, tmp_path)
    worker = WorkerProcess(database_url, redis_url, tmp_path)
    application = create_app(Settings.from_env(env))
    with services(application).db.session() as session:  # all 30 spooling at once, past its tier's 8
        update_tenant(session, services(application).settings, find_tenant(session, names[0]),
                      {"max_concurrent_uploads": TRICKLERS})
    sockets: list[socket.socket] = []
    try:
        began = time.monotonic()
        for i in range(TRICKLERS):
            path, kind = (("/v1/jobs", "application/jsonl") if i % 2 == 0 else
                          ("/v1/files", "multipart/form-data; boundary=x"))
            sockets.append(trickle(web.port, abuser, path, kind))
        accepted, answered = [], []
        with httpx.Client(base_url=web.url, timeout=10) as http:
            while time.monotonic() - began < 3:  # while every trickler still holds its socket open
                reply = http.post("/v1/requests", json={"prompt": f"still served {uuid.uuid4()}", "max_tokens": 4},
                                  headers={"Authorization": f"Bearer {other}"})
                answered.append(reply.status_code)
                if reply.status_code == 202:
                    accepted.append(reply.json()["id"])
                assert http.get("/healthz").status_code == 200
                time.sleep(0.1)
        assert answered and set(answered) == {202}, answered
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(answer_of, sockets))
        cut_after_s = time.monotonic() - began
        assert all(a.startswith("HTTP/1.1 408") and "body_timeout" in a for a in answers), \
            sorted({a[:40] for a in answers})
        recovered_s = cut_after_s + settle(application, accepted, 60)
        with services(application).db.session() as session:
            statuses = {str(r.id): r.status.value for r in session.query(InferenceRequest)
                        .filter(InferenceRequest.id.in_([uuid.UUID(i) for i in accepted]))}
        line = {"scenario": "30 trickling uploads, pool of 2", "tricklers": TRICKLERS, "cut_408": len(answers),
                "cut_after_s": round(cut_after_s, 1), "neighbour_accepted": len(accepted),
                "neighbour_refused": len(answered) - len(accepted), "lost": len(accepted) - len(statuses),
                "succeeded": sum(1 for s in statuses.values() if s == "succeeded"),
                "recovery_bound_s": TRICKLE_BOUND_S, "recovered_s": round(recovered_s, 1)}
        ledger(line)
        assert line["succeeded"] == len(accepted), line
        assert recovered_s <= TRICKLE_BOUND_S, line
    finally:
        for sock in sockets:
            sock.close()
        worker.stop()
        web.stop()
        services(application).db.dispose()
        redis_dbs.release(redis_url)


def test_sixty_parked_twins_never_run_past_their_tenants_limit(database_url, redis_dbs, new_client, tmp_path):
    """Tenant A (4 requests at once) sends one long deterministic batch request and the same 60
    more times while it runs, then cancels the first. Twins pass the tenant's gates, so only 3
    were accepted beside it, and after the cancel no more than 4 of A's ever run at once; tenant
    B's requests are served throughout. Every accepted request ends."""
    from admission_support import set_limits, tenant_id_of

    redis_url = redis_dbs()
    # The leader must still run when the 60 submits are done: at 4 times an H200's speed its 1,500
    # tokens took under 2 s, which 60 submits on a loaded host outlasted (the cancel found it
    # ended: 409). At an H200's speed 6,000 tokens take ~30 s; it is cancelled long before.
    env = {"SLUICE_SIM_SPEED": "1"}
    application = create_app(Settings.from_env(service_env(database_url, redis_url, env)))
    worker = WorkerProcess(database_url, redis_url, tmp_path, extra_env=env, concurrency=16)
    abuser, neighbour = new_client(application), new_client(application)
    set_limits(application, abuser, max_concurrent=4, requests_per_minute=100)
    tenant = tenant_id_of(application, abuser)
    try:
        body = {"prompt": f"X {uuid.uuid4()}", "max_tokens": 6000, "temperature": 0, "ignore_eos": True,
                "priority": "batch", "deadline_s": 3600}
        leader = abuser.submit(**body).get_json()["id"]
        abuser.wait(leader, statuses={"running"})
        answers = [abuser.submit(**body) for _ in range(60)]
        twins = [a.get_json()["id"] for a in answers if a.status_code == 202]
        refused = [a.status_code for a in answers if a.status_code != 202]
        fault_at = time.monotonic()
        assert abuser.cancel(leader).status_code == 200
        served, peak = [], 0
        while time.monotonic() - fault_at < 6:
            reply = neighbour.submit(prompt=f"served meanwhile {uuid.uuid4()}", max_tokens=8)
            assert reply.status_code == 202, reply.get_json()
            served.append(reply.get_json()["id"])
            with services(application).db.session() as session:
                running = session.query(InferenceRequest).filter(
                    InferenceRequest.tenant_id == tenant, InferenceRequest.status == "running").count()
            peak = max(peak, running)
            time.sleep(0.2)
        for twin in twins:
            abuser.cancel(twin)
        recovered_s = settle(application, [leader, *twins, *served], 120)
        with services(application).db.session() as session:
            neighbour_ok = session.query(InferenceRequest).filter(
                InferenceRequest.id.in_([uuid.UUID(i) for i in served]), InferenceRequest.status == "succeeded").count()
        line = {"scenario": "60 twins of a cancelled request, limit 4", "twins_accepted": len(twins),
                "twins_refused_429": refused.count(429), "peak_running": peak, "neighbour_accepted": len(served),
                "neighbour_succeeded": neighbour_ok, "lost": 0, "recovery_bound_s": TWINS_BOUND_S,
                "recovered_s": round(recovered_s, 1)}
        ledger(line)
        assert recovered_s <= TWINS_BOUND_S, line
        assert len(twins) == 3 and refused == [429] * 57, line
        assert peak <= 4 and neighbour_ok == len(served), line
    finally:
        worker.stop()
        services(application).db.dispose()
        redis_dbs.release(redis_url)
