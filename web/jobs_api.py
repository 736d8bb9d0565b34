"""The bulk jobs API: thin handlers over ``core/jobs/service.py``.

    POST /v1/jobs?model=&summary_tokens=&instruction=&priority=&completion_window=&on_invalid=&metadata=
         body: the JSONL file itself (Content-Type: application/jsonl), streamed
    GET  /v1/jobs                    the tenant's jobs, newest first (?limit=, ?before=<job id>); a key
                                     scoped own sees its own, one scoped submit none of these reads
    GET  /v1/jobs/<id>               status, counts per item status, tokens, rate, ETA
    GET  /v1/jobs/<id>/results       JSONL of finished items in input order (partial while it runs)
    GET  /v1/jobs/<id>/errors        JSONL of invalid lines and failed items
    POST /v1/jobs/<id>/cancel        stop feeding, cancel what runs, keep what finished
"""

from __future__ import annotations

from flask import Blueprint, Response, jsonify, request, stream_with_context

from core.jobs.intake import JSONL_TYPES
from web.auth import authenticate, authenticate_caller
from web.bodies import list_page, page_limit
from web.errors import ApiError
from web.services import services
from web.uploads import spooled_body, upload_slot

bp = Blueprint("jobs", __name__, url_prefix="/v1")


@bp.post("/jobs")
def submit_job() -> tuple[Response, int, dict[str, str]]:
    svc = services()
    tenant = authenticate(svc.db, svc.recent_keys)
    limit = svc.settings.job_max_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(f"The file is {request.content_length} bytes", limit)
    if request.mimetype not in JSONL_TYPES:
        raise ApiError(f"Send the file itself as the body with Content-Type: application/jsonl (one JSON object "
                       f"per line); got {request.mimetype or 'none'}.", code="unsupported_media_type", status=415)
    params = svc.jobs.params(request.args.to_dict(), tenant)
    svc.jobs.check_intake(tenant)  # refused before its body is read: rate-limited, too many jobs or items
    request.max_content_length = limit
    # The whole file first, then the database: a slow client holds no pooled connection (web/uploads.py);
    # one of the tenant's concurrent-upload slots held while it spools, as for /v1/files.
    with upload_slot(svc.settings, tenant), \
            spooled_body(svc.settings, limit, lambda: _too_large(f"The file is larger than {limit} bytes", limit)) \
            as body:
        job = svc.jobs.submit(tenant, params, body)
    return jsonify(job), 201, {"Location": f"/v1/jobs/{job['id']}"}


def _too_large(what: str, limit: int) -> ApiError:
    return ApiError(f"{what}; a job takes at most {limit} (SLUICE_JOB_MAX_BYTES). Split it into several jobs.",
                    code="file_too_large", status=413)


@bp.get("/jobs")
def list_jobs() -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys)
    limit = page_limit()
    return list_page(svc.jobs.list(caller, limit + 1, request.args.get("before")), limit)


@bp.get("/jobs/<job_id>")
def get_job(job_id: str) -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys)
    return jsonify(svc.jobs.get(caller, job_id))


@bp.get("/jobs/<job_id>/results")
def job_results(job_id: str) -> Response:
    return _jsonl(job_id, errors=False)


@bp.get("/jobs/<job_id>/errors")
def job_errors(job_id: str) -> Response:
    return _jsonl(job_id, errors=True)


@bp.post("/jobs/<job_id>/cancel")
def cancel_job(job_id: str) -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys)
    return jsonify(svc.jobs.cancel(caller, job_id))


def _jsonl(job_id: str, errors: bool) -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys)
    lines = svc.jobs.items(caller, job_id, errors)
    return Response(stream_with_context(lines), mimetype="application/jsonl")
