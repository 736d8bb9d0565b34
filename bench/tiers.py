"""Service tiers under overload: what each tier keeps at a multiple of the engine's knee.

    .venv/bin/python bench/tiers.py --engine vllm --shape 92m --mix chat --times 3
    .venv/bin/python bench/tiers.py --engine sim --times 3 --seconds 60      # the simulated engine

One Sluice stack (bench/overload.py's `sluice` setup: web, one worker, beat, the monitor, on a
scratch database and Redis database) and open-loop Poisson arrivals at --times × the knee for
--seconds. The knee is the realtime drain the load monitor states after a warm-up burst, in
questions of --rt-tokens a second, unless --knee gives it. Each arrival draws its tier from
--tiers (default priority 0.2, default 0.6, flex 0.2) and asks a question of the --mix's realtime
lengths (flex too: a cheaper answer, not a longer one), max_tokens --rt-tokens, ignore_eos,
naming no deadline: each tier's own default is its deadline (SLUICE_PRIORITY_DEADLINE_S,
SLUICE_REALTIME_DEADLINE_S, SLUICE_FLEX_DEADLINE_S, set here from --priority-s, --default-s and
--flex-s). A user polls its request every --poll s until it ends.

Per tier, the table gives what was sent; kept = answered by its deadline + refused fast (a 429/503
answered within --fast s, 0.1 by default); late = accepted and then not answered by its deadline
(expired, or finished after it); the refusals' p50 and p99 in ms; and for priority, the refusals
made while default or flex requests were running in the engine (from the rows' started_at and
finished_at). After the run, GET /v1/usage?group_by=service_tier gives each tier's requests,
refusals and cost: a flex refusal must cost nothing, and each tier's cost per output token is its
price multiple (the stack is started with SLUICE_PRICES for the model, 1/0.5/2 USD per million).

Goals (issue 36): priority keeps >= 99.5% and is never refused while default or flex work runs;
flex keeps >= 99% and nothing is billed for a refusal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import overload  # noqa: E402
from users import TERMINAL, Http  # noqa: E402

from launcher.harness import engine_affinity  # noqa: E402

TIERS = ("priority", "default", "flex")


def parse_args() -> tuple[argparse.Namespace, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--shape", choices=("tiny", "92m"), default="92m")
    parser.add_argument("--mix", default="short", help="bench/overload.py's prompt mixes")
    parser.add_argument("--knee", type=float, default=None,
                        help="questions/s the engine serves (default: the monitor's drain after a warm-up)")
    parser.add_argument("--times", type=float, default=3.0, help="the arrival rate, as a multiple of the knee")
    parser.add_argument("--tiers", default="priority=0.2,default=0.6,flex=0.2", help="each tier's share of arrivals")
    parser.add_argument("--seconds", type=float, default=90.0, help="how long arrivals come")
    parser.add_argument("--seqs", type=int, default=None)
    parser.add_argument("--rt-tokens", type=int, default=None)
    parser.add_argument("--slo", type=float, default=5.0, help="the knee search's SLO, s")
    parser.add_argument("--priority-s", type=float, default=5.0, help="SLUICE_PRIORITY_DEADLINE_S for the stack")
    parser.add_argument("--default-s", type=float, default=10.0, help="SLUICE_REALTIME_DEADLINE_S for the stack")
    parser.add_argument("--flex-s", type=float, default=30.0, help="SLUICE_FLEX_DEADLINE_S for the stack")
    parser.add_argument("--fast", type=float, default=0.1, help="a refusal within this many s is fast")
    parser.add_argument("--poll", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--pin-engine", type=int, metavar="CPU", default=None,
                        help="vLLM's engine on this core alone, the stack and this bench on the others (a CPU "
                             "host standing in for a GPU host: refusals are then not slowed by the engine)")
    parser.add_argument("--door", choices=("native", "openai"), default="native",
                        help="openai: each user calls /v1/completions with service_tier, held open with the tier's "
                             "deadline as its patience (Prefer: wait), as an OpenAI client does")
    parser.add_argument("--json", type=Path, default=None)
    ours = parser.parse_args()
    shares = {}
    for entry in ours.tiers.split(","):
        name, _, share = entry.partition("=")
        if name.strip() not in TIERS:
            parser.error(f"--tiers: {name!r} is not one of {', '.join(TIERS)}")
        shares[name.strip()] = float(share)
    ours.shares = shares
    theirs = overload.parse_args([
        "--engine", ours.engine, "--shape", ours.shape, "--mix", ours.mix, "--setups", "sluice",
        "--knee-setup", "sluice", "--slo", str(ours.slo), "--seed", str(ours.seed),
        *(["--seqs", str(ours.seqs)] if ours.seqs else []),
        *(["--rt-tokens", str(ours.rt_tokens)] if ours.rt_tokens else []),
        *(["--pin-engine", str(ours.pin_engine)] if ours.pin_engine is not None else [])])
    return ours, theirs


class Asked:
    """One user's request: its tier, what the submit answered, how it ended."""

    def __init__(self, tier: str, sent: float) -> None:
        self.tier, self.sent = tier, sent
        self.status = 0
        self.answer_s = 0.0
        self.request_id: str | None = None
        self.ended: str | None = None
        self.reason: str | None = None
        self.details: dict = {}  # a refusal's (estimated_wait_s, estimated_run_s, ...)
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.deadline_s: float | None = None
        self.created_at: float | None = None


def stamp(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso).timestamp() if iso else None


def user(front, asked: Asked, prompt: str, rt_tokens: int, poll_s: float, deadlines: dict[str, float],
         model: str | None = None) -> None:
    """One user: native, it submits and polls; through the OpenAI door (``model`` given), the
    official clients' call (``/v1/completions``, as bench/users.py's OpenAIFront: the same prompt
    tokens as native; ``service_tier``), held open until the answer with the tier's deadline as
    its patience (``Prefer: wait``), then the row read for its timings."""
    http = Http(front.api, {"Authorization": f"Bearer {front.key}"})
    began = time.perf_counter()
    if model is not None:
        reply = http.call("POST", "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": rt_tokens, "ignore_eos": True,
            "service_tier": asked.tier}, timeout_s=deadlines[asked.tier] + 60,
            headers={"Prefer": f"wait={deadlines[asked.tier]:.0f}"})
        asked.answer_s, asked.status = time.perf_counter() - began, reply.status
        asked.request_id = reply.headers.get("Sluice-Request-Id") if reply.headers else None
        if asked.request_id is None:  # refused at admission: the OpenAI error names its code
            asked.reason = ((reply.doc or {}).get("error") or {}).get("code")
            return
    else:
        reply = http.call("POST", "/v1/requests", {"prompt": prompt, "max_tokens": rt_tokens, "ignore_eos": True,
                                                   "service_tier": asked.tier}, timeout_s=60)
        asked.answer_s, asked.status = time.perf_counter() - began, reply.status
        if reply.status != 202:
            asked.details = ((reply.doc or {}).get("error") or {}).get("details", {})
            asked.reason = asked.details.get("reason")
            return
        asked.request_id = reply.doc["id"]
    give_up = time.monotonic() + deadlines[asked.tier] + 30
    while time.monotonic() < give_up:
        time.sleep(poll_s)
        view = http.call("GET", f"/v1/requests/{asked.request_id}", timeout_s=30)
        if view.status == 200 and view.doc["status"] in TERMINAL:
            timings = view.doc.get("timings") or {}
            asked.ended = view.doc["status"]
            asked.created_at = stamp(timings.get("created_at"))
            asked.started_at, asked.finished_at = stamp(timings.get("started_at")), stamp(timings.get("finished_at"))
            return
    asked.ended = "abandoned"


def run(front, ours, prompts, knee: float, rt_tokens: int, deadlines: dict[str, float]) -> list[Asked]:
    rng = random.Random(ours.seed)
    model = None
    if ours.door == "openai":  # the model a client names: the one GET /v1/models lists first
        model = Http(front.api, {"Authorization": f"Bearer {front.key}"}).call("GET", "/v1/models").doc["data"][0]["id"]
    rate = ours.times * knee
    names, weights = zip(*ours.shares.items(), strict=True)
    asked: list[Asked] = []
    threads = []
    clock = time.monotonic()
    end = clock + ours.seconds
    n = 0
    while True:
        clock += rng.expovariate(rate)
        if clock >= end:
            break
        time.sleep(max(0.0, clock - time.monotonic()))
        one = Asked(rng.choices(names, weights)[0], time.time())
        asked.append(one)
        thread = threading.Thread(target=user, args=(front, one, prompts.realtime(n).text, rt_tokens, ours.poll,
                                                     deadlines, model), daemon=True)
        thread.start()
        threads.append(thread)
        n += 1
    for thread in threads:
        thread.join(max(deadlines.values()) + 90)
    return asked


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(asked: list[Asked], ours, deadlines: dict[str, float]) -> dict[str, dict]:
    busy = [(a.started_at, a.finished_at) for a in asked
            if a.tier in ("default", "flex") and a.started_at and a.finished_at]
    rows = {}
    for tier in TIERS:
        mine = [a for a in asked if a.tier == tier]
        if not mine:
            continue
        refused = [a for a in mine if a.status in (429, 503)]
        fast = [a for a in refused if a.answer_s <= ours.fast]
        answered = [a for a in mine if a.ended == "succeeded" and a.finished_at and a.created_at
                    and a.finished_at - a.created_at <= deadlines[tier] + 0.001]
        # Accepted (a native 202, an OpenAI call's answer or its end: the row exists) and not answered in time.
        late = [a for a in mine if a.request_id and a.status not in (429, 503) and a not in answered]
        during = [a for a in refused if any(s <= a.sent <= f for s, f in busy)]
        ms = [a.answer_s * 1000 for a in refused]
        rows[tier] = {"sent": len(mine), "answered_in_time": len(answered), "refused": len(refused),
                      "refused_fast": len(fast), "late": len(late), "other": len(mine) - len(refused) - len(late)
                      - len(answered), "kept_share": (len(answered) + len(fast)) / len(mine),
                      "refusal_p50_ms": quantile(ms, 0.5), "refusal_p99_ms": quantile(ms, 0.99),
                      "refused_while_default_or_flex_ran": len(during) if tier == "priority" else None,
                      "reasons": dict(Counter(a.reason for a in refused)),
                      "ended": dict(Counter(a.ended for a in mine if a.ended))}
    return rows


def capacity(front, prompts, rt_tokens: int, seqs: int) -> float:
    """Questions a second the engines serve, as the load monitor states their realtime drain once
    a warm-up burst (twice the batch size, default tier) has run."""
    http = Http(front.api, {"Authorization": f"Bearer {front.key}"})
    ids = [http.call("POST", "/v1/requests", {"prompt": prompts.realtime(10_000 + n).text, "max_tokens": rt_tokens,
                                              "ignore_eos": True, "deadline_s": 600}, timeout_s=60).doc.get("id")
           for n in range(2 * seqs)]
    for request_id in filter(None, ids):
        while http.call("GET", f"/v1/requests/{request_id}", timeout_s=30).doc["status"] not in TERMINAL:
            time.sleep(0.5)
    time.sleep(3)
    load = front._sampler.call("GET", "/v1/admin/load", timeout_s=5).doc
    drain = sum(c["drain_tps"] for c in load.get("classes", []) if c["priority"] == "realtime")
    overload.say(f"capacity: the realtime drain the monitor states after the warm-up, {drain:.1f} output tokens/s "
                 f"= {drain / rt_tokens:.2f} questions/s of {rt_tokens} tokens (their prompts priced apart)")
    return drain / rt_tokens


def usage(front) -> dict:
    http = Http(front.api, {"Authorization": f"Bearer {front.key}"})
    report = http.call("GET", "/v1/usage?bucket=day&group_by=service_tier", timeout_s=60).doc
    found = {}
    for bucket in report.get("data", []):
        for result in bucket["results"]:
            found[result["service_tier"]] = {"requests": result["requests"], "output_tokens": result["output_tokens"],
                                             "input_tokens": result["input_tokens"], "cost_usd": result["cost_usd"],
                                             "refusals": result["refusals"]}
    return found


def main() -> int:
    ours, args = parse_args()
    prompts, notes = overload.prepare(args)
    lengths = overload.lengths([prompts.realtime(n).tokens for n in range(overload.PROMPT_SAMPLE)])
    deadlines = {"priority": ours.priority_s, "default": ours.default_s, "flex": ours.flex_s}
    os.environ.update({"SLUICE_PRIORITY_DEADLINE_S": str(ours.priority_s),
                       "SLUICE_REALTIME_DEADLINE_S": str(ours.default_s), "SLUICE_FLEX_DEADLINE_S": str(ours.flex_s),
                       "SLUICE_PRICES": f"{overload.MODEL_NAME if args.engine == 'vllm' else 'simulated-llama-8b'}"
                                        "=1/0.5/2"})
    overload.say(f"# {os.cpu_count()} CPUs; engine {args.engine} ({args.shape}); {args.mix} mix, questions of "
                 f"{overload.describe(lengths)}, max_tokens {args.rt_tokens}; tiers {ours.tiers}; "
                 f"deadlines {deadlines}; door {ours.door}")
    for note in notes:
        overload.say(f"# {note}")
    with contextlib.ExitStack() as exits:
        front = overload.start(args, "sluice", exits)
        if args.pin_engine is not None:
            overload.say(f"# pinned: {engine_affinity()}")
        knee = ours.knee or capacity(front, prompts, args.rt_tokens, args.seqs)
        overload.say(f"knee {knee:.2f}/s; arrivals at {ours.times:g}x = {ours.times * knee:.2f}/s for "
                     f"{ours.seconds:g} s")
        asked = run(front, ours, prompts, knee, args.rt_tokens, deadlines)
        rows = summarise(asked, ours, deadlines)
        time.sleep(2)
        billed = usage(front)
    overload.say(f"\n{'tier':<9} {'sent':>5} {'in time':>8} {'refused':>8} {'fast':>5} {'late':>5} {'kept':>7} "
                 f"{'ref p50 ms':>10} {'ref p99 ms':>10}  priority refused while others ran")
    for tier, r in rows.items():
        during = r["refused_while_default_or_flex_ran"]
        overload.say(f"{tier:<9} {r['sent']:>5} {r['answered_in_time']:>8} {r['refused']:>8} {r['refused_fast']:>5} "
                     f"{r['late']:>5} {100 * r['kept_share']:>6.1f}% {r['refusal_p50_ms'] or 0:>10.0f} "
                     f"{r['refusal_p99_ms'] or 0:>10.0f}  {'' if during is None else during}")
    overload.say("\nusage by tier (GET /v1/usage?group_by=service_tier):")
    for tier, u in billed.items():
        per = (float(u["cost_usd"]) / u["output_tokens"] * 1e6) if u["output_tokens"] else None
        overload.say(f"  {tier:<9} requests {u['requests']:>5}  cost {u['cost_usd']} USD  refusals {u['refusals']}"
                     + (f"  ({per:.3f} USD per million output tokens, input included)" if per else ""))
    if ours.json:
        ours.json.write_text(json.dumps({"knee": knee, "times": ours.times, "deadlines": deadlines,
                                         "lengths": lengths, "tiers": rows, "usage": billed,
                                         "median_refusal_ms": statistics.median([a.answer_s * 1000 for a in asked
                                                                                 if a.status in (429, 503)] or [0]),
                                         "asked": [vars(a) for a in asked]},
                                        indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
