"""``sluice tenants create/update/list/disable/enable``: tenants, their tiers and per-tenant limit
overrides."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from core.rediskeys import bump_auth_epoch, redis_client
from core.settings import Settings
from core.tenants.file_quotas import QUOTA_FIELDS
from core.tenants.manage import (
    MAX_RESERVED,
    TenantError,
    add_key,
    create_tenant,
    find_tenant,
    list_tenants,
    set_disabled,
    tenant_view,
    update_tenant,
)
from core.tenants.tiers import LIMIT_FIELDS
from launcher.options import service_settings
from models import Database, Tenant


class _LimitValue(click.ParamType):
    """A whole number > 0, or ``tier`` to drop the override and use the tier's value (None)."""

    name = "N|tier"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None or isinstance(value, int):
            return value
        if value == "tier":
            return None
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a whole number or 'tier'", param, ctx)
        if number <= 0:
            self.fail("must be > 0", param, ctx)
        return number


class _ShareValue(click.ParamType):
    """A fraction > 0 and ≤ MAX_RESERVED, or ``none`` to clear it (None)."""

    name = "SHARE|none"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float | None:
        if value is None or isinstance(value, float):
            return value
        if value == "none":
            return None
        try:
            share = float(value)
        except ValueError:
            self.fail(f"{value!r} is not a number or 'none'", param, ctx)
        if not 0 < share <= MAX_RESERVED:
            self.fail(f"must be > 0 and ≤ {MAX_RESERVED:g}", param, ctx)
        return share


def _limit_options(command: Callable) -> Callable:
    for name in reversed((*LIMIT_FIELDS, *QUOTA_FIELDS)):
        command = click.option(f"--{name.replace('_', '-')}", name, type=_LimitValue(), default=None,
                               help=f"Override the tier's {name.replace('_', ' ')} ('tier' removes it).")(command)
    command = click.option("--auto-service-tier", "auto_service_tier", type=click.Choice(["default", "priority"]),
                           default=None, help="What its requests' service_tier auto buys: default, or priority "
                           "(run as default, named so, when the priority promise cannot be kept).")(command)
    command = click.option("--batch-weight", "batch_weight", type=click.FloatRange(0, 1000, min_open=True),
                           default=None, help="Share of batch capacity for bulk jobs against other tenants' "
                           "(tokens; default 1).")(command)
    command = click.option("--reserved-share", "reserved_share", type=_ShareValue(), default=None,
                           help="The share (0 to 0.9) of each class's engine time the tenant gets whenever it has "
                           "work, beside tenants that queue more; inside it, it is never refused for their work "
                           "(docs/fairness.md). 'none' clears it.")(command)
    return click.option("--tier", default=None, help="Tier name from SLUICE_TIERS ('default': the default tier).")(
        command)


def _changes(tier: str | None, limits: dict[str, Any], ctx: click.Context) -> dict[str, Any]:
    """Only what was given on the command line: an absent option leaves the value alone."""
    changes: dict[str, Any] = {}
    if tier is not None:
        changes["tier"] = None if tier == "default" else tier
    for name, value in limits.items():
        if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            changes[name] = value
    return changes


@contextmanager
def management_session() -> Iterator[tuple[Any, Settings]]:
    """A session committed on leaving the block; a TenantError becomes the command's error message."""
    settings = service_settings()
    db = Database()
    db.configure(settings.sqlalchemy_url, pool_size=1, max_overflow=0)
    try:
        with db.session() as session:
            yield session, settings
    except TenantError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        db.dispose()


def tenant_named(session: Any, name: str) -> Tenant:
    tenant = find_tenant(session, name)
    if tenant is None:
        raise click.ClickException(f"no tenant named {name!r}")
    return tenant


def forget_keys(settings: Settings) -> None:
    """After a revocation or a disable commits: web processes stop refusing from memory."""
    client = redis_client(settings.redis_url)
    try:
        if not bump_auth_epoch(client):
            click.echo("warning: Redis unreachable; web processes may answer this key's submits with 503 "
                       "instead of 401/403 for up to SLUICE_AUTH_CACHE_S", err=True)
    finally:
        client.close()


def _summary(view: dict[str, Any]) -> str:
    limits = view["limits"]
    marks = {f: "*" if f in view["overrides"] else "" for f in (*LIMIT_FIELDS, *QUOTA_FIELDS)}
    quotas = view["file_quotas"]
    return (f"{view['name']}  tier={view['tier']}{' (default)' if view['tier_is_default'] else ''}  "
            f"tokens/min={limits['tokens_per_minute']}{marks['tokens_per_minute']}  "
            f"requests/min={limits['requests_per_minute']}{marks['requests_per_minute']}  "
            f"concurrent={limits['max_concurrent']}{marks['max_concurrent']}  "
            f"max_request_tokens={limits['max_request_tokens']}{marks['max_request_tokens']}  "
            f"batch_weight={view['batch_weight']:g}  auto_service_tier={view['auto_service_tier']}  "
            f"reserved_share={view['reserved_share'] if view.get('reserved_share') is not None else '-'}  "
            f"file_bytes={quotas['max_stored_bytes']}{marks['max_stored_bytes']}  "
            f"files={quotas['max_files']}{marks['max_files']}  "
            f"uploads/min={quotas['uploads_per_minute']}{marks['uploads_per_minute']}  "
            f"concurrent_uploads={quotas['max_concurrent_uploads']}{marks['max_concurrent_uploads']}")


@click.group()
def tenants() -> None:
    """Manage tenants, their tiers and limits (* marks a per-tenant override)."""


@tenants.command("create")
@click.argument("name")
@_limit_options
@click.option("--no-key", is_flag=True, help="Do not create an API key.")
@click.pass_context
def create(ctx: click.Context, name: str, tier: str | None, no_key: bool, **limits: Any) -> None:
    """Create tenant NAME and print its first API key (shown only this once)."""
    changes = _changes(tier, limits, ctx)
    with management_session() as (session, settings):
        tenant = create_tenant(session, settings, name, changes.pop("tier", None), changes)
        key = None if no_key else add_key(session, tenant)
        summary = _summary(tenant_view(tenant, settings))
    click.echo(summary, err=True)
    if key:
        click.echo(key)


@tenants.command("update")
@click.argument("name")
@_limit_options
@click.pass_context
def update(ctx: click.Context, name: str, tier: str | None, **limits: Any) -> None:
    """Change tenant NAME's tier or limit overrides; options not given stay as they are."""
    changes = _changes(tier, limits, ctx)
    if not changes:
        raise click.UsageError("nothing to change: give --tier or a limit option")
    with management_session() as (session, settings):
        tenant = tenant_named(session, name)
        update_tenant(session, settings, tenant, changes)
        summary = _summary(tenant_view(tenant, settings))
    click.echo(summary)


@tenants.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of one line per tenant.")
def list_(as_json: bool) -> None:
    """List tenants with their tier and effective limits."""
    with management_session() as (session, settings):
        views = list_tenants(session, settings)
    if as_json:
        click.echo(json.dumps(views, indent=2))
        return
    for view in views:
        click.echo(f"{_summary(view)}  keys={view['active_keys']}{'  disabled' if view['disabled'] else ''}")


@tenants.command("disable")
@click.argument("name")
def disable(name: str) -> None:
    """Refuse every call with tenant NAME's keys (403 tenant_disabled) until `enable`. Requests it
    submitted before still run."""
    with management_session() as (session, settings):
        set_disabled(session, tenant_named(session, name), True)
    forget_keys(settings)
    click.echo(f"tenant {name} disabled")


@tenants.command("enable")
@click.argument("name")
def enable(name: str) -> None:
    """Accept tenant NAME's keys again."""
    with management_session() as (session, _):
        set_disabled(session, tenant_named(session, name), False)
    click.echo(f"tenant {name} enabled")
