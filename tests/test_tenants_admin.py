"""Tenants, tiers and keys: the admin API (guarded by SLUICE_ADMIN_KEY) and `sluice tenants`."""

from __future__ import annotations

import json
import uuid

import pytest
from click.testing import CliRunner
from conftest import TEST_ENV, ApiClient
from test_admission import assert_ratelimit_headers
from test_api_errors import assert_envelope

from core.settings import Settings, SettingsError
from launcher.cli import main
from web.services import services

ADMIN_KEY = "admin-" + "k" * 20


@pytest.fixture
def admin_app(isolated_app):
    return isolated_app(admin_key=ADMIN_KEY)


def admin(app, method: str, path: str, body=None, key: str = ADMIN_KEY):
    return app.test_client().open(path, method=method, json=body, headers={"Authorization": f"Bearer {key}"})


def test_admin_api_needs_the_admin_key(admin_app, app):
    assert_envelope(admin_app.test_client().get("/admin/tenants"), 401, "invalid_admin_key")
    assert_envelope(admin(admin_app, "GET", "/admin/tenants", key="wrong-" + "k" * 20), 401, "invalid_admin_key")
    assert admin(admin_app, "GET", "/admin/tenants").status_code == 200
    # Without SLUICE_ADMIN_KEY (the session app) the admin API does not exist at all.
    assert_envelope(admin(app, "GET", "/admin/tenants"), 404, "not_found")


def test_admin_key_must_be_long_enough():
    with pytest.raises(SettingsError, match="SLUICE_ADMIN_KEY"):
        Settings.from_env({"SLUICE_ADMIN_KEY": "short"})


def test_create_a_tenant_with_a_tier_and_use_its_key(admin_app):
    name = f"acme-{uuid.uuid4().hex[:8]}"
    created = admin(admin_app, "POST", "/admin/tenants", {"name": name, "tier": "free", "max_concurrent": 2})
    assert created.status_code == 201, created.get_json()
    body = created.get_json()
    free = services(admin_app).settings.tiers["free"]
    assert body["tier"] == "free" and body["overrides"] == {"max_concurrent": 2}
    assert body["limits"] == {**free.as_dict(), "max_concurrent": 2}
    response = ApiClient(admin_app, body["api_key"]).submit(prompt="hello", max_tokens=8)
    assert response.status_code == 202
    assert_ratelimit_headers(response, free.tokens_per_minute, free.requests_per_minute)
    assert_envelope(admin(admin_app, "POST", "/admin/tenants", {"name": name}), 409, "tenant_exists")


def test_patch_changes_limits_for_the_next_submit(admin_app):
    name = f"beta-{uuid.uuid4().hex[:8]}"
    key = admin(admin_app, "POST", "/admin/tenants", {"name": name}).get_json()["api_key"]
    client = ApiClient(admin_app, key)
    standard = services(admin_app).settings.tiers["standard"]
    assert_ratelimit_headers(client.submit(prompt="x", max_tokens=4), standard.tokens_per_minute,
                             standard.requests_per_minute)

    patched = admin(admin_app, "PATCH", f"/admin/tenants/{name}", {"tier": "enterprise", "tokens_per_minute": 12345})
    assert patched.status_code == 200 and patched.get_json()["limits"]["tokens_per_minute"] == 12345
    enterprise = services(admin_app).settings.tiers["enterprise"]
    assert_ratelimit_headers(client.submit(prompt="x", max_tokens=4), 12345, enterprise.requests_per_minute)

    reset = admin(admin_app, "PATCH", f"/admin/tenants/{name}", {"tokens_per_minute": None, "tier": None})
    assert reset.get_json()["overrides"] == {} and reset.get_json()["tier_is_default"] is True
    assert_envelope(admin(admin_app, "PATCH", f"/admin/tenants/{name}", {"tier": "platinum"}), 422, "unknown_tier")
    assert_envelope(admin(admin_app, "PATCH", f"/admin/tenants/{name}", {"max_concurrent": 0}), 422,
                    "invalid_request")
    assert_envelope(admin(admin_app, "PATCH", "/admin/tenants/nobody-here", {"tier": "free"}), 404, "not_found")
    weighted = admin(admin_app, "PATCH", f"/admin/tenants/{name}", {"batch_weight": 2.5})
    assert weighted.status_code == 200 and weighted.get_json()["batch_weight"] == 2.5
    assert_envelope(admin(admin_app, "PATCH", f"/admin/tenants/{name}", {"batch_weight": 0}), 422, "invalid_request")
    assert admin(admin_app, "PATCH", f"/admin/tenants/{name}", {"batch_weight": None}).get_json()["batch_weight"] == 1


def test_list_and_new_keys(admin_app):
    name = f"gamma-{uuid.uuid4().hex[:8]}"
    admin(admin_app, "POST", "/admin/tenants", {"name": name, "create_key": False})
    key = admin(admin_app, "POST", f"/admin/tenants/{name}/keys")
    assert key.status_code == 201 and key.get_json()["api_key"].startswith("sk-sluice-")
    listed = {t["name"]: t for t in admin(admin_app, "GET", "/admin/tenants").get_json()["tenants"]}
    assert listed[name]["active_keys"] == 1
    assert admin(admin_app, "GET", f"/admin/tenants/{listed[name]['id']}").get_json()["name"] == name


def test_cli_creates_updates_and_lists_tenants(database_url, redis_url):
    runner = CliRunner()
    env = {**TEST_ENV, "DATABASE_URL": database_url, "REDIS_URL": redis_url}
    name = f"cli-{uuid.uuid4().hex[:8]}"
    created = runner.invoke(main, ["tenants", "create", name, "--tier", "free", "--requests-per-minute", "7"], env=env)
    assert created.exit_code == 0, created.output
    assert created.stdout.strip().startswith("sk-sluice-")
    updated = runner.invoke(main, ["tenants", "update", name, "--max-concurrent", "3",
                                   "--requests-per-minute", "tier", "--batch-weight", "4"], env=env)
    assert updated.exit_code == 0, updated.output
    assert "concurrent=3*" in updated.output and "requests/min=20 " in updated.output
    assert "batch_weight=4" in updated.output
    listed = runner.invoke(main, ["tenants", "list", "--json"], env=env)
    view = next(t for t in json.loads(listed.stdout) if t["name"] == name)
    assert view["tier"] == "free" and view["overrides"] == {"max_concurrent": 3} and view["active_keys"] == 1
    bad = runner.invoke(main, ["tenants", "update", name, "--tier", "platinum"], env=env)
    assert bad.exit_code != 0 and "Unknown tier" in bad.output
    assert runner.invoke(main, ["tenants", "create", name], env=env).exit_code != 0



def test_bodies_and_names_postgres_cannot_hold_are_4xx_not_500(admin_app):
    for name in ("nul\x00name", "lone\ud800surrogate"):
        assert_envelope(admin(admin_app, "POST", "/admin/tenants", {"name": name}), 422)
    body = {"name": f"big-{uuid.uuid4().hex[:8]}", "max_concurrent": 2**31}
    too_big = admin(admin_app, "POST", "/admin/tenants", body)
    assert "max_concurrent" in assert_envelope(too_big, 422)["details"]
    assert_envelope(admin(admin_app, "GET", "/admin/tenants/%00"), 404)
    assert_envelope(admin(admin_app, "PATCH", "/admin/tenants/%00", {"max_concurrent": 1}), 404)


def test_a_deeply_nested_body_is_a_400(client):
    deep = "[" * 100_000 + "]" * 100_000
    response = client.http.post("/v1/requests", data=deep,
                                headers={**client.headers, "Content-Type": "application/json"})
    assert assert_envelope(response, 400, "malformed_json")
    nested: dict = {"prompt": "x", "metadata": {}}
    node = nested["metadata"]
    for _ in range(40):
        node["a"] = {}
        node = node["a"]
    assert assert_envelope(client.submit(**nested), 400, "malformed_json")
