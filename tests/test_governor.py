"""The in-engine limit (workers/governor.py): learned from the engine's steps, governed by the
deadlines of what runs, carried out by the worker's prefetch count; batch work yields to realtime;
the promise sees the engine's room, so an idle platform never locks its door."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import redis
from conftest import ApiClient, WorkerProcess, admitted_once_idle, make_settings
from sqlalchemy import select

from core.admission.load import room_key
from core.broker.queues import queue_lists
from launcher.harness import start_all, stop_all
from models import InferenceRequest, Status
from web.services import services
from workers.engines.base import StepSample
from workers.governor import MIN_PREFILL_CHUNK, Governor, StepCurve
from workers.monitor import Monitor
from workers.preemption import Claims


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cpu_curve(a: float = 0.010, b: float = 0.0015, c: float = 0.001) -> StepCurve:
    """A curve fed with steps of a compute-bound engine: a + b·seqs + c·prompt tokens seconds."""
    curve = StepCurve()
    for seqs in (1, 2, 4, 8, 16, 32, 64) * 20:
        curve.add(StepSample(a + b * seqs, seqs))
    for tokens in (100, 400, 800):
        curve.add(StepSample(a + b * 4 + c * tokens, 4, tokens))
    return curve


def test_a_prompt_token_is_never_priced_below_half_what_the_idle_warm_up_measured():
    """Steps slowed by other processes on the host (whatever they prefill) can make the fit put
    everything in the intercept and price a prompt token near zero; the promise would then count
    prompts as free and the prefill cap would let whole documents into one step. The warm-up's
    price, measured idle, holds a floor under it."""
    curve = cpu_curve(c=0.001)
    assert curve.coefficients()[2] == pytest.approx(0.001, rel=0.2)
    warm = curve.token_s()
    curve.hold_token_floor()
    for _ in range(3000):  # a crowded host: every step 0.3 s, prompts or not
        for tokens in (0, 200, 0, 800):
            curve.add(StepSample(0.3, 4, tokens))
    a, _, c = curve.coefficients()
    assert a > 0.1 and c >= 0.5 * warm * 0.999, (a, c)  # the noise is in the intercept; the token keeps half its price


@contextlib.contextmanager
def sim_runtime(redis_url: str, governor: Governor, speed: float, worker_id: str):
    """An engine runtime over the simulated engine at ``speed``, its loop running but none of its
    housekeeping threads (the governor learns nothing unless a test feeds it)."""
    import redis as redis_lib

    from workers.engines.simulated import SimulatedConfig, SimulatedEngine
    from workers.runtime import EngineRuntime

    client = redis_lib.Redis.from_url(redis_url, decode_responses=True)
    runtime = EngineRuntime(SimulatedEngine(SimulatedConfig(speed=speed)), client, worker_id,
                            heartbeat_s=1.0, dead_after_s=10.0, cancel_poll_s=0.5, governor=governor)
    loop_thread = threading.Thread(target=runtime._loop.run_forever, daemon=True)
    loop_thread.start()
    runtime._call(runtime.engine.start())
    try:
        yield runtime
    finally:
        runtime._call(runtime.engine.shutdown())
        runtime._loop.call_soon_threadsafe(runtime._loop.stop)
        loop_thread.join(timeout=10)
        runtime._loop.close()
        client.close()


def test_the_step_curve_learns_the_price_of_a_sequence_and_of_a_prompt_token():
    a, b, c = cpu_curve().coefficients()
    assert a == pytest.approx(0.010, rel=0.05)
    assert b == pytest.approx(0.0015, rel=0.05)
    assert c == pytest.approx(0.001, rel=0.1)


def test_the_step_curve_prices_a_long_prompt_by_the_context_its_chunks_attend_to():
    """Attention makes a prompt token dearer the further into its prompt it sits: an engine that
    prefills prompts of 200 to 3,000 tokens in chunks of 256 shows it in the steps that carry the
    later chunks. The curve follows each prompt through its chunks and prices a prompt of P tokens
    at c·P + d·P²/2; the linear price alone would run a quarter short at 3,000 tokens."""
    a, b, c, d = 0.010, 0.0015, 0.001, 1.7e-7
    curve = StepCurve()
    for seqs in (1, 2, 4, 8, 16) * 10:
        curve.add(StepSample(a + b * seqs, seqs))
    for n, length in enumerate((200, 3000, 800, 1500, 400, 2500, 1200) * 6):
        curve.note_prefill(length, batch=True, request_id=f"p{n}", now=0.0)
        done = 0
        while done < length:
            k = min(256, length - done)
            curve.add(StepSample(a + b * 4 + c * k + d * k * (done + k / 2), 4, k, at=1.0 + n))
            done += k
        assert curve.pending() == 0
    true_s = c * 3000 + d * 3000 ** 2 / 2
    assert curve.prefill_s(3000) == pytest.approx(true_s, rel=0.05)
    assert curve.prefill_s(200) == pytest.approx(c * 200 + d * 200 ** 2 / 2, rel=0.05)
    assert 3000 * curve.prompt_token_s() < 0.85 * true_s, "the linear part alone runs short"
    # A step's price for its prompt tokens counts the context they have had lately.
    assert c < curve.token_s() < c + d * 3000


def test_a_host_that_slows_at_once_is_priced_at_its_speed_now_not_at_its_calm_one():
    """The fit forgets over hundreds of steps. When the platform's own spike takes the CPUs the
    engine shares, every step runs slower at once: within a dozen steps the curve prices steps and
    prompts at that speed, the limit falls to keep the pace, and when the host is calm again the
    prices come back to the fit's, as they do while the engine is idle. Steps faster than the fit
    never price below it, and a batch bigger than any fitted is the fit's to learn."""
    clock = Clock()
    governor = Governor(cpu_curve(), max_seqs=256, default_pace_s=1.0, clock=clock)
    curve = governor.curve
    governor.enter("rt", batch=False, deadline_s=5.0, max_tokens=32)
    calm_step, calm_token, calm_limit = curve.step_s(8, 0), curve.prompt_token_s(), governor.limit()
    assert curve.slowdown() == pytest.approx(1.0, abs=0.01) and calm_limit > 20
    for _ in range(15):  # every decode step 1.6× what the fit says
        curve.add(StepSample(1.6 * (0.010 + 0.0015 * 8), 8))
    assert 1.4 < curve.slowdown() < 1.6
    assert curve.step_s(8, 0) > 1.4 * calm_step and curve.prompt_token_s() > 1.3 * calm_token
    assert governor.limit() < 0.75 * calm_limit
    # Idle, the engine shows no speed: what it showed fades.
    assert curve.slowdown(now=time.monotonic() + 1 + 5 * 5) < 1.01
    for _ in range(60):  # calm again; then faster than fitted
        curve.add(StepSample(0.010 + 0.0015 * 8, 8))
    assert curve.slowdown() == pytest.approx(1.0, abs=0.05)
    for _ in range(30):
        curve.add(StepSample(0.5 * (0.010 + 0.0015 * 8), 8))
    assert curve.slowdown() == 1.0 and curve.step_s(8, 0) <= calm_step * 1.01
    curve.add(StepSample(3 * (0.010 + 0.0015 * 128), 128))  # twice the biggest batch fitted
    assert curve.slowdown() == 1.0


def test_a_curve_that_saw_one_batch_size_stays_flat_and_opens_the_whole_engine():
    curve = StepCurve()
    for _ in range(50):
        curve.add(StepSample(0.02, 1))
    assert curve.coefficients()[1] == pytest.approx(0.0, abs=1e-6)
    governor = Governor(curve, max_seqs=64, default_pace_s=0.1)
    assert governor.limit() == 64


def test_the_tightest_pace_in_the_engine_sets_the_limit_and_recent_traffic_keeps_it():
    clock = Clock()
    governor = Governor(cpu_curve(c=0.0), max_seqs=256, default_pace_s=1.0, clock=clock)
    # Nothing seen: the default pace (1 s a token) allows the whole engine.
    assert governor.limit() == 256
    # 32 tokens in 5 s: a step may take 0.7 × 5/32 s = 109 ms → (0.109 − 0.010) / 0.0015 = 66 sequences.
    governor.enter("calm", batch=False, deadline_s=5.0, max_tokens=32)
    assert governor.limit() == 66
    # A batch request's hours-long deadline constrains nothing.
    governor.enter("bulk", batch=True, deadline_s=3600.0, max_tokens=512)
    assert governor.limit() == 66
    # 64 tokens in 4 s: 0.7 × 62.5 ms = 43.75 ms → 22 sequences. The tightest decides.
    governor.enter("tight", batch=False, deadline_s=4.0, max_tokens=64)
    assert governor.limit() == 22
    governor.leave("tight")
    governor.leave("calm")
    clock.now += 30
    assert governor.limit() == 22, "the traffic it came with is likely still arriving"
    clock.now += 31
    assert governor.limit() == 256, "a minute later only the batch request (and the default) remain"
    # 256 tokens in 1 s needs 2.7 ms steps, shorter than one sequence's 11.5 ms: it cannot finish
    # whatever the limit, so it throttles nobody.
    governor.enter("hopeless", batch=False, deadline_s=1.0, max_tokens=256)
    assert governor.limit() == 256, "the default pace (1 s a token) stands for the realtime traffic"


def test_a_request_whose_wait_left_too_little_time_is_not_started():
    assert Governor(StepCurve(), max_seqs=8, default_pace_s=1.0).tokens_take_s(10_000) is None, "unknown: try"
    governor = Governor(cpu_curve(c=0.0), max_seqs=64, default_pace_s=1.0, clock=Clock())
    # Alone in the engine a step takes 10 + 1.5 ms: 32 tokens need 0.37 s.
    assert 0.3 < governor.tokens_take_s(32) <= 0.5
    for i in range(31):
        governor.enter(f"r{i}", batch=False, deadline_s=30.0, max_tokens=32)
    # Beside 31 others a step takes 10 + 48 ms: 32 tokens need 1.86 s.
    assert 1.8 < governor.tokens_take_s(32) <= 1.9


def test_batch_yields_and_is_preempted_newest_first_while_realtime_waits():
    clock = Clock()
    governor = Governor(cpu_curve(c=0.0), max_seqs=8, default_pace_s=10.0, clock=clock)
    for i in range(8):
        clock.now += 1
        governor.enter(f"b{i}", batch=True, deadline_s=3600.0, max_tokens=256)
    assert not governor.batch_yields(0) and governor.preempt(0) == []
    assert governor.batch_yields(2)
    assert governor.preempt(2) == ["b7", "b6"], "room for the two realtime requests waiting, newest batch out"
    # A tight realtime request in the engine lowers the limit: batch over it leaves.
    governor.enter("rt", batch=False, deadline_s=0.5, max_tokens=16)  # 21.9 ms steps → 7 sequences
    assert governor.limit() == 7
    assert governor.preempt(0) == ["b7", "b6"]


def test_the_priority_tiers_queued_requests_take_default_work_out_never_a_stream():
    """A priority request queued while default work fills the engine: the newest default request
    leaves for it (batch work first, where there is any); a default request queued takes no
    default work out; a stream is never taken out; a capped request stays."""
    clock = Clock()
    governor = Governor(cpu_curve(c=0.0), max_seqs=4, default_pace_s=10.0, clock=clock)
    for rid, stream in (("d0", False), ("d1", True), ("d2", False)):
        clock.now += 1
        governor.enter(rid, batch=False, deadline_s=30.0, max_tokens=64, rank=1, stream=stream)
    clock.now += 1
    governor.enter("b0", batch=True, deadline_s=3600.0, max_tokens=64)
    assert governor.preempt(1, priority_queued=0) == ["b0"], "any realtime queued: batch leaves"
    clock.now += 1
    governor.enter("d3", batch=False, deadline_s=30.0, max_tokens=64, rank=1)  # over the limit by one
    assert governor.preempt(0) == ["b0"], "no priority request queued or in hand: no default work leaves"
    governor.leave("d3")
    assert governor.preempt(2, priority_queued=0) == ["b0"], "default queued takes no default work out"
    assert governor.preempt(1, priority_queued=1) == ["b0"], "batch leaving makes the room priority needs"
    assert governor.preempt(2, priority_queued=2) == ["b0", "d2"], "then the newest default request"
    assert governor.preempt(3, priority_queued=3) == ["b0", "d2", "d0"], "never the stream between them"
    assert governor.preempt(3, priority_queued=3, exempt_realtime=lambda ids: {"d2"}) == ["b0", "d0"]
    granted = []
    assert governor.preempt(2, priority_queued=2, grant_priority=lambda want, queued: granted.append(
        (want, queued)) or 0) == ["b0"], "another worker claimed the room"
    assert granted == [(1, 2)]
    governor.leave("b0")
    governor.enter("p0", batch=False, deadline_s=15.0, max_tokens=64, rank=0)
    assert governor.preempt(1, priority_queued=1) == ["d2"], "priority work itself is never taken out"


def test_a_priority_request_in_hand_sets_the_limit_and_the_default_work_over_it_leaves():
    """Eight default requests (30 s for 128 tokens) run at a limit of 16. A priority request of 64
    tokens in 2.4 s comes in: its pace at PRIORITY_SAFETY of its deadline (22.5 ms a step) governs,
    whatever the default paces seen (the limit falls to 8), and the newest default request over
    that limit leaves; when it is gone the limit is back."""
    from workers.governor import PRIORITY_SAFETY

    clock = Clock()
    governor = Governor(cpu_curve(c=0.0), max_seqs=16, default_pace_s=10.0, clock=clock)
    for i in range(8):
        clock.now += 1
        governor.enter(f"d{i}", batch=False, deadline_s=30.0, max_tokens=128, rank=1)
    assert governor.limit() == 16 and governor.preempt(0) == []
    clock.now += 1
    governor.enter("p", batch=False, deadline_s=2.4, max_tokens=64, rank=0)
    assert governor.limit() == int((PRIORITY_SAFETY * 2.4 / 64 - 0.010) / 0.0015) == 8
    assert governor.preempt(0) == ["d7"], "one over the limit: the newest default request"
    assert governor.preempt(0, exempt_realtime=lambda ids: {"d7"}) == ["d6"], "a capped one stays"
    governor.leave("p")
    assert governor.limit() == 16 and governor.preempt(0) == []


def test_the_wait_before_the_engine_lets_a_better_tier_go_first():
    """Requests waiting for room go in by tier, then in the order they came; batch after all."""
    clock = Clock()
    governor = Governor(cpu_curve(c=0.0), max_seqs=2, default_pace_s=10.0, clock=clock)
    governor.enter("running", batch=False, deadline_s=30.0, max_tokens=64, rank=1, seqs=2)
    assert governor.take_prefill(10, "running", batch=False)
    governor.enter("default", batch=False, deadline_s=30.0, max_tokens=64, rank=1)
    governor.enter("batch", batch=True, deadline_s=3600.0, max_tokens=64)
    governor.enter("priority", batch=False, deadline_s=15.0, max_tokens=64, rank=0)
    governor.leave("running")
    assert not governor.take_prefill(10, "default", batch=False), "the priority request came later, goes first"
    assert not governor.take_prefill(10, "batch", batch=True)
    assert governor.take_prefill(10, "priority", batch=False)


def test_prompts_are_prefilled_in_the_slack_the_realtime_steps_leave():
    """On a compute-bound engine one prompt prefilled whole in a step costs the realtime decoding
    beside it more than a step's budget: the engine is told to prefill no more per step than the
    budget leaves beside the decodes, and batch documents go in beside realtime, one at a time,
    for the engine to chunk; realtime prompts never wait behind a batch document."""
    governor = Governor(cpu_curve(), max_seqs=64, default_pace_s=1.0, clock=Clock())

    def prefilled(tokens: int) -> None:  # the engine's step that prefilled that many prompt tokens
        governor.curve.add(StepSample(0.010 + 0.0015 * 4 + 0.001 * tokens, 4, tokens))

    # No realtime seen: the default pace (1 s a token) leaves ~0.69 s a step, ~690 tokens.
    assert governor.prefill_cap_tokens() == pytest.approx(690, abs=5)
    governor.enter("rt", batch=False, deadline_s=5.0, max_tokens=32)  # pace 156 ms: budget 109 ms a step
    assert governor.take_prefill(0, "rt", batch=False)
    assert governor.step_budget_s() == pytest.approx(0.7 * 5.0 / 32)
    assert governor.prefill_cap_tokens() == pytest.approx(97, abs=3), "109 ms less one sequence's 11.5 ms"
    governor.enter("doc", batch=True, deadline_s=None, max_tokens=64, prompt_tokens=2000)
    assert governor.take_prefill(2000, "doc"), "beside realtime: the engine prefills it in the slack"
    governor.enter("doc2", batch=True, deadline_s=None, max_tokens=64, prompt_tokens=2000)
    assert not governor.take_prefill(2000, "doc2"), "one document over a step budget at a time"
    governor.enter("q", batch=False, deadline_s=5.0, max_tokens=32, prompt_tokens=400)
    assert governor.take_prefill(400, "q", batch=False), "a realtime prompt never waits behind batch prefill"
    # A step of ~109 ms prefills ~97 tokens beside the decodes: a prompt token takes ~1.1 ms of
    # the clock, more than its 1 ms of engine time; only realtime's prefill is ahead of realtime.
    clock_price = governor.stretch() * governor.curve.token_s()
    assert clock_price == pytest.approx(governor.step_budget_s() / governor.prefill_cap_tokens())
    assert governor.prompt_token_s() > governor.curve.prompt_token_s()
    assert governor.backlog_s(batch=False) == pytest.approx(governor.prefill_s(400))
    assert governor.prefill_s(400) >= 400 * governor.prompt_token_s()
    governor.enter("q2", batch=False, deadline_s=5.0, max_tokens=32, prompt_tokens=400)
    assert not governor.take_prefill(400, "q2", batch=False), "a burst goes in a step budget at a time"
    # The engine prefills in chunks, realtime's first: the ledger follows, and nothing is dropped
    # while chunks come, however many steps a document takes.
    for _ in range(4):
        prefilled(100)
    assert governor.curve.realtime_pending() == 0 and governor.curve.batch_pending() == 2000
    assert governor.take_prefill(400, "q2", batch=False)
    for _ in range(24):
        prefilled(100)
    assert governor.curve.pending() == 0
    assert governor.take_prefill(2000, "doc2")
    # Four steps with no prefill at all: what is still counted pending was never prefilled as counted.
    for _ in range(5):
        prefilled(0)
    assert governor.curve.pending() == 0
    # A pace that leaves less than a step's decodes: the cap stays at its floor, and prompts move on.
    tight = Governor(cpu_curve(), max_seqs=64, default_pace_s=0.015, clock=Clock())
    assert tight.prefill_cap_tokens() == MIN_PREFILL_CHUNK


def test_batch_prefill_does_not_lower_the_limit_realtime_prefill_does():
    a, b, c = 0.010, 0.0015, 0.001

    def limit_after(prompt_tokens: int, batch: bool) -> int:
        """The limit once every fourth step prefilled ``prompt_tokens``, of batch or realtime work."""
        governor = Governor(cpu_curve(a, b, c), max_seqs=256, default_pace_s=1.0, clock=Clock())
        governor.enter("rt", batch=False, deadline_s=5.0, max_tokens=32)
        governor.leave("rt")  # its pace stays in force (recent traffic); the engine is empty
        for _ in range(60):
            if batch:
                assert governor.take_prefill(prompt_tokens)
            governor.curve.add(StepSample(a + b * 4 + c * prompt_tokens, 4, prompt_tokens))
            for _ in range(3):
                governor.curve.add(StepSample(a + b * 4, 4))
        return governor.limit()

    none = limit_after(0, batch=False)
    assert none == 66, "(109 ms budget - 10 ms) / 1.5 ms a sequence"
    assert limit_after(200, batch=True) == none
    # 50 prompt tokens a step of realtime's own: ~50 ms of each step, (109 - 60) / 1.5 ≈ 33.
    assert 30 <= limit_after(200, batch=False) <= 36


def test_the_monitor_sums_the_governed_engines_and_waits_for_a_slot_only_when_all_are_full():
    from workers.monitor import engines

    full = {"engine_limit": 20, "limit_seq_tps": 10.0, "room": 0, "slot_wait_s": 1.5}
    free = {"engine_limit": 40, "limit_seq_tps": 5.0, "room": 12, "slot_wait_s": 0.0}
    both = engines([full, free])
    assert (both.drain_tps, both.seq_tps, both.room, both.slot_wait_s) == (400.0, 7.5, 12, 0.0)
    alone = engines([full, {**full, "slot_wait_s": 0.5}])
    assert (alone.room, alone.slot_wait_s) == (0, 0.5), "the first slot to free anywhere"
    assert engines([full, {"threads": 4}]) is None, "a worker without a limit: the measured drain instead"


# ---------------------------------------------------------------------------------- real workers

# The compute-bound profile, at its measured speed: a step takes ~11.5 ms + 1.45 ms per sequence.
# Realtime answers 32 tokens in 2 s by default: a step may take 0.7 × 62.5 ms, so ~20 sequences.
CPU = {"SLUICE_SIM_PROFILE": "cpu", "SLUICE_SIM_SPEED": "1.0", "SLUICE_REALTIME_DEADLINE_S": "2",
       "SLUICE_DEFAULT_MAX_TOKENS": "32"}


@pytest.fixture
def cpu_stack(database_url, scratch_redis_url, new_client, tmp_path):
    from web import create_app

    application = create_app(make_settings(database_url, scratch_redis_url, CPU))
    worker = WorkerProcess(database_url, scratch_redis_url, tmp_path, concurrency=64, extra_env=CPU)
    yield application, new_client(application), worker
    worker.stop()
    services(application).db.dispose()


def burst(client: ApiClient, n: int, **body) -> list:
    def one(i: int):
        return ApiClient(client.http.application, client.key).submit(prompt=f"burst {i}", ignore_eos=True, **body)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def wait_terminal(application, ids: list[str], timeout: float = 120) -> list[InferenceRequest]:
    deadline = time.monotonic() + timeout
    while True:
        with services(application).db.session() as session:
            rows = session.scalars(select(InferenceRequest).where(InferenceRequest.id.in_(ids))).all()
            session.expunge_all()
        if all(r.status.terminal for r in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def test_a_burst_enters_the_engine_only_as_far_as_its_deadlines_allow(cpu_stack):
    application, client, worker = cpu_stack
    limit = worker.wait_stats(lambda s: "engine_limit" in s)["engine_limit"]
    assert 4 <= limit < 64, f"the compute-bound engine's limit for 32 tokens in 2 s: {worker.stats()}"
    # No monitor: the promise stands on the worker's own capacity (its heartbeat), and refuses
    # what its queue cannot finish in 2 s; the limit holds the engine against what it admits.
    responses = burst(client, 64)
    refused = [r.get_json()["error"] for r in responses if r.status_code != 202]
    assert all(e["code"] == "overloaded" and e["details"]["estimated_from"] == "workers" for e in refused), refused
    ids = [r.get_json()["id"] for r in responses if r.status_code == 202]
    rows = wait_terminal(application, ids)
    stats = worker.stats()
    # The warm-up burst ran 16 sequences together; the 64 requests never ran more than the limit.
    # The limit moves with every step learned (a heartbeat shows one value of it a second), so the
    # engine is held to the highest limit the governor set, which the worker reports.
    assert stats["max_batch_seen"] <= max(16, stats["engine_limit_peak"]) < 64, stats
    # What did not fit waited in the queue, where the promise sees it, and expired there unrun.
    statuses = {r.status for r in rows}
    assert statuses <= {Status.SUCCEEDED, Status.EXPIRED}, statuses
    assert any(r.status == Status.SUCCEEDED for r in rows)


def test_the_worker_writes_its_engines_room_as_requests_enter_and_leave(cpu_stack):
    application, client, worker = cpu_stack
    svc = services(application)
    key = room_key("realtime", svc.settings.registry.default.name)
    me = worker.wait_stats(lambda s: "engine_limit" in s)["worker"]

    def room() -> int | None:
        raw = svc.redis.hget(key, me)
        return None if raw is None else int(raw.split()[0])

    deadline = time.monotonic() + 30
    while not room() and time.monotonic() < deadline:
        time.sleep(0.05)
    idle = room()
    assert idle, (svc.redis.hgetall(key), worker.stats())
    # Watched from before the burst (a burst's peak may pass before its last submit returns): the
    # room falls as requests enter, between the heartbeats (seconds apart), and comes back. The
    # burst keeps the default deadline: a looser one would loosen the governing pace and raise the
    # limit above the idle figure, so a slowly arriving burst (a loaded host) could hold sequences
    # without the room ever reading below it. At the default pace or tighter the limit stays at
    # or under the idle one, and any request inside lowers the room.
    seen: list[int | None] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(room())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ids = [r.get_json()["id"] for r in burst(client, 64) if r.status_code == 202]
    assert ids, "some of the burst fits the engine's room"
    wait_terminal(application, ids)
    done.set()
    watcher.join(5)
    assert min(r for r in seen if r is not None) < idle, sorted(set(seen))
    deadline = time.monotonic() + 30
    while not room() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert room(), (svc.redis.hgetall(key), worker.stats())
    # A worker the monitor no longer sees alive leaves nothing behind; one that stops cleans up.
    svc.redis.hset(key, "a-killed-worker", 5)
    Monitor(svc.settings, svc.redis, svc.db).tick()
    assert svc.redis.hkeys(key) == [me]
    worker.stop()
    assert not svc.redis.exists(key)


def test_an_idle_platform_admits_a_default_request_after_an_overload(cpu_stack):
    application, client, worker = cpu_stack
    svc = services(application)
    monitor = Monitor(svc.settings, svc.redis, svc.db)
    worker.wait_stats(lambda s: "engine_limit" in s)
    monitor.tick()
    # The overload: more than the engine can finish in time; the live queue counters show it at once.
    responses = burst(client, 64)
    for _ in range(4):
        time.sleep(0.5)
        monitor.tick()
        responses += burst(client, 16)
    ids = [r.get_json()["id"] for r in responses if r.status_code == 202]
    refused = [r for r in responses if r.status_code == 503]
    assert refused and ids, "an overload the promise saw: some requests refused at once, some served"
    assert all(r.get_json()["error"]["details"]["reason"] == "deadline" for r in refused)
    wait_terminal(application, ids)
    response = admitted_once_idle(client, worker, monitor)
    assert response.status_code == 202, response.get_json()


def test_a_starved_engine_is_slow_not_hung_and_the_watchdog_lets_it_finish(database_url, scratch_redis_url,
                                                                           new_client, tmp_path):
    from web import create_app

    # Every step takes 5 s once the engine serves its first request, against a 2 s watchdog: the
    # engine is working on each step all along (a host whose CPU other processes take), so it must
    # not be restarted.
    env = {"SLUICE_SIM_STARVE_AFTER_S": "0", "SLUICE_WORKER_WATCHDOG_S": "2"}
    application = create_app(make_settings(database_url, scratch_redis_url, env))
    worker = WorkerProcess(database_url, scratch_redis_url, tmp_path, concurrency=4, extra_env=env)
    try:
        client = new_client(application)
        worker.wait_stats(lambda s: "engine_limit" in s)
        request_id = client.submit(prompt="slow going", max_tokens=3, ignore_eos=True).get_json()["id"]
        view = client.wait(request_id, timeout=60)
        assert view["status"] == "succeeded", view
        assert worker.proc.poll() is None, "the watchdog restarted a slow engine"
        log = worker.log_path.read_text()
        assert "slow, not hung" in log and "watchdog:" not in log
    finally:
        worker.stop()
        services(application).db.dispose()


def test_batch_in_a_full_engine_makes_room_for_realtime_and_still_finishes(database_url, scratch_redis_url,
                                                                          new_client, tmp_path):
    from web import create_app

    # Eight threads, every one of them open to batch work: the in-engine limit is the thread count
    # (the deadlines would allow ~20), so eight long batch requests fill the engine and no slot
    # frees on its own for ~10 s. A realtime request must get in by preemption.
    env = {**CPU, "SLUICE_WORKER_REALTIME_THREADS": "0"}
    application = create_app(make_settings(database_url, scratch_redis_url, env))
    worker = WorkerProcess(database_url, scratch_redis_url, tmp_path, concurrency=8, extra_env=env)
    try:
        client = new_client(application)
        assert worker.wait_stats(lambda s: "engine_limit" in s)["engine_limit"] == 8
        batch = burst(client, 8, priority="batch", max_tokens=400)
        assert all(r.status_code == 202 for r in batch)
        full = worker.wait_stats(lambda s: s.get("batch_in_flight", 0) == 8, timeout=20)
        assert full["batch_in_flight"] == 8, full
        # A deadline with room to spare: the slot it waits for is ~1 s away by the curve, near the
        # promise's margin on the class's 2 s default (this test is about who yields, not the promise).
        realtime = client.submit(prompt="let me in", max_tokens=8, ignore_eos=True, deadline_s=10)
        view = client.wait(realtime.get_json()["id"], timeout=60)
        assert view["status"] == "succeeded", view
        rows = wait_terminal(application, [r.get_json()["id"] for r in batch])
        assert {r.status for r in rows} == {Status.SUCCEEDED}, "preempted batch work is requeued and finishes"
        assert max(r.attempts for r in rows) <= 1, "a preemption spends no attempt"
        assert "preempting 1 request(s) (1 realtime queued" in worker.log_path.read_text()
    finally:
        worker.stop()
        services(application).db.dispose()


def test_a_claim_is_granted_on_the_queue_as_it_is_not_as_a_worker_read_it(scratch_redis_url):
    """One queued realtime message, two workers: the first claims the preemption. The message is
    consumed and the first releases its claim; the second, whose governor read the queue before
    that (a starved thread: in a 4-process run the read and the grant were ~1 s apart), asks with
    its stale count and is granted nothing, since the claim reads the lists again."""
    client = redis.Redis.from_url(scratch_redis_url)
    lists = queue_lists("realtime.small")  # one list per priority step
    client.delete(*lists)
    first, second = (Claims(client, worker, "m", lists=lists) for worker in ("w1", "w2"))
    client.rpush(lists[0], "a question")
    assert first.grant(1, 1) == 1
    assert second.grant(1, 1) == 0, "the first one's claim stands"
    client.lpop(lists[0])  # consumed...
    first.release()  # ... and seen gone by the first worker
    assert second.grant(1, 1) == 0, "a count read before the message left grants nothing"
    client.rpush(lists[1], "another question")
    assert second.grant(1, 1) == 1, "one queued now (at another step), granted"
    client.close()


def test_one_queued_realtime_request_makes_one_of_two_full_workers_yield(database_url, scratch_redis_url,
                                                                        new_client, tmp_path):
    """Two workers, both full of long batch work, read the same realtime queue. One question
    queued: one batch request is preempted in the whole fleet, not one per worker that saw it."""
    from web import create_app

    env = {**CPU, "SLUICE_WORKER_REALTIME_THREADS": "0"}
    application = create_app(make_settings(database_url, scratch_redis_url, env))
    workers = start_all(*[partial(WorkerProcess, database_url, scratch_redis_url, tmp_path, concurrency=8,
                                  extra_env=env)] * 2)
    try:
        client = new_client(application)
        for worker in workers:
            assert worker.wait_stats(lambda s: "engine_limit" in s)["engine_limit"] == 8
        # Long enough that neither worker can finish its eight and take the other's before that
        # one reads the queue: in a 4-process run on a slow host one worker had none 30 s later.
        batch = burst(client, 16, priority="batch", max_tokens=1200)
        assert all(r.status_code == 202 for r in batch)
        for worker in workers:
            full = worker.wait_stats(lambda s: s.get("batch_in_flight", 0) == 8, timeout=30)
            assert full["batch_in_flight"] == 8, full
        # A deadline with room to spare: the slot it waits for is ~1 s away by the curve, near the
        # promise's margin on the class's 2 s default (this test is about who yields, not the promise).
        realtime = client.submit(prompt="let me in", max_tokens=8, ignore_eos=True, deadline_s=10)
        assert realtime.status_code == 202, json.dumps([realtime.get_json(), [w.stats() for w in workers]])
        view = client.wait(realtime.get_json()["id"], timeout=60)
        assert view["status"] == "succeeded", view
        rows = wait_terminal(application, [r.get_json()["id"] for r in batch])
        assert {r.status for r in rows} == {Status.SUCCEEDED}, "preempted batch work is requeued and finishes"
        logs = "".join(w.log_path.read_text() for w in workers)
        preempted = sum(int(line.split("preempting ")[1].split()[0])
                        for line in logs.splitlines() if "preempting " in line)
        assert preempted == 1, [line for line in logs.splitlines() if "preempting " in line]
    finally:
        stop_all(workers)
        services(application).db.dispose()


def test_the_runtime_drops_a_request_its_wait_left_too_little_time_and_runs_one_it_cannot_judge(redis_url):
    """Not started: the whole deadline would have fit by the curve, what the queue left does not.
    Run: what is left fits, or even the whole deadline was too short (admission let it in to
    measure, and the curve may be wrong)."""
    from workers.engines.base import GenerationRequest, SamplingParams

    governor = Governor(cpu_curve(c=0.0), max_seqs=8, default_pace_s=1.0)  # 11.5 ms a step alone
    with sim_runtime(redis_url, governor, 1000.0, "test-unreachable") as runtime:
        def run(rid: str, left_s: float, whole_s: float):
            params = SamplingParams(max_tokens=32, ignore_eos=True)
            request = GenerationRequest(request_id=rid, prompt="q", params=params)
            return runtime.run(request, time_limit_s=60.0, deadline_in_s=left_s, deadline_s=whole_s)

        dropped = run("late", left_s=0.2, whole_s=5.0)  # 32 tokens need 0.37 s
        assert dropped.ended_by == "unreachable" and dropped.output is None
        assert governor.in_engine() == (0, 0)
        assert run("in-time", left_s=4.0, whole_s=5.0).ended_by == "finished"
        assert run("unjudged", left_s=0.2, whole_s=0.3).ended_by == "finished", "the sim is faster than the curve"


def test_a_batch_request_waiting_beside_realtime_for_room_is_handed_back_if_preempted(redis_url):
    """Beside a realtime request whose sequences fill the limit, a batch request waits outside the
    engine; preempted meanwhile, it ends `preempted` (handed back, requeued) without the engine
    ever seeing it; once the realtime has left, batch goes in at once."""
    from workers.engines.base import TIER_RANK, GenerationRequest, SamplingParams

    governor = Governor(cpu_curve(), max_seqs=8, default_pace_s=1.0)

    def request(rid: str, priority: int, max_tokens: int, n: int = 1) -> GenerationRequest:
        return GenerationRequest(request_id=rid, prompt="q " * 200, priority=priority, prompt_tokens=400,
                                 params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n))

    with sim_runtime(redis_url, governor, 1.0, "test-prefill-wait") as runtime, ThreadPoolExecutor(2) as pool:
        realtime = pool.submit(runtime.run, request("rt", 0, 4000, n=8), 60.0)
        deadline = time.monotonic() + 10
        while governor.in_engine() != (1, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        batch = pool.submit(runtime.run, request("batch", TIER_RANK["batch"], 8), 60.0)
        while governor.in_engine() != (2, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert not batch.done(), "the realtime request's eight sequences fill the limit: batch waits"
        assert runtime.engine.stats().prompt_tokens == 8 * 400, "only the realtime sequences reached the engine"
        with runtime._lock:
            runtime._preempted.add("batch")  # what govern_once does when realtime needs the room
        assert batch.result(timeout=5).ended_by == "preempted"
        assert runtime.engine.stats().prompt_tokens == 8 * 400
        runtime._call(runtime.engine.abort("rt"))
        assert realtime.result(timeout=10).ended_by == "engine_abort", "aborted, cancelled by nobody"
        assert governor.in_engine() == (0, 0)
        assert runtime.run(request("alone", TIER_RANK["batch"], 4), 60.0).ended_by == "finished", "no realtime: at once"
