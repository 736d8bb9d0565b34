"""API key authentication: `Authorization: Bearer <key>` → the key's tenant.

Every call that reads or changes anything authenticates against Postgres (``authenticate``): an
unknown or revoked key gets 401, a key of a disabled tenant 403. One path may use what this
process saw a moment ago instead: refusing a submit (``web/api.py``), above all with the 503 the
global gate would answer anyway (``RequestService.refuse_early``). ``RecentKeys`` remembers, for
``SLUICE_AUTH_CACHE_S``, the tenants of keys that authenticated here; such a refusal then costs no
database round trip, which matters when a spike makes refusals the commonest answer.

Revoking a key or disabling a tenant bumps a counter in Redis once it commits
(``core.rediskeys.AUTH_EPOCH_KEY``). A remembered key carries the value this process knew before
the lookup that found it, and a refusal from memory first reads the counter (one GET): if it
moved, Postgres is asked again (``RecentKeys.confirm``), so a revoked key gets its 401 at once.
Only if that bump failed (Redis away while revoking) may it get refusals for the rest of the
window. It never gets a request accepted: accepting always asks Postgres.
"""

from __future__ import annotations

from flask import request
from sqlalchemy.orm import Session

from core.errors import Forbidden, Unauthorized
from core.tenants.recent_keys import RecentKeys
from core.tenants.scopes import Caller
from models import Tenant, tenant_for_key
from models.session import Database

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="sluice"'}


def bearer_key() -> str:
    """The request's API key, or 401 when the header is missing or malformed."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if not header:
        raise Unauthorized("Missing API key: send `Authorization: Bearer <key>`.",
                           code="missing_api_key", headers=_CHALLENGE)
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("Malformed Authorization header: use `Authorization: Bearer <key>`.",
                           headers=_CHALLENGE)
    return key.strip()


def authenticate(db: Database, recent: RecentKeys | None = None, session: Session | None = None) -> Tenant:
    """The tenant of the request's API key (loaded once: admission reads its limits), 401 for an
    unknown or revoked key, 403 when its tenant is disabled.

    Always asks Postgres; ``recent``, when given, learns the answer. ``session``: look the key up
    in the caller's transaction, which then reads what it needs in the same one (a poll: one pool
    checkout, one liveness ping and one commit instead of two of each).
    """
    key = bearer_key()
    # Read before the lookup: a revocation that commits after the lookup bumps the epoch past it.
    epoch = recent.epoch if recent is not None else None
    with db.joined(session) as lookup:
        tenant = tenant_for_key(lookup, key)
        if tenant is not None and session is not None:
            # Out of the caller's transaction: a 404 or 403 later in it rolls it back, which would
            # expire the tenant that ``recent`` remembers and fail the key's next submit.
            lookup.expunge(tenant)
    if tenant is None:
        raise Unauthorized("Invalid or revoked API key.", headers=_CHALLENGE)
    if tenant.disabled_at is not None:
        raise Forbidden("This API key's tenant is disabled; the platform's operator can enable it again.",
                        code="tenant_disabled")
    if recent is not None:
        recent.remember(key, tenant, epoch)
    return tenant


def authenticate_caller(db: Database, recent: RecentKeys | None = None, session: Session | None = None) -> Caller:
    """:func:`authenticate`, as the key that called: what the routes that read hand the core
    services, which apply the key's scope (``core/tenants/scopes.py``)."""
    return Caller.of(authenticate(db, recent, session))
