"""Reading a job file: a streamed JSONL upload, line by line, into ``job_items`` with one COPY.

Nothing here holds the file: lines are parsed as they arrive and written to Postgres through
``COPY … FROM STDIN``, so a web process's memory does not grow with the upload (a line is
bounded by ``SLUICE_JOB_MAX_LINE_BYTES``). Two line formats are accepted, line by line:

* Sluice's own: ``{"custom_id": "...", "text": "..."}``, a document to summarise;
* the OpenAI Batch input format: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions"
  or "/v1/completions", "body": {...}}``, a request to run as it is.

A line that fails validation becomes an ``invalid`` item carrying its reason, so the caller can
either refuse the whole file (the default) or admit the valid lines with an error list.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from psycopg.types.json import Jsonb

from core.errors import OpenAIBodyError
from core.openai.shapes import URLS, to_native_for
from core.submit.plan import request_input_of
from core.submit.tokens import estimate_input_tokens, estimate_text_tokens
from models.job import ItemStatus
from models.request import storable

READ_CHUNK = 1 << 20
MAX_CUSTOM_ID_CHARS = 512
# Details a refusal lists; the count says how many more there were.
MAX_REPORTED = 100
COPY_COLUMNS = ("job_id", "line", "custom_id", "status", "text", "body", "estimated_tokens", "chunks", "depth",
                "final", "requests", "request_count", "input_tokens", "output_tokens", "error_code",
                "error_message")
COPY_TYPES = ("uuid", "int4", "text", "varchar", "text", "jsonb", "int4", "int4", "int4", "bool", "uuid[]",
              "int4", "int4", "int4", "varchar", "varchar")


class TooLarge(Exception):
    """The upload passed the file size limit while it was read."""


class LineError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Tally:
    """What reading the file found: counts, the first errors, the token estimate."""

    lines: int = 0
    valid: int = 0
    invalid: int = 0
    bytes: int = 0
    input_tokens: int = 0  # the documents' estimate, bytes ÷ 4
    timings: dict[str, float] = field(default_factory=dict)  # how long the intake's statements took
    errors: list[dict[str, Any]] = field(default_factory=list)

    def error(self, line: int, custom_id: str | None, code: str, message: str) -> None:
        self.invalid += 1
        if len(self.errors) < MAX_REPORTED:
            self.errors.append({"line": line, "custom_id": custom_id, "code": code, "message": message})


def lines(stream: IO[bytes], max_bytes: int, max_line_bytes: int, tally: Tally) -> Iterator[tuple[int, bytes | None]]:
    """(line number, raw line) for every non-blank line; ``None`` for a line over ``max_line_bytes``
    (skipped through without keeping it). Raises TooLarge past ``max_bytes``."""
    number, carry, skipping = 0, b"", False
    while True:
        chunk = stream.read(READ_CHUNK)
        if not chunk:
            break
        tally.bytes += len(chunk)
        if tally.bytes > max_bytes:
            raise TooLarge
        parts = (carry + chunk).split(b"\n")
        carry = parts.pop()
        for part in parts:
            number += 1
            if skipping:
                skipping = False
                yield number, None
            elif part.strip():
                yield number, part if len(part) <= max_line_bytes else None
        if len(carry) > max_line_bytes:
            carry, skipping = b"", True
    if skipping:
        yield number + 1, None
    elif carry.strip():
        yield number + 1, carry


def parse(raw: bytes, served: set[str]) -> tuple[str, str | None, dict[str, Any] | None, int]:
    """(custom_id, document text, OpenAI body, estimated input tokens) of one line; LineError if bad."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        raise LineError("malformed_json", "The line is not valid JSON.") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_line", "The line must be a JSON object.")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS or not storable(custom_id):
        raise LineError("invalid_custom_id", f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters "
                        "(no NUL).")
    if "body" in obj or "method" in obj or "url" in obj:
        body, tokens = _openai_line(obj, served)
        return custom_id, None, body, tokens
    unknown = set(obj) - {"custom_id", "text"}
    if unknown:
        raise LineError("unknown_fields", f"Unknown fields {_names(unknown)}: a document line has "
                        "custom_id and text (or use the OpenAI Batch format: custom_id, method, url, body).")
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        raise LineError("invalid_text", "text must be a non-empty string.")
    if not storable(text):
        raise LineError("invalid_text", "text must not contain NUL (\\u0000) or unpaired surrogates.")
    return custom_id, text, None, estimate_text_tokens(text)


def _openai_line(obj: dict[str, Any], served: set[str]) -> tuple[dict[str, Any], int]:
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise LineError("unknown_fields", f"Unknown fields {_names(unknown)} in an OpenAI Batch line.")
    if obj.get("method") != "POST":
        raise LineError("invalid_method", "method must be POST.")
    url = obj.get("url")
    if url not in URLS:
        raise LineError("invalid_url", f"url must be one of {', '.join(URLS)}.")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", "body must be a JSON object.")
    try:  # the front's own check (core/openai/shapes.py), as a batch line
        _, native = to_native_for(url, body, batch=True)
    except OpenAIBodyError as exc:
        message = exc.problems("body.")
        raise LineError("unsupported_fields" if set(exc.details) <= exc.unsupported else "invalid_body",
                        message if len(message) <= 500 else message[:499] + "…") from None  # its column: 500
    if "model" in body and body["model"] not in served:
        raise LineError("unknown_model", f"Unknown model {_names([body['model']])}; this platform serves: "
                        f"{', '.join(sorted(served))}.")
    return {**body, "url": url}, estimate_input_tokens(request_input_of(native))


def _names(values) -> str:
    """Names from the line itself, for a message Postgres stores: JSON-escaped (no NUL, no lone
    surrogate reaches the column) and cut short."""
    shown = ", ".join(json.dumps(v)[:60] for v in sorted(values, key=str)[:5])
    return shown + (", …" if len(values) > 5 else "")


def item_tokens(input_tokens: int, overhead: int, output: int, budget: int) -> int:
    """Tokens an item will cost (inputs + outputs of every request), map-reduce included, given the
    per-request input ``budget``: a document over it is summarised in chunks, whose summaries are
    summarised again until they fit."""
    total, tokens = 0, input_tokens
    while tokens > budget:
        chunks = math.ceil(tokens / budget)
        total += tokens + chunks * (overhead + output)
        tokens = chunks * output
    return total + tokens + overhead + output


def copy_row(job_id, line: int, custom_id: str | None, status: ItemStatus, text: str | None,
             body: dict[str, Any] | None, tokens: int, code: str | None = None, message: str | None = None) -> tuple:
    return (job_id, line, custom_id, status.value, text, None if body is None else Jsonb(body), tokens, 0, 0,
            False, [], 0, 0, 0, code, message)
