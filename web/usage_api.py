"""Usage and budgets, as a tenant sees its own: thin handlers over ``core/usage/``.

    GET /v1/usage      buckets of usage and cost (?start=, ?end=, ?bucket=hour|day,
                       ?group_by=model,priority,key,source, ?format=csv or Accept: text/csv)
    GET /v1/budgets    the tenant's budgets and its keys': used, left, when each resets

A key scoped ``own`` sees its own usage and its own budgets; one scoped ``submit`` neither (403).

The operator's report across tenants is ``GET /v1/admin/usage`` (``web/admin.py``).
"""

from __future__ import annotations

import dataclasses

from flask import Blueprint, Response, jsonify, request

from core.usage.report import UsageQuery, as_csv, usage
from web.auth import authenticate_caller
from web.services import services

bp = Blueprint("usage", __name__, url_prefix="/v1")


def report_response(query: UsageQuery) -> Response:
    """The report as JSON, or as CSV when asked (``format=csv`` or ``Accept: text/csv``)."""
    report = usage(services().db, query)
    wants_csv = request.args.get("format") == "csv" or (
        request.accept_mimetypes.best_match(["application/json", "text/csv"]) == "text/csv")
    if wants_csv:
        return Response(as_csv(report), mimetype="text/csv",
                        headers={"Content-Disposition": 'attachment; filename="sluice-usage.csv"'})
    return jsonify(report)


@bp.get("/usage")
def get_usage() -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys).reads("usage")
    query = UsageQuery.parse(request.args, caller.tenant_id)
    return report_response(dataclasses.replace(query, api_key_id=caller.only_key))


@bp.get("/budgets")
def list_budgets() -> Response:
    svc = services()
    caller = authenticate_caller(svc.db, svc.recent_keys).reads("budgets")
    return jsonify({"object": "list", "data": svc.budgets.views(caller.tenant_id, svc.redis, caller.only_key)})
