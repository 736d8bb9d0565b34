"""API key authentication: `Authorization: Bearer <key>` → the key's tenant."""

from __future__ import annotations

import uuid

from flask import g, request

from models import tenant_for_key
from models.session import Database

from .errors import Unauthorized

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="sluice"'}


def authenticate(db: Database) -> uuid.UUID:
    """Return the tenant id of the request's API key (the tenant itself on ``g.tenant``), or raise 401."""
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
    # The request's principal, loaded once: admission reads its limits from here.
    g.tenant = tenant
    return tenant.id
