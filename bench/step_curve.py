"""How an engine step's time grows with the batch: the figures behind the simulated engine's `cpu`
profile (docs/calibration.md) and the curve a worker's governor learns (workers/governor.py).

    .venv/bin/python bench/step_curve.py --shape 92m --pin-engine 0     # the 94M model, engine on core 0
    .venv/bin/python bench/step_curve.py                                # the tiny test model (overhead only)

Runs Sluice's own vLLM engine (workers/engines/vllm.py), no worker around it: for each batch size,
that many ~40-token prompts generating --tokens tokens together, every step timed from vLLM's
per-step statistics (VllmEngine.step_samples). Prints the median decode step and the prefill steps.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("tiny", "92m"), default="tiny")
    parser.add_argument("--model", type=Path, default=None, help="a model directory (default: built for --shape)")
    parser.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4, 16, 32, 64])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--kv-bytes", type=int, default=2**30)
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
    asyncio.run(measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
