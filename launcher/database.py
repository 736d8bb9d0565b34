"""Databases, schema migration and API keys, for commands that run before any server is up."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, pool, select, text

from core.tenants.manage import add_key
from models import Database, Tenant

ROOT = Path(__file__).resolve().parent.parent
# The key of the Postgres advisory lock (one per database) every migrating process takes: the
# bytes of "sluice:m" as a 64-bit integer, unlikely to be a key another program picked.
MIGRATION_LOCK = 0x736C756963653A6D


def create_database(admin_url: str, name: str, *, if_missing: bool = False) -> None:
    """Create database ``name`` on ``admin_url``'s server (psycopg's URL form); with ``if_missing``,
    only when it does not exist yet. The name is quoted as an identifier, never pasted into SQL."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as conn:
        if if_missing and conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            return
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(admin_url: str, name: str) -> None:
    """Drop database ``name`` if it exists, disconnecting whoever is still connected (WITH (FORCE))."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def upgrade_database(url: str) -> None:
    """Migrate the database at ``url`` to the latest Alembic revision.

    Safe when several processes start at once (each Procfile entry migrates before it starts;
    see `sluice migrate --then`): they queue on a Postgres advisory lock, so one runs Alembic
    while the others wait, then find the schema at head and change nothing. Two Alembic runs
    side by side on a fresh database would both try to create its tables, and one would fail.
    The lock is held by its own connection and dies with it, so a migrator that is killed never
    leaves it taken.
    """
    from alembic import command
    from alembic.config import Config

    config = Config(str(ROOT / "alembic.ini"))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.attributes["configure_logging"] = False
    engine = create_engine(url, poolclass=pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as lock:
            lock.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK})
            try:
                command.upgrade(config, "head")
            finally:
                lock.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK})
    finally:
        engine.dispose()


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
