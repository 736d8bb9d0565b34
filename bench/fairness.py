"""Fair share across tenants: a quiet tenant beside a flooder, a reserved tenant in a spike, and
what the fair line costs a request.

    .venv/bin/python bench/fairness.py                                  # simulated engine, ~10 min
    .venv/bin/python bench/fairness.py --engine vllm --shape 92m --mix chat --deadline 30
    .venv/bin/python bench/fairness.py --dispatch                       # the line's cost at 500 requests/s

Each --depths value gets a fresh stack (bench/overload.py's `sluice` setup: web, one worker, beat,
the monitor) with that SLUICE_FAIR_DEPTH; 0 is the comparison, no lines, first come first served.
On each, the realtime capacity (the knee, questions/s) is measured first (bench/tiers.py
capacity), then three scenarios run, one after the other, all realtime, same class and mix:

1. alone: the quiet tenant asks --quiet x knee questions/s for --seconds (Poisson);
2. flood: the same, beside a flooder asking --flood-times as many;
3. spike: a tenant holding a reserved share of --reserved sends --inside x that share of the
   knee, while two others send --spike-times x the knee between them.

Each question polls its request to the end. Per tenant: sent, admitted, refused, answered within
the deadline, and the p50/p99 of the wait for an engine (started - created), of the time to first
token (first token - created) and of the whole (finished - created), from the rows' timestamps.

--dispatch needs no stack: on a scratch Redis database it times the fair line's put (the
publisher's step) and take (a worker's) at 500 requests/s for --seconds, with a line already
holding 5,000 requests of 50 tenants, beside a plain publish of the same message.

Goals (issue 37): the quiet tenant's p99 beside the flooder <= 1.2x its p99 alone, and never
refused while the flooder's excess is queued or refused; the reserved tenant: 0 refusals, >= 99%
within its deadline; the dispatch step <= 2 ms p50 at 500 requests/s.
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
import uuid
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

import overload  # noqa: E402
import tiers  # noqa: E402
from users import TERMINAL, Http  # noqa: E402

NO_LIMITS = overload.NO_LIMITS
PUBLISHERS = 4  # --dispatch: threads sharing the rate, as web processes would


def parse_args() -> tuple[argparse.Namespace, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--shape", choices=("tiny", "92m"), default="92m")
    parser.add_argument("--mix", default="chat", help="bench/overload.py's prompt mixes")
    parser.add_argument("--depths", default="2,0", help="SLUICE_FAIR_DEPTH of each stack, comma-separated")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long each scenario's arrivals come")
    parser.add_argument("--quiet", type=float, default=0.1, help="the quiet tenant's rate, x the knee")
    parser.add_argument("--flood-times", type=float, default=30.0, help="the flooder's rate, x the quiet's")
    parser.add_argument("--reserved", type=float, default=0.3, help="the reserved tenant's share")
    parser.add_argument("--inside", type=float, default=0.8, help="its rate, x its share of the knee")
    parser.add_argument("--spike-times", type=float, default=3.0, help="the others' rate, x the knee")
    parser.add_argument("--deadline", type=float, default=10.0, help="SLUICE_REALTIME_DEADLINE_S for the stack")
    parser.add_argument("--knee", type=float, default=None, help="questions/s (default: measured)")
    parser.add_argument("--seqs", type=int, default=None)
    parser.add_argument("--rt-tokens", type=int, default=None)
    parser.add_argument("--poll", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--dispatch", action="store_true", help="time the fair line's step instead")
    parser.add_argument("--rate", type=float, default=500.0, help="--dispatch: requests/s")
    parser.add_argument("--json", type=Path, default=None)
    ours = parser.parse_args()
    theirs = overload.parse_args([
        "--engine", ours.engine, "--shape", ours.shape, "--mix", ours.mix, "--setups", "sluice",
        "--knee-setup", "sluice", "--seed", str(ours.seed),
        *(["--seqs", str(ours.seqs)] if ours.seqs else []),
        *(["--rt-tokens", str(ours.rt_tokens)] if ours.rt_tokens else [])])
    return ours, theirs


class Asked(NamedTuple):
    tenant: str
    status: int  # the submit's HTTP status
    outcome: str  # how it ended; when refused, the refusal's reason and level ("deadline at level 5", ...)
    wait_s: float | None
    first_s: float | None
    total_s: float | None


def stamp(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso).timestamp() if iso else None


def ask(api: str, key: str, tenant: str, prompt: str, rt_tokens: int, poll_s: float, out: list[Asked]) -> None:
    """One question, polled to its end."""
    http = Http(api, {"Authorization": f"Bearer {key}"})
    try:
        reply = http.call("POST", "/v1/requests", {"prompt": prompt, "max_tokens": rt_tokens, "ignore_eos": True},
                          timeout_s=60)
        if reply.status != 202:
            error = (reply.doc or {}).get("error") or {}
            details = error.get("details") or {}
            reason = details.get("reason") or error.get("code") or ""
            if "load_level" in details:  # the level it was judged at: the load's, or its own wait's
                reason += f" at level {details['load_level']}"
            out.append(Asked(tenant, reply.status, reason, None, None, None))
            return
        while True:
            time.sleep(poll_s)
            view = http.call("GET", f"/v1/requests/{reply.doc['id']}", timeout_s=60).doc
            if view["status"] in TERMINAL:
                break
        t = view.get("timings") or {}
        created = stamp(t.get("created_at"))
        times = [stamp(t.get(k)) for k in ("started_at", "first_token_at", "finished_at")]
        out.append(Asked(tenant, 202, view["status"],
                         *[None if created is None or x is None else x - created for x in times]))
    except (OSError, TimeoutError) as exc:
        out.append(Asked(tenant, 0, type(exc).__name__, None, None, None))
    finally:
        http.close()


def arrivals(api: str, key: str, tenant: str, rate: float, seconds: float, prompts, rt_tokens: int, poll_s: float,
             seed: int, out: list[Asked], threads: list[threading.Thread]) -> None:
    """Poisson arrivals of ``tenant``'s questions for ``seconds``, each in its own thread."""
    rnd = random.Random(seed)
    end, n = time.monotonic() + seconds, 0
    while True:
        time.sleep(rnd.expovariate(rate))
        if time.monotonic() > end:
            return
        thread = threading.Thread(target=ask, args=(api, key, tenant, prompts.realtime(seed * 100_000 + n).text,
                                                    rt_tokens, poll_s, out), daemon=True)
        thread.start()
        threads.append(thread)
        n += 1


def scenario(front, tenants: dict[str, tuple[str, float]], ours, prompts, rt_tokens: int, seed: int) -> list[Asked]:
    """``tenants``: name → (key, questions/s), all arriving at once for --seconds; every question
    followed to its end. Each tenant's questions come from a seed of its own (``seed`` + its
    place): no question is asked twice, which the hot cache would answer at once."""
    out: list[Asked] = []
    threads: list[threading.Thread] = []
    sources = [threading.Thread(target=arrivals, args=(front.api, key, name, rate, ours.seconds, prompts, rt_tokens,
                                                       ours.poll, seed + i, out, threads), daemon=True)
               for i, (name, (key, rate)) in enumerate(tenants.items())]
    for source in sources:
        source.start()
    for source in sources:
        source.join()
    for thread in list(threads):
        thread.join(timeout=ours.deadline * 4 + 60)
    return out


def quantile(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(asked: list[Asked], tenant: str, deadline: float) -> dict:
    mine = [a for a in asked if a.tenant == tenant]
    done = [a for a in mine if a.status == 202]
    refused = [a.outcome for a in mine if a.status in (429, 503)]
    return {"sent": len(mine), "admitted": len(done), "refused": len(refused),
            "reasons": {r: refused.count(r) for r in sorted(set(refused))},
            "in_time": sum(1 for a in done if a.outcome == "succeeded" and (a.total_s or 1e9) <= deadline),
            **{f"{name}_{label}": quantile([getattr(a, name) for a in done], q)
               for name in ("wait_s", "first_s", "total_s") for label, q in (("p50", 0.5), ("p99", 0.99))}}


def new_tenant(front, name: str, **settings) -> tuple[str, str]:
    """A tenant with no limits (and ``settings``): its key and id."""
    admin = Http(front.api, {"Authorization": f"Bearer {front.admin_key}"})
    made = admin.call("POST", "/admin/tenants", {"name": f"{name}-{uuid.uuid4().hex[:6]}", **NO_LIMITS, **settings},
                      timeout_s=30)
    if made.status != 201:
        raise RuntimeError(f"creating tenant {name}: HTTP {made.status} {made.doc}")
    return made.doc["api_key"], made.doc["id"]


def stack_run(depth: int, ours, args, prompts) -> dict:
    os.environ["SLUICE_FAIR_DEPTH"] = str(depth)
    with contextlib.ExitStack() as exits:
        front = overload.start(args, "sluice", exits)
        knee = ours.knee or tiers.capacity(front, prompts, args.rt_tokens, args.seqs)
        quiet_rate = ours.quiet * knee
        keys = {name: new_tenant(front, name)[0] for name in ("quiet", "flooder", "spike-a", "spike-b")}
        keys["reserved"] = new_tenant(front, "reserved", reserved_share=ours.reserved)[0]
        time.sleep(6)  # the monitor copies reserved shares every 5 s (the admin API at once)
        runs = {}
        plan = {
            "alone": {"quiet": quiet_rate},
            "flood": {"quiet": quiet_rate, "flooder": quiet_rate * ours.flood_times},
            "spike": {"reserved": ours.inside * ours.reserved * knee, "spike-a": ours.spike_times * knee / 2,
                      "spike-b": ours.spike_times * knee / 2},
        }
        for n, (name, rates) in enumerate(plan.items()):
            overload.say(f"  depth {depth}, {name}: " + ", ".join(f"{t} {r:.2f}/s" for t, r in rates.items()))
            asked = scenario(front, {t: (keys[t], r) for t, r in rates.items()}, ours, prompts, args.rt_tokens,
                             ours.seed * 1000 + 10 * n)
            runs[name] = {t: summary(asked, t, ours.deadline) for t in rates}
            time.sleep(ours.deadline)  # what the scenario left drains or expires before the next
    return {"depth": depth, "knee": knee, "runs": runs}


def dispatch(ours) -> dict:
    """The fair line's put and take at ``--rate`` requests/s, beside a plain publish."""
    from core.broker.config import publisher
    from core.broker.fair import FairQueues
    from core.broker.queues import publish_request, queue_lists
    from core.rediskeys import redis_client
    from core.settings import Settings
    from launcher.harness import free_redis_db

    base = overload.parse_args([]).redis
    url = f"{base}/{free_redis_db(base, set())}"
    client = redis_client(url)
    client.flushdb()
    celery = publisher(Settings.from_env({"REDIS_URL": url}), fail_fast=True)
    fair = FairQueues(client, depth=2, default_model="m")
    queue = "realtime.small"

    class Row(NamedTuple):
        id: uuid.UUID
        queue: str
        tenant_id: str
        service_tier: str = "default"
        input_tokens: int = 250
        reserved_tokens: int = 378

    tenants = [str(uuid.uuid4()) for _ in range(50)]
    client.lpush(queue, "held")  # at its depth: the backlog stays in the line
    client.lpush(queue, "held")
    fair.put([Row(uuid.uuid4(), queue, tenants[i % 50]) for i in range(5000)])
    client.delete(*queue_lists(queue))
    timings: dict[str, list[float]] = {"put": [], "take": [], "plain": []}
    stop = threading.Event()

    def worker() -> None:  # takes a message and tops the queue up, as a worker does
        lists = queue_lists(queue)
        while not stop.is_set():
            if client.brpop(lists, timeout=0.2) is None:
                continue
            began = time.perf_counter()
            taken = fair.take(queue)
            timings["take"].append(time.perf_counter() - began)
            fair.publish(celery, taken)

    def publisher_thread(i: int, fair_line: bool, end: float) -> None:
        """One web process's share of the rate: the line's put alone is timed (the publish that
        follows it is the same with or without a line), or the plain publish."""
        gap, n, next_at = PUBLISHERS / ours.rate, 0, time.monotonic()
        while time.monotonic() < end:
            began = time.perf_counter()
            if fair_line:
                taken = fair.put([Row(uuid.uuid4(), queue, tenants[(i + n * PUBLISHERS) % 50])])
                timings["put"].append(time.perf_counter() - began)
                fair.publish(celery, taken)
            else:
                publish_request(celery, uuid.uuid4(), "bench.plain", "default")
                timings["plain"].append(time.perf_counter() - began)
            n += 1
            next_at += gap
            time.sleep(max(0.0, next_at - time.monotonic()))

    consumer = threading.Thread(target=worker, daemon=True)
    consumer.start()
    for fair_line in (True, False):
        end = time.monotonic() + ours.seconds
        senders = [threading.Thread(target=publisher_thread, args=(i, fair_line, end)) for i in range(PUBLISHERS)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        stop.set()
    consumer.join()
    n = len(timings["put"])
    left = fair.size(queue)
    client.flushdb()
    ms = {k: {"p50": 1000 * statistics.median(v), "p99": 1000 * quantile(v, 0.99), "n": len(v)}
          for k, v in timings.items() if v}
    overload.say(f"# dispatch at {n / ours.seconds:.0f} requests/s for {ours.seconds:g} s, a line of 5,000 requests "
                 f"of 50 tenants ({left} left): {os.cpu_count()} CPUs")
    for name, what in (("put", "the fair line's put (the publisher's added step)"),
                       ("take", "the fair line's take (a worker's added step)"),
                       ("plain", "the publish every request makes, line or not")):
        if name in ms:
            overload.say(f"  {what}: p50 {ms[name]['p50']:.2f} ms, p99 {ms[name]['p99']:.2f} ms ({ms[name]['n']})")
    return ms


def main() -> int:
    ours, args = parse_args()
    if ours.dispatch:
        result = dispatch(ours)
        if ours.json:
            ours.json.write_text(json.dumps(result, indent=1))
        return 0
    os.environ["SLUICE_REALTIME_DEADLINE_S"] = str(ours.deadline)
    prompts, notes = overload.prepare(args)
    lengths = overload.lengths([prompts.realtime(n).tokens for n in range(overload.PROMPT_SAMPLE)])
    overload.say(f"# {os.cpu_count()} CPUs; engine {args.engine}{f' ({args.shape})' if args.engine == 'vllm' else ''}; "
                 f"{args.mix} mix, questions of {overload.describe(lengths)}, max_tokens {args.rt_tokens}; "
                 f"deadline {ours.deadline:g} s; {ours.seconds:g} s a scenario")
    for note in notes:
        overload.say(f"# {note}")
    results = [stack_run(int(d), ours, args, prompts) for d in ours.depths.split(",")]
    overload.say(f"\n{'depth':>5} {'scenario':<8} {'tenant':<9} {'sent':>5} {'refused':>7} {'in time':>7} "
                 f"{'wait p50':>8} {'wait p99':>8} {'ttft p50':>8} {'ttft p99':>8} {'total p99':>9}  refused for")
    for result in results:
        for scenario_name, per in result["runs"].items():
            for tenant, s in per.items():
                cells = [s[k] for k in ("wait_s_p50", "wait_s_p99", "first_s_p50", "first_s_p99", "total_s_p99")]
                overload.say(f"{result['depth']:>5} {scenario_name:<8} {tenant:<9} {s['sent']:>5} {s['refused']:>7} "
                             f"{s['in_time']:>7} " + " ".join(f"{'-' if c is None else f'{c:.2f}':>8}" for c in cells)
                             + "  " + ", ".join(f"{r} {n}" for r, n in s["reasons"].items()))
        alone = result["runs"]["alone"]["quiet"]["first_s_p99"]
        beside = result["runs"]["flood"]["quiet"]["first_s_p99"]
        if alone and beside:
            overload.say(f"  depth {result['depth']}: knee {result['knee']:.2f}/s; the quiet tenant's p99 time to "
                         f"first token beside the flooder is {beside / alone:.2f}x its p99 alone")
    if ours.json:
        ours.json.write_text(json.dumps({"lengths": lengths, "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
