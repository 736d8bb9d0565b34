"""Settings that are derived from others, and the worker command line built from them."""

from __future__ import annotations

import pytest

from core.settings import LADDER_STEPS, Settings, SettingsError
from launcher.argv import worker_argv


def concurrency_of(argv: list[str]) -> int:
    return int(argv[argv.index("--concurrency") + 1])


def test_worker_threads_default_to_the_engine_batch_size():
    # Fewer threads than the engine's batch size would cap the batch the engine can form.
    assert concurrency_of(worker_argv(Settings.from_env({}), "all")) == 256
    assert concurrency_of(worker_argv(Settings.from_env({"SLUICE_VLLM_MAX_NUM_SEQS": "64"}), "all")) == 64
    assert concurrency_of(worker_argv(Settings.from_env({"SLUICE_WORKER_CONCURRENCY": "12"}), "all")) == 12
    assert concurrency_of(worker_argv(Settings.from_env({}), "all", concurrency=5)) == 5
    with pytest.raises(SettingsError, match="SLUICE_WORKER_CONCURRENCY must be > 0"):
        Settings.from_env({"SLUICE_WORKER_CONCURRENCY": "0"})


def test_worker_queues_are_listed_in_order_of_preference():
    argv = worker_argv(Settings.from_env({}), "all", name="w1@host")
    assert argv[argv.index("--queues") + 1].split(",") == [
        "maintenance", "direct.w1@host", "realtime.small", "realtime.large", "batch.small", "batch.large"]


def test_ladder_steps_are_chosen_one_by_one_or_all_switched_off():
    assert Settings.from_env({}).ladder == LADDER_STEPS
    assert Settings.from_env({"SLUICE_LADDER_STEPS": "none"}).ladder == ()
    assert Settings.from_env({"SLUICE_LADDER_STEPS": "shed, reject_batch"}).ladder == ("shed", "reject_batch")
    with pytest.raises(SettingsError, match="unknown steps gpu"):
        Settings.from_env({"SLUICE_LADDER_STEPS": "gpu"})


def test_the_compose_deployment_stays_under_postgres_max_connections():
    """Every process holds up to pool + overflow connections; compose's sum must fit its server."""
    import re
    from pathlib import Path

    import yaml

    compose = yaml.safe_load((Path(__file__).resolve().parent.parent / "docker-compose.yml").read_text())
    services = compose["services"]
    command = " ".join(services["postgres"]["command"])
    max_connections = int(re.search(r"max_connections=(\d+)", command).group(1))
    settings = Settings.from_env({})
    per_process = settings.db_pool_size + settings.db_max_overflow
    processes = 0
    for service in services.values():
        argv = service.get("command") or []
        if argv[:1] != ["sluice"] or argv[1] == "migrate":  # migrate holds one connection, then exits
            continue
        processes += settings.web_workers if argv[1] == "web" else 1
    reserved = 3  # PostgreSQL's superuser_reserved_connections
    assert processes >= 7 and processes * per_process + 1 <= max_connections - reserved, (processes, per_process)
