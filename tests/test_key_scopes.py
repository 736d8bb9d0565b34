"""API key scopes: a key scoped ``tenant`` reads everything of its tenant (every key made before
scopes, and the default), ``own`` only what it made, ``submit`` nothing. Through the HTTP API, on
real Postgres and Redis: requests, jobs, files and batches, usage, webhooks, the admin API and
``sluice keys create --scope``."""

from __future__ import annotations

import io
import json
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from conftest import ApiClient
from test_api_errors import assert_envelope
from test_keys import cli
from test_openai_errors import openai_error
from test_tenants_admin import ADMIN_KEY, admin

from models import ApiKey, File, InferenceRequest, UsageHourly, hash_key, new_key
from web.services import services

OWN_404 = "No such request for this key: a key scoped `own` sees only the requests it made."


@pytest.fixture
def scoped_app(isolated_app):
    return isolated_app(admin_key=ADMIN_KEY)


class Tenant:
    """A tenant made through the admin API, with its first key (scoped ``tenant``)."""

    def __init__(self, app) -> None:
        self.app = app
        self.name = f"scopes-{uuid.uuid4().hex[:8]}"
        created = admin(app, "POST", "/admin/tenants", {"name": self.name})
        assert created.status_code == 201, created.get_json()
        self.first = ApiClient(app, created.get_json()["api_key"])

    def key(self, scope: str | None) -> ApiClient:
        made = admin(self.app, "POST", f"/admin/tenants/{self.name}/keys", {} if scope is None else {"scope": scope})
        assert made.status_code == 201, made.get_json()
        assert made.get_json()["key"]["scope"] == (scope or "tenant")
        return ApiClient(self.app, made.get_json()["api_key"])


def submitted(client: ApiClient, prompt: str = "hello") -> str:
    response = client.submit(prompt=prompt, max_tokens=8)
    assert response.status_code == 202, response.get_json()
    return response.get_json()["id"]


def listed(client: ApiClient, path: str = "/v1/requests") -> list[str]:
    response = client.http.get(path, headers=client.headers)
    assert response.status_code == 200, response.get_json()
    return [item["id"] for item in response.get_json()["data"]]


def key_scope_refused(response, openai: bool = False) -> str:
    """The 403 a key scoped ``submit`` gets for a read; its message."""
    error = openai_error(response, 403, "permission_error", "key_scope") if openai else \
        assert_envelope(response, 403, "key_scope")
    assert "`submit`" in error["message"] and "it submits" in error["message"]
    return error["message"]


# ---------------------------------------------------------------------- requests


def test_a_key_made_without_a_scope_reads_the_whole_tenant(scoped_app):
    """An existing key (a row written without the column: the migration's server default) and a
    key created with no scope both read every request of the tenant, another key's included."""
    tenant = Tenant(scoped_app)
    old_key = new_key()
    with services(scoped_app).db.session() as session:
        tenant_id = session.scalar(ApiKey.__table__.select().with_only_columns(ApiKey.tenant_id)
                                   .where(ApiKey.key_hash == hash_key(tenant.first.key)))
        session.execute(ApiKey.__table__.insert().values(id=uuid.uuid4(), tenant_id=tenant_id, prefix=old_key[:14],
                                                         key_hash=hash_key(old_key)))
        assert session.scalar(ApiKey.__table__.select().with_only_columns(ApiKey.scope)
                              .where(ApiKey.key_hash == hash_key(old_key))) == "tenant"
    old, default, own = ApiClient(scoped_app, old_key), tenant.key(None), tenant.key("own")
    theirs = submitted(own)
    for reader in (old, default, tenant.first):
        assert reader.get(theirs).status_code == 200
        assert theirs in listed(reader)
    assert old.cancel(theirs).get_json()["status"] == "cancelled"


def test_an_own_key_reads_and_cancels_only_its_own_requests(scoped_app):
    tenant = Tenant(scoped_app)
    own, other_own = tenant.key("own"), tenant.key("own")
    mine, theirs, colleague = submitted(own), submitted(tenant.first), submitted(other_own)

    assert own.get(mine).status_code == 200
    for rid in (theirs, colleague, str(uuid.uuid4())):  # another key's request reads as one that does not exist
        error = assert_envelope(own.get(rid), 404, "not_found")
        assert error["message"] == OWN_404
        assert assert_envelope(own.cancel(rid), 404, "not_found")["message"] == OWN_404
    waited = own.http.get(f"/v1/requests/{theirs}", headers={**own.headers, "Prefer": "wait=1"})
    assert assert_envelope(waited, 404, "not_found")["message"] == OWN_404

    assert listed(own) == [mine]
    paged = own.http.get("/v1/requests", query_string={"before": theirs}, headers=own.headers)
    assert_envelope(paged, 404, "not_found")
    assert set(listed(tenant.first)) == {mine, theirs, colleague}  # the tenant's key still sees all
    assert tenant.first.get(theirs).get_json()["status"] == "queued"  # the refused cancel changed nothing
    assert own.cancel(mine).get_json()["status"] == "cancelled"


def test_an_own_key_does_not_see_requests_made_before_keys_were_recorded(scoped_app):
    tenant = Tenant(scoped_app)
    own = tenant.key("own")
    old = submitted(own)
    with services(scoped_app).db.session() as session:
        session.execute(InferenceRequest.__table__.update().where(InferenceRequest.id == uuid.UUID(old))
                        .values(api_key_id=None))
    assert assert_envelope(own.get(old), 404, "not_found")["message"] == OWN_404
    assert listed(own) == []
    assert tenant.first.get(old).status_code == 200 and listed(tenant.first) == [old]


def test_a_submit_key_submits_but_every_read_is_refused(scoped_app):
    tenant = Tenant(scoped_app)
    submit = tenant.key("submit")
    mine = submitted(submit)
    message = key_scope_refused(submit.get(mine))
    assert "`own`" in message and "`tenant`" in message  # it says which keys would do
    key_scope_refused(submit.cancel(mine))
    for path in ("/v1/requests", "/v1/usage", "/v1/budgets", "/v1/jobs", f"/v1/jobs/{uuid.uuid4()}",
                 f"/v1/jobs/{uuid.uuid4()}/results"):
        key_scope_refused(submit.http.get(path, headers=submit.headers))
    key_scope_refused(submit.http.post(f"/v1/jobs/{uuid.uuid4()}/cancel", headers=submit.headers))
    for method, path in (("GET", "/v1/webhooks/deliveries"), ("POST", "/v1/webhooks/secret/rotate")):
        assert_envelope(submit.http.open(path, method=method, headers=submit.headers), 403, "key_scope")
    for method, path in (("GET", "/v1/files"), ("GET", f"/v1/files/file-{uuid.uuid4().hex}"),
                         ("GET", f"/v1/files/file-{uuid.uuid4().hex}/content"),
                         ("DELETE", f"/v1/files/file-{uuid.uuid4().hex}"), ("GET", "/v1/batches"),
                         ("GET", f"/v1/batches/batch_{uuid.uuid4().hex}")):
        key_scope_refused(submit.http.open(path, method=method, headers=submit.headers), openai=True)
    assert tenant.first.get(mine).get_json()["status"] == "queued"  # nothing was cancelled
    assert submitted(submit) != mine  # refused reads leave the key as able to submit as before


# ---------------------------------------------------------------------- jobs


def job_of(client: ApiClient, text: str):
    return client.http.post("/v1/jobs", data=(json.dumps({"custom_id": "a", "text": text}) + "\n").encode(),
                            headers={**client.headers, "Content-Type": "application/jsonl"})


def test_jobs_follow_the_key_scope(scoped_app):
    tenant = Tenant(scoped_app)
    own, submit = tenant.key("own"), tenant.key("submit")
    made = {}
    for name, client in (("own", own), ("tenant", tenant.first), ("submit", submit)):
        response = job_of(client, f"a document about {name}")
        assert response.status_code == 201, response.get_json()
        made[name] = response.get_json()["id"]

    assert listed(own, "/v1/jobs") == [made["own"]]
    assert own.http.get(f"/v1/jobs/{made['own']}/results", headers=own.headers).status_code == 200
    for path in (f"/v1/jobs/{made['tenant']}", f"/v1/jobs/{made['submit']}/results",
                 f"/v1/jobs/{made['tenant']}/errors"):
        error = assert_envelope(own.http.get(path, headers=own.headers), 404, "not_found")
        assert error["message"] == "No such job for this key: a key scoped `own` sees only the jobs it made."
    assert_envelope(own.http.post(f"/v1/jobs/{made['tenant']}/cancel", headers=own.headers), 404, "not_found")
    key_scope_refused(submit.http.get(f"/v1/jobs/{made['submit']}", headers=submit.headers))
    assert set(listed(tenant.first, "/v1/jobs")) == set(made.values())
    assert own.http.post(f"/v1/jobs/{made['own']}/cancel", headers=own.headers).status_code == 200


# ---------------------------------------------------------------------- files and batches


def upload(client: ApiClient, body: bytes):
    return client.http.post("/v1/files", data={"purpose": "batch", "file": (io.BytesIO(body), "in.jsonl")},
                            headers=client.headers, content_type="multipart/form-data")


def chat_lines(word: str) -> bytes:
    return (json.dumps({"custom_id": word, "method": "POST", "url": "/v1/chat/completions",
                        "body": {"messages": [{"role": "user", "content": word}], "max_tokens": 5}}) + "\n").encode()


def test_files_and_batches_follow_the_key_scope(scoped_app):
    tenant = Tenant(scoped_app)
    own, submit = tenant.key("own"), tenant.key("submit")
    files = {}
    for name, client in (("own", own), ("tenant", tenant.first), ("submit", submit)):
        response = upload(client, chat_lines(name))
        assert response.status_code == 200, response.get_json()
        files[name] = response.get_json()["id"]

    assert listed(own, "/v1/files") == [files["own"]]
    assert own.http.get(f"/v1/files/{files['own']}/content", headers=own.headers).data == chat_lines("own")
    for method, path in (("GET", f"/v1/files/{files['tenant']}"), ("GET", f"/v1/files/{files['submit']}/content"),
                         ("DELETE", f"/v1/files/{files['tenant']}")):
        error = openai_error(own.http.open(path, method=method, headers=own.headers), 404, "not_found_error",
                             "file_not_found")
        assert error["message"] == "No such file for this key: a key scoped `own` sees only the files it made."
    key_scope_refused(submit.http.get(f"/v1/files/{files['submit']}", headers=submit.headers), openai=True)

    # A batch is made only from a file the key may use: an own or submit key's own upload.
    batch = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    refused = own.http.post("/v1/batches", json={**batch, "input_file_id": files["tenant"]}, headers=own.headers)
    openai_error(refused, 404, "not_found_error", "file_not_found")
    batches = {}
    for name, client in (("own", own), ("submit", submit), ("tenant", tenant.first)):
        made = client.http.post("/v1/batches", json={**batch, "input_file_id": files[name]}, headers=client.headers)
        assert made.status_code == 200, made.get_json()
        batches[name] = made.get_json()["id"]
    assert listed(own, "/v1/batches") == [batches["own"]]
    missing = openai_error(own.http.get(f"/v1/batches/{batches['tenant']}", headers=own.headers), 404,
                           "not_found_error", "batch_not_found")
    assert missing["message"] == "No such batch for this key: a key scoped `own` sees only the batches it made."
    key_scope_refused(submit.http.get(f"/v1/batches/{batches['submit']}", headers=submit.headers), openai=True)
    assert set(listed(tenant.first, "/v1/batches")) == set(batches.values())

    # A file uploaded before files recorded their key is the tenant keys' only.
    with services(scoped_app).db.session() as session:
        session.execute(File.__table__.update().where(File.id == uuid.UUID(files["own"][len("file-"):]))
                        .values(api_key_id=None))
    assert listed(own, "/v1/files") == []
    assert set(listed(tenant.first, "/v1/files")) == set(files.values())
    assert tenant.first.http.delete(f"/v1/files/{files['tenant']}", headers=tenant.first.headers).status_code == 200


# ---------------------------------------------------------------------- usage and webhooks


def test_an_own_key_sees_only_its_own_usage(scoped_app):
    tenant = Tenant(scoped_app)
    own = tenant.key("own")
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    with services(scoped_app).db.session() as session:
        keys = dict(session.execute(ApiKey.__table__.select().with_only_columns(ApiKey.key_hash, ApiKey.id)
                                    .where(ApiKey.key_hash.in_([hash_key(own.key), hash_key(tenant.first.key)]))).all())
        tenant_id = session.scalar(ApiKey.__table__.select().with_only_columns(ApiKey.tenant_id)
                                   .where(ApiKey.key_hash == hash_key(own.key)))
        for key, requests in ((own.key, 3), (tenant.first.key, 5)):
            session.add(UsageHourly(hour=hour, tenant_id=tenant_id, api_key_id=keys[hash_key(key)], model="m",
                                    priority="realtime", service_tier="default", source="api", requests=requests,
                                    cache_hits=0,
                                    input_tokens=10, cached_tokens=0, output_tokens=10, billed_tokens=20,
                                    cost=Decimal("0.001"), succeeded=requests))
    query = {"start": int((hour - timedelta(days=1)).timestamp()), "group_by": "key"}

    def report(client: ApiClient) -> dict:
        response = client.http.get("/v1/usage", query_string=query, headers=client.headers)
        assert response.status_code == 200, response.get_json()
        return response.get_json()

    mine = report(own)
    assert mine["totals"]["requests"] == 3
    assert {r["api_key_id"] for b in mine["data"] for r in b["results"]} == {str(keys[hash_key(own.key)])}
    assert report(tenant.first)["totals"]["requests"] == 8


def test_only_a_tenant_key_reads_webhook_deliveries_or_rotates_the_secret(scoped_app):
    tenant = Tenant(scoped_app)
    own = tenant.key("own")
    for method, path in (("POST", "/v1/webhooks/secret/rotate"), ("GET", "/v1/webhooks/deliveries"),
                         ("GET", f"/v1/webhooks/deliveries/{uuid.uuid4()}")):
        error = assert_envelope(own.http.open(path, method=method, headers=own.headers), 403, "key_scope")
        assert "`own`" in error["message"] and "`tenant`" in error["message"]
    rotated = tenant.first.http.post("/v1/webhooks/secret/rotate", headers=tenant.first.headers)
    assert rotated.status_code == 201 and rotated.get_json()["secret"].startswith("whsec_")


# ---------------------------------------------------------------------- making keys


def test_the_admin_api_takes_and_shows_a_scope(scoped_app):
    tenant = Tenant(scoped_app)
    bad = admin(scoped_app, "POST", f"/admin/tenants/{tenant.name}/keys", {"scope": "everything"})
    error = assert_envelope(bad, 422, "invalid_scope")
    assert "scope" in error["message"] and set(error["details"]) == {"scope"}
    for wrong in (7, ""):
        assert_envelope(admin(scoped_app, "POST", f"/admin/tenants/{tenant.name}/keys", {"scope": wrong}), 422,
                        "invalid_scope")
    own = tenant.key("own")
    listed_keys = admin(scoped_app, "GET", f"/admin/tenants/{tenant.name}/keys").get_json()["keys"]
    assert [k["scope"] for k in listed_keys] == ["tenant", "own"]
    assert own.get(submitted(tenant.first)).status_code == 404  # the scope it was shown is the one it has


def test_sluice_keys_create_takes_a_scope(scoped_app, database_url):
    tenant = Tenant(scoped_app)
    made = cli(scoped_app, database_url, "keys", "create", tenant.name, "--scope", "submit", "--name", "ingest")
    assert made.exit_code == 0, made.output
    submit = ApiClient(scoped_app, made.output.strip())
    key_scope_refused(submit.get(submitted(submit)))
    default = cli(scoped_app, database_url, "keys", "create", tenant.name)
    assert default.exit_code == 0, default.output
    assert ApiClient(scoped_app, default.output.strip()).get(submitted(submit)).status_code == 200

    refused = cli(scoped_app, database_url, "keys", "create", tenant.name, "--scope", "everything")
    assert refused.exit_code == 2 and "--scope" in refused.output
    shown = cli(scoped_app, database_url, "keys", "list", tenant.name, "--json")
    assert [k["scope"] for k in json.loads(shown.output)] == ["tenant", "submit", "tenant"]
    text = cli(scoped_app, database_url, "keys", "list", tenant.name)
    assert "scope submit" in text.output
