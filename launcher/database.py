"""Schema migration and API keys, for commands that run before any server is up."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from models import Database, Tenant
from sluice.tenants import add_key

ROOT = Path(__file__).resolve().parent.parent


def upgrade_database(url: str) -> None:
    """Migrate the database at ``url`` to the latest Alembic revision."""
    from alembic import command
    from alembic.config import Config

    config = Config(str(ROOT / "alembic.ini"))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["configure_logging"] = False
    command.upgrade(config, "head")


def create_key(url: str, tenant_name: str) -> str:
    """A new API key for ``tenant_name`` (created if missing); the key is returned only here."""
    db = Database()
    db.configure(url, pool_size=1, max_overflow=0)
    try:
        with db.session() as session:
            tenant = session.scalar(select(Tenant).where(Tenant.name == tenant_name))
            if tenant is None:
                tenant = Tenant(name=tenant_name)
                session.add(tenant)
                session.flush()
            return add_key(session, tenant)
    finally:
        db.dispose()
