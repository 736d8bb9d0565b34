"""`sluice diagnose`: each verdict on a constructed scenario, then the command on real figures."""

from __future__ import annotations

import json

from click.testing import CliRunner
from conftest import WorkerProcess, service_env

from core.observe.diagnose import ClassFigures, EngineFigures, Figures, diagnose
from launcher.cli import main
from web.services import services
from workers.monitor import Monitor

MODEL = "llama-8b"


def engine(name: str = "w1", **figures) -> EngineFigures:
    """A warm worker serving MODEL's realtime queues, 256 threads for a batch of 256, idle."""
    return EngineFigures(**{"worker": name, "model": MODEL, "queues": ("realtime.small", "realtime.large"),
                            "threads": 256, "batch": 256, "running": 0, "kv_capacity_tokens": 500_000, **figures})


def realtime(**figures) -> ClassFigures:
    return ClassFigures("realtime", MODEL, deadline_s=30.0, **figures)


def test_requests_waiting_behind_fewer_threads_than_the_batch_is_a_concurrency_problem():
    busy = {"threads": 64, "in_flight": 64, "running": 64, "kv_used_tokens": 100_000}
    verdict = diagnose(Figures((realtime(queued_requests=40, queued_work=8000, wait_s=4.0, drain_tps=2000,
                                         arrival_tps=2100, queue_wait_s=6.0, inference_s=3.0),),
                               (engine("w1", **busy), engine("w2", **busy))))
    assert verdict.kind == "batching"
    assert "SLUICE_WORKER_CONCURRENCY" in verdict.sentence and "batch size, 256" in verdict.sentence
    assert "wait 6.0 s" in verdict.sentence and "run 128 of 512 sequences" in verdict.sentence
    assert (verdict.numbers["threads"], verdict.numbers["in_flight"], verdict.numbers["batch"]) == (128, 128, 512)


def test_requests_waiting_while_threads_and_engines_are_free_is_a_batching_problem():
    verdict = diagnose(Figures((realtime(queued_requests=12, queued_work=1200, wait_s=0.1, drain_tps=9000,
                                         queue_wait_s=5.0),),
                               (engine(in_flight=10, running=10),)))
    assert verdict.kind == "batching"
    assert "246 of 256 threads are free" in verdict.sentence and "not taking queued messages" in verdict.sentence


def test_a_queue_no_worker_consumes_is_named_with_the_worker_to_start():
    light = ClassFigures("realtime", "light-3b", deadline_s=30.0, queued_requests=12, queued_work=600, wait_s=-1.0)
    verdict = diagnose(Figures((realtime(queue_wait_s=0.05, inference_s=2.0), light), (engine(running=30),)))
    assert verdict.kind == "batching"
    assert "12 requests wait in realtime:light-3b" in verdict.sentence and "no warm worker" in verdict.sentence
    assert "sluice worker --role realtime --model light-3b" in verdict.sentence
    assert verdict.numbers["class"] == "realtime:light-3b" and verdict.numbers["workers"] == 0


def test_full_engines_with_long_inference_call_for_a_lighter_model():
    full = {"running": 250, "in_flight": 250, "kv_used_tokens": 470_000}
    verdict = diagnose(Figures((realtime(queued_requests=5, queued_work=1000, wait_s=0.8, drain_tps=1200,
                                         arrival_tps=1150, queue_wait_s=0.6, inference_s=18.0),),
                               (engine(**full),)))
    assert verdict.kind == "too_big"
    assert "light or quantised" in verdict.sentence and "18.0 s (median), 60% of its 30 s deadline" in verdict.sentence
    assert verdict.numbers["kv_used_share"] == 0.94 and verdict.numbers["running"] == 250


def test_full_engines_and_a_growing_queue_call_for_workers_sized_by_the_measured_drain():
    full = {"running": 240, "in_flight": 256}
    verdict = diagnose(Figures((realtime(queued_requests=30, queued_work=3000, wait_s=3.3, drain_tps=900,
                                         arrival_tps=1500, queue_wait_s=3.0, inference_s=4.0),),
                               (engine("w1", **full), engine("w2", **full))))
    assert verdict.kind == "add_capacity"
    # 1,500 tokens/s arrive; one worker drains 450: four keep up, two more than now.
    assert (verdict.numbers["per_worker_tps"], verdict.numbers["more_workers"]) == (450.0, 2)
    assert "arrives at 1,500 tokens/s and drains at 900" in verdict.sentence
    assert "add 2 workers like these (4 in all)" in verdict.sentence


def test_a_long_queue_admission_holds_steady_is_sized_to_wait_less_than_where_degrading_begins():
    # Admission refuses what cannot finish in time, so arrivals ≈ drain; the queue waits 20 s of 30.
    full = {"running": 256, "in_flight": 256}
    verdict = diagnose(Figures((realtime(queued_requests=180, queued_work=18000, wait_s=20.0, drain_tps=900,
                                         arrival_tps=880, queue_wait_s=19.0, inference_s=4.0),),
                               (engine("w1", **full), engine("w2", **full))))
    assert verdict.kind == "add_capacity" and "waits 20.0 s, 67% of the 30 s deadline" in verdict.sentence
    # 18,000 tokens drained within a quarter of the deadline (7.5 s) need 2,400 tokens/s: six workers.
    assert (verdict.numbers["needed_tps"], verdict.numbers["more_workers"]) == (2400.0, 4)


def test_capacity_is_not_sized_before_the_drain_was_measured():
    verdict = diagnose(Figures((realtime(queued_requests=30, queued_work=3000, wait_s=-1.0, arrival_tps=1500),),
                               (engine(running=256),)))
    assert verdict.kind == "add_capacity" and verdict.numbers["more_workers"] is None
    assert "not measured yet" in verdict.sentence


def test_short_waits_are_healthy_even_with_full_engines():
    busy = diagnose(Figures((realtime(queued_requests=2, queued_work=200, wait_s=0.2, drain_tps=900,
                                      arrival_tps=880, queue_wait_s=0.3, inference_s=4.0),),
                            (engine(running=250),)))
    assert busy.kind == "healthy" and "wait 0.3 s before they start and run 4.0 s" in busy.sentence
    quiet = diagnose(Figures((realtime(queue_wait_s=0.02, inference_s=2.5),), (engine(running=12),)))
    assert quiet.kind == "healthy" and "run 12 of 256 sequences on 1 worker." in quiet.sentence


def test_realtime_problems_come_before_batch_ones_and_any_problem_before_health():
    orphan = ClassFigures("batch", "summariser", deadline_s=86400.0, queued_requests=50, queued_work=5000)
    rt_growing = realtime(queued_requests=30, queued_work=3000, wait_s=3.3, drain_tps=900, arrival_tps=1500)
    assert diagnose(Figures((orphan, rt_growing), (engine(running=256),))).kind == "add_capacity"
    stuck = diagnose(Figures((realtime(queue_wait_s=0.1), orphan), (engine(running=3),)))
    assert stuck.kind == "batching" and stuck.numbers["class"] == "batch:summariser"


def test_without_the_monitors_figures_there_is_no_verdict():
    verdict = diagnose(Figures((), (engine(),)))
    assert verdict.kind == "no_figures" and "sluice monitor" in verdict.sentence


def test_the_command_reads_real_figures_and_names_the_queue_nobody_consumes(database_url, isolated, tmp_path):
    """Rows and queue counters from real submits, a real worker's heartbeat (it reads batch queues
    only), a snapshot from the monitor's own tick: the command must see realtime work unserved."""
    application, client, redis_url = isolated
    svc = services(application)
    model = svc.settings.registry.default.name
    worker = WorkerProcess(database_url, redis_url, tmp_path, role="batch", concurrency=2,
                           extra_env={"SLUICE_WORKER_METRICS_PORT": "0"})
    try:
        for i in range(3):
            assert client.submit(prompt=f"diagnose me {i}", max_tokens=20).status_code == 202
        Monitor(svc.settings, svc.redis, svc.db).tick()
        runner, env = CliRunner(), service_env(database_url, redis_url)
        as_json = runner.invoke(main, ["diagnose", "--json"], env=env)
        as_text = runner.invoke(main, ["diagnose"], env=env)
    finally:
        worker.stop()
    assert as_json.exit_code == 0, as_json.output
    report = json.loads(as_json.stdout)
    assert report["verdict"] == "batching", report
    assert f"3 requests wait in realtime:{model}" in report["sentence"] and "no warm worker" in report["sentence"]
    assert report["numbers"]["queued_requests"] == 3 and report["numbers"]["workers"] == 0
    rows = next(c for c in report["figures"]["classes"] if c["priority"] == "realtime")
    assert rows["arrival_tps"] >= 3 * 20 / 60 and rows["queue_wait_s"] is not None, "the request rows were read"
    engines = report["figures"]["engines"]
    assert len(engines) == 1 and worker.worker_key.endswith(engines[0]["worker"])
    assert {q for q in engines[0]["queues"] if q.startswith(("realtime.", "batch."))} == {"batch.small", "batch.large"}
    assert as_text.exit_code == 0 and as_text.stdout.startswith(f"batching: {report['sentence']}")
