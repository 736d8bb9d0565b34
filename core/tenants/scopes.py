"""What one API key may read of its tenant's: the one place a key's scope is decided.

A key is scoped ``tenant`` (everything of its tenant: every key made before scopes existed),
``own`` (it submits, and reads, lists and cancels only the requests, jobs, files and batches it
made, and its own usage) or ``submit`` (it submits; every read, list, cancel and usage call is
refused). The web tier turns the authenticated tenant into a :class:`Caller` and hands it to the
core services, which filter their queries with :meth:`Caller.sees` and word their 404s with
:meth:`Caller.missing`; nothing else compares scope strings.

An ``own`` key asking for another key's row gets the same 404 as for a row that does not exist:
whether another key made it is not this key's to learn. Rows made before their key was recorded
(``api_key_id`` NULL) are visible to ``tenant`` keys only.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import ColumnElement, and_

from core.errors import InvalidRequest, KeyScopeRefused, NotFound
from models import KeyScope, Tenant

SCOPES = tuple(s.value for s in KeyScope)

_ALLOWS = {
    KeyScope.TENANT: "it reads everything of its tenant",
    KeyScope.OWN: "it submits, and reads, lists and cancels only the requests, jobs and files it made",
    KeyScope.SUBMIT: "it submits requests, jobs, files and batches, but reads, lists and cancels nothing, "
                     "usage included",
}


def allows(scope: KeyScope) -> str:
    """What ``scope`` lets a key do, in words (messages, the CLI)."""
    return _ALLOWS[scope]


def parse_scope(raw: object) -> KeyScope:
    """A new key's scope as the admin API or the CLI gave it (None: ``tenant``); 422 ``invalid_scope``
    naming the field for anything else."""
    if raw is None:
        return KeyScope.TENANT
    if isinstance(raw, str) and raw in SCOPES:
        return KeyScope(raw)
    raise InvalidRequest(f"scope must be one of {', '.join(SCOPES)}: tenant reads everything of the tenant, own "
                         "only what the key made, submit nothing.", code="invalid_scope",
                         details={"scope": [f"One of {', '.join(SCOPES)}."]})


@dataclass(frozen=True)
class Caller:
    """A tenant as one of its keys reaches it. ``Caller(tenant_id)`` is the whole tenant: what the
    operator, the workers and the sweep act as."""

    tenant_id: uuid.UUID
    key_id: uuid.UUID | None = None
    scope: KeyScope = KeyScope.TENANT

    @classmethod
    def of(cls, tenant: Tenant) -> Caller:
        """The caller a tenant authenticated by ``tenant_for_key`` is (its key and that key's scope)."""
        return cls(tenant.id, tenant.via_key, KeyScope(tenant.via_scope))

    @property
    def own_only(self) -> bool:
        return self.scope is KeyScope.OWN

    @property
    def only_key(self) -> uuid.UUID | None:
        """The key whose rows alone this caller sees where rows are kept per key (usage rollups,
        budgets): its own for an ``own`` key; None (the whole tenant) for a ``tenant`` key."""
        return self.key_id if self.scope is KeyScope.OWN else None

    def reads(self, what: str) -> Caller:
        """Itself, when its scope lets it read ``what`` (plural: "requests"); else 403 ``key_scope``."""
        if self.scope is KeyScope.SUBMIT:
            raise KeyScopeRefused(f"This API key is scoped `submit`: {allows(self.scope)}. Reading {what} takes "
                                  "a key scoped `own` (what it made) or `tenant`.")
        return self

    def whole_tenant(self, what: str) -> Caller:
        """Itself, for what belongs to the tenant as a whole (its webhook secret and deliveries):
        a ``tenant`` key only; 403 ``key_scope`` for the others."""
        if self.scope is not KeyScope.TENANT:
            raise KeyScopeRefused(f"This API key is scoped `{self.scope.value}`: {allows(self.scope)}. The "
                                  f"{what} are the whole tenant's: they take a key scoped `tenant`.")
        return self

    def sees(self, tenant_column, key_column, what: str) -> ColumnElement[bool]:
        """The SQL condition a row (its tenant's and its creating key's columns) must meet for this
        caller to see it; 403 first for a key that reads nothing."""
        self.reads(what)
        if self.scope is KeyScope.OWN:
            return and_(tenant_column == self.tenant_id, key_column == self.key_id)
        return tenant_column == self.tenant_id

    def owns(self, tenant_id: uuid.UUID, key_id: uuid.UUID | None) -> bool:
        """Whether a row already read (its tenant, its creating key) is one this caller sees."""
        return tenant_id == self.tenant_id and (self.scope is not KeyScope.OWN or key_id == self.key_id)

    def uses(self, tenant_column, key_column) -> ColumnElement[bool]:
        """The SQL condition on a row this caller may build on without reading it back (a batch's
        input file): a ``tenant`` key any of its tenant's, an ``own`` or ``submit`` key only one it made."""
        if self.scope is KeyScope.TENANT:
            return tenant_column == self.tenant_id
        return and_(tenant_column == self.tenant_id, key_column == self.key_id)

    def missing(self, what: str, shown: str, code: str | None = None, plural: str | None = None) -> NotFound:
        """The 404 for ``what`` (singular: "request"; ``plural`` when not ``what`` + s) named
        ``shown`` that this caller cannot see."""
        if self.scope is not KeyScope.TENANT:
            verb = "sees" if self.scope is KeyScope.OWN else "uses"
            return NotFound(f"No such {what} for this key: a key scoped `{self.scope.value}` {verb} only the "
                            f"{plural or what + 's'} it made.", code=code)
        return NotFound(f"No {what} {shown} for this API key.", code=code)
