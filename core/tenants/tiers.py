"""Tenant tiers and the admission limits they grant.

A tier is a named set of four limits, configured in one setting::

    SLUICE_TIERS="free=40000/20/4/4096,standard=2000000/1200/512/8192,..."
                  name=tokens_per_minute/requests_per_minute/max_concurrent/max_request_tokens

A tenant has a tier (or none: the platform's default tier) and may override any single limit.
Tokens are what admission prices: estimated input tokens plus the reserved ``max_tokens``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

LIMIT_FIELDS = ("tokens_per_minute", "requests_per_minute", "max_concurrent", "max_request_tokens")
_TIER_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


class TierError(ValueError):
    pass


@dataclass(frozen=True)
class Limits:
    tokens_per_minute: int
    requests_per_minute: int
    max_concurrent: int  # requests admitted and not yet finished (queued or running)
    max_request_tokens: int  # input + max_tokens of one request

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def parse_tiers(spec: str) -> dict[str, Limits]:
    """``name=tpm/rpm/concurrent/max_request,...`` → {name: Limits}; raises TierError."""
    tiers: dict[str, Limits] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, values = entry.partition("=")
        name = name.strip()
        numbers = values.split("/")
        if not sep or not _TIER_NAME.match(name) or len(numbers) != len(LIMIT_FIELDS):
            raise TierError(f"tier {entry!r} is not name=tokens_per_minute/requests_per_minute/"
                            "max_concurrent/max_request_tokens (name: lower-case letters, digits, - or _)")
        try:
            limits = Limits(*(int(n) for n in numbers))
        except ValueError:
            raise TierError(f"tier {name!r}: limits must be whole numbers, got {values!r}") from None
        if min(limits.as_dict().values()) <= 0:
            raise TierError(f"tier {name!r}: every limit must be > 0")
        if name in tiers or name == "default":
            raise TierError(f"tier {name!r} is defined twice" if name in tiers else
                            "'default' is reserved (it means: the default tier)")
        tiers[name] = limits
    if not tiers:
        raise TierError("no tiers defined")
    return tiers


def effective_limits(tiers: dict[str, Limits], default_tier: str, tenant: Any) -> Limits:
    """The tenant's tier limits with its own overrides applied.

    ``tenant`` is anything with ``tier`` and the four limit attributes (a Tenant row). A tier
    that is no longer configured falls back to the default tier rather than locking the tenant out.
    """
    base = tiers.get(tenant.tier or default_tier) or tiers[default_tier]
    overrides = {f: getattr(tenant, f) for f in LIMIT_FIELDS if getattr(tenant, f) is not None}
    return dataclasses.replace(base, **overrides)
