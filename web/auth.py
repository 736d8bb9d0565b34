"""API key authentication: `Authorization: Bearer <key>` → the key's tenant."""

from __future__ import annotations

from flask import request

from models import Tenant, tenant_for_key
from models.session import Database

from .errors import Unauthorized

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="sluice"'}


def authenticate(db: Database) -> Tenant:
    """The tenant of the request's API key (loaded once: admission reads its limits), or 401."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if not header:
        raise Unauthorized("Missing API key: send `Authorization: Bearer <key>`.",
                           code="missing_api_key", headers=_CHALLENGE)
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("Malformed Authorization header: use `Authorization: Bearer <key>`.",
                           headers=_CHALLENGE)
    with db.session() as session:
        tenant = tenant_for_key(session, key.strip())
    if tenant is None:
        raise Unauthorized("Invalid or revoked API key.", headers=_CHALLENGE)
    return tenant
