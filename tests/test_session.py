"""The pool's liveness check (models/session.py): a connection idle past PING_AFTER_IDLE_S is
pinged at checkout and replaced when its server side is gone; one used a moment ago is not."""

from __future__ import annotations

import time

from sqlalchemy import text

import models.session as session_module
from core.settings import Settings
from models.session import Database


def _backend_pid(db: Database) -> int:
    with db.session() as session:
        return session.scalar(text("SELECT pg_backend_pid()"))


def _terminate(url: str, pid: int) -> None:
    killer = Database()
    killer.configure(url, pool_size=1, max_overflow=0)
    try:
        with killer.session() as session:
            assert session.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    finally:
        killer.dispose()


def _count_pings(db: Database) -> list[int]:
    pings = []
    dialect = db.engine.dialect
    real = dialect.do_ping

    def counted(dbapi_connection):
        pings.append(1)
        return real(dbapi_connection)

    dialect.do_ping = counted
    return pings


def test_an_idle_connection_whose_backend_died_is_replaced_at_checkout(database_url, monkeypatch):
    monkeypatch.setattr(session_module, "PING_AFTER_IDLE_S", 0.2)
    url = Settings(database_url=database_url).sqlalchemy_url
    db = Database()
    db.configure(url, pool_size=1, max_overflow=0)
    try:
        first = _backend_pid(db)
        _terminate(url, first)
        time.sleep(0.3)  # idle past the window: the next checkout pings, finds it dead, reconnects
        second = _backend_pid(db)
        assert second != first
    finally:
        db.dispose()


def test_a_connection_used_a_moment_ago_is_not_pinged_and_an_idle_one_is(database_url, monkeypatch):
    monkeypatch.setattr(session_module, "PING_AFTER_IDLE_S", 60.0)  # "a moment" however slow this machine
    db = Database()
    db.configure(Settings(database_url=database_url).sqlalchemy_url, pool_size=1, max_overflow=0)
    try:
        pings = _count_pings(db)
        first = _backend_pid(db)  # a new connection: nothing to check
        for _ in range(5):
            assert _backend_pid(db) == first
        assert pings == []
        monkeypatch.setattr(session_module, "PING_AFTER_IDLE_S", 0.05)
        time.sleep(0.1)
        assert _backend_pid(db) == first
        assert pings == [1]
    finally:
        db.dispose()
