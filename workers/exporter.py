"""Prometheus endpoints of a worker (its engine, its GPUs) and of the monitor (the platform).

Read at scrape time (collectors), not copied on a timer: a scrape sees the engine's stats of
that instant. The request histograms and counters (``core/observe/metrics.py``) live in the same
process registry and come out of the same endpoint.

GPU series come from NVML (``nvidia-ml-py``) for the devices this process may use. Where there
is no NVIDIA driver, or the package is missing, they are absent — not zero, which would read as
an idle GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector
from sqlalchemy import func, select

from core.admission.load import load_view
from core.broker.fair import lines_view
from core.observe.metrics import serve
from core.settings import Settings
from models import Delivery, Job, JobItem, JobStatus
from models.reservation import Reservation
from workers.runtime import EngineRuntime

log = logging.getLogger(__name__)
LIVE_JOBS = (JobStatus.VALIDATING, JobStatus.IN_PROGRESS, JobStatus.FINALIZING, JobStatus.CANCELLING)


class EngineCollector(Collector):
    def __init__(self, runtime: EngineRuntime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.runtime.engine.stats()
        labels = ["model", "device"]
        values = [self.runtime.info.get("model", "?"), self.runtime.info.get("device", "?")]
        for name, doc, value in (
                ("sluice_engine_running_sequences", "Sequences in the engine's current batch.", stats.running),
                ("sluice_engine_waiting_sequences", "Sequences in the engine not yet scheduled.", stats.waiting),
                ("sluice_engine_kv_cache_usage_ratio", "Share of the KV cache in use (0-1).",
                 stats.kv_used_tokens / stats.kv_capacity_tokens if stats.kv_capacity_tokens else 0.0),
                ("sluice_engine_kv_cache_capacity_tokens", "Tokens the KV cache holds.", stats.kv_capacity_tokens),
                ("sluice_worker_requests_in_flight", "Requests this worker has claimed and not finished.",
                 self.runtime.in_flight()),
                ("sluice_worker_engine_limit", "Requests this worker lets into its engine now: the in-engine limit "
                 "the deadlines in flight allow on its learned step curve.", self.runtime.limit),
                ("sluice_worker_batch_open", "1 while batch work may enter this worker's engine, 0 while it "
                 "yields to realtime.", 1.0 if self.runtime.batch_open() else 0.0)):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, float(value))
            yield family


class GpuCollector(Collector):
    """Utilisation and memory of each GPU NVML lists for this process."""

    def __init__(self, nvml) -> None:
        self.nvml = nvml

    def collect(self) -> Iterator[GaugeMetricFamily]:
        nvml = self.nvml
        util = GaugeMetricFamily("sluice_gpu_utilization_ratio", "Share of the last sample period the GPU "
                                 "was busy (0-1).", labels=["device"])
        used = GaugeMetricFamily("sluice_gpu_memory_used_bytes", "GPU memory in use.", labels=["device"])
        total = GaugeMetricFamily("sluice_gpu_memory_total_bytes", "GPU memory installed.", labels=["device"])
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            device = str(index)
            util.add_metric([device], nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
            used.add_metric([device], float(memory.used))
            total.add_metric([device], float(memory.total))
        yield from (util, used, total)


def nvml_or_none():
    """The initialised NVML module, or None where there is no NVIDIA GPU to ask."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return None
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
    except Exception:  # no package, no driver, no device: the series are absent
        return None
    return pynvml


def export(runtime: EngineRuntime, settings: Settings) -> bool:
    """Register this worker's collectors and serve its endpoint (SLUICE_WORKER_METRICS_PORT)."""
    REGISTRY.register(EngineCollector(runtime))
    nvml = nvml_or_none()
    if nvml is not None:
        REGISTRY.register(GpuCollector(nvml))
    return serve(settings.metrics_host, settings.worker_metrics_port, "worker")


class PlatformCollector(Collector):
    """What the monitor exports: the platform's state, shared by every process, as it is now.

    Queues and level come from Redis (the counters and snapshots the monitor itself maintains,
    ``core/admission/load.py``); jobs, deliveries and reservations from Postgres, a few small GROUP BYs a
    scrape (job items only of jobs still in progress)."""

    def __init__(self, svc) -> None:
        self.svc = svc

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._load()
        yield from self._database()

    def _load(self) -> Iterator[GaugeMetricFamily]:
        svc = self.svc
        view = load_view(svc.redis, svc.settings.ladder, [])
        families = {name: GaugeMetricFamily(name, doc, labels=["priority", "model"]) for name, doc in (
            ("sluice_queue_requests", "Requests queued, per class."),
            ("sluice_queue_tokens", "Tokens queued (input + max_tokens), per class: rising while requests do "
                                    "not is the hidden overload of long requests."),
            ("sluice_queue_wait_estimate_seconds", "Queued work over the class's measured drain (-1: unknown)."),
            ("sluice_queue_drain_tokens_per_second", "Work (max_tokens) claimed off the class's queues per second."),
            ("sluice_class_level", "The class's degradation level (0 normal … 6 shed)."),
            ("sluice_class_fair_level", "The level of the class's fair wait, which every tenant not queued past "
                                        "its turn in the class's fair lines is judged at."),
            ("sluice_class_fair_wait_estimate_seconds", "The wait of a tenant one turn away in the class's fair "
                                                        "lines (-1: unknown)."),
            ("sluice_class_workers", "Warm workers consuming the class's queues."))}
        for one in view["classes"]:
            labels = [one["priority"], one["model"]]
            for name, key in (("sluice_queue_requests", "queued_requests"), ("sluice_queue_tokens", "queued_tokens"),
                              ("sluice_queue_wait_estimate_seconds", "wait_s"),
                              ("sluice_queue_drain_tokens_per_second", "drain_tps"),
                              ("sluice_class_level", "level"), ("sluice_class_fair_level", "fair_level"),
                              ("sluice_class_fair_wait_estimate_seconds", "fair_wait_s"),
                              ("sluice_class_workers", "workers")):
                value = float(one[key])
                families[name].add_metric(labels, value if value != float("inf") else -1.0)
        yield from families.values()
        if view["level"] is not None:  # absent while no monitor publishes: admission's local rules apply
            yield GaugeMetricFamily("sluice_load_level", "The platform's degradation level (0 normal … 6 shed).",
                                    value=view["level"])
        steps = GaugeMetricFamily("sluice_degradation_step_active", "1 for each ladder step the level turns on.",
                                  labels=["step"])
        for step in svc.settings.ladder:
            steps.add_metric([step], 1.0 if step in view["steps"] else 0.0)
        yield steps
        yield from self._lines()

    def _lines(self) -> Iterator[GaugeMetricFamily]:
        """Each class queue's fair line per tenant: the top tenants by queued engine time by id, the
        rest as ``other`` (``core/broker/fair.py lines_view``): at most 11 series per queue."""
        families = {key: GaugeMetricFamily(name, doc, labels=["queue", "tenant"]) for key, name, doc in (
            ("requests", "sluice_tenant_queued_requests",
             "Requests a tenant has waiting in a class queue's fair line."),
            ("seconds", "sluice_tenant_queued_engine_seconds",
             "Engine seconds of a tenant's requests waiting in a class queue's fair line."),
            ("share", "sluice_tenant_share", "The share of the engines a tenant's weight gets while the tenants "
                                             "with work in the line all have work (0-1)."),
            ("wait_s", "sluice_tenant_wait_estimate_seconds",
             "How long a tenant's line takes to drain in fair order at the class's whole capacity."))}
        for line in lines_view(self.svc.redis):
            for row in line["tenants"]:
                for key, family in families.items():
                    family.add_metric([line["queue"], row["tenant"]], float(row[key]))
        yield from families.values()

    def _database(self) -> Iterator[GaugeMetricFamily]:
        with self.svc.db.session() as session:
            jobs = session.execute(select(Job.status, func.count()).group_by(Job.status)
                                   .where(Job.status.in_(LIVE_JOBS))).all()
            items = session.execute(select(JobItem.status, func.count()).join(Job, Job.id == JobItem.job_id)
                                    .where(Job.status.in_(LIVE_JOBS)).group_by(JobItem.status)).all()
            deliveries = session.execute(select(Delivery.status, func.count()).group_by(Delivery.status)).all()
            now = func.now()
            reservations = session.scalar(select(func.count()).select_from(Reservation).where(
                Reservation.starts_at <= now, Reservation.ends_at > now, Reservation.cancelled_at.is_(None)))
        for name, doc, rows in (
                ("sluice_jobs", "Bulk jobs not yet ended, by status.", jobs),
                ("sluice_job_items", "Items of the bulk jobs not yet ended, by status.", items),
                ("sluice_webhook_deliveries", "Webhook deliveries kept (SLUICE_RETENTION_DAYS), by status.",
                 deliveries)):
            family = GaugeMetricFamily(name, doc, labels=["status"])
            for status, count in rows:
                family.add_metric([status.value], float(count))
            yield family
        yield GaugeMetricFamily("sluice_reservations_active", "Peak reservations in force now.",
                                value=float(reservations or 0))


def export_platform(svc) -> bool:
    """The monitor's endpoint (SLUICE_MONITOR_METRICS_PORT)."""
    REGISTRY.register(PlatformCollector(svc))
    return serve(svc.settings.metrics_host, svc.settings.monitor_metrics_port, "monitor")
