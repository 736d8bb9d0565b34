"""What a webhook may be, checked where one is asked for (a request, a job, a budget alert): its
URL passes the SSRF guard (``core/ssrf.py``), its tenant has a signing secret, its events are
known. Below submit, usage and jobs, which check them, and delivery (``core/delivery/webhooks.py``),
which sends them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core import ssrf
from core.errors import InvalidRequest

if TYPE_CHECKING:
    from models import Tenant

JOB_EVENTS = ("started", "progress", "completed")
DEFAULT_EVENTS = ("completed",)


def check_url(url: str, allow: ssrf.AllowList) -> None:
    """422 ``webhook_url_refused`` when the SSRF guard refuses ``url``; its message says why."""
    try:
        ssrf.check(url, allow)
    except ssrf.Refused as exc:
        raise InvalidRequest(f"webhook_url refused ({exc.reason}): {exc.message}", code="webhook_url_refused",
                             details={"webhook_url": [exc.message]}) from None


def require_secret(tenant: Tenant) -> None:
    """A webhook is signed with its tenant's secret, which the tenant must have been shown first."""
    if tenant.webhook_secret is None:
        raise InvalidRequest("This API key's tenant has no webhook signing secret yet: create it with POST "
                             "/v1/webhooks/secret/rotate (shown once), then submit again.",
                             code="webhook_secret_missing")
