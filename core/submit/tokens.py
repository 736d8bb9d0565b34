"""Input token counts for pricing, size classes and admission.

With a model directory configured, tokens are counted with that model's own tokenizer
(`tokenizer.json`, loaded with the `tokenizers` library: no torch, no vLLM in the web tier).
Chat messages are rendered with the model's chat template first, as the engine will, so the
count matches what the engine sees.

Without a tokenizer the count is an estimate: about four bytes of UTF-8 per token holds for
English BPE vocabularies and over-counts for code and non-Latin scripts, which errs on the safe
side for admission; each chat message adds a few tokens of role and separator formatting.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from core.registry import ModelSpec

log = logging.getLogger(__name__)

BYTES_PER_TOKEN = 4
MESSAGE_OVERHEAD_TOKENS = 4


def estimate_text_tokens(text: str) -> int:
    return max(1, math.ceil(len(text.encode()) / BYTES_PER_TOKEN))


def message_text(message: dict[str, Any]) -> str:
    """What a message says, as a count without a template sees it: its content and the calls it made."""
    calls = message.get("tool_calls")
    return (message.get("content") or "") + (json.dumps(calls) if calls else "")


def estimate_input_tokens(request_input: dict[str, Any]) -> int:
    if "texts" in request_input:
        return sum(estimate_text_tokens(text) for text in request_input["texts"])
    if "messages" in request_input:
        return (sum(estimate_text_tokens(message_text(m)) + MESSAGE_OVERHEAD_TOKENS
                    for m in request_input["messages"])
                + (estimate_text_tokens(json.dumps(request_input["tools"])) if request_input.get("tools") else 0))
    return estimate_text_tokens(request_input["prompt"])


class ChatTemplateError(ValueError):
    """The served model's chat template cannot render the messages.

    ``message`` is one of two fixed sentences for the client: the template's author may write
    anything in a refusal, and a rendering bug's exception text describes our internals.
    """

    REFUSED = ("The model's chat template refuses this conversation: check that roles alternate "
               "user/assistant after an optional first system message, and that every role is one it supports.")
    UNRENDERABLE = "The model's chat template could not render these messages."

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _TemplateRefusal(Exception):
    """Raised by a template's own ``raise_exception(...)``."""


class TokenCounter:
    """Counts a request's input tokens for one model; exact when the model has a tokenizer."""

    def __init__(self, model_dir: str | None) -> None:
        self.tokenizer = None
        self.chat_template = None
        self._special: dict[str, str] = {}
        if not model_dir or not (Path(model_dir) / "tokenizer.json").exists():
            return
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        config_path = Path(model_dir) / "tokenizer_config.json"
        if config_path.exists():
            config = json.loads(config_path.read_text())
            template = config.get("chat_template")
            if isinstance(template, str):
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = _raise
                self.chat_template = env.from_string(template)
            self._special = {k: v for k in ("bos_token", "eos_token")
                             if isinstance(v := config.get(k), str)}

    @property
    def vocab_size(self) -> int | None:
        """Token ids this model has (None without its tokenizer)."""
        return None if self.tokenizer is None else self.tokenizer.get_vocab_size()

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count(self, request_input: dict[str, Any]) -> int:
        if self.tokenizer is None:
            return estimate_input_tokens(request_input)
        if "texts" in request_input:
            return sum(len(self.tokenizer.encode(text).ids) for text in request_input["texts"])
        if "prompt" in request_input:
            return len(self.tokenizer.encode(request_input["prompt"]).ids)
        if self.chat_template is None:
            return sum(len(self.tokenizer.encode(message_text(m), add_special_tokens=False).ids)
                       + MESSAGE_OVERHEAD_TOKENS for m in request_input["messages"])
        try:  # tools as the engine's chat template gets them (a template that ignores them counts none)
            text = self.chat_template.render(messages=request_input["messages"], add_generation_prompt=True,
                                             tools=request_input.get("tools"), **self._special)
        except _TemplateRefusal:  # the engine would fail on the same template: say so now
            raise ChatTemplateError(ChatTemplateError.REFUSED) from None
        except Exception as exc:
            log.warning("chat template failed to render: %s", type(exc).__name__)
            raise ChatTemplateError(ChatTemplateError.UNRENDERABLE) from None
        # The rendered template already holds its special tokens, as the engine tokenizes it.
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def split(self, text: str, max_tokens: int) -> list[str]:
        """``text`` cut into consecutive pieces of at most ``max_tokens`` tokens each, on token
        boundaries of this model's tokenizer (without one, on the estimate's byte budget, backing
        off to a space when one is near). Joined, the pieces are ``text`` again."""
        if self.tokenizer is None:
            return _split_estimated(text, max_tokens)
        offsets = self.tokenizer.encode(text, add_special_tokens=False).offsets
        if len(offsets) <= max_tokens:
            return [text]
        cuts = [offsets[i][0] for i in range(max_tokens, len(offsets), max_tokens)]
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _raise(message: str) -> None:
    raise _TemplateRefusal(message)


class TokenCounters:
    """One lazily loaded counter per registry model, shared by a web process's threads."""

    def __init__(self) -> None:
        self._counters: dict[str, TokenCounter] = {}
        self._lock = threading.Lock()

    def for_model(self, model: ModelSpec) -> TokenCounter:
        with self._lock:
            counter = self._counters.get(model.name)
            if counter is None:
                counter = self._counters[model.name] = TokenCounter(model.path)
                log.info("token counting for %s: %s", model.name, "tokenizer" if counter.exact else "estimate")
            return counter


def _split_estimated(text: str, max_tokens: int) -> list[str]:
    budget = max_tokens * BYTES_PER_TOKEN
    pieces: list[str] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + budget)
        while len(text[start:end].encode()) > budget:  # multi-byte characters: fewer of them fit
            end = start + max(1, (end - start) * budget // len(text[start:end].encode()))
        if end < len(text):
            space = text.rfind(" ", start + (end - start) * 9 // 10, end)
            end = space + 1 if space > start else end
        pieces.append(text[start:end])
        start = end
    return pieces
