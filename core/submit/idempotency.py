"""Idempotent submits: the ``Idempotency-Key`` header.

Within ``SLUICE_IDEMPOTENCY_WINDOW_S`` of the first use, a tenant's key answers every later
submit with the request the first one created:

* same key, same body → that request again: 202, the same id, ``Idempotent-Replayed: true``, no
  new row, no new work, no admission charge;
* same key, another body → 422 ``idempotency_key_reused``.

Keys live in Postgres (``models/idempotency.py``), inserted in the same transaction as the request
row. Of two concurrent submits with one key exactly one commits; the other's insert finds the
key taken (the primary key makes it wait for the first to commit), its transaction (its row
included) rolls back, and it answers with the winner's request. Postgres rather than Redis, so
the guarantee holds on the local floor too.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from core.errors import ApiError, InvalidRequest
from models import IdempotencyKey, InferenceRequest
from models.session import Database

HEADER = "Idempotency-Key"
_VALID = re.compile(r"^[\x21-\x7e]{1,255}$")  # printable ASCII without spaces, like Stripe's keys


class KeyTaken(Exception):
    """A concurrent submit with the same key committed first."""


@dataclass(frozen=True)
class Key:
    tenant_id: uuid.UUID
    value: str
    body_sha256: str
    window_s: float

    def claim(self, session: Session, request_id: uuid.UUID) -> None:
        """Record the key for ``request_id`` inside the transaction that inserts the request.

        One statement: insert, or take over the key if its window has passed. If another
        transaction holds the key, Postgres waits for it; once it has committed, the key is live
        and nothing is written here, so this submit raises KeyTaken and rolls back.
        """
        t = IdempotencyKey
        statement = insert(t).values(tenant_id=self.tenant_id, key=self.value, request_id=request_id,
                                     body_sha256=self.body_sha256)
        statement = statement.on_conflict_do_update(
            index_elements=[t.tenant_id, t.key],
            set_={"request_id": request_id, "body_sha256": self.body_sha256, "created_at": func.now()},
            where=t.created_at <= func.now() - timedelta(seconds=self.window_s),
        ).returning(t.key)
        if session.execute(statement).first() is None:
            raise KeyTaken()


def key_from(header: str | None, tenant_id: uuid.UUID, body: Any, window_s: float) -> Key | None:
    if header is None:
        return None
    if not _VALID.match(header):
        raise InvalidRequest("The Idempotency-Key header is malformed; see details.", details={
            HEADER: ["Use 1-255 printable ASCII characters without spaces, e.g. a UUID."]})
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return Key(tenant_id, header, hashlib.sha256(canonical.encode()).hexdigest(), window_s)


def find(db: Database, key: Key) -> InferenceRequest | None:
    """The request this key created within its window, or None; 422 if the body differs."""
    t = IdempotencyKey
    with db.session() as session:
        hit = session.execute(
            select(t.body_sha256, InferenceRequest).join(InferenceRequest, InferenceRequest.id == t.request_id)
            .where(t.tenant_id == key.tenant_id, t.key == key.value,
                   t.created_at > func.now() - timedelta(seconds=key.window_s))).first()
    if hit is None:
        return None
    if hit.body_sha256 != key.body_sha256:
        raise ApiError("This Idempotency-Key was already used with a different body. Send a new key for "
                       "a new request, or the same body to get the original request back.",
                       code="idempotency_key_reused", status=422)
    return hit.InferenceRequest
