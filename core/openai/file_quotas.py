"""The Files API's quotas, enforced: uploads per minute, stored bytes and file count per tenant.

A tenant's quotas are its tier's in ``SLUICE_FILE_QUOTAS`` with its own overrides
(``core/tenants/file_quotas.py``). They are checked as early as each can be, cheapest first:

* before the body is read (``FileQuotaGate.admit``): the upload is counted in Redis against
  ``uploads_per_minute`` (429 ``upload_rate_limited``, Retry-After to the end of the window), and
  one the stored files already leave no room for (the file count, or the bytes when the
  Content-Length says enough) is refused with 413 ``file_quota_exceeded``;
* while the file is stored (``UploadQuota.grow``): once it outgrows the room last read, its
  writing stops there rather than at its end;
* before it commits (``UploadQuota.settle``): exactly, under a per-tenant lock held to the
  commit, so two uploads of one tenant never both fit in room only one of them has.

Usage is read from the ``files`` table itself, never kept beside it: deleting a file frees its
bytes and its place at once, and nothing is left to reconcile when a process dies mid-upload
(a refused or broken upload rolls back with its row). The concurrent-upload cap is the web
process's (``web/uploads.py``): it guards that host's disk, which no other process shares.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from core.errors import FileQuotaExceeded, UploadRateLimited
from core.observe import submit_metrics as metrics
from core.rediskeys import count_in_window, uploads_key
from core.settings import Settings
from core.tenants.file_quotas import FileQuotas, effective_file_quotas
from models import File, Tenant
from models.session import Database

log = logging.getLogger(__name__)
# The uploads-per-minute window: it starts with the tenant's first upload in it.
WINDOW_S = 60


def tenant_file_quotas(settings: Settings, tenant: Any) -> FileQuotas:
    """The tenant's effective file quotas (its tier's, then its overrides)."""
    return effective_file_quotas(settings.file_quotas, settings.default_tier, tenant)


def usage(session: Session, tenant_id: uuid.UUID, besides: uuid.UUID | None = None) -> tuple[int, int]:
    """(bytes, files) the tenant's uploaded files hold, the file ``besides`` left out."""
    query = select(func.coalesce(func.sum(File.bytes), 0), func.count()).where(File.tenant_id == tenant_id)
    if besides is not None:
        query = query.where(File.id != besides)
    used, count = session.execute(query).one()
    return int(used), int(count)


@dataclass
class UploadQuota:
    """One upload's stored-bytes and file-count checks, from its first byte to its commit."""

    tenant_id: uuid.UUID
    quotas: FileQuotas
    room: int  # bytes the tenant's other files left when last read (unlocked: a hint, not a promise)

    def grow(self, session: Session, file_id: uuid.UUID, size: int) -> None:
        """The file has reached ``size`` bytes. Past the room last read, read again (files may have
        been deleted since) and refuse if it is still over: a file that cannot fit is not written
        to its end first."""
        if size <= self.room:
            return
        used, count = usage(session, self.tenant_id, file_id)
        self.room = self.quotas.max_stored_bytes - used
        self.refuse_if_over(used, count, size, whole=False)

    def settle(self, session: Session, file_id: uuid.UUID, size: int) -> None:
        """The file is whole (``size`` bytes) and about to commit: refuse it if it does not fit.

        A per-tenant lock is taken first and held until the commit (a transaction advisory lock,
        as job intake takes its own, ``core/jobs/intake.py``): a second upload of the tenant waits
        here until the first commits, and its sum, a statement begun after the lock was granted,
        sees the first's file (READ COMMITTED). Only the check and the commit are serialised, not
        the writing of the chunks before them."""
        session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"),
                        {"key": f"file-quota:{self.tenant_id}"})
        used, count = usage(session, self.tenant_id, file_id)
        self.refuse_if_over(used, count, size, whole=True)

    def refuse_if_over(self, used: int, count: int, size: int, whole: bool) -> None:
        """413 ``file_quota_exceeded`` when one more file of ``size`` bytes beside ``count`` files of
        ``used`` bytes passes the file count or the bytes. ``whole``: ``size`` is the file's
        size, not a part of it or a floor from its Content-Length."""
        q = self.quotas
        if count + 1 > q.max_files:
            metrics.REJECTIONS.labels(gate="files", reason="max_files").inc()
            raise FileQuotaExceeded(
                f"File quota reached: you keep {count} files, your quota of {q.max_files}. Delete one "
                "(DELETE /v1/files/<id>) before uploading another.",
                details={"quota": "max_files", "used": count, "limit": q.max_files, "upload": 1})
        if used + size > q.max_stored_bytes:
            metrics.REJECTIONS.labels(gate="files", reason="max_stored_bytes").inc()
            what = f"this upload's {size} bytes" if whole else f"this upload (at least {size} bytes)"
            raise FileQuotaExceeded(
                f"File quota exceeded: your {count} files hold {used} bytes; with {what} they would hold "
                f"{used + size}, over your quota of {q.max_stored_bytes} bytes ({max(0, q.max_stored_bytes - used)} "
                "left). Delete files (DELETE /v1/files/<id>) or upload a smaller one.",
                details={"quota": "max_stored_bytes", "used": used, "limit": q.max_stored_bytes, "upload": size,
                         "files": count})


class FileQuotaGate:
    """What a ``POST /v1/files`` call must pass before its body is read."""

    def __init__(self, settings: Settings, db: Database, redis_client: redis.Redis) -> None:
        self.settings = settings
        self.db = db
        self.redis = redis_client

    def admit(self, tenant: Tenant, at_least_bytes: int = 0) -> UploadQuota:
        """Count the upload against the tenant's uploads per minute, then refuse it if its files
        already leave no room for one more (or for ``at_least_bytes``, what its Content-Length
        says the file holds at the least); the returned quota checks the rest as it is stored."""
        quotas = tenant_file_quotas(self.settings, tenant)
        self._count(tenant.id, quotas.uploads_per_minute)
        with self.db.session() as session:
            used, count = usage(session, tenant.id)
        quota = UploadQuota(tenant.id, quotas, quotas.max_stored_bytes - used)
        quota.refuse_if_over(used, count, at_least_bytes, whole=False)
        return quota

    def _count(self, tenant_id: uuid.UUID, limit: int) -> None:
        """429 ``upload_rate_limited`` with Retry-After (to the end of its window) past ``limit``
        uploads in one. When Redis does not answer the upload goes through uncounted, as webhook
        actions do: the stored-bytes and count quotas, read from Postgres, still hold."""
        key = uploads_key(str(tenant_id))
        try:
            count, ttl = count_in_window(self.redis, key, WINDOW_S)
        except redis.RedisError as exc:
            log.warning("uploads per minute not counted for tenant %s: Redis %s", tenant_id, type(exc).__name__)
            return
        if count > limit:
            metrics.REJECTIONS.labels(gate="files", reason="uploads_per_minute").inc()
            retry_s = max(1, ttl)
            raise UploadRateLimited(
                f"Upload rate limit reached: {count - 1} upload calls this minute, your limit of {limit} per minute; "
                f"retry after {retry_s} s.", headers={"Retry-After": str(retry_s)},
                details={"quota": "uploads_per_minute", "used": count - 1, "limit": limit, "retry_after_s": retry_s})
