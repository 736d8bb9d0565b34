"""What the operator reads and sets without the HTTP API: `sluice usage` (table, CSV, JSON),
`sluice budgets list/set/delete`, keys made for a service or a person (`sluice keys create
--name/--owner/--expires-at`), and the operator page's usage panel (this month by tenant, the
top models by cost).

Usage rows are written straight into the hourly rollups (what the request trigger keeps, see
``models/usage.py``): these tests are about what the commands and the page show of them;
``tests/test_usage.py`` proves the rollups themselves."""

from __future__ import annotations

import csv
import io
import json
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from click.testing import CliRunner
from conftest import TEST_ENV
from test_tenants_admin import ADMIN_KEY

from core.usage.report import CSV_COLUMNS
from launcher.cli import main
from models import UsageHourly
from models.usage import NO_KEY


@pytest.fixture
def sluice(database_url, redis_url):
    """Run `sluice ARGS…` against the session's database and Redis."""
    env = {**TEST_ENV, "DATABASE_URL": database_url, "REDIS_URL": redis_url}
    runner = CliRunner()

    def run(*args: str):
        return runner.invoke(main, list(args), env=env)

    return run


@pytest.fixture
def tenant(sluice) -> str:
    """A new tenant's name, made by `sluice tenants create` (no key)."""
    name = f"usage-cli-{uuid.uuid4().hex[:8]}"
    created = sluice("tenants", "create", name, "--no-key")
    assert created.exit_code == 0, created.output
    return name


def tenant_id_of(sluice, name: str) -> uuid.UUID:
    listed = sluice("tenants", "list", "--json")
    return uuid.UUID(next(t["id"] for t in json.loads(listed.stdout) if t["name"] == name))


def add_usage(db, tenant_id: uuid.UUID, model: str, requests: int, input_tokens: int, output_tokens: int,
              cost: str, key_id: uuid.UUID = NO_KEY) -> None:
    """One rollup row for this hour, as the trigger would have written it."""
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    with db.session() as session:
        session.add(UsageHourly(hour=hour, tenant_id=tenant_id, api_key_id=key_id, model=model, priority="realtime",
                                service_tier="default", source="api", requests=requests, cache_hits=0,
                                input_tokens=input_tokens, cached_tokens=0, output_tokens=output_tokens,
                                billed_tokens=input_tokens + output_tokens, cost=Decimal(cost)))


def around_now() -> list[str]:
    now = datetime.now(UTC)
    return ["--start", (now - timedelta(days=1)).isoformat(), "--end", (now + timedelta(hours=1)).isoformat()]


# ---------------------------------------------------------------------------- keys


def test_a_key_made_for_a_service_shows_its_name_owner_and_expiry(sluice, tenant):
    expires = (datetime.now(UTC) + timedelta(days=90)).replace(microsecond=0)
    created = sluice("keys", "create", tenant, "--name", "svc", "--owner", "a@b.c", "--expires-at",
                     expires.isoformat())
    assert created.exit_code == 0, created.output
    assert created.stdout.strip().startswith("sk-sluice-")
    plain = sluice("keys", "create", tenant)
    assert plain.exit_code == 0, plain.output

    listed = sluice("keys", "list", tenant)
    assert listed.exit_code == 0, listed.output
    lines = listed.stdout.splitlines()
    assert len(lines) == 2
    named = next(line for line in lines if "name svc" in line)
    assert "owner a@b.c" in named and named.endswith("active")
    assert datetime.fromisoformat(named.split("expires ")[1].split()[0]) == expires
    other = next(line for line in lines if line is not named)
    assert "name -" in other and "owner -" in other and "expires never" in other

    views = json.loads(sluice("keys", "list", tenant, "--json").stdout)
    view = next(v for v in views if v["name"] == "svc")
    assert view["owner"] == "a@b.c" and datetime.fromisoformat(view["expires_at"]) == expires

    past = sluice("keys", "create", tenant, "--expires-at", "2020-01-01T00:00:00Z")
    assert past.exit_code == 2 and "must be in the future" in past.output
    assert sluice("keys", "create", tenant, "--expires-at", "next tuesday").exit_code == 2
    assert sluice("keys", "create", tenant, "--name", "x" * 101).exit_code == 2
    assert len(json.loads(sluice("keys", "list", tenant, "--json").stdout)) == 2  # the refused ones made none


# ---------------------------------------------------------------------------- budgets


def test_budgets_are_set_listed_and_deleted(sluice, tenant):
    assert sluice("budgets", "list", tenant).stdout == ""
    made = sluice("budgets", "set", tenant, "--unit", "usd", "--amount", "25", "--period", "month", "--hard")
    assert made.exit_code == 0, made.output
    budget_id = made.stdout.split()[0]
    assert uuid.UUID(budget_id) and "hard  tenant  $25.00 per month" in made.stdout

    listed = sluice("budgets", "list", tenant)
    assert listed.exit_code == 0, listed.output
    [line] = listed.stdout.splitlines()
    assert line.startswith(budget_id) and "$25.00 per month" in line and "left $25.00" in line
    [view] = json.loads(sluice("budgets", "list", tenant, "--json").stdout)
    assert view["id"] == budget_id and view["unit"] == "usd" and view["amount"] == 25 and view["hard"] is True
    assert view["period"] == "month" and view["api_key_id"] is None and view["remaining"] == 25

    deleted = sluice("budgets", "delete", budget_id)
    assert deleted.exit_code == 0 and f"budget {budget_id} deleted" in deleted.stdout
    assert sluice("budgets", "list", tenant).stdout == ""
    again = sluice("budgets", "delete", budget_id)
    assert again.exit_code == 1 and "No budget" in again.output


def test_a_key_budget_and_what_budgets_set_refuses(sluice, tenant):
    sluice("keys", "create", tenant, "--name", "batch-runner")
    [key] = json.loads(sluice("keys", "list", tenant, "--json").stdout)
    made = sluice("budgets", "set", tenant, "--unit", "tokens", "--amount", "1000000", "--period", "day",
                  "--key", key["id"])
    assert made.exit_code == 0, made.output
    assert f"soft  key {key['id']}  1,000,000 tokens per day" in made.stdout

    other = f"usage-cli-{uuid.uuid4().hex[:8]}"
    sluice("tenants", "create", other, "--no-key")
    foreign = sluice("budgets", "set", other, "--unit", "usd", "--amount", "5", "--period", "day", "--key", key["id"])
    # Checked by Budgets.create, as the admin API checks them: its refusals name the flag.
    assert foreign.exit_code == 1 and f"no key of tenant {other}" in foreign.output and "--key" in foreign.output
    no_window = sluice("budgets", "set", tenant, "--unit", "usd", "--amount", "5", "--period", "fixed")
    assert no_window.exit_code == 1 and "--starts-at" in no_window.output
    off_the_hour = sluice("budgets", "set", tenant, "--unit", "usd", "--amount", "5", "--period", "fixed",
                          "--starts-at", "2030-01-01T00:30:00Z", "--ends-at", "2030-02-01T00:00:00Z")
    assert off_the_hour.exit_code == 1 and "whole hours" in off_the_hour.output
    for amount in ("0", "-3", "lots", "1e20"):
        refused = sluice("budgets", "set", tenant, "--unit", "usd", "--amount", amount, "--period", "day")
        assert refused.exit_code == 2, (amount, refused.output)
    fixed = sluice("budgets", "set", tenant, "--unit", "tokens", "--amount", "500", "--period", "fixed",
                   "--starts-at", "2030-01-01T00:00:00Z", "--ends-at", "2030-02-01T00:00:00Z")
    assert fixed.exit_code == 0 and "in a fixed window" in fixed.stdout and "not in force" in fixed.stdout
    assert len(json.loads(sluice("budgets", "list", tenant, "--json").stdout)) == 2
    assert sluice("budgets", "list", "nobody-here").exit_code == 1


# ---------------------------------------------------------------------------- usage


def test_usage_as_csv_table_and_json(sluice, tenant, db):
    tenant_id = tenant_id_of(sluice, tenant)
    add_usage(db, tenant_id, "m-cheap", 30, 12000, 3000, "0.0123")
    add_usage(db, tenant_id, "m-dear", 4, 8000, 2000, "1.5")

    as_csv = sluice("usage", "--group-by", "tenant,model", "--csv", *around_now())
    assert as_csv.exit_code == 0, as_csv.output
    assert as_csv.stdout.splitlines()[0] == ",".join(CSV_COLUMNS)
    mine = [row for row in csv.DictReader(io.StringIO(as_csv.stdout)) if row["tenant_id"] == str(tenant_id)]
    assert {(r["tenant_name"], r["model"], r["requests"], r["cost_usd"]) for r in mine} == {
        (tenant, "m-cheap", "30", "0.0123000000"), (tenant, "m-dear", "4", "1.5000000000")}

    table = sluice("usage", "--tenant", tenant, "--group-by", "model", *around_now())
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[0].startswith(f"usage of tenant {tenant}") and lines[1].split() == [
        "day", "model", "requests", "input", "cached", "output", "cost"]
    assert any(line.split()[1:] == ["m-cheap", "30", "12,000", "0", "3,000", "$0.0123"] for line in lines[2:])
    assert lines[-1].split() == ["total", "34", "20,000", "0", "5,000", "$1.5123"]

    as_json = json.loads(sluice("usage", "--tenant", str(tenant_id), "--json", *around_now()).stdout)
    assert as_json["object"] == "page" and as_json["totals"]["requests"] == 34
    assert as_json["totals"]["cost_usd"] == "1.5123000000"


def test_usage_refuses_what_the_report_cannot_answer(sluice, tenant):
    bad = sluice("usage", "--group-by", "colour", "--start", "yesterday")
    assert bad.exit_code == 1
    assert "--group-by" in bad.output and "--start" in bad.output
    assert sluice("usage", "--tenant", tenant, "--group-by", "tenant").exit_code == 1  # one tenant: no tenant groups
    assert sluice("usage", "--tenant", "nobody-here").exit_code == 1
    assert sluice("usage", "--csv", "--json").exit_code == 2


# ---------------------------------------------------------------------------- the operator page


def test_the_dashboard_shows_this_months_usage_by_tenant_and_top_models(isolated_app, db, tenant_id):
    app = isolated_app(admin_key=ADMIN_KEY)
    model = f"m-{uuid.uuid4().hex[:6]}"
    add_usage(db, tenant_id, model, 7, 7000, 700, "987.65")  # dearer than anything else the session writes
    add_usage(db, tenant_id, "m-cheap", 3, 300, 30, "0.01")
    http = app.test_client()
    assert http.get("/v1/admin/dashboard/usage").status_code == 401

    answer = http.get("/v1/admin/dashboard/usage", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert answer.status_code == 200, answer.get_json()
    body = answer.get_json()
    assert body["start"].startswith(datetime.now(UTC).strftime("%Y-%m-01T00:00:00"))
    [row] = [t for t in body["tenants"] if t["tenant_id"] == str(tenant_id)]
    assert row["tenant_name"].startswith("owner-")
    assert (row["requests"], row["input_tokens"], row["output_tokens"]) == (10, 7300, 730)
    assert row["cost_usd"] == "987.6600000000" and row["cost"] == pytest.approx(987.66)
    assert len(body["models"]) <= 5 and body["models"][0]["model"] == model
    costs = [m["cost"] for m in body["models"]]
    assert costs == sorted(costs, reverse=True)
    assert http.get("/dashboard").data.count(b"usage-") >= 2  # the page has the panel's tables
