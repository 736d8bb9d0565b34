"""The client's patience as the deadline of a call to an OpenAI route (``chat.py``).

Such a call holds its connection until its request ends, and a client that leaves cancels it
(``web/waits.py``): this door has no 202 to come back to, so an answer ready after its client
gave up is computed for nobody. The request's deadline (what admission's promise judges, the
row keeps and the sweep expires by) is therefore how long its client waits:

* ``x-stainless-read-timeout``: the official OpenAI SDKs send their read timeout on every call
  (``"8.0"``, ``"600"``: seconds). A call that does not stream receives nothing before its
  answer, so that is its whole wait. A stream is different: its first chunk leaves at once and
  a ping fills every silence (``SLUICE_STREAM_IDLE_PING_S``), so the SDK never times it out; a
  read timeout bounds nothing there and is not taken as its patience.
* ``Prefer: wait=N`` (RFC 7240, ``web/prefer.py``), on any call. ``respond-async`` changes
  nothing here: this door cannot answer later.
* Both: the shorter (a tie is Prefer's). A malformed value is ignored, as a malformed Prefer is.

A stated patience less :func:`margin` is the deadline, so an answer in time is committed,
announced and sent while its client still waits. Patience shortens the deadline and never
lengthens it: the class's ceiling (:func:`ceiling`) is also the deadline of a call that states
none (source ``default``): SLUICE_OPENAI_DEFAULT_DEADLINE_S (unset: SLUICE_REALTIME_DEADLINE_S)
for realtime (SLUICE_PRIORITY_DEADLINE_S for ``service_tier: priority``), SLUICE_FLEX_DEADLINE_S for
``service_tier: flex``. So the SDK's default read
timeout (600 s) leaves a realtime call at the operator's realtime deadline, as the native door
does with a long ``Prefer: wait`` (``core/submit/plan.py with_patience``), and every deadline
stays within the native ``deadline_s`` bounds. Unlike the native door, a flex call's patience
counts too: there is no 202 to come back to on this door either.

The answer says what was taken (:meth:`Deadline.headers`), on success, on a refusal and on a
stream alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from werkzeug.datastructures import Headers

from core.settings import Settings
from web import prefer

READ_TIMEOUT_HEADER = "x-stainless-read-timeout"
DEADLINE_HEADER = "Sluice-Deadline-S"
SOURCE_HEADER = "Sluice-Deadline-Source"
PREFER, DEFAULT = "prefer", "default"  # the sources besides READ_TIMEOUT_HEADER
# Taken off a stated patience: the time an answer needs from its row's end to the client (commit,
# announcement, the waiting call's read, rendering, the network) and the clocks' skew. 10% of a
# short patience, at most 1 s: 8 s → 7.2 s, 600 s → 599 s, 2 s → 1.8 s.
MARGIN_S = 1.0
MARGIN_SHARE = 0.1
_MAX_CHARS = 32  # a read timeout is a short decimal; a longer value is no timeout


@dataclass(frozen=True)
class Deadline:
    """The deadline a call's request is given (seconds from its planning) and where it came
    from: ``x-stainless-read-timeout``, ``prefer`` or ``default``."""

    seconds: float
    source: str

    def applied(self, body: dict[str, Any]) -> dict[str, Any]:
        """The validated native submit ``body`` with this deadline."""
        return {**body, "deadline_s": self.seconds}

    def headers(self) -> dict[str, str]:
        return {DEADLINE_HEADER: f"{self.seconds:.3f}".rstrip("0").rstrip("."), SOURCE_HEADER: self.source}


def read_timeout(value: str | None) -> float | None:
    """Seconds of an ``x-stainless-read-timeout`` value, or None when it is none: not a finite
    number above 0 (``inf``: a client with no timeout states no patience)."""
    if value is None or len(value) > _MAX_CHARS or not value.isascii():
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def margin(patience_s: float) -> float:
    """What is taken off a stated patience: ``MARGIN_SHARE`` of it, at most ``MARGIN_S``."""
    return min(MARGIN_S, MARGIN_SHARE * patience_s)


def ceiling(settings: Settings, tier: str) -> float:
    """The deadline of a call of service ``tier`` that states no patience, and the longest one that
    does gets (``auto``: as default)."""
    if tier == "flex":
        return settings.flex_deadline_s
    if tier == "batch":
        return settings.batch_deadline_s
    if tier == "priority":
        return settings.priority_deadline_s
    return settings.openai_default_deadline_s or settings.realtime_deadline_s


def deadline(headers: Headers, tier: str, stream: bool, settings: Settings) -> Deadline:
    """The deadline of a call with these request ``headers`` whose request runs at service ``tier``."""
    stated: list[tuple[float, str]] = []
    wait_s = prefer.wait_seconds(headers.getlist("Prefer"))
    if wait_s:  # wait=0 states no patience, as on the native door
        stated.append((float(wait_s), PREFER))
    timeout_s = None if stream else read_timeout(headers.get(READ_TIMEOUT_HEADER))
    if timeout_s is not None:
        stated.append((timeout_s, READ_TIMEOUT_HEADER))
    most = ceiling(settings, tier)
    if not stated:
        return Deadline(most, DEFAULT)
    patience_s, source = min(stated, key=lambda pair: pair[0])
    seconds = patience_s - margin(patience_s)
    return Deadline(seconds, source) if seconds < most else Deadline(most, DEFAULT)
