"""Files uploaded through the OpenAI Files API (``POST /v1/files``), and the OpenAI batches run from them.

Files live in Postgres, not on a web host's disk: several web hosts share one database, and a
batch may be created on another host than the one that took the upload. A file's content is
the upload cut into chunks of at most ``CHUNK_BYTES``, each compressed with zlib on its own, so
it is written and read back one chunk at a time and no process ever holds a whole file.

A batch *is* a bulk job (``models/job.py``): its ``batches`` row only adds what the OpenAI batch
object names and a job does not, the file it was made from and the endpoint its lines call.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import BigInteger, ForeignKey, Index, LargeBinary, String, Text, func
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base

CHUNK_BYTES = 1 << 20


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_id_created_at", "tenant_id", "created_at"),)
    __mapper_args__ = {"eager_defaults": True}

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    # The key that uploaded it: a key scoped ``own`` sees only its own files. NULL: uploaded before
    # keys were recorded on files (only the tenant's ``tenant`` keys see it) or its key was deleted.
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)  # as uploaded, before compression
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())


class FileChunk(Base):
    __tablename__ = "file_chunks"

    file_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(primary_key=True)  # 0, 1, …: the upload's order
    data: Mapped[bytes] = mapped_column(LargeBinary)  # zlib; already compressed, so Postgres stores it as is


class Batch(Base):
    __tablename__ = "batches"

    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    # The file it was made from; no foreign key: the file may be deleted (DELETE /v1/files/<id>) and
    # the batch, whose lines were read into its job when it was made, keeps naming it.
    input_file_id: Mapped[uuid.UUID] = mapped_column(index=True)
    endpoint: Mapped[str] = mapped_column(String(32))  # /v1/chat/completions or /v1/completions
