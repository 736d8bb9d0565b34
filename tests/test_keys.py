"""Revoking API keys and disabling tenants (admin API and `sluice keys` / `sluice tenants`):
the key's next call gets 401 (403 for a disabled tenant), even on the path that refuses an
overloaded submit from keys this process remembers."""

from __future__ import annotations

import json
import uuid

import pytest
from click.testing import CliRunner
from conftest import TEST_ENV, ApiClient
from test_api_errors import assert_envelope as envelope
from test_promise import publish, statements
from test_tenants_admin import ADMIN_KEY, admin

from launcher.cli import main
from models import ApiKey, hash_key, new_key
from web.services import services


@pytest.fixture
def admin_app(isolated_app):
    # The promise without margin and the shipped realtime deadline, as test_promise: an overload
    # is one publish() away.
    return isolated_app(admin_key=ADMIN_KEY, realtime_deadline_s=30.0, promise_factor=1.0)


def new_tenant(app) -> tuple[str, ApiClient]:
    name = f"keys-{uuid.uuid4().hex[:8]}"
    created = admin(app, "POST", "/admin/tenants", {"name": name})
    assert created.status_code == 201, created.get_json()
    return name, ApiClient(app, created.get_json()["api_key"])


def keys_of(app, name: str) -> list[dict]:
    listed = admin(app, "GET", f"/admin/tenants/{name}/keys")
    assert listed.status_code == 200, listed.get_json()
    return listed.get_json()["keys"]


def cli(app, database_url: str, *args: str, redis_url: str | None = None):
    env = {**TEST_ENV, "DATABASE_URL": database_url, "REDIS_URL": redis_url or services(app).settings.redis_url}
    return CliRunner().invoke(main, list(args), env=env)


def overload(app) -> None:
    # 5,000 tokens of work ahead drain in 50 s: a 100-token realtime request misses its 30 s.
    publish(app, queued_work=5000, drain_tps=100, seq_tps=50)


def test_the_admin_api_lists_keys_with_their_last_use(admin_app):
    name, client = new_tenant(admin_app)
    [view] = keys_of(admin_app, name)
    assert set(view) == {"id", "prefix", "name", "owner", "scope", "created_at", "expires_at", "last_used_at",
                         "revoked_at"}
    assert view["scope"] == "tenant"  # what a key made without a scope reads: the whole tenant
    assert client.key.startswith(view["prefix"]) and view["created_at"]
    assert view["last_used_at"] is None and view["revoked_at"] is None

    assert client.submit(prompt="hello", max_tokens=8).status_code == 202
    [used] = keys_of(admin_app, name)
    assert used["last_used_at"] is not None
    # Stamped at most once a minute: the next call leaves it as it is.
    assert client.submit(prompt="again", max_tokens=8).status_code == 202
    assert keys_of(admin_app, name)[0]["last_used_at"] == used["last_used_at"]
    envelope(admin(admin_app, "GET", "/admin/tenants/nobody-here/keys"), 404, "not_found")


def test_a_key_revoked_through_the_admin_api_gets_401_at_once(admin_app):
    name, client = new_tenant(admin_app)
    request_id = client.submit(prompt="before", max_tokens=8).get_json()["id"]
    [view] = keys_of(admin_app, name)
    revoked = admin(admin_app, "DELETE", f"/admin/tenants/{name}/keys/{view['id']}")
    assert revoked.status_code == 200, revoked.get_json()
    body = revoked.get_json()
    assert body["id"] == view["id"] and body["revoked_at"] and body["already_revoked"] is False

    envelope(client.submit(prompt="after", max_tokens=8), 401, "invalid_api_key")
    envelope(client.get(request_id), 401, "invalid_api_key")
    again = admin(admin_app, "DELETE", f"/admin/tenants/{name}/keys/{view['id']}").get_json()
    assert again["already_revoked"] is True and again["revoked_at"] == body["revoked_at"]
    assert admin(admin_app, "GET", f"/admin/tenants/{name}").get_json()["active_keys"] == 0
    assert keys_of(admin_app, name)[0]["revoked_at"] == body["revoked_at"]


def test_revoking_answers_404_for_what_is_not_the_tenants_key(admin_app):
    name, _ = new_tenant(admin_app)
    other, _ = new_tenant(admin_app)
    [foreign] = keys_of(admin_app, other)
    for key_id in ("not-a-uuid", str(uuid.uuid4()), foreign["id"]):
        envelope(admin(admin_app, "DELETE", f"/admin/tenants/{name}/keys/{key_id}"), 404, "key_not_found")
    assert keys_of(admin_app, other)[0]["revoked_at"] is None
    envelope(admin(admin_app, "DELETE", f"/admin/tenants/nobody-here/keys/{foreign['id']}"), 404, "not_found")


def test_the_cli_creates_lists_and_revokes_keys_by_prefix(admin_app, database_url):
    name, first = new_tenant(admin_app)
    created = cli(admin_app, database_url, "keys", "create", name)
    assert created.exit_code == 0, created.output
    second = ApiClient(admin_app, created.stdout.strip())
    assert second.key.startswith("sk-sluice-") and second.key != first.key

    listed = cli(admin_app, database_url, "keys", "list", name, "--json")
    assert listed.exit_code == 0, listed.output
    views = json.loads(listed.stdout)
    assert len(views) == 2 and all(v["revoked_at"] is None for v in views)
    prefix = next(v["prefix"] for v in views if first.key.startswith(v["prefix"]))

    revoked = cli(admin_app, database_url, "keys", "revoke", prefix)
    assert revoked.exit_code == 0, revoked.output
    assert "revoked" in revoked.output
    envelope(first.submit(prompt="revoked", max_tokens=8), 401, "invalid_api_key")
    assert second.submit(prompt="still good", max_tokens=8).status_code == 202

    again = cli(admin_app, database_url, "keys", "revoke", prefix)
    assert again.exit_code == 0 and "already revoked" in again.output
    lines = cli(admin_app, database_url, "keys", "list", name).stdout.splitlines()
    assert len(lines) == 2 and sum("revoked" in line for line in lines) == 1
    unknown = cli(admin_app, database_url, "keys", "revoke", "sk-sluice-none")
    assert unknown.exit_code != 0 and "No API key" in unknown.output
    assert cli(admin_app, database_url, "keys", "list", "nobody-here").exit_code != 0


def test_a_prefix_two_keys_share_does_not_revoke_either(admin_app, database_url):
    name, client = new_tenant(admin_app)
    [view] = keys_of(admin_app, name)
    tenant_id = uuid.UUID(admin(admin_app, "GET", f"/admin/tenants/{name}").get_json()["id"])
    with services(admin_app).db.session() as session:  # 4 random characters: rare, but it happens
        session.add(ApiKey(tenant_id=tenant_id, prefix=view["prefix"], key_hash=hash_key(new_key())))
    ambiguous = cli(admin_app, database_url, "keys", "revoke", view["prefix"])
    assert ambiguous.exit_code != 0 and "More than one key" in ambiguous.output
    assert client.submit(prompt="not revoked", max_tokens=8).status_code == 202
    by_id = cli(admin_app, database_url, "keys", "revoke", view["id"])
    assert by_id.exit_code == 0, by_id.output
    envelope(client.submit(prompt="revoked", max_tokens=8), 401)


def test_a_revocation_commits_while_redis_is_away(admin_app, database_url):
    name, client = new_tenant(admin_app)
    prefix = keys_of(admin_app, name)[0]["prefix"]
    # Nothing listens on port 1: the epoch cannot be bumped, the revocation still stands.
    revoked = cli(admin_app, database_url, "keys", "revoke", prefix, redis_url="redis://127.0.0.1:1/0")
    assert revoked.exit_code == 0, revoked.output
    assert "Redis unreachable" in revoked.stderr and "revoked" in revoked.stdout
    envelope(client.submit(prompt="revoked", max_tokens=8), 401)


def test_a_disabled_tenant_gets_403_until_enabled(admin_app):
    name, client = new_tenant(admin_app)
    request_id = client.submit(prompt="before", max_tokens=8).get_json()["id"]
    disabled = admin(admin_app, "PATCH", f"/admin/tenants/{name}", {"disabled": True})
    assert disabled.status_code == 200, disabled.get_json()
    assert disabled.get_json()["disabled"] is True and disabled.get_json()["disabled_at"]
    envelope(client.submit(prompt="while disabled", max_tokens=8), 403, "tenant_disabled")
    envelope(client.get(request_id), 403, "tenant_disabled")
    envelope(admin(admin_app, "PATCH", f"/admin/tenants/{name}", {"disabled": "no"}), 422, "invalid_request")
    envelope(admin(admin_app, "PATCH", f"/admin/tenants/{name}", {"disabled": None}), 422, "invalid_request")
    envelope(admin(admin_app, "POST", "/admin/tenants", {"name": f"off-{name}", "disabled": True}), 422)

    enabled = admin(admin_app, "PATCH", f"/admin/tenants/{name}", {"disabled": False})
    assert enabled.get_json()["disabled"] is False and enabled.get_json()["disabled_at"] is None
    assert client.submit(prompt="enabled again", max_tokens=8).status_code == 202


def test_the_cli_disables_and_enables_a_tenant(admin_app, database_url):
    name, client = new_tenant(admin_app)
    assert cli(admin_app, database_url, "tenants", "disable", name).exit_code == 0
    envelope(client.submit(prompt="while disabled", max_tokens=8), 403, "tenant_disabled")
    listed = json.loads(cli(admin_app, database_url, "tenants", "list", "--json").stdout)
    assert next(t for t in listed if t["name"] == name)["disabled"] is True
    assert cli(admin_app, database_url, "tenants", "enable", name).exit_code == 0
    assert client.submit(prompt="enabled again", max_tokens=8).status_code == 202
    assert cli(admin_app, database_url, "tenants", "disable", "nobody-here").exit_code != 0


def test_a_key_refused_early_gets_401_at_once_when_revoked(admin_app):
    name, revoked = new_tenant(admin_app)
    _, live = new_tenant(admin_app)
    for client in (revoked, live):
        assert client.submit(prompt="authenticates the key", max_tokens=8).status_code == 202
    overload(admin_app)
    with statements(admin_app) as seen:
        for client in (revoked, live):
            envelope(client.submit(prompt="late", max_tokens=100), 503, "overloaded")
    assert seen == [], "the refusals asked Postgres: this test would not cover the remembered keys"

    key_id = keys_of(admin_app, name)[0]["id"]
    assert admin(admin_app, "DELETE", f"/admin/tenants/{name}/keys/{key_id}").status_code == 200
    envelope(revoked.submit(prompt="late", max_tokens=100), 401, "invalid_api_key")
    # A live key is asked after once per revocation, then refused from memory again.
    with statements(admin_app) as seen:
        envelope(live.submit(prompt="late", max_tokens=100), 503, "overloaded")
    assert any("api_keys" in s for s in seen)
    with statements(admin_app) as seen:
        envelope(live.submit(prompt="late", max_tokens=100), 503, "overloaded")
    assert seen == []


def test_a_tenant_disabled_while_its_key_is_remembered_gets_403_at_once(admin_app):
    name, client = new_tenant(admin_app)
    assert client.submit(prompt="authenticates the key", max_tokens=8).status_code == 202
    overload(admin_app)
    envelope(client.submit(prompt="late", max_tokens=100), 503, "overloaded")
    assert admin(admin_app, "PATCH", f"/admin/tenants/{name}", {"disabled": True}).status_code == 200
    envelope(client.submit(prompt="late", max_tokens=100), 403, "tenant_disabled")
