"""``sluice keys list/create/revoke``: a tenant's API keys. Listings show a key's prefix, never
the key; a new key is printed once."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import click

from core.tenants.manage import add_key, key_view, list_keys, revoke_key
from core.tenants.scopes import SCOPES
from launcher.tenants_cli import forget_keys, management_session, tenant_named
from launcher.usage_cli import Moment


@click.group()
def keys() -> None:
    """Manage API keys."""


@keys.command("list")
@click.argument("tenant")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of one line per key.")
def list_(tenant: str, as_json: bool) -> None:
    """List TENANT's keys, revoked ones too: id, prefix, scope, name, owner, created, expiry, last
    used (to the minute)."""
    with management_session() as (session, _):
        views = list_keys(session, tenant_named(session, tenant))
    if as_json:
        click.echo(json.dumps(views, indent=2))
        return
    now = datetime.now(UTC)
    for view in views:
        expires = view["expires_at"]
        if view["revoked_at"]:
            state = f"revoked {view['revoked_at']}"
        elif expires and datetime.fromisoformat(expires) <= now:
            state = "expired"
        else:
            state = "active"
        click.echo(f"{view['id']}  {view['prefix']}  scope {view['scope']}  name {view['name'] or '-'}  "
                   f"owner {view['owner'] or '-'}  created {view['created_at']}  expires {expires or 'never'}  "
                   f"last used {view['last_used_at'] or 'never'}  {state}")


def _text(limit: int):
    """1 to ``limit`` characters Postgres can store (argv that is not UTF-8 arrives as lone surrogates)."""
    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            value.encode()
        except UnicodeEncodeError:
            raise click.BadParameter("not valid UTF-8") from None
        if not 1 <= len(value) <= limit:
            raise click.BadParameter(f"1 to {limit} characters")
        return value

    return check


@keys.command("create")
@click.argument("tenant")
@click.option("--name", default=None, callback=_text(100), help="What the key is for: a service, a team, a person.")
@click.option("--owner", default=None, callback=_text(200), help="Who holds it (an e-mail address, a team).")
@click.option("--expires-at", "expires_at", type=Moment(), default=None,
              help="From then on the key is refused (401), like a revoked one (ISO 8601; UTC if no zone).")
@click.option("--scope", type=click.Choice(SCOPES), default="tenant", show_default=True,
              help="What the key may read: tenant, everything of the tenant; own, only the requests, jobs and "
                   "files it made (and its own usage); submit, nothing (it only submits).")
def create(tenant: str, name: str | None, owner: str | None, expires_at: datetime | None, scope: str) -> None:
    """Create an API key for TENANT and print it. It is shown only this once."""
    if expires_at is not None and expires_at <= datetime.now(UTC):
        raise click.BadParameter("must be in the future", param_hint="--expires-at")
    with management_session() as (session, _):
        key = add_key(session, tenant_named(session, tenant), name=name, owner=owner, expires_at=expires_at,
                      scope=scope)
    click.echo(key)


@keys.command("revoke")
@click.argument("key_ref", metavar="KEY_ID_OR_PREFIX")
def revoke(key_ref: str) -> None:
    """Revoke a key, named by its id or its prefix (as `sluice keys list` shows them); its next call
    gets 401."""
    with management_session() as (session, settings):
        key, revoked = revoke_key(session, key_ref)
        view = key_view(key)
    forget_keys(settings)
    if revoked:
        click.echo(f"revoked {view['prefix']} ({view['id']})")
    else:
        click.echo(f"{view['prefix']} ({view['id']}) was already revoked at {view['revoked_at']}")
