"""``sluice usage`` and ``sluice budgets list/set/delete``: what tenants used and what it cost, and
their budgets, read and written in Postgres directly (the operator's view: every tenant).

The report is ``core/usage/report.py``'s, the one ``GET /v1/usage`` and ``GET /v1/admin/usage``
answer: a table here, or its CSV or JSON. Budgets go through ``core/usage/budgets.py`` and are
checked as ``POST /admin/tenants/<t>/budgets`` checks them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import click

from core.errors import ApiError
from core.rediskeys import redis_client
from core.settings import Settings
from core.submit.listing import instant
from core.tenants.manage import find_tenant
from core.usage.budgets import PERIODS, UNITS, Budgets
from core.usage.report import ADMIN_GROUPS, BUCKETS, UsageQuery, as_csv, usage
from launcher.options import not_found, operator_settings
from models import Database, Tenant

# What the details of a domain error name, and the flags that set them, for error messages.
FLAGS = {"start": "--start", "end": "--end", "bucket": "--bucket", "group_by": "--group-by", "tenant": "--tenant",
         "api_key_id": "--key", "webhook_url": "--webhook-url", "starts_at": "--starts-at"}
MAX_AMOUNT = Decimal(10) ** 14  # budgets.amount is numeric(24, 10): 14 digits before the point


class Moment(click.ParamType):
    """An RFC 3339 / ISO 8601 time (UTC if it names no zone) or Unix seconds."""

    name = "TIME"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> datetime:
        if isinstance(value, datetime):
            return value
        moment = instant(str(value).strip())
        if moment is None:
            self.fail(f"{value!r} is not an ISO 8601 time (2026-12-01T00:00:00Z) or Unix seconds", param, ctx)
        return moment


@contextmanager
def database() -> Iterator[tuple[Database, Settings]]:
    """The platform's database (only DATABASE_URL is needed); a domain error becomes the command's
    error message, with what its details say per flag."""
    settings = operator_settings()
    if not settings.database_url:
        raise click.UsageError(not_found(settings, ["DATABASE_URL"]))
    db = Database()
    db.configure(settings.sqlalchemy_url, pool_size=1, max_overflow=0)
    try:
        yield db, settings
    except ApiError as exc:
        details = exc.details if isinstance(exc.details, dict) else {}
        problems = {FLAGS.get(k, k): " ".join(map(str, v)) for k, v in details.items() if isinstance(v, list)}
        lines = [f"  {flag}: {text}" for flag, text in problems.items() if text not in exc.message]
        raise click.ClickException("\n".join([exc.message, *lines])) from None
    finally:
        db.dispose()


def _tenant(db: Database, ref: str) -> Tenant:
    with db.session() as session:
        tenant = find_tenant(session, ref)
    if tenant is None:
        raise click.ClickException(f"no tenant named {ref!r}")
    return tenant


# ---------------------------------------------------------------------------- sluice usage


@click.command("usage")
@click.option("--tenant", "tenant_ref", metavar="NAME_OR_ID", default=None,
              help="Only this tenant (default: every tenant, the operator's report).")
@click.option("--start", default=None, metavar="TIME",
              help="From (RFC 3339 or Unix seconds; default: the start of this month, UTC).")
@click.option("--end", default=None, metavar="TIME", help="Until (default: now).")
@click.option("--bucket", type=click.Choice(sorted(BUCKETS)), default="day", show_default=True,
              help="Width of a time bucket.")
@click.option("--group-by", "group_by", default="", metavar="FIELDS",
              help=f"Comma-separated, from {', '.join(ADMIN_GROUPS)} (tenant only without --tenant).")
@click.option("--csv", "as_csv_", is_flag=True, help="Print CSV (one line per bucket and group).")
@click.option("--json", "as_json", is_flag=True, help="Print the report's JSON, as GET /v1/usage answers it.")
def usage_command(tenant_ref: str | None, start: str | None, end: str | None, bucket: str, group_by: str,
                  as_csv_: bool, as_json: bool) -> None:
    """Requests, tokens and cost per time bucket and group, then the totals: from the hourly
    rollups, never the request table."""
    if as_csv_ and as_json:
        raise click.UsageError("--csv or --json, not both")
    with database() as (db, _):
        tenant = _tenant(db, tenant_ref) if tenant_ref else None
        query = UsageQuery.parse({"start": start, "end": end, "bucket": bucket, "group_by": group_by},
                                 tenant.id if tenant else None)
        report = usage(db, query)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    elif as_csv_:
        click.echo(as_csv(report), nl=False)
    else:
        scope = f"tenant {tenant.name}" if tenant else "every tenant"
        click.echo(f"usage of {scope}, {_iso(query.start)} to {_iso(query.end)}, by {query.bucket}")
        click.echo(usage_table(report, query))


def usage_table(report: dict[str, Any], query: UsageQuery) -> str:
    """One line per bucket and group with results (empty buckets left out), then the totals."""
    groups = list(query.group_by)
    header = [query.bucket, *groups, "requests", "input", "cached", "output", "cost"]
    rows = []
    for bucket in report["data"]:
        for result in bucket["results"]:
            rows.append([_bucket(bucket["start_time"], query.bucket), *(_group(result, g) for g in groups),
                         *_sums(result)])
    totals = report["totals"]
    rows.append(["total", *([""] * len(groups)), *_sums(totals)])
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    numeric = len(header) - 5  # the last five columns are numbers: right-aligned

    def line(row: list[str]) -> str:
        return "  ".join(cell.rjust(w) if i >= numeric else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip()

    return "\n".join(line(row) for row in [header, *rows])


def _sums(result: dict[str, Any]) -> list[str]:
    return [f"{result['requests']:,}", f"{result['input_tokens']:,}", f"{result['cached_tokens']:,}",
            f"{result['output_tokens']:,}", dollars(Decimal(result["cost_usd"]))]


def dollars(amount: Decimal) -> str:
    """$ with 2 to 4 decimals: $12.34, $0.0012."""
    text = f"{amount:,.4f}"
    whole, _, cents = text.partition(".")
    return f"${whole}.{cents.rstrip('0').ljust(2, '0')}"


def _group(result: dict[str, Any], group: str) -> str:
    if group == "tenant":
        return result["tenant_name"] or result["tenant_id"]
    if group == "key":
        return result["api_key_name"] or result["api_key_id"] or "(no key)"
    return str(result[group])


def _bucket(seconds: int, width: str) -> str:
    moment = datetime.fromtimestamp(seconds, UTC)
    return moment.strftime("%Y-%m-%d" if width == "day" else "%Y-%m-%d %H:00")


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# ---------------------------------------------------------------------------- sluice budgets


@click.group()
def budgets() -> None:
    """Manage budgets: a tenant's or one key's tokens or USD per day, week, month or fixed window.

    A hard budget refuses requests past it (429 budget_exhausted); a soft one only warns, by webhook."""


def budget_line(view: dict[str, Any]) -> str:
    def show(amount: float | int) -> str:
        return f"{amount:,.0f} tokens" if view["unit"] == "tokens" else dollars(Decimal(str(amount)))

    scope = f"key {view['api_key_id']}" if view["api_key_id"] else "tenant"
    window = (f"{view['window_start']} → {view['resets_at']}" if view["window_start"] else
              f"not in force ({view['starts_at']} → {view['ends_at']})")
    period = "in a fixed window" if view["period"] == "fixed" else f"per {view['period']}"
    return (f"{view['id']}  {'hard' if view['hard'] else 'soft'}  {scope}  {show(view['amount'])} {period}  "
            f"used {show(view['used'])} ({view['used_percent']:g} %)  reserved {show(view['reserved'])}  "
            f"left {show(view['remaining'])}  window {window}"
            f"{'  webhook ' + view['webhook_url'] if view['webhook_url'] else ''}")


@budgets.command("list")
@click.argument("tenant_ref", metavar="TENANT")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of one line per budget.")
def list_(tenant_ref: str, as_json: bool) -> None:
    """TENANT's budgets and its keys': the window in force, used, reserved by requests in flight
    (hard budgets, when Redis answers), left."""
    with database() as (db, settings):
        tenant = _tenant(db, tenant_ref)
        client = redis_client(settings.redis_url) if settings.redis_url else None
        try:
            views = Budgets(db).views(tenant.id, client)
        finally:
            if client is not None:
                client.close()
    if as_json:
        click.echo(json.dumps(views, indent=2))
        return
    for view in views:
        click.echo(budget_line(view))
    if not views:
        click.echo(f"tenant {tenant.name} has no budgets", err=True)


def _amount(ctx: click.Context, param: click.Parameter, value: str) -> Decimal:
    try:
        amount = Decimal(value)
    except InvalidOperation:
        raise click.BadParameter(f"{value!r} is not a number") from None
    if not amount.is_finite() or not 0 < amount < MAX_AMOUNT:
        raise click.BadParameter(f"must be > 0 and under {MAX_AMOUNT:,}")
    return amount


@budgets.command("set")
@click.argument("tenant_ref", metavar="TENANT")
@click.option("--unit", type=click.Choice(UNITS), required=True,
              help="tokens (input + output an engine computed) or usd (cost).")
@click.option("--amount", callback=_amount, required=True, metavar="N", help="The budget, in the unit.")
@click.option("--period", type=click.Choice(PERIODS), required=True,
              help="day, week (from Monday), month (UTC calendar windows) or fixed (--starts-at to --ends-at).")
@click.option("--starts-at", "starts_at", type=Moment(), default=None, help="Start of a fixed window (whole hour).")
@click.option("--ends-at", "ends_at", type=Moment(), default=None, help="End of a fixed window (whole hour).")
@click.option("--hard", is_flag=True,
              help="Refuse requests past it (429 budget_exhausted); without it, only warn by webhook at 50, 80, 100 %.")
@click.option("--key", "key_id", type=click.UUID, default=None, metavar="KEY_ID",
              help="One of TENANT's keys (its id, as `sluice keys list` shows it): a budget of that key alone.")
@click.option("--webhook-url", "webhook_url", default=None, metavar="URL",
              help="Where budget.threshold events go (signed with the tenant's webhook secret).")
def set_(tenant_ref: str, unit: str, amount: Decimal, period: str, starts_at: datetime | None,
         ends_at: datetime | None, hard: bool, key_id: uuid.UUID | None, webhook_url: str | None) -> None:
    """Add a budget to TENANT (or to one of its keys) and print it, checked as the admin API checks
    it (core/usage/budgets.py Budgets.create). Processes take it up within a few seconds."""
    with database() as (db, settings):
        tenant = _tenant(db, tenant_ref)
        view = Budgets(db).create(tenant, {"unit": unit, "amount": amount, "period": period, "starts_at": starts_at,
                                           "ends_at": ends_at, "hard": hard, "api_key_id": key_id,
                                           "webhook_url": webhook_url}, settings.webhook_allow_list)
    click.echo(budget_line(view))


@budgets.command("delete")
@click.argument("budget_id", type=click.UUID)
def delete(budget_id: uuid.UUID) -> None:
    """Remove a budget (its id, as `sluice budgets list` shows it); processes drop it within a few
    seconds."""
    with database() as (db, _):
        Budgets(db).delete(budget_id)
    click.echo(f"budget {budget_id} deleted")
