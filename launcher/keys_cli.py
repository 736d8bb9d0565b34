"""``sluice keys list/create/revoke``: a tenant's API keys. Listings show a key's prefix, never
the key; a new key is printed once."""

from __future__ import annotations

import json

import click

from core.tenants.manage import add_key, key_view, list_keys, revoke_key
from launcher.tenants_cli import forget_keys, management_session, tenant_named


@click.group()
def keys() -> None:
    """Manage API keys."""


@keys.command("list")
@click.argument("tenant")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of one line per key.")
def list_(tenant: str, as_json: bool) -> None:
    """List TENANT's keys, revoked ones too: id, prefix, created, last used (to the minute)."""
    with management_session() as (session, _):
        views = list_keys(session, tenant_named(session, tenant))
    if as_json:
        click.echo(json.dumps(views, indent=2))
        return
    for view in views:
        state = f"revoked {view['revoked_at']}" if view["revoked_at"] else "active"
        click.echo(f"{view['id']}  {view['prefix']}  created {view['created_at']}  "
                   f"last used {view['last_used_at'] or 'never'}  {state}")


@keys.command("create")
@click.argument("tenant")
def create(tenant: str) -> None:
    """Create an API key for TENANT and print it. It is shown only this once."""
    with management_session() as (session, _):
        key = add_key(session, tenant_named(session, tenant))
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
