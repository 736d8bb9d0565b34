"""Settings that are derived from others, and the worker command line built from them."""

from __future__ import annotations

import pytest

from launcher.argv import worker_argv
from sluice.settings import LADDER_STEPS, Settings, SettingsError


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
