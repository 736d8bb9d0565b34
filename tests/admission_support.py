"""Helpers for the admission tests: apps on their own Redis database, tenant limits, rows."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import redis as redis_lib
from conftest import ApiClient, make_settings
from sqlalchemy import func, select

from core.tenants.manage import update_tenant
from models import ApiKey, IdempotencyKey, InferenceRequest, Tenant, hash_key
from web.services import services


@pytest.fixture(scope="session")
def admission_redis_url(redis_dbs) -> str:
    """One Redis database for every admission test (there are only 15), emptied after each."""
    return redis_dbs(keep=True)


@pytest.fixture
def isolated_app(database_url, admission_redis_url) -> Iterator[Callable[..., object]]:
    """Factory: an app with settings overrides, on a Redis database no worker consumes."""
    made = []

    def make(redis_url: str | None = None, **overrides):
        from web import create_app

        application = create_app(make_settings(database_url, redis_url or admission_redis_url, **overrides))
        made.append(application)
        return application

    yield make
    for application in made:
        services(application).db.dispose()
    flush = redis_lib.Redis.from_url(admission_redis_url)
    flush.flushdb()
    flush.close()


@pytest.fixture
def promising(isolated_app, new_client):
    """An app no worker consumes and its client, with the shipped 30 s realtime deadline and the
    promise keeping no margin, to keep the arithmetic plain (test_promise.py's
    test_the_promise_keeps_its_margin checks the shipped one)."""
    application = isolated_app(realtime_deadline_s=30.0, promise_factor=1.0)
    return application, new_client(application)


def tenant_id_of(app, client: ApiClient) -> uuid.UUID:
    with services(app).db.session() as session:
        return session.scalar(select(ApiKey.tenant_id).where(ApiKey.key_hash == hash_key(client.key)))


def set_limits(app, client: ApiClient, **changes) -> uuid.UUID:
    """Give the client's tenant a tier and/or limit overrides, as `sluice tenants update` does."""
    tenant_id = tenant_id_of(app, client)
    with services(app).db.session() as session:
        update_tenant(session, services(app).settings, session.get(Tenant, tenant_id), changes)
    return tenant_id


def rows_of(app, tenant_id: uuid.UUID) -> list[InferenceRequest]:
    with services(app).db.session() as session:
        return list(session.scalars(select(InferenceRequest).where(InferenceRequest.tenant_id == tenant_id)))


def idempotency_keys_of(app, tenant_id: uuid.UUID) -> int:
    with services(app).db.session() as session:
        return session.scalar(select(func.count()).select_from(IdempotencyKey).where(
            IdempotencyKey.tenant_id == tenant_id))


def ratelimit(response) -> dict[str, str]:
    return {k.lower(): v for k, v in response.headers.items() if k.lower().startswith("x-ratelimit-")}
