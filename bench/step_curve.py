"""How an engine step's time grows with the batch: the figures behind the simulated engine's `cpu`
profile (docs/calibration.md) and the curve a worker's governor learns (workers/governor.py).

    .venv/bin/python bench/step_curve.py --shape 92m --pin-engine 0     # the 94M model, engine on core 0
    .venv/bin/python bench/step_curve.py                                # the tiny test model (overhead only)
    .venv/bin/python bench/step_curve.py --shape 92m --prompts 200,500,1000,2000,3000,3800

Runs Sluice's own vLLM engine (workers/engines/vllm.py), no worker around it.

Without ``--prompts``: for each batch size, that many ~40-token prompts generating --tokens tokens
together, every step timed from vLLM's per-step statistics (VllmEngine.step_samples). Prints the
median decode step and the prefill steps.

With ``--prompts``: what a prompt of each length costs, against what the worker's step curve
(workers/governor.py StepCurve) predicts before it runs. Prompts of those lengths (words no two
share, so the prefix cache holds none) go in one at a time, shuffled, --rounds times, beside one
sequence decoding all along (as a worker's warm-up does: a step is timed from the one before),
chunked at --chunk tokens a step. Each is timed from submit to its first token. The prediction
is made from the steps seen so far: its chunks' steps at the curve's price (the linear part and
the attention to the context before each chunk), against a fit of the same steps with a linear
price only (what the governor used before the attention term). Prints the last round's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


async def measure(args: argparse.Namespace) -> None:
    from workers.engines.base import GenerationRequest, SamplingParams
    from workers.engines.vllm import VllmConfig, VllmEngine

    engine = VllmEngine(VllmConfig(model_path=str(args.model), model_name="step-curve", max_num_seqs=max(args.batches),
                                   max_num_batched_tokens=2048, max_model_len=2048,
                                   kv_cache_memory_bytes=args.kv_bytes, enforce_eager=True, dtype="float32"))
    await engine.start()

    async def one(rid: str, tokens: int) -> None:
        request = GenerationRequest(rid, "hello there " * 10, SamplingParams(max_tokens=tokens, ignore_eos=True))
        async for _ in engine.generate(request):
            pass

    try:
        await one("warm-up", 4)
        print(f"{'sequences':>9} {'median decode step ms':>22}  prefill steps (ms, sequences, prompt tokens)")
        for n in args.batches:
            engine.step_samples()
            await asyncio.gather(*(one(f"{n}-{i}", args.tokens) for i in range(n)))
            steps = engine.step_samples()
            decode = [s.seconds for s in steps if s.prompt_tokens == 0]
            prefill = [(round(s.seconds * 1e3, 1), s.seqs, s.prompt_tokens) for s in steps if s.prompt_tokens]
            print(f"{n:>9} {statistics.median(decode) * 1e3 if decode else float('nan'):>22.1f}  {prefill[:3]}",
                  flush=True)
    finally:
        await engine.shutdown()


async def prompts(args: argparse.Namespace) -> None:
    import numpy as np

    from core.submit.tokens import TokenCounter
    from workers.engines.base import GenerationRequest, SamplingParams
    from workers.engines.vllm import VllmConfig, VllmEngine
    from workers.governor import StepCurve

    counter = TokenCounter(str(args.model))
    longest = max(args.prompts) * 5 // 4 + 64  # the text for N tokens may count a few more
    engine = VllmEngine(VllmConfig(model_path=str(args.model), model_name="step-curve", max_num_seqs=8,
                                   max_num_batched_tokens=max(2048, args.chunk), max_model_len=longest,
                                   kv_cache_memory_bytes=args.kv_bytes, enforce_eager=True, dtype="float32"))
    await engine.start()
    engine.set_prefill_cap(args.chunk)
    curve = StepCurve()
    samples: list = []  # (seconds, seqs, prompt tokens): the linear fit's data

    def learn() -> None:
        for step in engine.step_samples():
            curve.add(step)
            if step.seconds > 0 and step.seqs > 0:
                samples.append((step.seconds, step.seqs, step.prompt_tokens))

    def linear_prefill_s(tokens: int, seqs: int) -> float:
        """The chunks' steps at a + b·seqs + c·tokens, by least squares over the steps seen."""
        x = np.array([(1.0, s, p) for _, s, p in samples])
        coef = np.linalg.lstsq(x, np.array([t for t, _, _ in samples]), rcond=None)[0]
        chunks = -(-tokens // args.chunk)
        return chunks * (coef[0] + coef[1] * seqs) + coef[2] * tokens

    def curve_prefill_s(tokens: int, seqs: int) -> float:
        a, b, _ = curve.coefficients()
        return -(-tokens // args.chunk) * (a + b * seqs) + curve.prefill_s(tokens)

    def text_of(tokens: int, seed: int) -> str:
        words = lambda n: " ".join(f"p{seed}w{k}" for k in range(max(1, n)))  # noqa: E731
        return words(int(100 * tokens / counter.count({"prompt": words(100)})))

    carrier = GenerationRequest("carrier", "carry on", SamplingParams(max_tokens=1_000_000, ignore_eos=True))

    async def carry() -> None:
        async for _ in engine.generate(carrier):
            pass

    beside = asyncio.ensure_future(carry())
    rows: dict[int, list[tuple[float, float, float]]] = {}
    try:
        while engine.stats().running == 0:
            await asyncio.sleep(0.01)
        seed = 0
        for round_ in range(args.rounds):
            lengths = list(args.prompts)
            random.Random(round_).shuffle(lengths)
            for length in lengths:
                seed += 1
                text = text_of(length, seed)
                tokens = counter.count({"prompt": text})
                learn()
                predicted = (curve_prefill_s(tokens, 2), linear_prefill_s(tokens, 2)) if samples else None
                curve.note_prefill(tokens, batch=False, request_id=str(seed))
                began = time.monotonic()
                async for _ in engine.generate(GenerationRequest(str(seed), text, SamplingParams(max_tokens=1))):
                    pass
                took = time.monotonic() - began
                learn()
                curve.forget(str(seed))
                if predicted is not None and round_ == args.rounds - 1:
                    rows.setdefault(tokens, []).append((took, *predicted))
                print(f"round {round_ + 1}: {tokens:>5} tokens in {took * 1e3:7.0f} ms", flush=True)
    finally:
        await engine.abort(carrier.request_id)
        beside.cancel()
        await engine.shutdown()
    a, b, c = curve.coefficients()
    print(f"\nstep curve: {a * 1e3:.2f} ms + {b * 1e3:.3f} ms/sequence + {c * 1e6:.1f} us/prompt token "
          f"+ {curve.attention_s() * 1e9:.2f} ns/prompt token/token of context; chunks of {args.chunk}")
    print(f"{'prompt tokens':>13} {'measured ms':>12} {'curve ms':>9} {'error':>7} {'linear ms':>10} {'error':>7}")
    for tokens, runs in sorted(rows.items()):
        took, quad, lin = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"{tokens:>13} {took * 1e3:>12.0f} {quad * 1e3:>9.0f} {(quad / took - 1) * 100:>+6.0f}% "
              f"{lin * 1e3:>10.0f} {(lin / took - 1) * 100:>+6.0f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("tiny", "92m"), default="tiny")
    parser.add_argument("--model", type=Path, default=None, help="a model directory (default: built for --shape)")
    parser.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4, 16, 32, 64])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--kv-bytes", type=int, default=2**30)
    parser.add_argument("--prompts", type=lambda v: [int(x) for x in v.split(",")], default=None,
                        help="prompt lengths in tokens: measure what each costs against the step curve")
    parser.add_argument("--rounds", type=int, default=3, help="with --prompts: times each length runs")
    parser.add_argument("--chunk", type=int, default=512, help="with --prompts: prompt tokens a step prefills")
    parser.add_argument("--pin-engine", type=int, metavar="CPU", default=None,
                        help="the engine on this core, this process on the others")
    args = parser.parse_args()
    if args.pin_engine is not None:
        from launcher.harness import pin_engine

        try:
            pin_engine(args.pin_engine)
        except ValueError as exc:
            parser.error(str(exc))
    if args.model is None:
        from tiny_model import cached_model

        args.model = cached_model(ROOT / ".cache", args.shape)
    asyncio.run(prompts(args) if args.prompts else measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
