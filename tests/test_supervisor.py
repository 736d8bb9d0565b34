"""`sluice up`'s process manager keeps a crash-looping worker coming back, ever more slowly,
instead of giving up after a few restarts and taking the whole stack down (issue 35): six
requests that each killed a worker used to end `sluice up`."""

from __future__ import annotations

import sys
import time

from launcher import supervisor
from workers.runtime import EngineRuntime


def test_a_worker_that_keeps_dying_by_its_watchdog_is_restarted_with_backoff_and_never_given_up(
        tmp_path, monkeypatch):
    (tmp_path / "logs").mkdir()
    platform = supervisor.Platform(data_dir=tmp_path)
    delays: list[float] = []
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", (0.01, 0.08))  # the same doubling, in milliseconds
    real_delay = supervisor.restart_delay
    monkeypatch.setattr(supervisor, "restart_delay", lambda restarts: delays.append(real_delay(restarts)) or delays[-1])
    dies = [sys.executable, "-c", f"import sys; sys.exit({EngineRuntime.WATCHDOG_EXIT_CODE})"]
    platform.spawn("worker", dies, {})
    child = platform.children[0]
    starts = {child.proc.pid}
    deadline = time.monotonic() + 120
    while len(starts) < 9:  # eight restarts: past the five after which it used to give up
        assert platform.dead() is None, "a worker dying by its watchdog is restarted, not reported"
        starts.add(child.proc.pid)
        assert time.monotonic() < deadline, f"only {len(starts)} starts"
        time.sleep(0.005)
    assert delays[:8] == [0.01, 0.02, 0.04, 0.08, 0.08, 0.08, 0.08, 0.08]
    child.proc.wait()


def test_a_worker_that_fails_as_it_starts_is_reported_not_restarted(tmp_path):
    (tmp_path / "logs").mkdir()
    platform = supervisor.Platform(data_dir=tmp_path)
    platform.spawn("worker", [sys.executable, "-c", "import sys; sys.exit(3)"], {})
    platform.children[0].proc.wait()
    problem = platform.dead()
    assert problem is not None and "worker exited unexpectedly (code 3)" in problem
