"""Token estimates used for pricing and size classes before any tokenizer is involved.

About four bytes of UTF-8 per token holds for English BPE vocabularies and over-counts for
code and non-Latin scripts, which errs on the safe side for admission. Each chat message adds
a few tokens of role and separator formatting.
"""

from __future__ import annotations

import math
from typing import Any

BYTES_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4


def estimate_text_tokens(text: str) -> int:
    return max(1, math.ceil(len(text.encode()) / BYTES_PER_TOKEN))


def estimate_input_tokens(request_input: dict[str, Any]) -> int:
    if "messages" in request_input:
        return sum(estimate_text_tokens(m["content"]) + MESSAGE_OVERHEAD_TOKENS
                   for m in request_input["messages"])
    return estimate_text_tokens(request_input["prompt"])
