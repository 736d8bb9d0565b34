"""The ``Prefer`` request header (RFC 7240), for the one preference Sluice honours: ``wait``.

A preference the server does not understand, or cannot parse, is ignored (RFC 7240 §2): a
malformed header never turns a submit into an error. What was honoured is echoed in
``Preference-Applied``, with the wait actually used when it was clamped to the maximum.
"""

from __future__ import annotations

from collections.abc import Iterable

APPLIED_HEADER = "Preference-Applied"


def wait_seconds(headers: Iterable[str]) -> int | None:
    """The ``wait=N`` preference among all ``Prefer`` header values, or None.

    Preferences are comma-separated, names case-insensitive, values optionally quoted;
    parameters after ``;`` are ignored. The first well-formed ``wait`` wins."""
    for header in headers:
        for preference in header.split(","):
            name, _, value = preference.split(";", 1)[0].partition("=")
            if name.strip().lower() != "wait":
                continue
            value = value.strip().strip('"')
            if value.isascii() and value.isdigit():
                return int(value)
    return None


def applied(wait_s: int) -> dict[str, str]:
    return {APPLIED_HEADER: f"wait={wait_s}"}
