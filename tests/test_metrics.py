"""Prometheus metrics, scraped from the real processes: the web tier under gunicorn (one scrape
sums every web process), a worker's own endpoint, and the monitor's view of the platform."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml
from conftest import ROOT, WorkerProcess, make_settings, service_env
from prometheus_client.parser import text_string_to_metric_families

from core.settings import Settings
from launcher.database import create_key
from launcher.harness import SLUICE, WebProcess
from web import create_app
from web.services import services


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def wait_for_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"exited early:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def post(url: str, key: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/requests", json.dumps(body).encode(), method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json", "Connection": "close"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def test_one_scrape_of_the_web_tier_counts_every_web_process(database_url, scratch_redis_url, tmp_path):
    env = service_env(database_url, scratch_redis_url, {"SLUICE_WEB_WORKERS": "2", "SLUICE_DATA_DIR": str(tmp_path)})
    web = WebProcess(env, tmp_path)
    try:
        key = create_key(Settings(database_url=database_url).sqlalchemy_url, f"metrics-{time.monotonic_ns()}")
        before = total(scrape(web.url + "/metrics"), "sluice_admission_admitted_total")
        for i in range(12):  # a connection each: gunicorn spreads them over both processes
            post(web.url, key, {"prompt": f"count me {i}", "max_tokens": 4, "priority": "batch"})
        pids = {Path(p).stem.rsplit("_", 1)[-1] for p in os.listdir(tmp_path / "metrics" / f"web-{web.port}")}
        assert len(pids) >= 2, pids  # both web processes wrote series
        for _ in range(4):  # whichever process answers the scrape, it reports all of them
            assert total(scrape(web.url + "/metrics"), "sluice_admission_admitted_total") - before == 12
    finally:
        web.stop()


def test_a_worker_exports_its_requests_and_its_engine(database_url, scratch_redis_url, tmp_path, new_client):
    port = free_port()
    worker = WorkerProcess(database_url, scratch_redis_url, tmp_path,
                           extra_env={"SLUICE_WORKER_METRICS_PORT": str(port)})
    app = create_app(make_settings(database_url, scratch_redis_url))
    try:
        client = new_client(app)
        ids = [client.submit(prompt=f"measure me {i}", max_tokens=8, ignore_eos=True).get_json()["id"]
               for i in range(3)]
        assert {client.wait(i)["status"] for i in ids} == {"succeeded"}
        timings = ("sluice_queue_wait_seconds_count", "sluice_inference_seconds_count",
                   "sluice_time_to_first_token_seconds_count")

        def counted(samples) -> bool:
            return (all(total(samples, name, priority="realtime") >= 3 for name in timings)
                    and total(samples, "sluice_output_tokens_total", priority="realtime") >= 24
                    and total(samples, "sluice_requests_ended_total", status="succeeded") >= 3
                    and total(samples, "sluice_worker_batch_open") == 1)

        # The worker records a request's end after its row committed (the row a poll reads), and
        # its governor opens batch again on its next tick once no realtime work waits (0.25 s): the
        # scrape waits for both rather than racing them (CI at aaef238 once saw batch still shut).
        deadline = time.monotonic() + 10
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
        while not counted(samples) and time.monotonic() < deadline:
            time.sleep(0.1)
            samples = scrape(f"http://127.0.0.1:{port}/metrics")
        for name in timings:
            assert total(samples, name, priority="realtime") >= 3, name
        assert total(samples, "sluice_output_tokens_total", priority="realtime") >= 24
        assert total(samples, "sluice_requests_ended_total", status="succeeded") >= 3
        assert ("sluice_engine_running_sequences", (("device", "simulated-h200"), ("model", "simulated-llama-8b"))) \
            in samples
        assert total(samples, "sluice_engine_kv_cache_capacity_tokens") > 0
        assert total(samples, "sluice_worker_engine_limit") >= 1 and total(samples, "sluice_worker_batch_open") == 1
        assert not any(name.startswith("sluice_gpu_") for name, _ in samples)  # no GPU: absent, not zero
    finally:
        worker.stop()
        services(app).db.dispose()


def test_the_monitor_exports_queues_in_requests_and_tokens(database_url, scratch_redis_url, tmp_path, new_client):
    app = create_app(make_settings(database_url, scratch_redis_url))
    client = new_client(app)
    # Queued before the monitor starts: nobody consumes this Redis database's queues, and once the
    # monitor publishes that, admission refuses what no worker could ever finish.
    for i in range(3):
        assert client.submit(prompt=f"wait in line {i} " * 20, max_tokens=100, priority="batch").status_code == 202
    port = free_port()
    env = {**os.environ, **service_env(database_url, scratch_redis_url, {"SLUICE_MONITOR_METRICS_PORT": str(port)})}
    log = open(tmp_path / "monitor.log", "w")  # noqa: SIM115 - closed below
    monitor = subprocess.Popen([*SLUICE, "monitor"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/metrics", monitor, tmp_path / "monitor.log")

        def queued() -> dict | None:
            samples = scrape(f"http://127.0.0.1:{port}/metrics")
            return samples if total(samples, "sluice_queue_requests", priority="batch") >= 3 else None

        samples = None
        deadline = time.monotonic() + 30
        while samples is None and time.monotonic() < deadline:
            samples = queued()
            time.sleep(0.5)
        assert samples is not None, (tmp_path / "monitor.log").read_text()[-2000:]
        # Tokens as well as requests (their exact sum is not ours to predict: other tests' rows share
        # the database, and the monitor's recount from Postgres includes them).
        batch = {dict(labels)["model"]: v for (n, labels), v in samples.items()
                 if n == "sluice_queue_tokens" and dict(labels)["priority"] == "batch"}
        assert batch and all(v > 0 for v in batch.values()), batch
        assert ("sluice_load_level", ()) in samples
        assert ("sluice_degradation_step_active", (("step", "light_model"),)) in samples
        assert "sluice_reservations_active" in {name for name, _ in samples}
    finally:
        os.killpg(monitor.pid, signal.SIGTERM)
        monitor.wait(30)
        log.close()
        services(app).db.dispose()



def test_the_grafana_dashboard_queries_only_series_sluice_exports():
    sources = ["core/observe/metrics.py", "core/observe/submit_metrics.py", "workers/exporter.py"]
    defined = {name for path in sources for name in re.findall(r'"(sluice_[a-z_]+)"', (ROOT / path).read_text())}
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/sluice.json").read_text())
    queried = {re.sub(r"_(bucket|count|sum)$", "", name) for panel in dashboard["panels"]
               for target in panel["targets"] for name in re.findall(r"sluice_[a-z_]+", target["expr"])}
    assert queried and queried <= defined, queried - defined
    scrape_config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    ports = {t.rsplit(":", 1)[1] for job in scrape_config["scrape_configs"] for c in job["static_configs"]
             for t in c["targets"]}
    settings = Settings()
    assert ports == {str(settings.web_port), str(settings.worker_metrics_port), str(settings.monitor_metrics_port)}
