"""File quotas: what a tenant may keep in the Files API and how fast and wide it may upload.

A second setting beside ``SLUICE_TIERS`` (whose four numbers stay as they were), keyed by the
same tier names::

    SLUICE_FILE_QUOTAS="free=100MiB/100/10/2,standard=10GiB/10000/60/8,..."
                        name=stored_bytes/files/uploads_per_minute/concurrent_uploads

* ``max_stored_bytes``: the sum of the tenant's live uploaded files (``files.bytes``, as uploaded);
* ``max_files``: how many it keeps;
* ``uploads_per_minute``: ``POST /v1/files`` calls per minute;
* ``max_concurrent_uploads``: bodies (``/v1/files`` and ``/v1/jobs``) one web process spools for
  the tenant at once: each takes the web host's disk, up to ``SLUICE_JOB_MAX_BYTES``.

Bytes take a binary suffix (``KiB``, ``MiB``, ``GiB``, ``TiB``) or none. A tier the setting does not
name gets the default tier's quotas, or, if that is not named either, the shipped ``standard``
ones: a deployment with its own ``SLUICE_TIERS`` keeps starting. A tenant may override any one
(``sluice tenants update --max-stored-bytes …``), as it overrides its admission limits.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from core.tenants.tiers import TierError

QUOTA_FIELDS = ("max_stored_bytes", "max_files", "uploads_per_minute", "max_concurrent_uploads")
DEFAULT_FILE_QUOTAS = ("free=100MiB/100/10/2,standard=10GiB/10000/60/8,"
                       "enterprise=1TiB/1000000/600/32")
# The shipped standard tier's, for a tier the setting names neither itself nor its default.
FALLBACK_TIER = "standard"
_TIER_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_BYTES = re.compile(r"^(\d+)\s*(KiB|MiB|GiB|TiB)?$")
_UNITS = {None: 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
# The override columns are BIGINT (bytes) and INTEGER (the rest).
BIGINT_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class FileQuotas:
    max_stored_bytes: int
    max_files: int
    uploads_per_minute: int
    max_concurrent_uploads: int  # per web process: spooled bodies on one host's disk

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def most(name: str) -> int:
    """The largest value the override column of quota ``name`` holds."""
    return BIGINT_MAX if name == "max_stored_bytes" else INT32_MAX


def parse_file_quotas(spec: str) -> dict[str, FileQuotas]:
    """``name=bytes/files/per_minute/concurrent,...`` → {name: FileQuotas}; raises TierError."""
    quotas: dict[str, FileQuotas] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, values = entry.partition("=")
        name = name.strip()
        numbers = [n.strip() for n in values.split("/")]
        if not sep or not _TIER_NAME.match(name) or len(numbers) != len(QUOTA_FIELDS):
            raise TierError(f"entry {entry!r} is not name=stored_bytes/files/uploads_per_minute/concurrent_uploads "
                            "(name: a tier of SLUICE_TIERS)")
        match = _BYTES.match(numbers[0])
        if match is None or not all(n.isdigit() for n in numbers[1:]):
            raise TierError(f"tier {name!r}: quotas must be whole numbers (bytes may end in KiB, MiB, GiB or "
                            f"TiB), got {values!r}")
        quota = FileQuotas(int(match.group(1)) * _UNITS[match.group(2)], *(int(n) for n in numbers[1:]))
        for field, value in quota.as_dict().items():
            if not 0 < value <= most(field):
                raise TierError(f"tier {name!r}: {field} must be > 0 and ≤ {most(field)}, got {value}")
        if name in quotas:
            raise TierError(f"tier {name!r} is named twice")
        quotas[name] = quota
    if not quotas:
        raise TierError("no tiers named")
    return quotas


def effective_file_quotas(quotas: dict[str, FileQuotas], default_tier: str, tenant: Any) -> FileQuotas:
    """The tenant's tier's quotas with its own overrides applied.

    ``tenant`` is anything with ``tier`` and the four quota attributes (a Tenant row). A tier the
    setting does not name gets the default tier's quotas, then the shipped standard ones: a tier
    added to SLUICE_TIERS alone must not lock its tenants out of the Files API.
    """
    base = (quotas.get(tenant.tier or default_tier) or quotas.get(default_tier)
            or parse_file_quotas(DEFAULT_FILE_QUOTAS)[FALLBACK_TIER])
    overrides = {f: getattr(tenant, f) for f in QUOTA_FIELDS if getattr(tenant, f, None) is not None}
    return dataclasses.replace(base, **overrides)
