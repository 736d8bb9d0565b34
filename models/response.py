"""Responses made through OpenAI's Responses API (``POST /v1/responses``).

A response *is* a request row (``models/request.py``): its ``responses`` row adds only what the
Response object names and a request does not. Its text (input and answer) stays in the request
row alone, which the retention sweep redacts.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import ForeignKey
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base


class StoredResponse(Base):
    __tablename__ = "responses"

    request_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"), primary_key=True)
    # The response it continues (previous_response_id); no foreign key, as a deleted response is
    # kept (deleted_at) and its request row outlives it anyway.
    previous_id: Mapped[uuid.UUID | None]
    # Where this call's own input begins among the request's messages (those before it are the
    # conversation it continues), and the message its instructions are, if it had any.
    turn_from: Mapped[int]
    instructions_at: Mapped[int | None]
    background: Mapped[bool] = mapped_column(default=False)
    # The body's fields the Response object repeats and the request row does not keep
    # (max_output_tokens, store): no text.
    fields: Mapped[dict[str, Any]] = mapped_column(JSONB, default=dict)
    # DELETE /v1/responses/<id>: it reads as gone from then on.
    deleted_at: Mapped[datetime | None]
