"""The SQLAlchemy engine and session factory, configured once per process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker


class Database:
    """Holds one engine per process. Unconfigured until ``configure`` is called."""

    def __init__(self) -> None:
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._pid: int | None = None

    def configure(self, url: str, **engine_kw) -> None:
        engine_kw.setdefault("pool_pre_ping", True)
        engine_kw.setdefault("pool_size", 10)
        engine_kw.setdefault("max_overflow", 20)
        engine_kw.setdefault("pool_timeout", 10)
        # Never put bound parameters (prompts, outputs) into exception messages and logs.
        engine_kw.setdefault("hide_parameters", True)
        # Bounded waits: a partitioned or stuck database must fail a web request or a worker
        # step in seconds, not hang it for the kernel's TCP timeouts.
        engine_kw.setdefault("connect_args", {
            "connect_timeout": 5,
            "options": "-c statement_timeout=15000 -c lock_timeout=5000",
            "tcp_user_timeout": 10000,
        })
        self.dispose()
        self._engine = create_engine(url, **engine_kw)
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

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
        self._engine = None
        self._sessions = None
