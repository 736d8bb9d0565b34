"""`sluice up` on a bare machine: embedded Postgres and Redis, the whole platform, one demo request.

Runs the real command twice on one data directory: the second run must reuse the data (same demo
key), and after each run no process that belongs to that data directory may be left.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import ENGINE_ENV, ROOT

pytestmark = pytest.mark.slow


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _processes_of(data_dir: Path) -> list[str]:
    """Live processes whose command line, working directory or SLUICE_DATA_DIR names ``data_dir``.

    All three are needed: redis-server overwrites its environment to set its title, but runs in
    its data directory; web and worker processes only carry SLUICE_DATA_DIR.
    """
    found = []
    for proc in psutil.process_iter(["pid", "status", "cmdline", "cwd", "environ"]):
        info = proc.info
        if info["pid"] == os.getpid() or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmdline = " ".join(info["cmdline"] or [])
        if (str(data_dir) in cmdline or (info["cwd"] or "").startswith(str(data_dir))
                or (info["environ"] or {}).get("SLUICE_DATA_DIR") == str(data_dir)):
            found.append(f"{info['pid']}: {cmdline}")
    return found


def _sluice_up(data_dir: Path, *flags: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    web_port, flower_port = _free_ports(2)
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "SLUICE_PUBLIC_URL", "SLUICE_WEB_HOST")}
    env.update(SLUICE_DATA_DIR=str(data_dir), SLUICE_WEB_PORT=str(web_port),
               SLUICE_FLOWER_PORT=str(flower_port), SLUICE_ENGINE="simulated", **env_vars)
    return subprocess.run([sys.executable, "-m", "launcher.cli", "up", "--smoke", "--no-flower", *flags],
                          env=env, capture_output=True, text=True, timeout=600)


def _demo_key(result: subprocess.CompletedProcess[str]) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Demo request succeeded." in result.stdout, output
    assert re.search(r"^\s+status\s+succeeded$", result.stdout, re.M), output
    # The bulk job demo ran too: the feeder runs in the monitor `sluice up` starts.
    assert "Demo job completed." in result.stdout and re.search(r"summaries\s+3/3", result.stdout), output
    # And the embeddings demo, on the simulated embedding model's own worker.
    assert re.search(r"2 vectors of 384 dimensions from simulated-embed \(simulated", result.stdout), output
    match = re.search(r"API key\s+(sk-sluice-\S+)", result.stdout)
    assert match, output
    return match.group(1)


def test_up_runs_the_demo_on_embedded_servers_and_reuses_its_data(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"

    first = _sluice_up(data_dir)
    key = _demo_key(first)
    assert "Postgres: embedded" in first.stdout and "Redis: embedded" in first.stdout
    assert (data_dir / "demo-key").read_text().strip() == key
    assert (data_dir / "demo-key").stat().st_mode & 0o777 == 0o600
    for secret in ("postgres.password", "redis/password"):  # never printed
        assert (data_dir / secret).read_text().strip() not in first.stdout
    # Operator commands elsewhere are told how to find it; the platform file went with the platform.
    assert f"sluice --data-dir {data_dir} status" in first.stdout
    assert not (data_dir / "platform.json").exists()
    assert _processes_of(data_dir) == []

    second = _sluice_up(data_dir)
    assert _demo_key(second) == key
    assert _processes_of(data_dir) == []


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (make test installs it)")
def test_up_serves_a_model_and_an_embedding_model_beside_it_on_vllm(tmp_path: Path) -> None:
    """`sluice up --engine vllm --model DIR --embed-model DIR2` (`make up MODEL=… EMBED_MODEL=…`):
    the chat model's worker and the embedding model's, both vLLM; the demo's three calls pass."""
    from tiny_model import build_tiny_model

    chat = build_tiny_model(ROOT / ".cache" / "tiny-llama")
    embed = shutil.copytree(chat, tmp_path / "tiny-embed")  # another directory: another model's name
    data_dir = tmp_path / "data"
    result = _sluice_up(data_dir, "--engine", "vllm", "--model", str(chat), "--embed-model", str(embed),
                        SLUICE_VLLM_ENFORCE_EAGER="1", SLUICE_VLLM_DTYPE="float32",
                        SLUICE_VLLM_KV_CACHE_BYTES=str(128 * 2**20), SLUICE_VLLM_MAX_NUM_SEQS="4",
                        SLUICE_MAX_CONTEXT_TOKENS="16384", **ENGINE_ENV)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Demo request succeeded." in result.stdout and "Demo job completed." in result.stdout, output
    assert "2 vectors of 128 dimensions from tiny-embed" in result.stdout, output  # its config's hidden size
    assert _processes_of(data_dir) == []
