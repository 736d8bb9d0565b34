"""The degradation ladder's first steps, applied to a realtime plan before admission prices it.

    level 1  light_model     a realtime request that named no model goes to the registry's
                             ``light`` model, when one is configured and a worker serves it warm
    level 2  shorter_output  a realtime request's max_tokens is capped (SLUICE_SHORTER_OUTPUT_TOKENS)

Later steps act in admission's Lua gate (reject_batch at level 4, tight_promise at 5: the
promise keeps a margin, shed at 6); the promise at arrival refuses what cannot finish in time at
every level. Each step is switched on or off in
SLUICE_LADDER_STEPS. A degraded request's row says which steps changed it (``degradation_step``)
and so does the answer (the ``Sluice-Degradation`` header).

Each request is judged by the level of the class it arrives for (priority × the model it would
run on before any step: a request naming no model, the default), so one overloaded model degrades
only its own traffic. The light model takes a class's traffic only while its own class is
calmer. The levels come from Redis, read at most every ``REFRESH_S`` per process and only while
admission's breaker says Redis answers: with no level (no monitor, stale figures, Redis away)
nothing is degraded, and the promise on the workers' own figures (or the local floor) applies.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from core.admission.gates import Admission
from core.admission.load import LoadLevel, class_level, snapshot_key
from core.rediskeys import LOAD_LEVEL_KEY
from core.settings import Settings
from core.submit.plan import Plan, Planner
from models import Priority, SizeClass

log = logging.getLogger(__name__)

REFRESH_S = 0.5
HEADER = "Sluice-Degradation"


@dataclass(frozen=True)
class Levels:
    """The levels the monitor last published (``LOAD_LEVEL_KEY``); none when stale or away."""

    published: dict[str, str] = field(default_factory=dict)

    def of(self, priority: Priority | str, model: str, tenant: uuid.UUID | None = None) -> LoadLevel:
        """The class's level, as ``tenant`` is judged at it (its fair level unless it is loud)."""
        return LoadLevel(min(class_level(self.published, priority, model, tenant and str(tenant)), max(LoadLevel)))


class LoadReader:
    """The published levels and whether the light model has warm realtime workers, cached briefly."""

    def __init__(self, settings: Settings, admission: Admission, clock=time.monotonic) -> None:
        self.settings = settings
        self.admission = admission
        self.clock = clock
        self.light = settings.registry.light
        self._read_at = float("-inf")
        self._levels, self._light_warm = Levels(), False
        self._lock = threading.Lock()

    def current(self) -> tuple[Levels, bool]:
        with self._lock:
            if self.clock() - self._read_at >= REFRESH_S:
                self._read_at = self.clock()
                self._levels, self._light_warm = self._read()
            return self._levels, self._light_warm

    def _read(self) -> tuple[Levels, bool]:
        if not self.admission.redis_healthy:
            return Levels(), False
        try:
            with self.admission.redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(LOAD_LEVEL_KEY)
                if self.light is not None:
                    pipe.hget(snapshot_key(Priority.REALTIME, self.light.name), "workers")
                published, *light = pipe.execute()
        except Exception:  # the gate's own Redis call will open the breaker if Redis is away
            log.warning("could not read the load levels; degrading nothing")
            return Levels(), False
        max_age_ms = self.settings.load_level_max_age_s * 1000
        updated_ms = published.get("updated_at_ms")
        fresh = updated_ms is not None and time.time() * 1000 - int(updated_ms) <= max_age_ms
        warm = bool(light) and int(light[0] or 0) > 0
        return (Levels(published) if fresh else Levels()), warm


class Ladder:
    def __init__(self, settings: Settings, planner: Planner, reader: LoadReader) -> None:
        self.settings = settings
        self.planner = planner
        self.reader = reader

    def answers_samples_from_cache(self, plan: Plan) -> bool:
        """Step 3 (cached_answer) in force for ``plan``'s class: a sampled request too may be
        answered by its cached twin."""
        return (plan.priority == Priority.REALTIME and "cached_answer" in self.settings.ladder
                and self.reader.current()[0].of(plan.priority, self._arrived_for(plan), plan.tenant_id)
                >= LoadLevel.CACHED_ANSWERS)

    def apply(self, plan: Plan, model_named: bool) -> Plan:
        """``plan`` with the steps its class's level calls for; unchanged for batch work and for
        embeddings (no lighter model embeds into the same space; there is no output to shorten)."""
        if plan.priority != Priority.REALTIME or plan.size_class == SizeClass.EMBED:
            return plan
        levels, light_warm = self.reader.current()
        level = levels.of(plan.priority, plan.target_model, plan.tenant_id)
        steps = self.settings.ladder
        light = self.reader.light
        applied: list[str] = []
        if (level >= LoadLevel.LIGHT_MODEL and "light_model" in steps and light_warm and not model_named
                and light is not None and plan.route_reason is None
                and levels.of(plan.priority, light.name) < level):  # relief, not another overload
            rerouted = self.planner.reroute(plan, light, "light_model")
            if rerouted is not None:
                plan = rerouted
                applied.append("light_model")
        if (level >= LoadLevel.SHORTER_OUTPUT and "shorter_output" in steps
                and plan.max_tokens > self.settings.shorter_output_tokens):
            shorter = self.settings.shorter_output_tokens
            params = ({**plan.params, "min_tokens": shorter} if plan.params.get("min_tokens", 0) > shorter
                      else plan.params)  # a floor above the new ceiling would fail in the engine
            plan = dataclasses.replace(plan, max_tokens=shorter, params=params)
            applied.append("shorter_output")
        if applied:
            plan = dataclasses.replace(plan, degradation=tuple(applied))
        return plan

    def _arrived_for(self, plan: Plan) -> str:
        """The model whose class ``plan`` arrived in: before the light-model step moved it."""
        if "light_model" in plan.degradation:
            return self.settings.registry.default.name
        return plan.target_model
