"""The model registry: which models the platform serves, where they live, who serves them.

Configured with ``SLUICE_MODELS`` (JSON list) or, when unset, one main model built from
``SLUICE_MODEL`` / ``SLUICE_MODEL_PATH`` / ``SLUICE_MAX_CONTEXT_TOKENS``. The first model
with role ``main`` is the default for requests that name none. A ``light`` model is the
cheaper step that degradation (a later issue) falls back to. A ``long`` model takes requests
that name no model and do not fit the default's context (admission routes them there and
records it on the row); without one, such requests get 413.

Each model has its own queues: the default model keeps the plain names (``realtime.small``),
others append their name (``realtime.small.<model>``), so a worker serves exactly one model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from core.usage.prices import TIERS, multiplier

ALL_ROLES = ("realtime", "batch", "large", "all")
# How `tool_choice: auto` can read tool calls out of a model's free text (core/submit/sampling.py):
# hermes = <tool_call>{"name": ..., "arguments": ...}</tool_call>, as Hermes, Qwen and others write them;
# llama3_json = the answer is {"name": ..., "parameters": ...} (Llama 3.1 and later); mistral =
# [TOOL_CALLS] then the calls (Mistral's templates).
TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
# A model with no tool_parser of its own gets the one its chat template's family writes calls in:
# the first of these marks found in the template (tokenizer_config.json's chat_template, or
# chat_template.jinja beside it) names it.
TEMPLATE_FAMILIES = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("[AVAILABLE_TOOLS]", "mistral"),
                     ("<|python_tag|>", "llama3_json"), ("<|start_header_id|>ipython", "llama3_json"))
# The simulated engine writes its calls as a hermes model does (workers/engines/simulated.py).
SIMULATED_TOOL_PARSER = "hermes"
# Model names end up in queue names (`realtime.small.<model>`, 64 characters at most).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,47}$")


class RegistryError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str | None = None
    role: str = "main"  # main | light | long | embed
    context_tokens: int = 8192
    worker_roles: tuple[str, ...] = ALL_ROLES
    # How `tool_choice: auto` reads tool calls out of this model's free text (TOOL_PARSERS);
    # None: auto is refused for it, required and named functions still work.
    tool_parser: str | None = None
    # An embedding model (role embed): the length of its vectors, and whether a request may ask for
    # fewer (`dimensions`: a Matryoshka model, whose leading dimensions are an embedding too).
    dimensions: int | None = None
    matryoshka: bool = False
    # USD per million tokens, {"input", "cached", "output"} (core/usage/prices.py); None: free,
    # unless SLUICE_PRICES names it.
    prices: dict[str, object] | None = None
    # Multiples of those prices per service tier, {"priority": 2.5, ...} (docs/tiers.md); a tier it
    # does not name pays SLUICE_SERVICE_TIER_PRICES'.
    service_tiers: dict[str, object] | None = None


@dataclass(frozen=True)
class Registry:
    models: tuple[ModelSpec, ...]

    @property
    def default(self) -> ModelSpec:
        return next(m for m in self.models if m.role == "main")

    @property
    def embed(self) -> ModelSpec | None:
        """The first embedding model: what an embeddings request naming no model runs on."""
        return next((m for m in self.models if m.role == "embed"), None)

    def get(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)

    @property
    def light(self) -> ModelSpec | None:
        """The first model with role ``light``: degradation's lighter step, if there is one."""
        return next((m for m in self.models if m.role == "light"), None)

    def long_models(self) -> list[ModelSpec]:
        """Models with role ``long``, smallest context first."""
        return sorted((m for m in self.models if m.role == "long"), key=lambda m: m.context_tokens)

    def queue_suffix(self, model: ModelSpec) -> str:
        return "" if model.name == self.default.name else f".{model.name}"


def parse_registry(models_json: str | None, *, name: str, path: str | None, context_tokens: int,
                   embed: ModelSpec | None = None, simulated: bool = False) -> Registry:
    """``embed``: the embedding model SLUICE_EMBED_MODEL names, served beside the main model when
    SLUICE_MODELS is unset (with it, list the embedding model there, role embed). ``simulated``:
    the simulated engine serves these models (its tool calls are written as hermes models write
    them); else a model that names no ``tool_parser`` gets its chat template family's."""
    if not models_json:
        main = ModelSpec(name=name, path=path, context_tokens=context_tokens,
                         tool_parser=SIMULATED_TOOL_PARSER if simulated else template_parser(path))
        if embed is not None:
            _check(embed, 1)
            if embed.name == name:
                raise RegistryError("SLUICE_EMBED_MODEL must differ from SLUICE_MODEL")
        return Registry((main,) if embed is None else (main, embed))
    try:
        raw = json.loads(models_json)
    except json.JSONDecodeError as exc:
        raise RegistryError(f"SLUICE_MODELS is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(raw, list) or not raw:
        raise RegistryError("SLUICE_MODELS must be a non-empty JSON list of models")
    models = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or "name" not in entry:
            raise RegistryError(f"SLUICE_MODELS[{i}] must be an object with at least a name")
        unknown = set(entry) - {"name", "path", "role", "context_tokens", "worker_roles", "tool_parser", "dimensions",
                                "matryoshka", "prices", "service_tiers"}
        if unknown:
            raise RegistryError(f"SLUICE_MODELS[{i}] has unknown keys: {', '.join(sorted(unknown))}")
        spec = ModelSpec(name=entry["name"], path=entry.get("path"), role=entry.get("role", "main"),
                         context_tokens=entry.get("context_tokens", context_tokens),
                         worker_roles=tuple(entry.get("worker_roles", ALL_ROLES)),
                         tool_parser=_parser_of(entry, simulated), dimensions=entry.get("dimensions"),
                         matryoshka=entry.get("matryoshka", False), prices=entry.get("prices"),
                         service_tiers=entry.get("service_tiers"))
        _check(spec, i)
        models.append(spec)
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise RegistryError("SLUICE_MODELS has duplicate model names")
    if not any(m.role == "main" for m in models):
        raise RegistryError("SLUICE_MODELS needs at least one model with role main")
    return Registry(tuple(models))


def _parser_of(entry: dict, simulated: bool) -> str | None:
    """A SLUICE_MODELS entry's tool parser: its own (null: none, so `auto` is refused), else the
    simulated engine's or its chat template family's; an embedding model has none."""
    if "tool_parser" in entry or entry.get("role") == "embed":
        return entry.get("tool_parser")
    return SIMULATED_TOOL_PARSER if simulated else template_parser(entry.get("path"))


def template_parser(path: str | None) -> str | None:
    """The tool parser of the chat template family of the model in ``path`` (TEMPLATE_FAMILIES);
    None when it has no template, or one of no family known here."""
    template = chat_template(path)
    return next((parser for mark, parser in TEMPLATE_FAMILIES if mark in template), None)


def chat_template(path: str | None) -> str:
    """The chat template of the model in ``path`` as its tokenizer files give it ('' if none):
    ``chat_template.jinja``, else tokenizer_config.json's ``chat_template`` (a string, or named
    templates, of which ``tool_use`` renders tools, else ``default``)."""
    if not path:
        return ""
    directory = Path(path)
    try:
        if (directory / "chat_template.jinja").is_file():
            return (directory / "chat_template.jinja").read_text()
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return ""
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("tool_use") or named.get("default")
    return template if isinstance(template, str) else ""


def _check(spec: ModelSpec, i: int) -> None:
    if not isinstance(spec.name, str) or not _NAME.match(spec.name):
        raise RegistryError(f"SLUICE_MODELS[{i}].name must be 1-48 letters, digits, '.', '_' or '-'")
    if spec.role not in ("main", "light", "long", "embed"):
        raise RegistryError(f"SLUICE_MODELS[{i}].role must be main, light, long or embed")
    if (spec.role == "embed") != (spec.dimensions is not None):
        raise RegistryError(f"SLUICE_MODELS[{i}]: an embed model, and only one, names its dimensions")
    if spec.dimensions is not None and (isinstance(spec.dimensions, bool) or not isinstance(spec.dimensions, int)
                                        or not 1 <= spec.dimensions <= 65536):
        raise RegistryError(f"SLUICE_MODELS[{i}].dimensions must be an integer from 1 to 65536")
    if not isinstance(spec.matryoshka, bool):
        raise RegistryError(f"SLUICE_MODELS[{i}].matryoshka must be true or false")
    if not isinstance(spec.context_tokens, int) or isinstance(spec.context_tokens, bool) or spec.context_tokens < 16:
        raise RegistryError(f"SLUICE_MODELS[{i}].context_tokens must be an integer ≥ 16")
    if spec.prices is not None and (not isinstance(spec.prices, dict)
                                    or set(spec.prices) != {"input", "cached", "output"}):
        raise RegistryError(f"SLUICE_MODELS[{i}].prices must be an object with input, cached and output "
                            "(USD per million tokens)")
    if spec.service_tiers is not None:
        if not isinstance(spec.service_tiers, dict) or not set(spec.service_tiers) <= set(TIERS):
            raise RegistryError(f"SLUICE_MODELS[{i}].service_tiers must be an object of multipliers for "
                                f"{', '.join(TIERS)}")
        for tier, value in spec.service_tiers.items():
            try:
                multiplier(value, f"SLUICE_MODELS[{i}].service_tiers.{tier}")
            except ValueError as exc:
                raise RegistryError(str(exc)) from None
    if spec.tool_parser is not None and spec.tool_parser not in TOOL_PARSERS:
        raise RegistryError(f"SLUICE_MODELS[{i}].tool_parser must be one of {', '.join(TOOL_PARSERS)}")
    if not set(spec.worker_roles) <= set(ALL_ROLES):
        raise RegistryError(f"SLUICE_MODELS[{i}].worker_roles must be among {', '.join(ALL_ROLES)}")
