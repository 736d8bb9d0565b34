"""Simulated users for bench/overload.py: open-loop arrivals, impatient questions, patient batch jobs.

A realtime user asks one question and waits at most the SLO for its answer (the client
timeout). When the page hangs (no answer in time, or the platform says the request expired) the
user asks again, as a new request with the same question, up to ``retries`` times. A user who is
refused (429/503) got an answer with Retry-After and does not ask again. A batch job submits long
work, waits as long as it takes, and resubmits after Retry-After when refused. The prompts come
from the caller (bench/prompts.py writes them at the lengths of a mix).

Three front ends play the same users against different servers:

  SluiceFront  POST /v1/requests, then GET /v1/requests/<id> every ``poll_s`` until terminal
  OpenAIFront  Sluice's OpenAI door through the official ``openai`` SDK: one blocking
               ``client.completions.create(..., timeout=SLO)`` per attempt (the SDK sends its
               timeout as ``x-stainless-read-timeout``); batch as ``service_tier: flex``
  VllmFront    POST /v1/completions on vLLM's OpenAI server: one blocking call; closing the
               connection on timeout makes the server abort the request

Arrivals are open loop (Poisson): a user arrives on schedule whether or not earlier users got
answers, which is what makes a queue grow without bound past the knee. Every user is a thread.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from prompts import question_prompt  # noqa: F401  (bench/bulk.py takes the short question from here)

TERMINAL = {"succeeded", "failed", "timed_out", "cancelled", "expired", "rejected"}
# The platform gave up on the request for lack of time: to the user that is a page that hangs.
TOO_LATE = {"expired", "timed_out"}
REFUSED = {429, 503}
FAST_REFUSAL_S = 0.1
REQUEST_ID = "Sluice-Request-Id"  # the row of an OpenAI-door call
# Errors of a keep-alive connection the server closed while it sat idle; a GET is simply resent.
STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


@dataclass
class Reply:
    status: int
    doc: dict
    headers: http.client.HTTPMessage | None = None

    def _number(self, name: str) -> float | None:
        """The header ``name`` as a number; None when absent or not a number."""
        raw = self.headers.get(name) if self.headers else None
        try:
            return float(raw) if raw else None
        except ValueError:
            return None

    def due_s(self) -> float | None:
        """A 202's prediction of when its answer is due (retry-after-ms), None without one."""
        ms = self._number("retry-after-ms")
        return None if ms is None else ms / 1000

    def retry_after_s(self, default: float = 1.0) -> float:
        seconds = self._number("Retry-After")
        return default if seconds is None else seconds


class Http:
    """One keep-alive HTTP/1.1 connection to one server; JSON in and out; every call has a timeout."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self._conn: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, body: dict | None = None, timeout_s: float = 30.0,
             headers: dict[str, str] | None = None) -> Reply:
        """Raises TimeoutError when no answer came within ``timeout_s``, OSError when the server is
        unreachable. A GET on a connection the server closed while idle is sent once more."""
        for fresh in (self._conn is None, True):
            try:
                return self._once(method, path, body, timeout_s, headers)
            except STALE:
                self.close()
                if fresh or method != "GET":
                    raise
        raise AssertionError("unreachable")

    def _once(self, method: str, path: str, body: dict | None, timeout_s: float,
              headers: dict[str, str] | None = None) -> Reply:
        timeout_s = max(timeout_s, 0.001)  # a deadline already passed still gets one quick try
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        else:
            self._conn.timeout = timeout_s
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout_s)
        try:
            self._conn.request(method, path, json.dumps(body) if body is not None else None,
                               {**self.headers, **(headers or {})})
            response = self._conn.getresponse()
            raw = response.read()
        except BaseException:
            self.close()  # a half-read answer poisons the connection
            raise
        try:
            doc = json.loads(raw) if raw else {}
        except ValueError:
            doc = {"text": raw.decode(errors="replace")}
        return Reply(response.status, doc if isinstance(doc, dict) else {}, response.headers)

    def abort(self) -> None:
        """From another thread: make a call blocked on this connection fail now."""
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


@dataclass
class Attempt:
    """One request a user sent. ``sent`` and ``ended`` are wall-clock seconds (time.time())."""

    kind: str  # realtime | batch
    sent: float
    outcome: str = "pending"  # answered | refused | late | failed | cut (batch work stopped at the end)
    latency_s: float | None = None  # until the answer, the refusal, or giving up
    ended: float | None = None
    status: int | None = None  # HTTP status of the submit
    code: str | None = None  # the error code of a refusal or failure
    request_id: str | None = None  # Sluice's row id
    # Sent as metadata.bench_attempt: finds the row of a submit whose answer never came back (a
    # waiting client that hung up before the 202), whose tokens are waste too.
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Sluice: its row as it ended (read back after the run): status, queue wait and inference time.
    row_status: str | None = None
    queue_wait_s: float | None = None
    inference_s: float | None = None
    tokens: int | None = None  # output tokens the client received (vLLM's usage)
    retry_after_s: float = 1.0

    def end(self, outcome: str, began_mono: float, **fields: object) -> None:
        self.outcome, self.latency_s, self.ended = outcome, time.monotonic() - began_mono, time.time()
        for name, value in fields.items():
            setattr(self, name, value)


@dataclass
class Question:
    """One user's question: its first attempt decides the outcome, later ones are retries."""

    number: int
    kind: str
    phase: str
    arrived: float
    attempts: list[Attempt] = field(default_factory=list)
    prompt_tokens: int | None = None  # its prompt's length in the model's tokens

    @property
    def outcome(self) -> str:
        """within_slo | refused_fast | refused_slow | late | failed | pending. A retry starts only
        after the SLO has passed, so only the first attempt can answer within it."""
        first = self.attempts[0] if self.attempts else None
        if first is None or first.outcome == "pending":
            return "pending"
        if first.outcome == "answered":
            return "within_slo"
        if first.outcome == "refused":
            return "refused_fast" if (first.latency_s or 0) < FAST_REFUSAL_S else "refused_slow"
        return first.outcome

    @property
    def retries(self) -> int:
        return max(0, len(self.attempts) - 1)


class SluiceFront:
    """Users of Sluice's REST API. ``deadline`` sends ``deadline_s`` (the user's stated patience)."""

    def __init__(self, api: str, key: str, admin_key: str, *, deadline: bool, slo_s: float, rt_tokens: int,
                 batch_tokens: int, batch_deadline_s: float, poll_s: float, database_url: str | None = None,
                 follow_hints: bool = True) -> None:
        self.api, self.key, self.admin_key = api, key, admin_key
        # A polling user first comes back when the 202 says its answer is due (as the API asks),
        # then every poll_s; without follow_hints it polls every poll_s from the start.
        self.follow_hints = follow_hints
        self.database_url = database_url  # the platform's (scratch) database: rows by their tag
        self.logs: list[Path] | None = None  # the worker's log, where the sweep says what it requeued
        self.deadline, self.slo_s, self.poll_s = deadline, slo_s, poll_s
        self.rt_tokens, self.batch_tokens, self.batch_deadline_s = rt_tokens, batch_tokens, batch_deadline_s
        self._sampler = Http(api, {"Authorization": f"Bearer {admin_key}"})
        self._sampling = threading.Lock()  # the sampler thread and the phase marks share one connection

    def _client(self) -> Http:
        return Http(self.api, {"Authorization": f"Bearer {self.key}"})

    def ask(self, attempt: Attempt, prompt: str) -> None:
        """With ``deadline``: its patience as ``deadline_s``, then polls. Without: it states no
        deadline and waits on the connection for up to its patience (``Prefer: wait``, as a page
        that waits for its answer does), polling after that until it gives up."""
        body = {"prompt": prompt, "max_tokens": self.rt_tokens, "priority": "realtime", "ignore_eos": True,
                "metadata": {"bench_attempt": attempt.tag}, **({"deadline_s": self.slo_s} if self.deadline else {})}
        wait = {} if self.deadline else {"Prefer": f"wait={max(1, math.floor(self.slo_s))}"}
        self._run(attempt, body, timeout_s=self.slo_s, poll_s=self.poll_s, stop=None, headers=wait)

    def batch(self, attempt: Attempt, prompt: str, stop: threading.Event) -> None:
        body = {"prompt": prompt, "max_tokens": self.batch_tokens, "priority": "batch",
                "ignore_eos": True, "metadata": {"bench_attempt": attempt.tag},
                **({"deadline_s": self.batch_deadline_s} if self.deadline else {})}
        self._run(attempt, body, timeout_s=None, poll_s=1.0, stop=stop)

    def _run(self, attempt: Attempt, body: dict, timeout_s: float | None, poll_s: float,
             stop: threading.Event | None, headers: dict[str, str] | None = None) -> None:
        """Submit, then poll to a terminal status; a realtime user gives up at ``timeout_s``, a
        batch job only when ``stop`` is set (then its request is cancelled)."""
        began = time.monotonic()
        left = (lambda: timeout_s - (time.monotonic() - began)) if timeout_s else (lambda: 30.0)
        client = self._client()
        try:
            reply = client.call("POST", "/v1/requests", body, timeout_s=left(), headers=headers)
            attempt.status = reply.status
            if reply.status in REFUSED:
                return attempt.end("refused", began, code=_code(reply), retry_after_s=reply.retry_after_s())
            if reply.status not in (200, 202):  # 200: answered within the wait it asked for
                return attempt.end("failed", began, code=_code(reply))
            attempt.request_id = reply.doc["id"]
            view = reply.doc
            due = reply.due_s() if self.follow_hints and reply.status == 202 and stop is None else None
            if due and view.get("status") not in TERMINAL:
                time.sleep(max(0.0, min(due - poll_s, left() - 0.01)))  # the loop's first sleep ends at due
            while view.get("status") not in TERMINAL:
                if stop is not None and stop.is_set():
                    client.call("POST", f"/v1/requests/{attempt.request_id}/cancel", {}, timeout_s=10)
                    return attempt.end("cut", began)
                time.sleep(max(0.0, min(poll_s, left() - 0.01)))
                if left() <= 0:
                    raise TimeoutError
                polled = client.call("GET", f"/v1/requests/{attempt.request_id}", timeout_s=left())
                if polled.status == 200:
                    view = polled.doc
            if view["status"] == "succeeded":
                return attempt.end("answered", began)
            return attempt.end("late" if view["status"] in TOO_LATE else "failed", began,
                               code=(view.get("error") or {}).get("code") or view["status"])
        except TimeoutError:
            attempt.end("late", began)  # the user closes the page; Sluice is not told
        except (OSError, http.client.HTTPException, KeyError, ValueError) as exc:
            attempt.end("failed", began, code=type(exc).__name__)
        finally:
            client.close()

    def sample(self) -> dict:
        """Queued tokens per priority, the platform level and the ladder steps it turns on, as the
        load monitor published them."""
        with self._sampling:
            reply = self._sampler.call("GET", "/v1/admin/load", timeout_s=5)
        queued = {"realtime": 0, "batch": 0}
        for one in reply.doc.get("classes", []):
            queued[one["priority"]] = queued.get(one["priority"], 0) + int(one["queued_tokens"])
        return {"realtime_queued_tokens": queued["realtime"], "batch_queued_tokens": queued["batch"],
                "level": reply.doc.get("level"), "steps": reply.doc.get("steps")}

    def ids_by_tag(self, tags: list[str]) -> dict[str, str]:
        """Row ids of the attempts tagged ``tags`` (metadata.bench_attempt), read from the database:
        the API has no listing, and these are submits whose client never saw the answer."""
        if not tags or not self.database_url:
            return {}
        import psycopg

        with psycopg.connect(self.database_url) as conn:
            found = conn.execute("SELECT metadata->>'bench_attempt', id::text FROM requests "
                                 "WHERE metadata->>'bench_attempt' = ANY(%s)", (tags,)).fetchall()
        return dict(found)

    def rows(self, ids: list[str], workers: int = 8) -> dict[str, dict]:
        """The request views of ``ids`` (GET /v1/requests/<id>), read back after the run."""
        local = threading.local()

        def one(request_id: str) -> tuple[str, dict]:
            if not hasattr(local, "client"):
                local.client = self._client()
            reply = local.client.call("GET", f"/v1/requests/{request_id}", timeout_s=30)
            return request_id, reply.doc if reply.status == 200 else {}

        with ThreadPoolExecutor(workers) as pool:
            return dict(pool.map(one, ids))

    def cancel(self, request_id: str) -> None:
        client = self._client()
        try:
            client.call("POST", f"/v1/requests/{request_id}/cancel", {}, timeout_s=10)
        finally:
            client.close()

    def cut(self) -> None:
        """End the batch work still waiting: nothing to do here, each job's poller sees its stop."""


class OpenAIFront(SluiceFront):
    """Users of Sluice's OpenAI door through the official ``openai`` SDK, called as an application
    calls it: ``client.completions.create(..., timeout=SLO)``, which the SDK also sends as
    ``x-stainless-read-timeout`` (whether the door takes it as the deadline is the door's
    business). Batch jobs are ``service_tier: flex`` calls that wait up to ``batch_deadline_s``.

    The completions route, so that every door's engine sees the same prompt tokens (a chat
    template would add its own); ``service_tier``, ``metadata`` and ``ignore_eos`` travel in
    ``extra_body``, as the SDK takes the fields its completions signature lacks. The SDK's own
    retries are off: a user retries as every other front's users do (``realtime_user``). Outcomes
    count as on the native door: 429/503 refused, the client's timeout or a 504 late."""

    def __init__(self, api: str, key: str, admin_key: str, *, model: str, **kwargs: object) -> None:
        super().__init__(api, key, admin_key, deadline=False, **kwargs)
        from openai import OpenAI

        self.model = model
        self._sdk = OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0)
        self._waiting: set[str] = set()  # tags of the batch calls in flight
        self._lock = threading.Lock()

    def ask(self, attempt: Attempt, prompt: str) -> None:
        self._complete(attempt, prompt, self.rt_tokens, timeout_s=self.slo_s)

    def batch(self, attempt: Attempt, prompt: str, stop: threading.Event) -> None:
        if stop.is_set():
            return
        with self._lock:
            self._waiting.add(attempt.tag)
        try:
            self._complete(attempt, prompt, self.batch_tokens, timeout_s=self.batch_deadline_s, flex=True, stop=stop)
        finally:
            with self._lock:
                self._waiting.discard(attempt.tag)

    def _complete(self, attempt: Attempt, prompt: str, max_tokens: int, timeout_s: float, flex: bool = False,
                  stop: threading.Event | None = None) -> None:
        import openai

        extra = {"ignore_eos": True, "metadata": {"bench_attempt": attempt.tag},
                 **({"service_tier": "flex"} if flex else {})}
        began = time.monotonic()
        try:
            raw = self._sdk.completions.with_raw_response.create(
                model=self.model, prompt=prompt, max_tokens=max_tokens, timeout=timeout_s, extra_body=extra)
            attempt.status, attempt.request_id = raw.http_response.status_code, raw.headers.get(REQUEST_ID)
            usage = raw.parse().usage
            attempt.end("answered", began, tokens=usage.completion_tokens if usage else None)
        except openai.APITimeoutError:
            attempt.end("cut" if stop is not None and stop.is_set() else "late", began)
        except openai.APIStatusError as exc:
            status, headers = exc.status_code, exc.response.headers
            attempt.status, attempt.request_id = status, headers.get(REQUEST_ID)
            code = str(exc.code or status)
            if stop is not None and stop.is_set():
                attempt.end("cut", began, code=code)
            elif status in REFUSED:
                attempt.end("refused", began, code=code, retry_after_s=_seconds(headers.get("Retry-After"), 1.0))
            else:
                attempt.end("late" if status == 504 else "failed", began, code=code)
        except openai.APIConnectionError as exc:
            attempt.end("cut" if stop is not None and stop.is_set() else "failed", began,
                        code=type(exc.__cause__ or exc).__name__)

    def cut(self) -> None:
        """End the batch calls still waiting: cancel their rows (found by their tags), which
        answers each call."""
        with self._lock:
            tags = list(self._waiting)
        for request_id in self.ids_by_tag(tags).values():
            with contextlib.suppress(OSError, http.client.HTTPException):
                self.cancel(request_id)


class VllmFront:
    """Users of vLLM's OpenAI server (priority scheduling on: realtime 0, batch 1; lower runs first).

    They cannot state their patience: the client timeout is all they have, and closing the
    connection is how the server learns that nobody waits any more."""

    def __init__(self, api: str, model: str, *, slo_s: float, rt_tokens: int, batch_tokens: int) -> None:
        self.api, self.model, self.slo_s = api, model, slo_s
        self.rt_tokens, self.batch_tokens = rt_tokens, batch_tokens
        self._sampler = Http(api)
        self._sampling = threading.Lock()  # the sampler thread and the phase marks share one connection
        self._open: set[Http] = set()
        self._lock = threading.Lock()

    def ask(self, attempt: Attempt, prompt: str) -> None:
        self._complete(attempt, prompt, self.rt_tokens, priority=0, timeout_s=self.slo_s)

    def batch(self, attempt: Attempt, prompt: str, stop: threading.Event) -> None:
        if not stop.is_set():
            self._complete(attempt, prompt, self.batch_tokens, priority=1, timeout_s=None)

    def _complete(self, attempt: Attempt, prompt: str, max_tokens: int, priority: int,
                  timeout_s: float | None) -> None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "priority": priority}
        began = time.monotonic()
        client = Http(self.api)
        with self._lock:
            self._open.add(client)
        try:
            reply = client.call("POST", "/v1/completions", body, timeout_s=timeout_s or 24 * 3600)
            attempt.status = reply.status
            if reply.status == 200:
                attempt.end("answered", began, tokens=int(reply.doc.get("usage", {}).get("completion_tokens", 0)))
            elif reply.status in REFUSED:
                attempt.end("refused", began, code=str(reply.status), retry_after_s=reply.retry_after_s())
            else:
                attempt.end("failed", began, code=str(reply.status))
        except TimeoutError:
            attempt.end("late", began)  # the connection closes below: the server aborts the request
        except (OSError, http.client.HTTPException) as exc:
            attempt.end("cut" if attempt.kind == "batch" else "failed", began, code=type(exc).__name__)
        finally:
            with self._lock:
                self._open.discard(client)
            client.close()

    def cut(self) -> None:
        """End every call still waiting (batch work at the end of the run)."""
        with self._lock:
            for client in list(self._open):
                client.abort()

    def sample(self) -> dict:
        """Requests waiting and running, and output tokens generated so far, from /metrics."""
        with self._sampling:
            return metrics(self._sampler.call("GET", "/metrics", timeout_s=5).doc.get("text", ""))


def metrics(text: str) -> dict:
    """Sums over label sets of the vLLM gauges and counter this benchmark reads."""
    wanted = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
              "vllm:generation_tokens_total": "generated_tokens"}
    out = dict.fromkeys(wanted.values(), 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        if name in wanted:
            out[wanted[name]] += float(value)
    return out


def _seconds(raw: str | None, default: float) -> float:
    try:
        return float(raw) if raw else default
    except ValueError:
        return default


def _code(reply: Reply) -> str:
    """The error code, with the gate's reason when there is one (``overloaded:deadline``)."""
    error = reply.doc.get("error")
    if not isinstance(error, dict):
        return str(reply.status)
    reason = (error.get("details") or {}).get("reason") if isinstance(error.get("details"), dict) else None
    return f"{error.get('code', reply.status)}:{reason}" if reason else str(error.get("code", reply.status))


def realtime_user(front: SluiceFront | VllmFront, question: Question, prompt: str, retries: int) -> None:
    """Ask, and ask again (up to ``retries`` times) while the answer does not come in time."""
    for _ in range(1 + retries):
        attempt = Attempt("realtime", time.time())
        question.attempts.append(attempt)
        front.ask(attempt, prompt)
        if attempt.outcome != "late":
            return


def batch_job(front: SluiceFront | VllmFront, question: Question, prompt: str, stop: threading.Event) -> None:
    """Submit until accepted (sleeping Retry-After, at most 10 s, between refusals), then wait."""
    while not stop.is_set():
        attempt = Attempt("batch", time.time())
        question.attempts.append(attempt)
        front.batch(attempt, prompt, stop)
        if attempt.outcome != "refused":
            return
        stop.wait(min(10.0, max(0.5, attempt.retry_after_s)))


class Arrivals:
    """Open-loop Poisson arrivals: ``spawn(number)`` in a new thread at exponential gaps, on a fixed
    schedule, never waiting for earlier arrivals. Threads are kept so the caller can join them."""

    def __init__(self, seed: int, first: int = 0) -> None:
        self.rng = random.Random(seed)
        self.threads: list[threading.Thread] = []
        # Numbers name questions; runs on one server start from different ``first`` so that no
        # question is asked twice by accident (the hot answer cache would answer it).
        self._numbers = iter(range(first, first + 10**9))

    def run(self, rate: float, seconds: float, spawn: Callable[[int], None],
            stop: threading.Event | None = None) -> None:
        """Arrivals at ``rate`` per second for ``seconds`` (or until ``stop``), in this thread."""
        began = time.monotonic()
        at = self.rng.expovariate(rate) if rate > 0 else seconds
        while at < seconds and not (stop is not None and stop.is_set()):
            delay = began + at - time.monotonic()
            if delay > 0:
                if stop is not None:
                    stop.wait(delay)
                else:
                    time.sleep(delay)
            thread = threading.Thread(target=spawn, args=(next(self._numbers),), daemon=True,
                                      name=f"user-{uuid.uuid4().hex[:6]}")
            thread.start()
            self.threads.append(thread)
            at += self.rng.expovariate(rate)
        rest = began + seconds - time.monotonic()
        if rest > 0 and stop is None:
            time.sleep(rest)

    def join(self, timeout_s: float) -> int:
        """Wait for every spawned thread up to ``timeout_s`` in all; how many are still alive."""
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in self.threads)
