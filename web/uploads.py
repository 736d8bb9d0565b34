"""Upload bodies read to their end before anything shared is taken.

A job file or an OpenAI file can be hundreds of megabytes, and a client sends it as fast as it
likes. Read straight into Postgres (a COPY, or chunks inserted in one transaction), a client that
trickles its body holds a pooled connection for as long as it dawdles: 30 such sockets from one
tenant emptied the pool, and every other tenant's submits and ``/healthz`` got 503. So an upload
is first spooled (in memory up to ``SPOOL_MEMORY_BYTES``, then to a temporary file), and only the
complete body reaches the core, which reads it from local storage at disk speed.

Spooling alone would still let a trickling client hold a web worker's thread or greenlet and a
temporary file for ever, so the body must keep arriving: a client that sends nothing for
``SLUICE_UPLOAD_STALL_S``, or falls behind ``SLUICE_UPLOAD_MIN_BYTES_PER_S`` on average after
that grace, is cut off with 408 ``body_timeout`` (a watchdog shuts the socket's read side, so a
read blocked in the server returns). Under Flask's test client there is no socket and no watchdog.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO

from flask import request
from werkzeug.exceptions import ClientDisconnected, RequestEntityTooLarge

from core.errors import ApiError
from core.settings import Settings

# Bodies up to this size stay in memory; larger ones go to a temporary file.
SPOOL_MEMORY_BYTES = 1 << 20
CHUNK_BYTES = 1 << 16
# How often the watchdog looks at the upload's progress.
WATCH_S = 0.5


class BodyTimeout(ApiError):
    status, code = 408, "body_timeout"


class _Progress:
    """Bytes received and when, as the watchdog judges them (monotonic clock)."""

    def __init__(self, stall_s: float, min_rate: float) -> None:
        self.stall_s = stall_s
        self.min_rate = min_rate
        self.began = self.last = time.monotonic()
        self.received = 0
        self.cut = False

    def got(self, n: int) -> None:
        self.received += n
        self.last = time.monotonic()

    def overdue(self, now: float) -> bool:
        """Nothing for ``stall_s``, or slower on average than ``min_rate`` after that grace."""
        behind = self.min_rate > 0 and now > self.began + self.stall_s + self.received / self.min_rate
        return now - self.last > self.stall_s or behind


def spooled_body(settings: Settings, limit: int, too_large: Callable[[], ApiError]) -> IO[bytes]:
    """The request's whole body as a seekable file at position 0; ``too_large()`` is raised past
    ``limit`` bytes, :class:`BodyTimeout` when the client stalls or trickles (see the module)."""
    progress = _Progress(settings.upload_stall_s, settings.upload_min_bytes_per_s)
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)  # noqa: SIM115 - returned, or closed below
    done = threading.Event()
    sock = request.environ.get("gunicorn.socket")
    if sock is not None:
        threading.Thread(target=_watch, args=(sock, progress, done), name="upload-watchdog", daemon=True).start()
    try:
        while True:
            try:
                chunk = request.stream.read(CHUNK_BYTES)
            except RequestEntityTooLarge:  # a body without a length, past request.max_content_length
                raise too_large() from None
            except (ClientDisconnected, OSError):
                if progress.cut:
                    raise _timeout(progress) from None
                raise
            if progress.cut:  # the watchdog shut the socket: what was read is not the whole body
                raise _timeout(progress)
            if not chunk:
                break
            progress.got(len(chunk))
            if progress.received > limit:
                raise too_large()
            spool.write(chunk)
    except BaseException:
        spool.close()
        raise
    finally:
        done.set()
    spool.seek(0)
    return spool


def _watch(sock: socket.socket, progress: _Progress, done: threading.Event) -> None:
    while not done.wait(WATCH_S):
        if progress.overdue(time.monotonic()):
            progress.cut = True
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD)
            return


def _timeout(progress: _Progress) -> BodyTimeout:
    return BodyTimeout(
        f"The upload stopped arriving: {progress.received} bytes in {time.monotonic() - progress.began:.0f} s. "
        f"A body must keep coming (no pause over {progress.stall_s:g} s, at least {progress.min_rate:g} bytes/s "
        "on average after that); send it again.", headers={"Connection": "close"})
