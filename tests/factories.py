"""Row factories: one place that knows every NOT NULL column of a request row."""

from __future__ import annotations

import uuid
from typing import Any

from models import InferenceRequest, Priority, SizeClass, Status


def request_row(tenant_id: uuid.UUID, **overrides: Any) -> InferenceRequest:
    """A small realtime request for the default simulated model, queued unless told otherwise."""
    values: dict[str, Any] = dict(
        tenant_id=tenant_id, status=Status.QUEUED, priority=Priority.REALTIME, size_class=SizeClass.SMALL,
        queue="realtime.small", model_requested="simulated-llama-8b", input={"prompt": "factory prompt"},
        params={}, meta={}, max_tokens=8, time_limit_s=30.0, reserved_tokens=10, input_tokens=2,
        cache_hit=False, attempts=0)
    values.update(overrides)
    return InferenceRequest(**values)
