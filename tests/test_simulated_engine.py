"""The simulated engine: batching, KV limits, priority, abort, text contract, cost model.

Every assertion is about counts and states (steps, batch sizes, finish reasons, KV tokens),
never wall-clock time, so the file cannot flake on a slow machine.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from workers.engines.base import GenerationOutput, GenerationRequest, SamplingParams
from workers.engines.simulated import MARKER, PROFILES, SimulatedConfig, SimulatedEngine, step_time_s

FAST = SimulatedConfig(speed=1000.0)


def req(rid: str, max_tokens: int = 16, *, prompt: str = "hello", priority: int = 0,
        prompt_tokens: int | None = 32, seed: int | None = 0,
        stop: tuple[str, ...] = ()) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, seed=seed, stop=stop),
                             priority=priority, prompt_tokens=prompt_tokens)


async def collect(engine: SimulatedEngine, request: GenerationRequest,
                  started: list[str] | None = None) -> list[GenerationOutput]:
    outs = []
    async for out in engine.generate(request):
        if started is not None and not outs:
            started.append(request.request_id)
        outs.append(out)
    return outs


async def until(predicate, limit: int = 100_000) -> None:
    """Yield to the event loop until ``predicate()`` holds (bounded, no wall clock)."""
    for _ in range(limit):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


def run(config: SimulatedConfig, body):
    async def main():
        engine = SimulatedEngine(config)
        await engine.start()
        try:
            # A hang guard only, far above the ~0.1 s these take: a deadlock fails, not stalls.
            return await asyncio.wait_for(body(engine), 60)
        finally:
            await engine.shutdown()
    return asyncio.run(main())


def test_concurrent_requests_are_batched():
    async def body(engine):
        results = await asyncio.gather(*(collect(engine, req(f"r{i}")) for i in range(32)))
        return results, engine.stats()
    results, stats = run(FAST, body)
    assert all(r[-1].finished and r[-1].finish_reason == "length" for r in results)
    assert all(r[-1].output_tokens == 16 for r in results)
    assert stats.max_batch_seen > 1
    # One request alone needs 16 steps; 32 of them one by one would need 512.
    assert stats.steps <= 16 + 4
    assert stats.generated_tokens == 32 * 16 and stats.prompt_tokens == 32 * 32
    single = step_time_s(FAST, prefill_tokens=32) + sum(
        step_time_s(FAST, decode_seqs=1, context_tokens=32 + k) for k in range(1, 16))
    assert stats.extra["simulated_time_s"] < 0.1 * 32 * single
    assert stats.kv_used_tokens == 0 and stats.running == 0 and stats.waiting == 0


def test_abort_running_request_frees_kv():
    async def body(engine):
        gen = engine.generate(req("a", max_tokens=100_000))
        first = await gen.__anext__()
        assert first.output_tokens == 1 and engine.stats().kv_used_tokens > 0
        await engine.abort("a")
        final = await gen.__anext__()
        return first, final, engine.stats()
    first, final, stats = run(FAST, body)
    assert final.finished and final.finish_reason == "abort"
    assert final.text.startswith(first.text) and final.output_tokens >= 1
    assert stats.kv_used_tokens == 0 and stats.running == 0 and stats.aborted == 1


def test_abort_running_request_keeps_others_kv():
    async def body(engine):
        gens = {rid: engine.generate(req(rid, max_tokens=100_000)) for rid in ("a", "b")}
        for gen in gens.values():
            await gen.__anext__()
        await engine.abort("a")
        assert (await gens["a"].__anext__()).finish_reason == "abort"
        left = engine.stats().kv_used_tokens
        b_blocks = engine._seqs["b"].blocks
        await engine.abort("b")
        return left, b_blocks * FAST.block_size, engine.stats().kv_used_tokens
    left, b_holds, after = run(FAST, body)
    assert left == b_holds > 0 and after == 0


def test_abort_waiting_request():
    async def body(engine):
        blocker = engine.generate(req("a", max_tokens=100_000))
        await blocker.__anext__()
        waiter = asyncio.create_task(collect(engine, req("b")))
        await until(lambda: engine.stats().waiting == 1)
        kv_before = engine.stats().kv_used_tokens
        await engine.abort("b")
        outs = await waiter
        stats = engine.stats()
        await engine.abort("a")
        return outs, kv_before, stats
    outs, kv_before, stats = run(dataclasses.replace(FAST, max_num_seqs=1), body)
    assert len(outs) == 1 and outs[0].finish_reason == "abort" and outs[0].output_tokens == 0
    assert outs[0].text == MARKER
    assert stats.waiting == 0 and stats.running == 1 and stats.kv_used_tokens == kv_before


def test_priority_zero_jumps_the_queue():
    async def body(engine):
        started: list[str] = []
        blocker = engine.generate(req("blocker", max_tokens=100_000, priority=1))
        await blocker.__anext__()
        tasks = [asyncio.create_task(collect(engine, req(f"batch{i}", 4, priority=1), started))
                 for i in range(3)]
        await until(lambda: engine.stats().waiting == 3)
        tasks.append(asyncio.create_task(collect(engine, req("rt", 4, priority=0), started)))
        await until(lambda: engine.stats().waiting == 4)
        await engine.abort("blocker")
        await asyncio.gather(*tasks)
        return started
    started = run(dataclasses.replace(FAST, max_num_seqs=1), body)
    assert started == ["rt", "batch0", "batch1", "batch2"]


def test_sequences_beyond_kv_capacity_wait_and_finish():
    # 64 tokens = 4 blocks; each request needs 2 blocks to start and 3 to finish.
    config = dataclasses.replace(FAST, kv_capacity_tokens=64)

    async def body(engine):
        tasks = [asyncio.create_task(collect(engine, req(f"r{i}", 20, prompt_tokens=20)))
                 for i in range(4)]
        await until(lambda: engine.stats().waiting + engine.stats().running == 4)
        waiting_seen = engine.stats().waiting
        results = await asyncio.gather(*tasks)
        return waiting_seen, results, engine.stats()
    waiting_seen, results, stats = run(config, body)
    assert waiting_seen >= 2 and stats.max_batch_seen <= 2
    assert [r[-1].finish_reason for r in results] == ["length"] * 4
    assert all(r[-1].output_tokens == 20 for r in results)
    assert stats.kv_used_tokens == 0 and stats.kv_capacity_tokens == 64


def test_request_larger_than_kv_capacity_is_rejected():
    async def body(engine):
        with pytest.raises(ValueError):
            await collect(engine, req("big", 100, prompt_tokens=100))
    run(dataclasses.replace(FAST, kv_capacity_tokens=64), body)


def test_duplicate_in_flight_id_is_rejected():
    async def body(engine):
        gen = engine.generate(req("dup", max_tokens=100_000))
        await gen.__anext__()
        with pytest.raises(ValueError):
            await collect(engine, req("dup"))
        await engine.abort("dup")
        assert (await gen.__anext__()).finish_reason == "abort"
        return await collect(engine, req("dup", 2))  # a finished id may be reused
    assert run(FAST, body)[-1].finish_reason == "length"


def test_text_is_deterministic_marked_and_honours_limits():
    async def body(engine):
        a = await collect(engine, req("a", 12, prompt="same prompt", seed=7))
        b = await collect(engine, req("b", 12, prompt="same prompt", seed=7))
        c = await collect(engine, req("c", 12, prompt="same prompt", seed=8))
        d = await collect(engine, req("d", 12, prompt="same prompt", seed=7, prompt_tokens=None))
        return a, b, c, d
    a, b, c, d = run(FAST, body)
    assert a[-1].text == b[-1].text == d[-1].text != c[-1].text
    assert a[-1].text.startswith(MARKER) and len(a[-1].text.split()) == 13  # marker + 12 words
    assert a[-1].output_tokens == 12 and a[-1].finish_reason == "length"
    assert a[0].output_tokens == 1 and not a[0].finished  # first-token output for TTFT
    assert d[-1].prompt_tokens == 3  # ceil(len(b"same prompt") / 4)


def test_stop_string_truncates_and_finishes():
    async def body(engine):
        full = (await collect(engine, req("full", 12, seed=3)))[-1].text
        word = full[len(MARKER):].split()[5]
        stopped = (await collect(engine, req("stop", 12, seed=3, stop=(word,))))[-1]
        return full, word, stopped
    full, word, stopped = run(FAST, body)
    assert stopped.finish_reason == "stop" and stopped.finished
    assert stopped.text == full[:full.index(word, len(MARKER))]
    assert word not in stopped.text[len(MARKER):] and stopped.output_tokens <= 6


def test_cancelling_the_consumer_aborts_the_request():
    async def body(engine):
        got_first = asyncio.Event()

        async def consume():
            async for _ in engine.generate(req("c", max_tokens=100_000)):
                got_first.set()
        task = asyncio.create_task(consume())
        await got_first.wait()
        assert engine.stats().running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return engine.stats()
    stats = run(FAST, body)
    assert stats.running == 0 and stats.kv_used_tokens == 0 and stats.aborted == 1


def test_shutdown_aborts_in_flight_requests():
    async def main():
        engine = SimulatedEngine(FAST)
        await engine.start()
        task = asyncio.create_task(collect(engine, req("s", max_tokens=100_000)))
        await until(lambda: engine.stats().running == 1)
        await engine.shutdown()
        outs = await asyncio.wait_for(task, 60)
        return outs, engine.stats()
    outs, stats = asyncio.run(main())
    assert outs[-1].finish_reason == "abort" and stats.running == 0 and stats.kv_used_tokens == 0


def test_stats_describe_a_simulated_engine():
    stats = SimulatedEngine().stats()
    assert stats.simulated and stats.engine == "simulated" and stats.model == "simulated-llama-8b"
    # (141e9 * 0.9 - 15e9) / 131072, rounded down to 16-token blocks
    assert 853_000 < stats.kv_capacity_tokens <= 853_729


@pytest.mark.parametrize(("batch", "context", "measured_ms"), [
    (1, 512, 4.61), (8, 512, 4.80), (64, 512, 5.79), (256, 512, 11.48),
    (1, 2048, 4.65), (32, 2048, 6.59), (128, 2048, 13.96), (256, 2048, 22.51),
])
def test_decode_step_time_matches_h200_calibration(batch, context, measured_ms):
    model_ms = step_time_s(SimulatedConfig(), decode_seqs=batch, context_tokens=batch * context) * 1e3
    assert abs(model_ms / measured_ms - 1) < 0.25


@pytest.mark.parametrize(("tokens", "measured_ms"), [(512, 11.4), (2048, 43.4), (8192, 199.7)])
def test_prefill_time_matches_h200_calibration(tokens, measured_ms):
    model_ms = step_time_s(SimulatedConfig(), prefill_tokens=tokens) * 1e3
    assert abs(model_ms / measured_ms - 1) < 0.05


def test_a_chunk_late_in_a_long_prompt_costs_more_than_its_first():
    """Attention: each chunk of a prompt attends to every token before it, so the prompt's chunks
    cost more the later they come, and a prompt's arithmetic is the same chunked or whole (each
    step also reads the weights once)."""
    cpu = PROFILES["cpu"]
    first = step_time_s(cpu, prefill_tokens=512, attention_pairs=512 * 256)
    last = step_time_s(cpu, prefill_tokens=512, attention_pairs=512 * (3584 + 256))
    assert last > first * 1.3
    whole = step_time_s(cpu, prefill_tokens=4096)
    chunked = sum(step_time_s(cpu, prefill_tokens=512, attention_pairs=512 * (start + 256))
                  for start in range(0, 4096, 512))
    assert chunked == pytest.approx(whole + 7 * cpu.weight_bytes / cpu.memory_bandwidth, rel=1e-9)
    # What a CPU measured (docs/benchmarks.md, bench/step_curve.py --prompts): 211 ns per prompt
    # token per token before it, where the profile's arithmetic says 196.
    assert cpu.attention_flops / cpu.prefill_flops == pytest.approx(211e-9, rel=0.1)


def test_a_prefill_cap_chunks_long_prompts_and_prefills_realtime_first():
    """With a cap set, no step prefills more than the cap; a realtime prompt that arrives while a
    batch document is part way through its prefill is prefilled first, and the document goes on
    in chunks after it (as Sluice's vLLM scheduler does)."""
    async def body(engine):
        engine.set_prefill_cap(64)
        started: list[str] = []
        decoding = asyncio.ensure_future(collect(engine, req("rt-decoding", 200), started))
        await until(lambda: started == ["rt-decoding"])
        engine.step_samples()
        doc = asyncio.ensure_future(collect(engine, req("doc", 4, priority=1, prompt_tokens=2000), started))
        await until(lambda: engine.stats().prompt_tokens > 64 * 3)  # some chunks of it are in
        question = asyncio.ensure_future(collect(engine, req("question", 4, prompt_tokens=300), started))
        await asyncio.gather(decoding, doc, question)
        return started, engine.step_samples(), engine.stats()
    started, steps, stats = run(SimulatedConfig(speed=50.0), body)
    assert max(s.prompt_tokens for s in steps) <= 64, [s.prompt_tokens for s in steps]
    assert sum(s.prompt_tokens for s in steps) == 2000 + 300
    assert started.index("question") < started.index("doc"), started
    assert stats.generated_tokens == 200 + 4 + 4
