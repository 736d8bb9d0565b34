"""Worker process start and stop: load the engine once, before the first task is taken.

Celery fires ``worker_init`` before the consumer starts, so a worker only takes messages once
its engine is loaded and warmed up (a cold model never sees a user's request).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from celery.signals import task_received, worker_init, worker_ready, worker_shutdown, worker_shutting_down

from core.broker.queues import RUN_TASK
from core.rediskeys import RESERVED_KEY
from core.registry import ModelSpec
from core.services import Services
from core.settings import Settings
from workers import exporter, queue_order
from workers.engines import load_engine
from workers.governor import Governor, StepCurve
from workers.runtime import EngineRuntime

log = logging.getLogger(__name__)


class EngineNotStarted(RuntimeError):
    """A task arrived in a process whose engine is not running (not a `sluice worker`, or it is
    shutting down). Its message goes back to the queue for a worker that has one."""


class BatchSlots:
    """How many of this worker's threads batch requests may hold at once.

    A thread that takes a batch message while every batch slot is taken hands it back to the
    queue, so the threads left over only ever run realtime work. While realtime requests run
    (``realtime_busy``), fewer batch requests may start (``beside``): each one's prefill, and each
    sequence it adds to the batch, lengthens the engine steps realtime decodes in, so batch work
    takes what realtime leaves instead of slowing it down.
    """

    def __init__(self, limit: int, beside: int | None = None,
                 realtime_busy: Callable[[], bool] = lambda: False) -> None:
        self.limit = limit
        self.beside = limit if beside is None else min(limit, beside)
        self.realtime_busy = realtime_busy
        self._held = 0
        self._lock = threading.Lock()

    def has_room(self) -> bool:
        return not (self._held >= self.limit or (self._held >= self.beside and self.realtime_busy()))

    def try_take(self) -> bool:
        with self._lock:
            if not self.has_room():
                return False
            self._held += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self._held -= 1


def batch_slots(settings: Settings, threads: int, queues: list[str],
                realtime_busy: Callable[[], bool] = lambda: False) -> BatchSlots:
    """Slots for batch work: every thread, unless this worker also serves realtime queues; then
    fewer, and fewer still to start while realtime requests run."""
    both = any(q.startswith("realtime.") for q in queues) and any(q.startswith("batch.") for q in queues)
    if not both:
        return BatchSlots(threads)
    keep = settings.worker_realtime_threads
    keep = max(1, threads // 4) if keep is None else keep
    limit = max(1, threads - keep)
    beside = settings.worker_batch_beside_realtime
    return BatchSlots(limit, max(1, limit // 2) if beside is None else beside, realtime_busy)


@dataclass
class WorkerState:
    """This process's engine runtime and batch slots, from ``worker_init`` to ``worker_shutdown``."""

    runtime: EngineRuntime | None = None
    batch: BatchSlots | None = None

    def require(self) -> EngineRuntime:
        if self.runtime is None:
            raise EngineNotStarted("engine runtime not started; run workers with `sluice worker`")
        return self.runtime


WORKER = WorkerState()


def container_devices(environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """The host devices an NVIDIA container runtime gave this container, in the order CUDA numbers
    them inside it (from 0); [] for none; None outside such a container or when it was given all.

    Docker writes NVIDIA_VISIBLE_DEVICES (host indices or UUIDs) from a compose device reservation
    or `docker run --gpus`.
    """
    given = environ.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if given in ("", "all"):
        return None
    if given in ("none", "void"):
        return []
    return [d.strip() for d in given.split(",") if d.strip()]


def device_env(gpus: str | None, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables `sluice worker --gpus` sets before anything touches CUDA; ValueError when
    ``gpus`` names a device this process cannot have.

    ``gpus`` names devices as this process sees them: on a bare host, the host's indices; in a
    container, the container's own, numbered from 0 whichever host devices it was given. So a
    container worker takes no --gpus (it uses what its reservation gave it): a host index there
    names a device the container does not have, and CUDA would find none. Several devices for one
    worker, by --gpus or by the container, mean one model split across them.
    """
    given = container_devices(environ)
    if gpus is None:
        env, devices = {}, given or []
    else:
        devices = [g.strip() for g in gpus.split(",") if g.strip()]
        if given is not None and any(d.isdigit() and int(d) >= len(given) for d in devices):
            raise ValueError(
                f"--gpus {gpus}: this container was given {len(given)} device(s) (NVIDIA_VISIBLE_DEVICES="
                f"{environ['NVIDIA_VISIBLE_DEVICES']}), numbered from 0 inside it; leave --gpus out and the "
                "worker uses what its reservation gave it")
        env = {"CUDA_VISIBLE_DEVICES": gpus}
    if len(devices) > 1 and "SLUICE_VLLM_TENSOR_PARALLEL_SIZE" not in environ:
        env["SLUICE_VLLM_TENSOR_PARALLEL_SIZE"] = str(len(devices))
    return env


def device_label(settings: Settings, environ: Mapping[str, str] = os.environ) -> str:
    """The devices this worker runs on, as the host names them (a row's ``device``, /readyz): in a
    container given host device 1, CUDA calls it 0, and the label says cuda:1."""
    if settings.engine == "simulated":
        return f"simulated-{settings.sim_profile}"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    given = container_devices(environ)
    if not given:
        return f"cuda:{visible}" if visible else "cpu"
    if not visible:
        return "cuda:" + ",".join(given)
    inside = [v.strip() for v in visible.split(",")]
    return "cuda:" + ",".join(given[int(v)] if v.isdigit() and int(v) < len(given) else v for v in inside)


def start_runtime(svc: Services, hostname: str, queues: list[str], threads: int | None = None) -> EngineRuntime:
    settings = svc.settings
    worker_id = f"{hostname}/{os.getpid()}.{uuid.uuid4().hex[:6]}"
    model = served_model(settings)
    info = {"node": hostname, "role": settings.worker_role, "model": model.name, "engine": settings.engine,
            "device": device_label(settings), "queues": queues, "threads": threads or settings.worker_threads}
    # Realtime traffic not seen yet is taken to be its class's defaults: its deadline for its
    # max_tokens. A worker that serves no realtime queue has none to expect.
    serves_realtime = any(q.startswith("realtime.") for q in queues)
    # A request past the engine's own batch cap would wait inside the engine, where no promise sees it.
    cap = settings.vllm_max_num_seqs if settings.engine == "vllm" else info["threads"]
    governor = Governor(StepCurve(), max_seqs=min(info["threads"], cap),
                        default_pace_s=(settings.realtime_deadline_s / settings.default_max_tokens
                                        if serves_realtime else math.inf))
    runtime = EngineRuntime(load_engine(settings, model), svc.redis, worker_id,
                            heartbeat_s=settings.worker_heartbeat_s,
                            dead_after_s=settings.worker_dead_after_s,
                            cancel_poll_s=settings.cancel_poll_s, watchdog_s=settings.worker_watchdog_s, info=info,
                            governor=governor, poison_prompt=settings.fault_poison_prompt)
    lined = [q for q in queues if svc.fair.handles(q)]  # in the worker's order: realtime first
    if lined:
        runtime.on_room = lambda: top_up(svc, lined)
    runtime.start()
    exporter.export(runtime, settings)
    WORKER.batch = slots = batch_slots(settings, info["threads"], queues, lambda: runtime.realtime_in_flight() > 0)
    if slots.limit < info["threads"]:
        runtime.batch_cap = slots.limit
    queue_order.set_batch_gate(lambda: runtime.batch_open() and slots.has_room())
    WORKER.runtime = runtime
    log.info("%d of %d threads may hold batch work (%d may start while realtime runs)", WORKER.batch.limit,
             info["threads"], WORKER.batch.beside)
    return runtime


def top_up(svc: Services, queues: list[str]) -> None:
    """A seat came free in this worker's engine: each of its ``queues`` with a fair line gets the
    next requests of that line, in fair order, as far as the engines serving its class have room
    (``core/broker/fair.py``): what waited in the line takes the seat, not what a queue held."""
    for queue in queues:
        svc.fair.publish(svc.broker, svc.fair.take(queue))


def set_prefetch(qos, limit: int) -> None:
    """Make the consumer's prefetch count ``limit`` (at least 1: 0 would mean no limit). Celery's
    consumer loop applies it before its next fetch."""
    change = max(1, limit) - qos.value
    if change > 0:
        qos.increment_eventually(change)
    elif change < 0:
        qos.decrement_eventually(-change)


def served_model(settings: Settings) -> ModelSpec:
    registry = settings.registry
    spec = registry.get(settings.worker_model) if settings.worker_model else registry.default
    if spec is None:
        raise ValueError(f"SLUICE_WORKER_MODEL={settings.worker_model!r} is not in the model registry")
    return spec


def connect(svc: Services) -> None:
    """Hook engine start/stop into this process's Celery worker lifecycle."""

    @worker_init.connect(weak=False)
    def _on_init(sender, **kwargs) -> None:
        queues = sorted(sender.app.amqp.queues.consume_from) if sender.app.amqp.queues.consume_from else []
        try:
            start_runtime(svc, sender.hostname, queues, int(sender.concurrency or 0) or None)
        except Exception:
            # Celery logs and ignores exceptions from signal handlers; a worker without an
            # engine must not start consuming, so leave with a BaseException it does not catch.
            log.exception("engine failed to start; the worker exits")
            raise SystemExit(1) from None

    @worker_ready.connect(weak=False)
    def _on_ready(sender, **kwargs) -> None:
        # The consumer holds at most its prefetch count of unacknowledged messages, and every
        # request message stays unacknowledged while it runs: the in-engine limit, carried out.
        # Read through the consumer each time: a reconnection to the broker builds a new QoS.
        runtime = WORKER.runtime
        if runtime is not None and getattr(sender, "qos", None) is not None:
            runtime.on_limit = lambda limit: set_prefetch(sender.qos, limit)
            runtime.govern_once()

    @task_received.connect(weak=False)
    def _on_received(request, **kwargs) -> None:
        runtime = WORKER.runtime
        if runtime is None or request.name != RUN_TASK:
            return
        runtime.arriving(request.id)
        try:
            svc.redis.hset(RESERVED_KEY, request.id, runtime.worker_id)
        except Exception:
            log.warning("could not record reservation of %s; recovery falls back to the visibility timeout",
                        request.id)


    @worker_shutting_down.connect(weak=False)
    def _on_shutting_down(**kwargs) -> None:
        # Sent from Celery's signal handler on every SIGTERM/SIGINT: the first drains, the next
        # hands back what still runs at once. Celery itself stops taking messages.
        runtime = WORKER.runtime
        if runtime is not None:
            runtime.drain(svc.settings.stop_grace_s)

    @worker_shutdown.connect(weak=False)
    def _on_shutdown(**kwargs) -> None:
        runtime, WORKER.runtime = WORKER.runtime, None
        if runtime is not None:
            runtime.stop()
