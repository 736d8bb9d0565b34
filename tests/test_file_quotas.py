"""File quotas (SLUICE_FILE_QUOTAS, per-tenant overrides): what a tenant may keep in /v1/files and
how fast and how wide it may upload, on real Postgres and Redis.

The stored-bytes, file-count and per-minute quotas are checked through the whole web app in
process (Flask's test client); the concurrent-upload cap and parallel uploads of one tenant
through a real `sluice web` (gunicorn, gevent), where uploads really are received at once.
"""

from __future__ import annotations

import io
import json
import select as io_select
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from admission_support import set_limits
from conftest import make_settings, service_env
from prometheus_client import REGISTRY
from sqlalchemy import func, select

from core.errors import FileQuotaExceeded
from core.openai.file_quotas import FileQuotaGate, UploadQuota, tenant_file_quotas
from core.settings import Settings
from launcher.database import create_key
from launcher.harness import WebProcess
from models import File, Tenant
from web.services import services


def jsonl_bytes(size: int) -> bytes:
    """A JSONL body of exactly ``size`` bytes (one line, newline-terminated)."""
    head = b'{"custom_id": "x", "pad": "'
    tail = b'"}\n'
    return head + b"a" * (size - len(head) - len(tail)) + tail


def upload(client, size: int):
    return client.http.post("/v1/files", headers=client.headers, content_type="multipart/form-data",
                            data={"purpose": "batch", "file": (io.BytesIO(jsonl_bytes(size)), "input.jsonl")})


def error_of(response) -> dict:
    return response.get_json()["error"]


def rejections(reason: str) -> float:
    return REGISTRY.get_sample_value("sluice_admission_rejections_total", {"gate": "files", "reason": reason}) or 0


def stored(app, tenant_id: uuid.UUID) -> tuple[int, int]:
    with services(app).db.session() as session:
        used, count = session.execute(select(func.coalesce(func.sum(File.bytes), 0), func.count())
                                      .where(File.tenant_id == tenant_id)).one()
    return int(used), int(count)


def test_stored_bytes_quota_refuses_with_413_and_the_numbers_and_a_delete_frees_it(isolated_app, new_client):
    app = isolated_app()
    client = new_client(app)
    tenant = set_limits(app, client, max_stored_bytes=10_000)
    first = upload(client, 6_000)
    assert first.status_code == 200, first.get_json()
    before = rejections("max_stored_bytes")

    refused = upload(client, 6_000)
    assert refused.status_code == 413
    error = error_of(refused)
    assert error["code"] == "file_quota_exceeded" and error["type"] == "invalid_request_error"
    assert "your 1 files hold 6000 bytes" in error["message"] and "quota of 10000 bytes" in error["message"]
    assert "4000 left" in error["message"], error["message"]
    assert stored(app, tenant) == (6_000, 1)  # the refused upload left no row and no chunk
    assert rejections("max_stored_bytes") == before + 1

    deleted = client.http.delete(f"/v1/files/{first.get_json()['id']}", headers=client.headers)
    assert deleted.status_code == 200 and deleted.get_json()["deleted"] is True
    again = upload(client, 6_000)
    assert again.status_code == 200, again.get_json()
    assert stored(app, tenant) == (6_000, 1)


def test_a_refusal_carries_used_limit_and_upload_in_details(isolated_app, new_client):
    """OpenAI's error shape has no details, so the route's message holds the numbers; the domain
    error itself carries them for any door that shows details."""
    app = isolated_app()
    client = new_client(app)
    tenant_id = set_limits(app, client, max_stored_bytes=10_000)
    assert upload(client, 3_000).status_code == 200
    svc = services(app)
    with svc.db.session() as session:
        tenant = session.get(Tenant, tenant_id)
        session.expunge(tenant)
    with pytest.raises(FileQuotaExceeded) as refused:
        FileQuotaGate(svc.settings, svc.db, svc.redis).admit(tenant, at_least_bytes=8_000)
    assert refused.value.status == 413 and refused.value.code == "file_quota_exceeded"
    assert refused.value.details == {"quota": "max_stored_bytes", "used": 3_000, "limit": 10_000, "upload": 8_000,
                                     "files": 1}


def test_a_second_upload_settles_only_after_the_first_commits_and_sees_it(isolated_app, new_client):
    """The race the per-tenant lock closes, on two real Postgres sessions: upload A has settled
    (its 8,000 bytes fit the 10,000) but not committed; upload B's settle waits for A's commit, then
    counts A's file and refuses. Without the lock B would see A's file missing and pass: 16,000 stored."""
    app = isolated_app()
    client = new_client(app)
    tenant_id = set_limits(app, client, max_stored_bytes=10_000)
    svc = services(app)
    with svc.db.session() as session:
        quotas = tenant_file_quotas(svc.settings, session.get(Tenant, tenant_id))
    outcome: dict[str, object] = {}

    def second() -> None:
        try:
            with svc.db.session() as session:  # refused: rolled back, its row with it
                file = File(tenant_id=tenant_id, purpose="batch", filename="b.jsonl", bytes=8_000)
                session.add(file)
                session.flush()
                UploadQuota(tenant_id, quotas, 10_000).settle(session, file.id, 8_000)
            outcome["b"] = "stored"
        except FileQuotaExceeded as exc:
            outcome["b"] = exc

    with svc.db.session() as session:
        first = File(tenant_id=tenant_id, purpose="batch", filename="a.jsonl", bytes=8_000)
        session.add(first)
        session.flush()
        UploadQuota(tenant_id, quotas, 10_000).settle(session, first.id, 8_000)
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(1.0)
        assert thread.is_alive() and "b" not in outcome  # B waits on A's lock
    thread.join(10)
    refused = outcome["b"]
    assert isinstance(refused, FileQuotaExceeded), refused
    assert refused.details == {"quota": "max_stored_bytes", "used": 8_000, "limit": 10_000, "upload": 8_000,
                               "files": 1}
    assert stored(app, tenant_id) == (8_000, 1)


def test_file_count_quota(isolated_app, new_client):
    app = isolated_app()
    client = new_client(app)
    tenant = set_limits(app, client, max_files=2)
    ids = [upload(client, 200).get_json()["id"] for _ in range(2)]
    before = rejections("max_files")
    refused = upload(client, 200)
    assert refused.status_code == 413
    error = error_of(refused)
    assert error["code"] == "file_quota_exceeded"
    assert "you keep 2 files, your quota of 2" in error["message"], error["message"]
    assert stored(app, tenant) == (400, 2)
    assert rejections("max_files") == before + 1
    assert client.http.delete(f"/v1/files/{ids[0]}", headers=client.headers).status_code == 200
    assert upload(client, 200).status_code == 200
    assert stored(app, tenant) == (400, 2)


def test_uploads_per_minute_answer_429_with_retry_after(isolated_app, new_client):
    app = isolated_app()
    client, neighbour = new_client(app), new_client(app)
    set_limits(app, client, uploads_per_minute=3)
    assert [upload(client, 100).status_code for _ in range(3)] == [200, 200, 200]
    before = rejections("uploads_per_minute")
    refused = upload(client, 100)
    assert refused.status_code == 429
    error = error_of(refused)
    assert error["code"] == "upload_rate_limited" and error["type"] == "rate_limit_error"
    assert "3 upload calls this minute, your limit of 3 per minute" in error["message"], error["message"]
    retry = int(refused.headers["Retry-After"])
    assert 1 <= retry <= 60 and f"retry after {retry} s" in error["message"]
    assert rejections("uploads_per_minute") == before + 1
    assert upload(neighbour, 100).status_code == 200  # another tenant's minute is its own


def test_a_tiers_quota_applies_and_a_tenant_override_wins(isolated_app, new_client):
    app = isolated_app(file_quotas_spec="free=5000/100/10/2,standard=10GiB/10000/60/8,enterprise=1TiB/1000000/600/32")
    client = new_client(app)
    tenant_id = set_limits(app, client, tier="free")
    refused = upload(client, 6_000)
    assert refused.status_code == 413 and "quota of 5000 bytes" in error_of(refused)["message"]

    set_limits(app, client, max_stored_bytes=20_000)
    assert upload(client, 6_000).status_code == 200
    svc = services(app)
    from core.tenants.manage import tenant_view
    with svc.db.session() as session:
        view = tenant_view(session.get(Tenant, tenant_id), svc.settings)
    assert view["file_quotas"] == {"max_stored_bytes": 20_000, "max_files": 100, "uploads_per_minute": 10,
                                   "max_concurrent_uploads": 2}
    assert view["overrides"] == {"max_stored_bytes": 20_000}

    set_limits(app, client, max_stored_bytes=None)  # back to the tier's 5000: 6000 stored already, no room
    assert upload(client, 100).status_code == 413


def test_a_tier_the_setting_does_not_name_gets_the_default_tiers_quotas(database_url, admission_redis_url):
    settings = make_settings(database_url, admission_redis_url, {
        "SLUICE_TIERS": "gold=40000/20/4/4096,silver=2000000/1200/512/8192", "SLUICE_DEFAULT_TIER": "silver",
        "SLUICE_FILE_QUOTAS": "silver=1GiB/7/60/8"})
    assert tenant_file_quotas(settings, Tenant(tier="gold")).max_files == 7
    # The shipped setting names tiers a deployment may not have; it must still start.
    shipped = make_settings(database_url, admission_redis_url, {"SLUICE_TIERS": "gold=40000/20/4/4096",
                                                               "SLUICE_DEFAULT_TIER": "gold"})
    assert tenant_file_quotas(shipped, Tenant(tier="gold")).max_files == 10_000  # the shipped standard's
    with pytest.raises(ValueError, match="SLUICE_FILE_QUOTAS names tiers SLUICE_TIERS does not have: bronze"):
        make_settings(database_url, admission_redis_url, {"SLUICE_FILE_QUOTAS": "bronze=1/1/1/1"})


# --------------------------------------------------------------- a real web process


@pytest.fixture(scope="module")
def web(database_url, redis_dbs, tmp_path_factory):
    """One `sluice web` process (gunicorn, gevent, one worker: one process's spool count)."""
    redis_url = redis_dbs()
    process = WebProcess(service_env(database_url, redis_url), tmp_path_factory.mktemp("file-quotas"))
    yield process
    process.stop()
    redis_dbs.release(redis_url)


def tenant_key(database_url: str, **overrides) -> str:
    """A new tenant's API key, with file quota overrides as `sluice tenants update` sets them."""
    from core.tenants.manage import find_tenant, update_tenant
    from models import Database

    name = f"quota-{uuid.uuid4().hex[:10]}"
    url = Settings(database_url=database_url).sqlalchemy_url
    key = create_key(url, name)
    db = Database()
    db.configure(url, pool_size=1, max_overflow=0)
    try:
        with db.session() as session:
            update_tenant(session, Settings.from_env({}), find_tenant(session, name), overrides)
    finally:
        db.dispose()
    return key


def multipart(size: int, boundary: str = "quota-boundary") -> bytes:
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n")
    return head.encode() + jsonl_bytes(size) + f"\r\n--{boundary}--\r\n".encode()


def post_file(http: httpx.Client, key: str, size: int) -> httpx.Response:
    return http.post("/v1/files", content=multipart(size), headers={
        "Authorization": f"Bearer {key}", "Content-Type": "multipart/form-data; boundary=quota-boundary"})


def held_open(port: int, key: str, path: str, content_type: str) -> socket.socket:
    """An upload whose head announces 100,000 bytes and whose body never comes: it holds a spool."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: {content_type}\r\nContent-Length: 100000\r\n\r\n".encode() + b"--quota-boundary\r\n")
    return sock


def test_concurrent_uploads_past_the_cap_get_429_before_their_body_is_read(web, database_url):
    """Two of the tenant's uploads held open in one web process take its two slots: a third file
    upload and a job upload are refused at once with 429 too_many_uploads; another tenant is not;
    once the two end, the tenant uploads again."""
    key = tenant_key(database_url, max_concurrent_uploads=2, uploads_per_minute=1000)
    neighbour = tenant_key(database_url)
    held = (("/v1/files", "multipart/form-data; boundary=quota-boundary"), ("/v1/jobs", "application/jsonl"))
    sockets = [held_open(web.port, key, path, kind) for path, kind in held]
    try:
        with httpx.Client(base_url=web.url, timeout=20) as http:
            # Until the server has taken both heads and holds both spools: within a second alone, but
            # a spread run once kept it from them for over 10 s while it answered this loop's posts.
            # A head the server reads while one of those posts holds a slot is itself refused (429,
            # and closed): that upload is opened again, and the next post waits until the server
            # had a moment for it.
            deadline = time.monotonic() + 60
            while True:
                for i, sock in enumerate(sockets):
                    if io_select.select([sock], [], [], 0)[0]:  # answered (refused) or closed: not held
                        sock.close()
                        sockets[i] = held_open(web.port, key, *held[i])
                        time.sleep(0.3)
                refused = post_file(http, key, 500)
                if refused.status_code == 429 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["code"] == "too_many_uploads" and error["type"] == "rate_limit_error"
            assert "2 of yours are being received by this server, your limit of 2" in error["message"]
            assert refused.headers["Retry-After"] == "5"

            job = http.post("/v1/jobs", content=b'{"text": "a document"}\n', headers={
                "Authorization": f"Bearer {key}", "Content-Type": "application/jsonl"})
            assert job.status_code == 429, job.text
            body = job.json()["error"]
            assert body["code"] == "too_many_uploads" and job.headers["Retry-After"] == "5"
            assert body["details"]["used"] == 2 and body["details"]["limit"] == 2

            assert post_file(http, neighbour, 500).status_code == 200
            scraped = http.get("/metrics").text
            assert 'sluice_admission_rejections_total{gate="files",reason="max_concurrent_uploads"}' in scraped

            for sock in sockets:
                sock.close()
            deadline = time.monotonic() + 10
            while (answer := post_file(http, key, 500)).status_code == 429 and time.monotonic() < deadline:
                time.sleep(0.1)  # the server notices the closed sockets and gives their slots back
            assert answer.status_code == 200, answer.text
    finally:
        for sock in sockets:
            sock.close()


def test_parallel_uploads_of_one_tenant_never_pass_its_bytes_quota(web, database_url):
    """Ten 8,000-byte uploads at once against a 50,000-byte quota: exactly six are stored (six fit,
    a seventh would not), whatever order they commit in; the other four get 413."""
    key = tenant_key(database_url, max_stored_bytes=50_000, max_concurrent_uploads=20, uploads_per_minute=100)
    with httpx.Client(base_url=web.url, timeout=30) as http, ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda _: post_file(http, key, 8_000), range(10)))
        listed = http.get("/v1/files", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200] * 6 + [413] * 4, [a.text for a in answers if a.status_code not in (200, 413)]
    assert {json.loads(a.text)["error"]["code"] for a in answers if a.status_code == 413} == {"file_quota_exceeded"}
    assert len(listed) == 6 and sum(f["bytes"] for f in listed) == 48_000


def test_a_body_announced_over_the_quota_is_refused_from_its_head(web, database_url):
    """A Content-Length that cannot fit is refused with 413 before a byte of the body is sent."""
    key = tenant_key(database_url, max_stored_bytes=1_000_000)
    sock = socket.create_connection(("127.0.0.1", web.port), timeout=20)
    answer = b""
    try:
        sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                     "Content-Type: multipart/form-data; boundary=quota-boundary\r\n"
                     "Content-Length: 5000000\r\n\r\n".encode())
        while b"}}" not in answer and (data := sock.recv(65536)):  # the whole error, then it may close
            answer += data
    finally:
        sock.close()
    answer = answer.decode(errors="replace")
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert "file_quota_exceeded" in answer and "quota of 1000000 bytes" in answer
