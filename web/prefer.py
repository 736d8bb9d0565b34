"""The ``Prefer`` request header (RFC 7240), for the preferences Sluice honours: ``wait`` (and, with
it, ``respond-async``: a client that comes back for the answer).

A preference the server does not understand, or cannot parse, is ignored (RFC 7240 §2): a
malformed header never turns a submit into an error. What was honoured is echoed in
``Preference-Applied``, with the wait actually used when it was clamped to the maximum.
"""

from __future__ import annotations

from collections.abc import Iterable

APPLIED_HEADER = "Preference-Applied"
# A wait longer than this (over 31 years) reads as this: the server clamps it to its own maximum
# anyway, and a number of thousands of digits is past what int() parses (and past float()'s range
# well before that), which once turned an accepted submit into a 500.
WAIT_CEILING_S = 10**9


def wait_seconds(headers: Iterable[str]) -> int | None:
    """The ``wait=N`` preference among all ``Prefer`` header values, or None.

    Preferences are comma-separated, names case-insensitive, values optionally quoted;
    parameters after ``;`` are ignored. The first well-formed ``wait`` (ASCII digits) wins; one
    over :data:`WAIT_CEILING_S` reads as that ceiling."""
    for header in headers:
        for preference in header.split(","):
            name, _, value = preference.split(";", 1)[0].partition("=")
            if name.strip().lower() != "wait":
                continue
            value = value.strip().strip('"')
            if value.isascii() and value.isdigit():
                digits = value.lstrip("0")
                return int(digits or "0") if len(digits) < len(str(WAIT_CEILING_S)) else WAIT_CEILING_S
    return None


def respond_async(headers: Iterable[str]) -> bool:
    """Whether the ``respond-async`` preference is among the ``Prefer`` header values: the client
    takes a 202 and comes back for the answer, so its ``wait`` is no measure of its patience."""
    return any(preference.split(";", 1)[0].strip().lower() == "respond-async"
               for header in headers for preference in header.split(","))


def patience_seconds(headers: Iterable[str]) -> int | None:
    """How long the client will wait for the answer and no longer: its ``wait``, unless it also
    said ``respond-async``."""
    headers = list(headers)
    return None if respond_async(headers) else wait_seconds(headers)


def applied(wait_s: int) -> dict[str, str]:
    return {APPLIED_HEADER: f"wait={wait_s}"}
