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

Each spool takes the web host's disk (up to ``SLUICE_JOB_MAX_BYTES``), so a tenant may have only
its ``max_concurrent_uploads`` (``SLUICE_FILE_QUOTAS``) spooling in one web process at once
(``upload_slot``; job and file uploads alike): one more is refused with 429 ``too_many_uploads``
before a byte of it is read. The count is the process's own, kept in memory under a lock (a
gevent lock once gunicorn's gevent worker has patched ``threading``): it guards this host's disk,
which no other process's count would say anything about.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import IO, Any

from flask import current_app, request
from werkzeug.exceptions import ClientDisconnected, RequestEntityTooLarge

from core.errors import ApiError, TooManyUploads
from core.observe import submit_metrics as metrics
from core.openai.file_quotas import tenant_file_quotas
from core.settings import Settings

# Bodies up to this size stay in memory; larger ones go to a temporary file.
SPOOL_MEMORY_BYTES = 1 << 20
CHUNK_BYTES = 1 << 16
# How often the watchdog looks at the upload's progress.
WATCH_S = 0.5
# Retry-After of too_many_uploads: a spool ends when its upload is stored or cut off, which this
# process cannot foresee; a few seconds, so a client polling for a free slot stays cheap.
SLOT_RETRY_S = 5


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


class SpoolSlots:
    """Upload bodies this web process is spooling, per tenant."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[uuid.UUID, int] = {}

    def take(self, tenant_id: uuid.UUID, limit: int) -> None:
        """One more of the tenant's, or 429 ``too_many_uploads`` when it has ``limit`` already."""
        with self._lock:
            held = self._held.get(tenant_id, 0)
            if held < limit:
                self._held[tenant_id] = held + 1
                return
        metrics.REJECTIONS.labels(gate="files", reason="max_concurrent_uploads").inc()
        raise TooManyUploads(
            f"Too many uploads at once: {held} of yours are being received by this server, your limit of {limit} "
            f"at a time; retry after one ends (Retry-After {SLOT_RETRY_S} s).",
            headers={"Retry-After": str(SLOT_RETRY_S)},
            details={"quota": "max_concurrent_uploads", "used": held, "limit": limit, "retry_after_s": SLOT_RETRY_S})

    def give(self, tenant_id: uuid.UUID) -> None:
        with self._lock:
            left = self._held[tenant_id] - 1
            if left:
                self._held[tenant_id] = left
            else:
                del self._held[tenant_id]  # idle tenants cost nothing


@contextlib.contextmanager
def upload_slot(settings: Settings, tenant: Any) -> Iterator[None]:
    """Hold one of the tenant's concurrent-upload slots in this process while the block runs:
    around the spool and what reads it, since the spool's disk is held until the block ends."""
    slots: SpoolSlots = current_app.extensions.setdefault("sluice.spool_slots", SpoolSlots())
    slots.take(tenant.id, tenant_file_quotas(settings, tenant).max_concurrent_uploads)
    try:
        yield
    finally:
        slots.give(tenant.id)


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
