"""`sluice diagnose`: why requests are slow, in plain words, with the numbers behind the answer.

Slowness has a few usual causes and each needs a different fix, so the verdict names one:

    batching      requests wait while the engines have room: fewer worker threads than an
                  engine's batch, or a queue no worker consumes. More GPUs would idle as well:
                  the workers need fixing.
    too_big       the engines are full and inference alone takes half the deadline or more: the
                  model is too big for this traffic; a light or quantised one runs faster.
    add_capacity  the engines are full and the queue grows, or already waits past the point
                  where degrading begins: N more workers, sized by the drain one worker measured.
    healthy       none of these.
    no_figures    the load monitor publishes nothing: there is nothing to judge.

:func:`diagnose` is pure: :class:`Figures` in (per class what the load monitor publishes and what
recent request rows say; per worker what its heartbeat says), one :class:`Verdict` out. Realtime
classes are judged before batch ones: their users feel a problem first.
launcher/diagnose_cli.py gathers the figures from Redis and Postgres.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# An engine running this share of its batch, or with this share of its KV cache used, or with
# sequences waiting inside it for room, is full: it cannot take more work at once.
FULL = 0.9
# A free thread takes a queued message within milliseconds: waits of a second are not that.
WAIT_S = 1.0
# Inference alone taking this share of the deadline leaves too little of it for any queue.
LONG_INFERENCE = 0.5
# Arrivals this far above the drain: the queue grows (closer, the two measures are within noise).
GROWING = 1.1
# Estimated wait ÷ deadline at which the monitor's first degradation level begins
# (workers/monitor.py UP_THRESHOLDS): past it users already get a degraded service.
DEGRADING = 0.25

_RANK = {"batching": 0, "too_big": 1, "add_capacity": 2, "healthy": 3}


@dataclass(frozen=True)
class EngineFigures:
    """One warm worker, as its heartbeat says."""

    worker: str
    model: str
    queues: tuple[str, ...]
    threads: int  # requests it may hold in flight (its thread pool)
    batch: int  # sequences its engine runs in one step at most
    running: int  # sequences in the engine's current batch
    waiting: int = 0  # handed to the engine, not yet scheduled (no room in the batch or KV cache)
    in_flight: int = 0  # requests its threads hold
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0

    def serves(self, priority: str, model: str) -> bool:
        return self.model == model and any(q.startswith(priority + ".") for q in self.queues)


@dataclass(frozen=True)
class ClassFigures:
    """One class (priority × model): the monitor's snapshot and the recent request rows."""

    priority: str
    model: str
    deadline_s: float
    queued_requests: int = 0
    queued_work: int = 0  # tokens of output (max_tokens) queued: what the engines must decode
    wait_s: float = 0.0  # the monitor's estimate for a new request: queued work ÷ drain (-1: unknown)
    drain_tps: float = 0.0  # work claimed off the queue per second (0: unknown)
    arrival_tps: float = 0.0  # work that arrived per second over the window
    queue_wait_s: float | None = None  # median wait before starting, of the window's requests
    inference_s: float | None = None  # median inference time, of the window's finished requests

    @property
    def name(self) -> str:
        return f"{self.priority}:{self.model}"


@dataclass(frozen=True)
class Figures:
    classes: tuple[ClassFigures, ...]
    engines: tuple[EngineFigures, ...]


@dataclass(frozen=True)
class Verdict:
    kind: str  # batching | too_big | add_capacity | healthy | no_figures
    sentence: str
    numbers: dict[str, Any]


def diagnose(figures: Figures) -> Verdict:
    """The most pressing finding: realtime before batch, a misconfiguration before a lack of
    capacity (fixing it may be all that is needed); healthy only when every class is."""
    if not figures.classes:
        return Verdict("no_figures", "No load figures in Redis: the load monitor (`sluice monitor`) is not "
                       "running or has not published yet. Start it, then ask again.",
                       {"workers": len(figures.engines)})
    verdicts = [(c, _judge(c, [e for e in figures.engines if e.serves(c.priority, c.model)]))
                for c in figures.classes]
    verdicts.sort(key=lambda cv: (cv[1].kind == "healthy", cv[0].priority != "realtime", _RANK[cv[1].kind]))
    return verdicts[0][1]


def _judge(c: ClassFigures, serving: list[EngineFigures]) -> Verdict:
    n = _numbers(c, serving)
    waited = max(c.queue_wait_s or 0.0, c.wait_s if c.queued_requests else 0.0)
    where = f"{c.name}'s engines run {n['running']} of {n['batch']} sequences"
    if c.queued_requests and not serving:
        return Verdict("batching", f"A queue nobody consumes: {c.queued_requests} requests wait in {c.name} and no "
                       f"warm worker serves its queues. Start one for model {c.model} with a role that reads "
                       f"{c.priority} queues (`sluice worker --role {c.priority} --model {c.model}`).", n)
    if not serving:
        return Verdict("healthy", f"Nothing waits in {c.name}, and no warm worker serves it.", n)
    full = n["running"] >= FULL * n["batch"] or n["kv_used_share"] >= FULL or n["engine_waiting"] > 0
    if waited >= WAIT_S and not full:
        if n["threads"] < n["batch"] and n["in_flight"] >= n["threads"]:
            return Verdict("batching", f"A concurrency problem: requests wait {waited:.1f} s while {where}: all "
                           f"{n['threads']} worker threads are busy, and an engine batches only what threads hand "
                           f"it. Raise SLUICE_WORKER_CONCURRENCY (`sluice worker --concurrency`) to the engine's "
                           f"batch size, {max(e.batch for e in serving)}.", n)
        return Verdict("batching", f"A batching problem: requests wait {waited:.1f} s while {where} and "
                       f"{n['threads'] - n['in_flight']} of {n['threads']} threads are free: the workers are not "
                       "taking queued messages. Check the worker logs, that the sweep runs (it re-publishes lost "
                       "messages) and, for batch work, the peak reservations in force (`sluice status`).", n)
    if full and c.inference_s is not None and c.inference_s >= LONG_INFERENCE * c.deadline_s:
        return Verdict("too_big", f"The model is too big for this traffic: {where} (KV cache {n['kv_used_share']:.0%} "
                       f"used) and a request's inference alone takes {c.inference_s:.1f} s (median), "
                       f"{c.inference_s / c.deadline_s:.0%} of its {c.deadline_s:.0f} s deadline. Serve a light or "
                       "quantised model (a `light` model in SLUICE_MODELS also takes realtime work when the "
                       "platform degrades): it decodes each sequence faster and fits more of them on a GPU.", n)
    growing = c.arrival_tps > GROWING * c.drain_tps
    if full and c.queued_requests and (growing or c.wait_s >= DEGRADING * c.deadline_s):
        return _add_capacity(c, len(serving), growing, where, n)
    return Verdict("healthy", f"Healthy: {c.name} requests wait {waited:.1f} s before they start"
                   f"{'' if c.inference_s is None else f' and run {c.inference_s:.1f} s'} (medians); "
                   f"{where} on {len(serving)} worker{'s' if len(serving) > 1 else ''}.", n)


def _add_capacity(c: ClassFigures, workers: int, growing: bool, where: str, n: dict[str, Any]) -> Verdict:
    """How many more workers like these: enough to drain what arrives, and to bring the queue as
    it stands under the wait where degrading begins (admission refuses or degrades what goes past
    it, so when it does, arrivals only count the admitted part of the demand)."""
    why = (f"work arrives at {c.arrival_tps:,.0f} tokens/s and drains at {c.drain_tps:,.0f}" if growing else
           f"its queue waits {c.wait_s:.1f} s, {c.wait_s / c.deadline_s:.0%} of the {c.deadline_s:.0f} s deadline")
    if c.drain_tps <= 0:
        return Verdict("add_capacity", f"Add capacity: {where} (full), while {why}. Its drain rate is not measured "
                       "yet, so how many workers is unknown: ask again in a minute.", {**n, "more_workers": None})
    per_worker = c.drain_tps / workers
    needed = max(c.arrival_tps, c.queued_work / (DEGRADING * c.deadline_s))
    more = max(1, math.ceil(needed / per_worker) - workers)
    plural = "s" if more > 1 else ""
    return Verdict("add_capacity", f"Add capacity: {where} (full), while {why}. One worker drains "
                   f"{per_worker:,.0f} tokens/s and {needed:,.0f} are needed: add {more} worker{plural} like these "
                   f"({workers + more} in all).",
                   {**n, "per_worker_tps": round(per_worker, 1), "needed_tps": round(needed, 1),
                    "more_workers": more})


def _numbers(c: ClassFigures, serving: list[EngineFigures]) -> dict[str, Any]:
    kv_capacity = sum(e.kv_capacity_tokens for e in serving)
    return {"class": c.name, "queued_requests": c.queued_requests, "queued_work_tokens": c.queued_work,
            "estimated_wait_s": c.wait_s, "queue_wait_p50_s": c.queue_wait_s, "inference_p50_s": c.inference_s,
            "deadline_s": c.deadline_s, "arrival_tps": round(c.arrival_tps, 1), "drain_tps": round(c.drain_tps, 1),
            "workers": len(serving), "threads": sum(e.threads for e in serving),
            "in_flight": sum(e.in_flight for e in serving), "running": sum(e.running for e in serving),
            "batch": sum(e.batch for e in serving), "engine_waiting": sum(e.waiting for e in serving),
            "kv_used_share": round(sum(e.kv_used_tokens for e in serving) / kv_capacity, 3) if kv_capacity else 0.0}
