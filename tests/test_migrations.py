"""The Alembic chain and the SQLAlchemy models describe the same schema, both ways."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from conftest import ROOT
from sqlalchemy import create_engine

from core.settings import Settings
from launcher.harness import with_database
from models import Base


@pytest.fixture
def scratch_db(admin_db_url):
    name = f"sluice_migrations_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_db_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield Settings(database_url=with_database(admin_db_url, name)).sqlalchemy_url
    with psycopg.connect(admin_db_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def schema_diff(url: str) -> list:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()


def test_migrations_match_the_models_and_downgrade_cleanly(scratch_db):
    config = Config(str(ROOT / "alembic.ini"))
    config.set_main_option("sqlalchemy.url", scratch_db.replace("%", "%%"))
    config.attributes["configure_logging"] = False
    command.upgrade(config, "head")
    assert schema_diff(scratch_db) == []
    command.downgrade(config, "base")
    command.upgrade(config, "head")
    assert schema_diff(scratch_db) == []
