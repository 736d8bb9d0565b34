"""An embeddings request's vectors as they are stored (``requests.embedding``: float32
little-endian, one vector per input, end to end) and as the answers show them."""

from __future__ import annotations

import base64
import struct
from typing import Any

from models import InferenceRequest


def vectors(blob: bytes, count: int) -> list[bytes]:
    """``blob`` cut into its ``count`` vectors."""
    size = len(blob) // max(1, count)
    return [blob[i * size:(i + 1) * size] for i in range(count)]


def shown(vector: bytes, encoding: str) -> list[float] | str:
    """A vector as ``encoding`` asks: a list of floats, or (``base64``) its float32 bytes in
    base64, as OpenAI's SDKs decode it."""
    if encoding == "base64":
        return base64.b64encode(vector).decode()
    return list(struct.unpack(f"<{len(vector) // 4}f", vector))


def row_vectors(row: InferenceRequest, encoding: str | None = None) -> list[list[float] | str] | None:
    """A finished embeddings row's vectors in input order, or None for any other row (or one whose
    vectors the retention sweep deleted)."""
    if row.embedding is None or "texts" not in (row.input or {}):
        return None
    encoding = encoding or row.params.get("encoding_format", "float")
    return [shown(v, encoding) for v in vectors(row.embedding, len(row.input["texts"]))]


def dimensions(row: InferenceRequest) -> int | None:
    if row.embedding is None or "texts" not in (row.input or {}):
        return None
    return len(row.embedding) // 4 // max(1, len(row.input["texts"]))


def view(row: Any, encoding: str | None = None) -> dict[str, Any]:
    """The native view's ``output`` of an embeddings row."""
    return {"text": "", "finish_reason": row.finish_reason, "embeddings": row_vectors(row, encoding),
            "dimensions": dimensions(row)}
