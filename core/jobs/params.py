"""A bulk job's parameters: the query string of a submit, read into :class:`JobParams`.

Every bad or unknown parameter is named at once (422 with details). The summary length is
checked against the model's context and the tenant's per-request limit: a document request
must fit the instruction and at least twice the summary, so each reduce round shrinks what it
summarises (:func:`chunk_budget`, which the feeder sizes its chunks with too).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from core import hooks
from core.errors import InvalidRequest
from core.settings import Settings
from core.submit.tokens import estimate_text_tokens
from core.tenants.tiers import effective_limits
from models import ServiceTier, Tenant
from models.request import storable

# A document request's prompt leaves this many tokens of room beyond the instruction and the
# summary: the separator between them, and the model's special tokens.
PROMPT_MARGIN_TOKENS = 16
PARAMS = ("model", "summary_tokens", "instruction", "priority", "service_tier", "completion_window", "on_invalid",
          "metadata", "webhook_url", "webhook_events")
_WINDOW = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class JobParams:
    model: str
    summary_tokens: int
    instruction: str
    priority: str
    completion_window_s: int
    on_invalid: str  # reject: any bad line refuses the file; skip: bad lines are listed, the rest run
    metadata: dict[str, str]
    webhook_url: str | None = None  # its events (webhook_events) are sent by the sweep: workers/webhooks.py
    webhook_events: tuple[str, ...] = ()
    # Its lines' service tier (docs/tiers.md): its class's plain tier unless it names one.
    service_tier: str = ServiceTier.BATCH.value
    # An OpenAI batch's (core/openai/batches.py): every line must be an OpenAI request to this url.
    endpoint: str | None = None


def chunk_budget(context_tokens: int, max_request_tokens: int, instruction_tokens: int, summary_tokens: int) -> int:
    """Input tokens one document request may carry: what the model's context and the tenant's
    per-request limit leave after the instruction, the summary and a margin."""
    return min(context_tokens, max_request_tokens) - instruction_tokens - summary_tokens - PROMPT_MARGIN_TOKENS


def parse_params(settings: Settings, args: dict[str, str], tenant: Tenant) -> JobParams:
    """The job's parameters from the query string; 422 naming every bad or unknown one."""
    problems: dict[str, list[str]] = {}
    for name in set(args) - set(PARAMS):
        problems[name] = [f"Unknown parameter; a job takes {', '.join(PARAMS)}."]
    model = settings.registry.get(args["model"]) if "model" in args else settings.registry.default
    if model is None:
        problems["model"] = [f"Unknown model {args['model']!r}; this platform serves: "
                             f"{', '.join(m.name for m in settings.registry.models)}."]
    summary = _integer(args, "summary_tokens", settings.job_summary_tokens, problems, 1, settings.max_output_tokens)
    instruction = args.get("instruction", settings.job_instruction)
    if not instruction.strip() or len(instruction) > 4000 or "\x00" in instruction:
        problems["instruction"] = ["Must be 1 to 4000 characters."]
    tier = args.get("service_tier")
    if tier is not None and tier not in set(ServiceTier):
        problems["service_tier"] = [f"Must be one of {', '.join(ServiceTier)}."]
        tier = None
    priority = args.get("priority", ServiceTier(tier).priority.value if tier else "batch")
    if priority not in ("batch", "realtime"):
        problems["priority"] = ["Must be batch or realtime."]
    elif tier is not None and ServiceTier(tier).priority != priority:
        problems["priority"] = [f"The {tier} service tier runs as {ServiceTier(tier).priority}; leave priority out "
                                "or make it agree."]
    window = _window(args.get("completion_window"), settings, problems)
    on_invalid = args.get("on_invalid", "reject")
    if on_invalid not in ("reject", "skip"):
        problems["on_invalid"] = ["Must be reject (any bad line refuses the file) or skip (bad lines are listed)."]
    metadata: dict[str, str] = {}
    if "metadata" in args:
        try:
            metadata = json.loads(args["metadata"])
        except ValueError:
            metadata = None  # type: ignore[assignment]
        # JSON may spell a NUL or a lone surrogate (\u0000, \ud800), which Postgres cannot store.
        if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                and storable(k) and storable(v) for k, v in metadata.items()):
            problems["metadata"] = ["Must be a JSON object of at most 16 string values (keys up to 64 characters, "
                                    "values up to 512), with no NUL character or unpaired surrogate."]
    if model is not None and not problems:
        limits = effective_limits(settings.tiers, settings.default_tier, tenant)
        room = chunk_budget(model.context_tokens, limits.max_request_tokens, estimate_text_tokens(instruction), 0)
        if "summary_tokens" not in args:  # the default, shortened to what this model's context allows
            summary = max(1, min(summary, room // 3))
        if room - summary < 2 * summary:  # each reduce round must shrink what it summarises
            holds = min(model.context_tokens, limits.max_request_tokens)
            problems["summary_tokens"] = [
                f"Too long for {model.name}: a request holds {holds} tokens, which must fit the instruction "
                "and at least twice the summary."]
    events = _events(args, problems)
    if problems:
        raise InvalidRequest("The job has invalid parameters; see details.", details=problems)
    if "webhook_url" in args:
        hooks.check_url(args["webhook_url"], settings.webhook_allow_list)
        hooks.require_secret(tenant)
    return JobParams(model.name, summary, instruction, priority, window, on_invalid, metadata,
                     args.get("webhook_url"), events, tier or ServiceTier.of(priority).value)


def _events(args: dict[str, str], problems: dict[str, list[str]]) -> tuple[str, ...]:
    """webhook_events: comma-separated, of started, progress, completed (default: completed)."""
    if "webhook_url" not in args:
        if "webhook_events" in args:
            problems["webhook_events"] = ["Events are sent to a webhook_url; give one."]
        return ()
    if len(args["webhook_url"]) > 2048:
        problems["webhook_url"] = ["At most 2048 characters."]
    events = tuple(dict.fromkeys(e.strip() for e in args.get("webhook_events", "completed").split(",")))
    if not events or not set(events) <= set(hooks.JOB_EVENTS):
        problems["webhook_events"] = [f"Comma-separated, of {', '.join(hooks.JOB_EVENTS)}."]
    return events


def _integer(args: dict[str, str], name: str, default: int, problems: dict[str, list[str]], low: int, high: int) -> int:
    if name not in args:
        return default
    try:
        value = int(args[name])
    except ValueError:
        problems[name] = ["Must be a whole number."]
        return default
    if not low <= value <= high:
        problems[name] = [f"Must be between {low} and {high}."]
    return value


def _window(raw: str | None, settings: Settings, problems: dict[str, list[str]]) -> int:
    if raw is None:
        return int(settings.job_window_s)
    match = _WINDOW.match(raw.strip().lower())
    seconds = float(match.group(1)) * _UNITS[match.group(2)] if match else 0
    if not match or not 60 <= seconds <= settings.job_max_window_s:
        problems["completion_window"] = [f"Must be a duration like 24h, 90m or 3600 (seconds), from 60 s to "
                                         f"{human(settings.job_max_window_s)}."]
        return int(settings.job_window_s)
    return int(seconds)


def human(seconds: float) -> str:
    """A duration as a message says it: 45 s, 90 min, 1.5 h, 2 d."""
    if seconds >= 86400 and seconds % 3600 == 0:
        return f"{seconds / 86400:g} d" if seconds % 86400 == 0 else f"{seconds / 3600:g} h"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 60 else f"{seconds:.0f} s"
