"""Engines behind one interface; `load_engine` picks one from settings.

Each engine module is imported only when chosen, so a simulated worker never imports vLLM.
"""

from __future__ import annotations

from sluice.registry import ModelSpec
from sluice.settings import Settings

from .base import Engine, EngineStats, GenerationOutput, GenerationRequest, SamplingParams


def load_engine(settings: Settings, model: ModelSpec) -> Engine:
    if settings.engine == "simulated":
        from .simulated import SimulatedConfig, SimulatedEngine

        return SimulatedEngine(SimulatedConfig(model_name=model.name, speed=settings.sim_speed))
    raise ValueError(f"engine {settings.engine!r} is not available in this build")


__all__ = ["Engine", "EngineStats", "GenerationOutput", "GenerationRequest", "SamplingParams",
           "load_engine"]
