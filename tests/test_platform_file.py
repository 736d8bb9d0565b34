"""Operator commands find the platform `sluice up` runs beside them, with nothing exported.

`sluice up` keeps ``<data_dir>/platform.json`` (0600) while its servers are up; a command that
needs Postgres and Redis and finds neither URL in the environment reads it (launcher/options.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from conftest import wait_until_running
from test_up import _free_ports, _processes_of

from core.settings import Settings
from launcher.cli import main
from launcher.harness import SLUICE
from launcher.options import (
    PLATFORM_FILE,
    operator_settings,
    read_platform_file,
    remove_platform_file,
    service_settings,
    write_platform_file,
)

DB = "postgresql://postgres:db-secret@127.0.0.1:1/sluice"
REDIS = "redis://:redis-secret@127.0.0.1:2/0"


def _bare_env() -> dict[str, str]:
    """A fresh terminal's environment: no URL and no Sluice setting exported."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("SLUICE_") and k not in ("DATABASE_URL", "REDIS_URL")}


# ---------------------------------------------------------------------------- a real `sluice up`


@pytest.mark.slow
def test_status_and_diagnose_find_the_running_platform(tmp_path: Path) -> None:
    """`sluice up` in a folder; `sluice status` and `sluice diagnose` in the same folder, with no
    variable exported, answer with its figures; `--data-dir` finds it from elsewhere; the file
    goes when `sluice up` stops, and so does every process."""
    here, data_dir = tmp_path, tmp_path / ".sluice"
    web_port, flower_port = _free_ports(2)
    env = {**_bare_env(), "SLUICE_WEB_PORT": str(web_port), "SLUICE_FLOWER_PORT": str(flower_port),
           "SLUICE_ENGINE": "simulated", "SLUICE_WORKER_METRICS_PORT": "0", "SLUICE_MONITOR_METRICS_PORT": "0"}
    log_path = tmp_path / "up.log"
    with log_path.open("w") as log:
        up = subprocess.Popen([*SLUICE, "up", "--no-flower"], cwd=here, env=env, stdout=log,
                              stderr=subprocess.STDOUT)

    def run(*args: str, cwd: Path = here) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*SLUICE, *args], cwd=cwd, env=_bare_env(), capture_output=True, text=True,
                              timeout=60)

    try:
        wait_until_running(up, log_path)
        platform = data_dir / PLATFORM_FILE
        assert platform.stat().st_mode & 0o777 == 0o600
        doc = json.loads(platform.read_text())
        assert doc["pid"] == up.pid and doc["api_url"] == f"http://127.0.0.1:{web_port}"
        assert doc["env"]["DATABASE_URL"] and doc["env"]["REDIS_URL"]

        status = run("status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert re.search(r"^level 0", status.stdout, re.M), status.stdout
        # The monitor's figures for the class the demo ran in: one warm worker.
        assert re.search(r"^realtime:simulated-llama-8b\s.*\s1$", status.stdout, re.M), status.stdout

        diagnose = run("diagnose", "--json")
        assert diagnose.returncode == 0, diagnose.stdout + diagnose.stderr
        report = json.loads(diagnose.stdout)
        # Two engines: the main model's worker and the embedding model's (`sluice up` serves both).
        assert report["verdict"] and sorted(e["model"] for e in report["figures"]["engines"]) == [
            "simulated-embed", "simulated-llama-8b"], report
        assert any(c["priority"] == "realtime" and c["queue_wait_s"] is not None
                   for c in report["figures"]["classes"]), report  # the demo request's row, from Postgres

        tenants = run("tenants", "list")
        assert tenants.returncode == 0 and tenants.stdout.startswith("demo "), tenants.stdout + tenants.stderr

        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        lost = run("status", cwd=elsewhere)
        assert lost.returncode != 0
        assert "Export it, or run this command in the folder where `sluice up` runs" in " ".join(lost.stderr.split())
        found = run("--data-dir", str(data_dir), "status", "--json", cwd=elsewhere)
        assert found.returncode == 0, found.stderr
        assert any(c["priority"] == "realtime" for c in json.loads(found.stdout)["classes"])
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(120)
    assert up.returncode == 0, log_path.read_text()[-4000:]
    assert not (data_dir / PLATFORM_FILE).exists()
    assert _processes_of(data_dir) == []
    after = run("status")
    assert after.returncode != 0 and "no `sluice up` runs on data folder" in " ".join(after.stderr.split())


# ---------------------------------------------------------------------------- the file's lookup


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data folder named by SLUICE_DATA_DIR, with no URL in the environment."""
    for name in ("DATABASE_URL", "REDIS_URL", "SLUICE_WEB_PORT", "SLUICE_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLUICE_DATA_DIR", str(tmp_path))
    return tmp_path


def _write(data_dir: Path) -> Path:
    settings = Settings(database_url=DB, redis_url=REDIS, web_port=8123, admin_key="a" * 24, data_dir=str(data_dir))
    return write_platform_file(data_dir, settings, "http://127.0.0.1:8123", None)


def test_the_platform_file_is_private_and_written_whole(data_dir: Path) -> None:
    old = os.umask(0)  # even under a permissive umask
    try:
        path = _write(data_dir)
    finally:
        os.umask(old)
    assert path == data_dir / PLATFORM_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in data_dir.iterdir()) == [PLATFORM_FILE]  # no temporary file left
    doc = json.loads(path.read_text())
    assert doc["pid"] == os.getpid() and doc["api_url"] == "http://127.0.0.1:8123"
    assert doc["env"] == {"DATABASE_URL": DB, "REDIS_URL": REDIS, "SLUICE_DATA_DIR": str(data_dir),
                          "SLUICE_WEB_PORT": "8123", "SLUICE_ADMIN_KEY": "a" * 24}


def test_commands_take_the_urls_and_settings_from_the_file(data_dir: Path) -> None:
    _write(data_dir)
    settings = service_settings()
    assert (settings.database_url, settings.redis_url, settings.web_port) == (DB, REDIS, 8123)
    assert settings.admin_key == "a" * 24


def test_a_server_started_beside_the_platform_gets_its_settings(data_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`sluice beat` (and worker, web, flower, migrate --then) exec a server: what the command took
    from the file must reach it, or the server would start without the URLs."""
    _write(data_dir)
    monkeypatch.setenv("SLUICE_WEB_PORT", "9000")  # the environment's own value stays
    execs = []

    def exec_(path: str, argv: list[str], env: dict[str, str]) -> None:
        execs.append(env)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execvpe", exec_)
    result = CliRunner().invoke(main, ["beat"])
    assert result.exit_code == 0, result.output
    (env,) = execs
    assert (env["DATABASE_URL"], env["REDIS_URL"], env["SLUICE_WEB_PORT"]) == (DB, REDIS, "9000")
    assert "DATABASE_URL" not in os.environ  # this process's own environment is left alone


def test_the_current_folder_is_looked_in_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DATABASE_URL", "REDIS_URL", "SLUICE_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / ".sluice").mkdir()
    _write(tmp_path / ".sluice")
    monkeypatch.chdir(tmp_path)
    assert service_settings().database_url == DB


def test_the_environment_wins_over_the_file(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(data_dir)
    mine = "redis://127.0.0.1:6399/3"
    monkeypatch.setenv("REDIS_URL", mine)  # one URL exported: the other comes from the file
    monkeypatch.setenv("SLUICE_WEB_PORT", "9000")
    settings = service_settings()
    assert (settings.database_url, settings.redis_url, settings.web_port) == (DB, mine, 9000)


def test_the_file_is_not_read_when_both_urls_are_exported(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(data_dir)
    other_db = "postgresql://someone@db.internal/sluice"
    monkeypatch.setenv("DATABASE_URL", other_db)
    monkeypatch.setenv("REDIS_URL", "redis://redis.internal:6379/0")
    settings = service_settings()
    # Another platform: none of the file's settings are mixed into it.
    assert (settings.database_url, settings.web_port, settings.admin_key) == (other_db, 8000, None)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("writer", ["dead", "reused"])
def test_a_stale_file_is_ignored_with_a_message(data_dir: Path, writer: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A `sluice up` that was killed leaves its file: its pid is gone, or now names another
    process (this one, started at another time)."""
    path = _write(data_dir)
    doc = json.loads(path.read_text())
    if writer == "dead":
        doc["pid"] = _dead_pid()
    else:
        doc["pid_started"] -= 3600
    path.write_text(json.dumps(doc))
    assert read_platform_file(data_dir) is None
    assert f"ignoring {path}: the `sluice up` that wrote it (pid {doc['pid']}) is no longer running" in \
        capsys.readouterr().err
    assert operator_settings().database_url is None
    with pytest.raises(click.UsageError) as refused:
        service_settings()
    message = refused.value.message
    assert message.startswith("DATABASE_URL and REDIS_URL not set, and no `sluice up` runs on data folder")
    assert "Export them, or run this command in the folder where `sluice up` runs" in message
    assert "--data-dir" in message


def test_an_unreadable_file_is_ignored_with_a_message(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (data_dir / PLATFORM_FILE).write_text("{not json")
    assert read_platform_file(data_dir) is None
    assert "cannot read it" in capsys.readouterr().err


def test_stopping_removes_only_its_own_file(data_dir: Path) -> None:
    path = _write(data_dir)
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "pid": doc["pid"] + 1}))  # another `sluice up` wrote this one
    remove_platform_file(data_dir)
    assert path.exists()
    _write(data_dir)
    remove_platform_file(data_dir)
    assert not path.exists()


def test_status_says_both_ways_when_nothing_is_found(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--data-dir", str(tmp_path / "nowhere"), "status"],
                                env={"DATABASE_URL": None, "REDIS_URL": None, "SLUICE_DATA_DIR": None})
    assert result.exit_code == 2
    output = " ".join(result.output.split())
    assert f"REDIS_URL not set, and no `sluice up` runs on data folder {tmp_path / 'nowhere'}" in output
    assert "Export it, or run this command in the folder where `sluice up` runs" in output
