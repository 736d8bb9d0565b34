"""OpenAI's Files and Batches routes, for OpenAI's SDKs: thin handlers over ``core/openai/files.py``
and ``core/openai/batches.py``. Errors here take OpenAI's shape (``web/openai/errors.py``, registered
on this blueprint by ``web/openai/__init__.py``).

    POST /v1/files                   multipart: file, purpose=batch; spooled, then streamed into Postgres,
                                     within the tenant's file quotas (SLUICE_FILE_QUOTAS)
    GET  /v1/files/<id>              the file object (an upload, or a batch's output or error file)
    GET  /v1/files/<id>/content      its content, streamed
    POST /v1/batches                 {input_file_id, endpoint, completion_window: 24h, metadata}
    GET  /v1/batches                 the tenant's batches, newest first (?limit=, ?after=<batch id>)
    GET  /v1/batches/<id>            the batch object
    POST /v1/batches/<id>/cancel     cancel its job: what finished stays in its output file
"""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request, stream_with_context

from core.errors import InvalidRequest
from core.openai.batches import BatchService
from core.openai.file_quotas import FileQuotaGate
from core.openai.files import FileStore, file_view, parse_id, too_large
from web.auth import authenticate, authenticate_caller
from web.bodies import list_page, page_limit
from web.errors import ApiError
from web.services import services
from web.uploads import spooled_body, upload_slot

bp = Blueprint("openai_batches", __name__, url_prefix="/v1")
# The multipart envelope around the file: boundaries, part headers, the purpose field.
FORM_OVERHEAD_BYTES = 64 * 1024


def _files() -> FileStore:
    svc = services()
    return FileStore(svc.db, svc.settings.job_max_bytes)


def _batches() -> BatchService:
    return BatchService(services().db, services().jobs, _files())


@bp.post("/files")
def upload_file() -> tuple[Response, int]:
    svc = services()
    tenant = authenticate(svc.db, svc.recent_keys)
    limit = svc.settings.job_max_bytes
    if request.content_length is not None and request.content_length > limit + FORM_OVERHEAD_BYTES:
        raise too_large(limit)
    boundary = request.mimetype_params.get("boundary")
    if request.mimetype != "multipart/form-data" or not boundary:
        raise ApiError("Send the file as multipart/form-data with the parts file and purpose=batch.",
                       code="unsupported_media_type", status=415)
    request.max_content_length = limit + FORM_OVERHEAD_BYTES
    # Quotas before the body: a slot of this process's spools, the uploads per minute, and room in
    # the tenant's stored files for what the Content-Length says (core/openai/file_quotas.py).
    with upload_slot(svc.settings, tenant):
        quota = FileQuotaGate(svc.settings, svc.db, svc.redis).admit(
            tenant, max(0, (request.content_length or 0) - FORM_OVERHEAD_BYTES))
        # The whole form first, then the database: a slow client holds no pooled connection (web/uploads.py).
        with spooled_body(svc.settings, limit + FORM_OVERHEAD_BYTES, lambda: too_large(limit)) as body:
            file = _files().upload(tenant, body, boundary.encode(), quota)
    return jsonify(file_view(file)), 200


@bp.get("/files")
def list_files() -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys)
    limit = page_limit(default=100, most=10_000)
    order = request.args.get("order", "desc")
    purpose = request.args.get("purpose")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc.", details={"order": ["asc or desc."]})
    if purpose not in (None, "batch"):
        raise InvalidRequest("Only uploaded files (purpose batch) are listed; a batch's output and error files "
                             "are named on the batch (output_file_id, error_file_id).",
                             details={"purpose": ["batch."]})
    files = _files().list(caller, limit + 1, request.args.get("after"), order == "asc", purpose)
    return list_page(files, limit, file_view, openai=True)


@bp.delete("/files/<file_id>")
def delete_file(file_id: str) -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys).reads("files")
    kind, uid = parse_id(file_id)
    if kind is not None:
        raise ApiError("A batch's output and error files are read from its lines: they cannot be deleted on "
                       "their own.", code="file_not_deletable", status=400)
    return jsonify(_files().delete(caller, uid, file_id))


@bp.get("/files/<file_id>")
def get_file(file_id: str) -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys).reads("files")
    kind, uid = parse_id(file_id)
    if kind is None:
        return jsonify(file_view(_files().get(caller, uid, file_id)))
    return jsonify(_batches().output_file(caller, uid, errors=kind == "err"))


@bp.get("/files/<file_id>/content")
def file_content(file_id: str) -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys).reads("files")
    kind, uid = parse_id(file_id)
    if kind is None:
        chunks = _files().chunks(_files().get(caller, uid, file_id).id)
    else:
        chunks = _batches().output(caller, uid, errors=kind == "err")
    return Response(stream_with_context(chunks), mimetype="application/jsonl")


@bp.post("/batches")
def create_batch() -> Response:
    svc = services()
    tenant = authenticate(svc.db, svc.recent_keys)
    return jsonify(_batches().create(tenant, request.get_json(silent=True)))


@bp.get("/batches")
def list_batches() -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys)
    limit = page_limit()
    return list_page(_batches().list(caller, limit + 1, request.args.get("after")), limit, openai=True)


@bp.get("/batches/<batch_id>")
def get_batch(batch_id: str) -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys)
    return jsonify(_batches().get(caller, batch_id))


@bp.post("/batches/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys)
    return jsonify(_batches().cancel(caller, batch_id))
