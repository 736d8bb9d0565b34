"""The SQLAlchemy engine and session factory, configured once per process."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

# A pooled connection is checked for life before use only when it sat idle this long. Under load
# connections come back to the pool and go out again within milliseconds, and a ping on every
# checkout (SQLAlchemy's pool_pre_ping) was a third of a poll's round trips; a connection that
# answered this recently is used as it is (HikariCP skips its check the same way, within 500 ms).
# A database that went away since then fails that one statement, and the pool's disconnect
# handling drops every connection older than the failure.
PING_AFTER_IDLE_S = 1.0


class Database:
    """Holds one engine per process. Unconfigured until ``configure`` is called."""

    def __init__(self) -> None:
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._pid: int | None = None

    def configure(self, url: str, **engine_kw) -> None:
        """``pool_pre_ping``: True pings on every checkout; False never; unset, only a connection
        idle for over :data:`PING_AFTER_IDLE_S` is pinged."""
        ping_when_idle = "pool_pre_ping" not in engine_kw
        engine_kw.setdefault("pool_size", 10)
        engine_kw.setdefault("max_overflow", 20)
        engine_kw.setdefault("pool_timeout", 10)
        # Never put bound parameters (prompts, outputs) into exception messages and logs.
        engine_kw.setdefault("hide_parameters", True)
        # Bounded waits: a partitioned or stuck database must fail a web request or a worker
        # step in seconds, not hang it for the kernel's TCP timeouts. A transaction left idle (its
        # process stuck, or waiting on anything but the database) is ended by the server after a
        # minute instead of holding its connection and locks: nothing in Sluice waits on a client
        # or an engine inside a transaction (uploads are spooled first: web/uploads.py).
        engine_kw.setdefault("connect_args", {
            "connect_timeout": 5,
            "options": "-c statement_timeout=15000 -c lock_timeout=5000 -c idle_in_transaction_session_timeout=60000",
            "tcp_user_timeout": 10000,
        })
        self.dispose()
        self._engine = create_engine(url, **engine_kw)
        if ping_when_idle:
            _ping_when_idle(self._engine)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._pid = os.getpid()

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("database not configured")
        if self._pid != os.getpid():
            # A forked child (gunicorn worker) must not share the parent's sockets.
            self._engine.dispose(close=False)
            self._pid = os.getpid()
        return self._engine

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on error."""
        self.engine  # noqa: B018 - re-arms the pool after a fork
        assert self._sessions is not None
        with self._sessions.begin() as session:
            yield session

    @contextmanager
    def joined(self, session: Session | None) -> Iterator[Session]:
        """``session`` when the caller has one (its transaction goes on), else :meth:`session`."""
        if session is not None:
            yield session
            return
        with self.session() as own:
            yield own

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
        self._engine = None
        self._sessions = None


def _ping_when_idle(engine: Engine) -> None:
    """Ping a pooled connection at checkout when it was idle past :data:`PING_AFTER_IDLE_S`; a
    failed ping makes the pool replace it (it retries with a fresh connection)."""

    @event.listens_for(engine, "checkin")
    def _checked_in(dbapi_connection, record) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection, record, proxy) -> None:
        idle_since = record.info.get("idle_since")  # None: connected just now (info dies with it)
        if idle_since is None or time.monotonic() - idle_since < PING_AFTER_IDLE_S:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise DisconnectionError("pooled connection failed its ping") from exc
