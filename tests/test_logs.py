"""Logs: JSON lines with the ids, one handler per process, and no prompt or output in any line."""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.request
import uuid

import pytest
from conftest import WorkerProcess, service_env

from core.observe.logs import _FORMAT, ContextFilter, JsonFormatter, configure_logging, log_context
from core.settings import Settings, SettingsError
from launcher.argv import web_argv, worker_argv
from launcher.database import create_key
from launcher.harness import WebProcess

KEYS = {"time", "level", "logger", "process", "message", "call_id", "request_id"}


def test_a_json_line_holds_one_record_with_its_ids():
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(handler.format(record))
    handler.setFormatter(JsonFormatter())
    handler.addFilter(ContextFilter())
    log = logging.getLogger("test.logs.json")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        with log_context(call="call-1", request="row-1"):
            log.warning("two\nlines, %d tokens", 12)
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("it failed")
        log.info("about another row", extra={"request_id": "row-9"})
        log.info("Task %(id)s received", {"id": "task-7"}, extra={"data": {"id": "task-7"}})  # as Celery logs it
        log.info("about nothing")
    finally:
        log.removeHandler(handler)
    assert all("\n" not in line for line in lines), "a newline in a message must not split its line"
    entries = [json.loads(line) for line in lines]
    assert all(KEYS <= set(entry) for entry in entries)
    first, failed, other, celery, unbound = entries
    assert (first["message"], first["level"], first["logger"]) == ("two\nlines, 12 tokens", "WARNING", "test.logs.json")
    assert (first["call_id"], first["request_id"]) == ("call-1", "row-1")
    assert "ValueError: boom" in failed["exc"] and failed["request_id"] == "row-1"
    assert (other["call_id"], other["request_id"]) == (None, "row-9")
    assert (celery["message"], celery["call_id"]) == ("Task task-7 received", "task-7")
    assert (unbound["call_id"], unbound["request_id"]) == (None, None)


def test_configuring_again_switches_the_format_of_the_one_handler():
    root = logging.getLogger()
    level = root.level

    def ours() -> list[logging.Handler]:
        return [h for h in root.handlers if any(isinstance(f, ContextFilter) for f in h.filters)]

    try:
        configure_logging("INFO", "json")
        configure_logging("DEBUG", "json")
        assert len(ours()) == 1 and isinstance(ours()[0].formatter, JsonFormatter)
        assert root.level == logging.DEBUG
        configure_logging("INFO", "text")
        assert len(ours()) == 1 and ours()[0].formatter._fmt == _FORMAT
    finally:
        configure_logging(logging.getLevelName(level), "text")


def test_the_format_is_a_setting_that_reaches_gunicorn_and_celery():
    assert Settings.from_env({}).log_format == "text"
    with pytest.raises(SettingsError, match="SLUICE_LOG_FORMAT must be text or json"):
        Settings.from_env({"SLUICE_LOG_FORMAT": "xml"})
    json_settings = Settings.from_env({"SLUICE_LOG_FORMAT": "json", "SLUICE_LOG_LEVEL": "WARNING"})
    web = web_argv(json_settings)
    assert web[web.index("--logger-class") + 1] == "web.gunicorn_hooks.JsonGunicornLogger"
    assert web[web.index("--log-level") + 1] == "warning"
    worker = worker_argv(json_settings, "all")
    assert worker.index("--quiet") < worker.index("worker"), "Celery's banner is printed outside logging"
    assert "--quiet" not in worker_argv(Settings.from_env({}), "all")


def test_gunicorn_writes_its_lines_in_the_text_format_with_the_call_id(database_url, scratch_redis_url, tmp_path):
    env = service_env(database_url, scratch_redis_url, {"SLUICE_DATA_DIR": str(tmp_path / "data")})
    web = WebProcess(env, tmp_path)
    try:
        probe = urllib.request.Request(f"{web.url}/healthz", headers={"X-Request-Id": "probe-1"})
        with urllib.request.urlopen(probe, timeout=10) as response:
            call = response.headers["X-Request-Id"]
    finally:
        web.stop()
    lines = web.log_path.read_text().splitlines()
    assert any(f"gunicorn.access call={call} req=-: " in line and "GET /healthz" in line for line in lines), lines
    assert any("gunicorn.error call=- req=-: Listening at" in line for line in lines), lines


def test_at_warning_gunicorn_logs_no_call(database_url, scratch_redis_url, tmp_path):
    """gunicorn keeps its access log at INFO on its own; SLUICE_LOG_LEVEL=WARNING turns it off."""
    env = service_env(database_url, scratch_redis_url, {"SLUICE_DATA_DIR": str(tmp_path / "data"),
                                                        "SLUICE_LOG_LEVEL": "WARNING"})
    web = WebProcess(env, tmp_path)
    try:
        for _ in range(3):
            with urllib.request.urlopen(f"{web.url}/healthz", timeout=10) as response:
                assert response.status == 200
    finally:
        web.stop()
    lines = web.log_path.read_text().splitlines()
    assert not any("gunicorn.access" in line or "GET /healthz" in line for line in lines), lines


def _post(url: str, key: str, body: dict) -> tuple[dict, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read()), response.headers["X-Request-Id"]


def _get(url: str, key: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"}),
                                timeout=10) as response:
        return json.loads(response.read())


def _entries(path) -> list[dict]:
    """Every line of a process's log as a JSON object (a line that is not one fails here)."""
    entries = []
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        assert isinstance(entry, dict) and KEYS <= set(entry), line
        entries.append(entry)
    return entries


def test_web_and_worker_write_json_lines_with_ids_and_never_the_prompt_or_output(database_url, scratch_redis_url,
                                                                               tmp_path):
    """Real `sluice web` (gunicorn) and `sluice worker` (Celery) logging JSON at DEBUG: every line of
    both parses, gunicorn's and Celery's own included; lines about the request carry its ids; and
    neither its prompt nor its output appears anywhere."""
    env = service_env(database_url, scratch_redis_url, {
        "SLUICE_LOG_FORMAT": "json", "SLUICE_LOG_LEVEL": "DEBUG", "SLUICE_DATA_DIR": str(tmp_path / "data"),
        "SLUICE_WORKER_METRICS_PORT": "0"})
    secret = f"zebra-{uuid.uuid4().hex}"
    key = create_key(Settings(database_url=database_url).sqlalchemy_url, f"tenant-{uuid.uuid4().hex[:10]}")
    worker = WorkerProcess(database_url, scratch_redis_url, tmp_path, concurrency=4, extra_env=env)
    web = WebProcess(env, tmp_path)
    try:
        accepted, call = _post(f"{web.url}/v1/requests", key, {"prompt": f"Keep {secret} private.", "max_tokens": 16,
                                                               "ignore_eos": True})
        rid, deadline = accepted["id"], time.monotonic() + 60
        while (view := _get(f"{web.url}/v1/requests/{rid}", key))["status"] != "succeeded":
            assert view["status"] in ("queued", "running") and time.monotonic() < deadline, view
            time.sleep(0.1)
        # Read while it runs (at SIGTERM Celery writes "worker: Warm shutdown" straight to its stdout),
        # once its last line about the task is out: Celery's own, after the task returned.
        while not any(e["logger"] == "celery.app.trace" and e["call_id"] == rid for e in _entries(worker.log_path)):
            assert time.monotonic() < deadline, "the worker never logged the task's end"
            time.sleep(0.1)
        worker_log = _entries(worker.log_path)
    finally:
        web.stop()
        worker.stop()
    output = view["output"]["text"]
    assert len(output.split()) > 10, output  # the marker and 16 words: a text no log line holds by chance
    web_log = _entries(web.log_path)
    for entries in (web_log, worker_log):
        text = json.dumps(entries)
        assert secret not in text and output not in text and output.split(" ", 1)[1] not in text
    assert any(e["logger"] == "gunicorn.error" and "Listening at" in e["message"] for e in web_log)
    assert any(e["logger"] == "gunicorn.access" and e["call_id"] == call and "POST /v1/requests" in e["message"]
               for e in web_log), "the access line names the call by the id the client got"
    assert any(e["request_id"] == rid and e["call_id"] == call and "accepted into" in e["message"] for e in web_log)
    task = [e["message"] for e in worker_log if e["logger"].startswith("celery") and e["call_id"] == rid]
    assert any("received" in m for m in task) and any("succeeded in" in m for m in task), "Celery's own lines"
    about = [e for e in worker_log if e["request_id"] == rid]
    assert any("running on" in e["message"] for e in about) and any(e["message"] == "succeeded" for e in about)


def test_what_gunicorn_refuses_itself_is_answered_in_the_json_envelope(database_url, scratch_redis_url, tmp_path):
    """A request line or headers past gunicorn's limits never reach the app: gunicorn's own answer
    (414, 431) is the API's JSON error envelope, not an HTML page."""
    env = service_env(database_url, scratch_redis_url, {"SLUICE_DATA_DIR": str(tmp_path / "data")})
    web = WebProcess(env, tmp_path)
    try:
        answers = {}
        for name, extra in (("uri", {"path": "/v1/requests?" + "q" * 9000}),
                            ("headers", {"headers": {f"X-Filler-{i}": "v" for i in range(120)}})):
            connection = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
            connection.request("GET", extra.get("path", "/healthz"), headers=extra.get("headers", {}))
            response = connection.getresponse()
            answers[name] = (response.status, response.getheader("Content-Type"), json.loads(response.read()))
            connection.close()
    finally:
        web.stop()
    assert answers["uri"][:2] == (414, "application/json") and answers["uri"][2]["error"]["code"] == "uri_too_long"
    assert answers["headers"][:2] == (431, "application/json"), answers["headers"]
    assert answers["headers"][2]["error"]["code"] == "headers_too_large" and answers["headers"][2]["error"]["message"]
