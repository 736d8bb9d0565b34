"""OpenAI Files for batches: a multipart upload streamed into Postgres, read back chunk by chunk.

``POST /v1/files`` is read with Werkzeug's incremental multipart decoder, not ``request.files``:
the file part goes into ``file_chunks`` one compressed chunk at a time, inside one transaction,
so a 2 GiB upload neither sits in the web process's memory nor on its disk, and a refused one
(another purpose, too large, a dropped connection) leaves no row. The upload is stored as it
came; its lines are checked when a batch is made from it (``core/openai/batches.py``).

Ids are ``file-<uuid hex>``; a batch's results are virtual files, ``file-out-<job hex>`` and
``file-err-<job hex>``, written on each read from the job's items.
"""

from __future__ import annotations

import io
import re
import uuid
import zlib
from collections.abc import Iterator
from typing import IO, Any

from sqlalchemy import delete, func, insert, select, tuple_
from werkzeug.sansio.multipart import Data, Epilogue, Field, MultipartDecoder, NeedData
from werkzeug.sansio.multipart import File as FilePart

from core.errors import ApiError, InvalidRequest, NotFound
from core.ids import uuid_or_404
from core.openai.file_quotas import UploadQuota
from core.tenants.scopes import Caller
from models import File, FileChunk, Tenant
from models.file import CHUNK_BYTES
from models.request import storable
from models.session import Database

# A form field (purpose, expires_after) is a few bytes; more is not a field we read.
MAX_FIELD_BYTES = 4096
_ID = re.compile(r"^file-(?:(out|err)-)?([0-9a-f]{32})$")


def parse_id(file_id: str) -> tuple[str | None, uuid.UUID]:
    """(``out``, ``err`` or None for an upload, uuid) of a file id; 404 for anything else."""
    match = _ID.match(file_id)
    kind, hex_id = match.groups() if match else (None, "")  # "" is no UUID: the same 404
    return kind, uuid_or_404(hex_id, "file", hint="file ids look like file-<32 hex digits>", code="file_not_found")


def file_view(file: File) -> dict[str, Any]:
    return {"id": f"file-{file.id.hex}", "object": "file", "bytes": file.bytes, "created_at": unix(file.created_at),
            "filename": file.filename, "purpose": file.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def unix(value) -> int | None:
    return int(value.timestamp()) if value is not None else None


class FileStore:
    def __init__(self, db: Database, max_bytes: int) -> None:
        self.db = db
        self.max_bytes = max_bytes  # SLUICE_JOB_MAX_BYTES: a file is worth storing only if a job takes it

    def upload(self, tenant: Tenant, stream: IO[bytes], boundary: bytes, quota: UploadQuota | None = None) -> File:
        """Store the ``file`` part of a multipart form whose ``purpose`` is ``batch``, as it streams in;
        ``quota``: the tenant's stored bytes and file count, checked as it grows and, exactly, before
        it commits (``core/openai/file_quotas.py``)."""
        # No memory limit in the decoder: it would cap a file sent as a plain field; fields are capped below.
        decoder = MultipartDecoder(boundary, max_parts=16)
        file = File(id=uuid.uuid4(), tenant_id=tenant.id, api_key_id=tenant.via_key, purpose="", filename="", bytes=0)
        fields: dict[str, bytes] = {}
        part: Field | FilePart | None = None
        file_part: Field | FilePart | None = None  # the first part named file; a second one is ignored
        pending, seq = bytearray(), 0
        with self.db.session() as session:
            session.add(file)
            session.flush()
            while True:
                data = stream.read(CHUNK_BYTES)
                decoder.receive_data(data or None)
                event = _next(decoder)
                while not isinstance(event, NeedData | Epilogue):
                    if isinstance(event, Field | FilePart) and event.name == "file" and file_part is None:
                        if "purpose" in fields:  # sent first, as OpenAI's SDKs do: refuse before reading the file
                            _purpose(fields["purpose"], True)
                        part = file_part = event
                        file.filename = _filename(getattr(event, "filename", None))
                    elif isinstance(event, Field | FilePart):
                        part = event
                        fields.setdefault(event.name, b"")
                    elif isinstance(event, Data) and part is not None and part is file_part:
                        file.bytes += len(event.data)
                        if file.bytes > self.max_bytes:
                            raise too_large(self.max_bytes)
                        if quota is not None:
                            quota.grow(session, file.id, file.bytes)
                        pending += event.data
                        while len(pending) >= CHUNK_BYTES:
                            self._write(session, file.id, seq, pending[:CHUNK_BYTES])
                            del pending[:CHUNK_BYTES]
                            seq += 1
                    elif isinstance(event, Data) and part is not None and len(fields[part.name]) < MAX_FIELD_BYTES:
                        fields[part.name] += event.data
                    event = _next(decoder)
                if not data or isinstance(event, Epilogue):
                    break
            if pending:
                self._write(session, file.id, seq, pending)
            file.purpose = _purpose(fields.get("purpose"), file_part is not None)
            if quota is not None:
                quota.settle(session, file.id, file.bytes)
        return file

    @staticmethod
    def _write(session, file_id: uuid.UUID, seq: int, data: bytes | bytearray) -> None:
        # Core insert, not session.add: the session must not keep every chunk until it commits.
        session.execute(insert(FileChunk).values(file_id=file_id, seq=seq, data=zlib.compress(bytes(data), 1)))

    def get(self, caller: Caller, file_id: uuid.UUID, shown: str, *, to_use: bool = False) -> File:
        """An uploaded file ``caller`` sees (a key scoped ``own``: one it uploaded), or 404;
        ``to_use``: one it may make a batch of without reading it (``Caller.uses``)."""
        visible = caller.uses(File.tenant_id, File.api_key_id) if to_use else \
            caller.sees(File.tenant_id, File.api_key_id, "files")
        with self.db.session() as session:
            file = session.scalar(select(File).where(File.id == file_id, visible))
        if file is None:
            raise caller.missing("file", shown, code="file_not_found")
        return file

    def list(self, caller: Caller, limit: int, after: str | None, ascending: bool,
             purpose: str | None) -> list[File]:
        """The uploaded files ``caller`` sees (a batch's output files are the batch's), newest first
        or (``ascending``) oldest first; ``after``: those past that file in the same order."""
        order = (File.created_at.asc(), File.id.asc()) if ascending else (File.created_at.desc(), File.id.desc())
        visible = caller.sees(File.tenant_id, File.api_key_id, "files")
        query = select(File).where(visible).order_by(*order).limit(limit)
        if purpose is not None:
            query = query.where(File.purpose == purpose)
        with self.db.session() as session:
            if after:
                kind, uid = parse_id(after)
                anchor = None if kind else session.scalar(select(File).where(File.id == uid, visible))
                if anchor is None:
                    raise NotFound(f"No file {after[:60]} for this API key.", code="file_not_found")
                past = tuple_(File.created_at, File.id)
                mark = tuple_(anchor.created_at, anchor.id)
                query = query.where(past > mark if ascending else past < mark)
            return list(session.scalars(query).all())

    def delete(self, caller: Caller, file_id: uuid.UUID, shown: str) -> dict[str, Any]:
        """Delete an uploaded file and its chunks. A batch made from it keeps its lines (read into
        the job when it was made) and the file's id; only the file's content goes. Its bytes and its
        place in the tenant's file quota are free once this commits: usage is read from ``files``."""
        visible = caller.sees(File.tenant_id, File.api_key_id, "files")  # a key scoped own: one it uploaded
        with self.db.session() as session:
            gone = session.execute(delete(File).where(File.id == file_id, visible).returning(File.id)).first()
        if gone is None:
            raise caller.missing("file", shown, code="file_not_found")
        return {"id": shown, "object": "file", "deleted": True}

    def chunks(self, file_id: uuid.UUID) -> Iterator[bytes]:
        """The file's content, one chunk per query: no session is held between chunks, so a slow
        reader (a client downloading, a batch being ingested) pins no pooled connection."""
        with self.db.session() as session:
            count = session.scalar(select(func.count()).where(FileChunk.file_id == file_id)) or 0
        for seq in range(count):
            with self.db.session() as session:
                data = session.scalar(select(FileChunk.data).where(FileChunk.file_id == file_id, FileChunk.seq == seq))
            if data is None:  # deleted while being read
                raise NotFound("The file was deleted while it was being read.", code="file_not_found")
            yield zlib.decompress(data)


class ChunkReader(io.RawIOBase):
    """A stored file as the binary stream ``core/jobs/ingest.py`` reads an upload from."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._left = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._left:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._left = memoryview(chunk)
        size = min(len(buffer), len(self._left))
        buffer[:size] = self._left[:size]
        self._left = self._left[size:]
        return size


def too_large(limit: int) -> ApiError:
    return ApiError(f"The file is larger than {limit} bytes, the most one batch takes (SLUICE_JOB_MAX_BYTES); "
                    "split it.", code="file_too_large", status=413)


def _purpose(raw: bytes | None, seen_file: bool) -> str:
    purpose = (raw or b"").decode("utf-8", "replace").strip()
    if not purpose:
        raise InvalidRequest("Missing purpose: send purpose=batch.", code="invalid_purpose",
                             details={"purpose": ["Required; must be batch."]})
    if purpose != "batch":
        raise InvalidRequest(f"Files with purpose {purpose[:40]!r} are not stored here: Sluice keeps files for "
                             "batches only (purpose=batch).", code="invalid_purpose",
                             details={"purpose": ["Must be batch."]})
    if not seen_file:
        raise InvalidRequest("Missing the file: send it as the multipart part named file.", code="missing_file",
                             details={"file": ["Required."]})
    return purpose


def _next(decoder: MultipartDecoder):
    try:
        return decoder.next_event()
    except ValueError:  # Werkzeug's word for a form it cannot parse
        raise InvalidRequest("The multipart form could not be read.", code="invalid_form") from None


def _filename(raw: str | None) -> str:
    name = (raw or "upload.jsonl")[:255]
    return name if storable(name) else "upload.jsonl"
