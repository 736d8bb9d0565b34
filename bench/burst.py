"""Submit N concurrent requests of mixed size and priority to a running Sluice; report outcomes.

    python bench/burst.py --api http://127.0.0.1:8000 --key "$(cat .sluice/demo-key)" -n 300

Prints how many reached each status, which queues they travelled through, and the median and
p95 queue wait and inference time read back from the request rows. Exits 1 if any request
did not reach a terminal status (lost or stuck) within the timeout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

TERMINAL = {"succeeded", "failed", "timed_out", "cancelled", "expired", "rejected"}


def call(url: str, key: str, body: dict | None = None, timeout: float = 30) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        return json.load(exc)


def body_for(i: int, large_tokens: int) -> dict:
    large = i % 5 == 0
    prompt = "context " * (large_tokens * 4 // 8 + 1) if large else f"Question {i}: what limits GPU throughput?"
    return {"prompt": prompt, "max_tokens": 32 + (i % 4) * 32, "priority": "batch" if i % 3 == 0 else "realtime"}


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else (values[0] if values else float("nan"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", default="http://127.0.0.1:8000")
    parser.add_argument("--key", required=True)
    parser.add_argument("-n", type=int, default=300)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--large-tokens", type=int, default=4096, help="size of the large requests' prompts")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()

    began = time.monotonic()
    with ThreadPoolExecutor(args.clients) as pool:
        accepted = list(pool.map(lambda i: call(f"{args.api}/v1/requests", args.key, body_for(i, args.large_tokens)),
                                 range(args.n)))
    submitted_s = time.monotonic() - began
    ids = [a["id"] for a in accepted if "id" in a]
    refused = [a["error"]["code"] for a in accepted if "error" in a]
    views: dict[str, dict] = {}
    deadline = time.monotonic() + args.timeout
    while len(views) < len(ids) and time.monotonic() < deadline:
        for rid in ids:
            if rid not in views:
                view = call(f"{args.api}/v1/requests/{rid}", args.key)
                if view.get("status") in TERMINAL:
                    views[rid] = view
        time.sleep(0.5)
    done_s = time.monotonic() - began
    waits = [v["timings"]["queue_wait_s"] for v in views.values() if v["timings"]["queue_wait_s"] is not None]
    infer = [v["timings"]["inference_s"] for v in views.values() if v["timings"]["inference_s"] is not None]
    print(f"submitted {args.n} in {submitted_s:.1f}s; accepted {len(ids)}; refused {Counter(refused) or 0}")
    statuses = dict(Counter(v["status"] for v in views.values()))
    print(f"terminal after {done_s:.1f}s: {len(views)}/{len(ids)}  statuses {statuses}")
    print(f"queues {dict(Counter(v['queue'] for v in views.values()))}")
    print(f"sizes  {dict(Counter(v['size_class'] for v in views.values()))}")
    if waits and infer:
        print(f"queue wait  p50 {statistics.median(waits):.3f}s  p95 {pct(waits, 95):.3f}s")
        print(f"inference   p50 {statistics.median(infer):.3f}s  p95 {pct(infer, 95):.3f}s")
    missing = [rid for rid in ids if rid not in views]
    if missing:
        print(f"NOT TERMINAL: {len(missing)} e.g. {missing[:3]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
