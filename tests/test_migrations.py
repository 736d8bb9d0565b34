"""The Alembic chain and the SQLAlchemy models describe the same schema, both ways."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from conftest import ROOT
from sqlalchemy import create_engine

from core.settings import Settings
from launcher.harness import scratch_database
from models import Base


@pytest.fixture
def scratch_db(admin_db_url):
    with scratch_database(admin_db_url, "sluice_migrations") as url:
        yield Settings(database_url=url).sqlalchemy_url


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
