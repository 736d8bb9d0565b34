"""Every way of running Sluice the README offers: the Procfile under honcho, `sluice up` with Flower,
and the compose files and Dockerfile (checked, not run: no Docker engine runs the tests).
"""

from __future__ import annotations

import base64
import importlib.resources
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import click
import jsonschema
import psycopg
import pytest
import yaml
from alembic.config import Config
from alembic.script import ScriptDirectory
from click.testing import CliRunner
from conftest import ROOT, TERMINAL, service_env, wait_until_running
from test_up import _free_ports, _processes_of

from core.settings import Settings
from launcher.cli import main
from launcher.database import MIGRATION_LOCK, create_key
from launcher.harness import SLUICE, scratch_database
from workers.bootstrap import device_env, device_label

BIN = Path(sys.executable).parent
SETTINGS = {env for env, _default, _help in Settings.describe()}
# Variables the compose files read for compose itself, not for Sluice: the host's model folder.
COMPOSE_VARIABLES = {"MODELS_DIR"}
# (files, merged in order as `docker compose -f … -f …` does): each is one deployment.
DEPLOYMENTS = {
    "one host": ["docker-compose.yml"],
    "one host, vLLM": ["docker-compose.yml", "deploy/compose.vllm.yml"],
    "another GPU host": ["deploy/compose.gpu-host.yml"],
}


# ----------------------------------------------------------------- compose files and Dockerfile


def compose_schema() -> dict:
    """The compose-spec JSON schema, as check-jsonschema ships it (so the tests need no network)."""
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads((vendor / "compose-spec.json").read_text())


@pytest.mark.parametrize("path", sorted({p for files in DEPLOYMENTS.values() for p in files}))
def test_compose_files_follow_the_compose_schema(path):
    validator = jsonschema.Draft202012Validator(compose_schema(), format_checker=jsonschema.FormatChecker())
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(yaml.safe_load((ROOT / path).read_text()))]
    assert errors == []


def merged(files: list[str]) -> dict:
    """The project compose makes of ``files``: services of later files merge into earlier ones
    (mappings key by key, lists such as volumes appended, anything else replaced)."""
    project: dict = {"services": {}, "volumes": {}}
    for path in files:
        doc = yaml.safe_load((ROOT / path).read_text())
        for name, over in doc["services"].items():
            assert name in project["services"] or path == files[0], f"{path} changes {name}, which no earlier file has"
            service = dict(project["services"].get(name, {}))
            for key, value in over.items():
                old = service.get(key)
                if isinstance(old, dict) and isinstance(value, dict):
                    service[key] = {**old, **value}
                elif isinstance(old, list) and isinstance(value, list):
                    service[key] = old + [v for v in value if v not in old]
                else:
                    service[key] = value
            project["services"][name] = service
        project["volumes"].update(doc.get("volumes") or {})
    return project


def dockerfile_stages() -> list[str]:
    return re.findall(r"^FROM\s+\S+(?:\s+AS\s+(\S+))?\s*$", (ROOT / "Dockerfile").read_text(), re.M | re.I)


def test_the_image_copies_every_package_the_project_installs():
    """A package added to (or renamed in) pyproject.toml must reach the image, and every COPY must exist."""
    copied = re.findall(r"^COPY\s+(\S+)\s+/app/\1\s*$", (ROOT / "Dockerfile").read_text(), re.M)
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(copied) == sorted(name.rstrip("*") for name in include)
    assert all((ROOT / name).is_dir() for name in copied)


def sluice_command(argv: list[str]) -> click.Command:
    """The `sluice` command ``argv`` runs, its options parsed as the CLI would (UsageError if wrong)."""
    assert argv[:1] == ["sluice"], argv
    command, args = main, list(argv[1:])
    while isinstance(command, click.Group):
        assert args, f"{argv}: names a group, not a command"
        name, args = args[0], args[1:]
        command = command.get_command(click.Context(command), name)
        assert command is not None, f"{argv}: sluice has no command {name!r}"
    command.make_context(command.name, args)
    return command


def interpolated(value) -> set[str]:
    """The variables ``${NAME…}`` a compose value reads from the environment."""
    if isinstance(value, dict):
        return set().union(*map(interpolated, value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*map(interpolated, value)) if value else set()
    return set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", value)) if isinstance(value, str) else set()


def seconds(duration: str) -> int:
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert match and duration, f"not a duration in minutes and seconds: {duration!r}"
    return int(match.group(1) or 0) * 60 + int(match.group(2) or 0)


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_compose_runs_only_real_sluice_commands_and_settings(deployment):
    """What the schema cannot know: each Sluice service runs a real `sluice` command on an image
    the Dockerfile builds, with real settings; each GPU worker reserves one device and names none."""
    project = merged(DEPLOYMENTS[deployment])
    services, stages = project["services"], set(dockerfile_stages())
    settings = Settings()
    devices: list[str] = []
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        for needed in service.get("depends_on") or {}:
            assert needed in services, f"{name} depends on {needed}, which is not a service"
        for volume in service.get("volumes") or []:
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if source and not source.startswith(("/", ".", "$", "~")):
                assert source in project["volumes"], f"{name} mounts undeclared volume {source}"
        build = service.get("build")
        if build is None and not str(service.get("image", "")).startswith("sluice:"):
            continue  # postgres, redis: their own images and commands
        if isinstance(build, dict):
            assert build.get("target") in stages, f"{name} builds target {build.get('target')}, not in the Dockerfile"
        environment = service.get("environment") or {}
        keys = environment if isinstance(environment, dict) else [e.split("=")[0] for e in environment]
        assert set(keys) <= SETTINGS, f"{name}: not settings: {set(keys) - SETTINGS}"
        assert interpolated(service) <= SETTINGS | COMPOSE_VARIABLES, name
        argv = service["command"]
        command = sluice_command(argv)
        if command.name != "worker" or "webhooks" in argv:
            continue
        # A GPU worker: exactly one device, reserved, and found as device 0 in its container.
        assert "--gpus" not in argv, f"{name} passes a host device number to --gpus inside its container"
        reserved = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(reserved) == 1 and reserved[0]["driver"] == "nvidia" and "gpu" in reserved[0]["capabilities"], name
        ids = reserved[0].get("device_ids") or []
        assert len(ids) == 1 or (not ids and reserved[0].get("count") == 1), f"{name} must reserve one device"
        devices += ids
        # Docker must wait out the worker's drain (requests in flight may finish) before SIGKILL.
        assert seconds(service["stop_grace_period"]) > settings.stop_grace_s, name
    assert len(devices) == len(set(devices)), f"two workers reserve one device: {devices}"


def test_the_dockerfile_builds_the_default_image_and_the_gpu_image_from_every_package():
    text = (ROOT / "Dockerfile").read_text()
    stages = dockerfile_stages()
    assert stages[-1] == "app", "the last stage is what `docker build .` builds: the simulated default"
    assert "gpu" in stages
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "vllm" in pyproject["project"]["optional-dependencies"]
    gpu = text.split("AS gpu", 1)[1].split("\nFROM ", 1)[0]
    assert "pip install --no-cache-dir -e '.[vllm]'" in gpu
    for package in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        folder = package.rstrip("*")
        assert re.search(rf"^COPY {folder} /app/{folder}$", text, re.M), f"the images leave out {folder}/"


def test_every_procfile_entry_is_a_sluice_command_that_keeps_running():
    entries = dict(line.split(":", 1) for line in (ROOT / "Procfile").read_text().splitlines()
                   if line.strip() and not line.startswith("#"))
    assert {"web", "worker", "beat", "monitor", "flower", "webhooks"} <= set(entries)
    for name, line in entries.items():
        argv = shlex.split(line)
        if argv[:3] == ["sluice", "migrate", "--then"]:
            argv = argv[3:]
        # A one-shot entry would stop honcho, and every other process with it, when it exits.
        assert sluice_command(argv).name != "migrate", name


# ----------------------------------------------------------------- devices


def test_a_worker_in_a_container_uses_the_device_the_container_was_given():
    vllm = Settings.from_env({"SLUICE_ENGINE": "vllm"})
    # Compose reserved host device 1: Docker sets NVIDIA_VISIBLE_DEVICES=1; CUDA calls it 0 inside.
    one = {"NVIDIA_VISIBLE_DEVICES": "1"}
    assert device_env(None, one) == {}
    assert device_label(vllm, one) == "cuda:1"
    with pytest.raises(ValueError, match=r"given 1 device\(s\) .* leave --gpus out"):
        device_env("1", one)
    # Two devices for one container: one model split over both; --gpus counts from 0 inside it.
    two = {"NVIDIA_VISIBLE_DEVICES": "2,3"}
    assert device_env(None, two) == {"SLUICE_VLLM_TENSOR_PARALLEL_SIZE": "2"}
    assert device_label(vllm, two) == "cuda:2,3"
    assert device_env("1", two) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert device_label(vllm, {**two, "CUDA_VISIBLE_DEVICES": "1"}) == "cuda:3"
    # A bare host with several GPUs: --gpus names the host's devices; an explicit size wins.
    assert device_env("0,1", {}) == {"CUDA_VISIBLE_DEVICES": "0,1", "SLUICE_VLLM_TENSOR_PARALLEL_SIZE": "2"}
    assert device_env("0,1", {"SLUICE_VLLM_TENSOR_PARALLEL_SIZE": "1"}) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert device_label(vllm, {"CUDA_VISIBLE_DEVICES": "0,1"}) == "cuda:0,1"
    assert device_label(vllm, {}) == "cpu"

    env = {"DATABASE_URL": "postgresql://sluice@127.0.0.1:1/none", "REDIS_URL": "redis://127.0.0.1:1/0", **one}
    result = CliRunner().invoke(main, ["worker", "--role", "realtime", "--gpus", "1"], env=env)
    assert result.exit_code == 2 and "leave --gpus out" in result.output, result.output


# ----------------------------------------------------------------- migrations started together


@pytest.fixture
def fresh_database_url(admin_db_url):
    """A database of its own, created empty: no schema yet."""
    with scratch_database(admin_db_url, "sluice_deploy") as url:
        yield url


def head_revision() -> str:
    return ScriptDirectory.from_config(Config(str(ROOT / "alembic.ini"))).get_current_head()


@pytest.mark.slow
def test_a_migration_waits_for_the_one_running_then_finds_its_work_done(fresh_database_url, scratch_redis_url):
    """`sluice migrate` queues on the advisory lock another migrator holds, and migrates once it is free."""
    with psycopg.connect(fresh_database_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
        proc = subprocess.Popen([*SLUICE, "migrate"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, **service_env(fresh_database_url, scratch_redis_url)})
        try:
            deadline = time.monotonic() + 60
            while not holder.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND wait_event = 'advisory'").fetchone()[0]:
                assert proc.poll() is None, proc.communicate()[0]
                assert time.monotonic() < deadline, "sluice migrate never asked for the lock"
                time.sleep(0.1)
            # Waiting, it has changed nothing.
            assert holder.execute("SELECT to_regclass('alembic_version')").fetchone()[0] is None
            holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))
            output = proc.communicate(timeout=120)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, output
        assert holder.execute("SELECT version_num FROM alembic_version").fetchall() == [(head_revision(),)]


# ----------------------------------------------------------------- the Procfile under honcho


def _http(url: str, body: dict | None = None, key: str | None = None, auth: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body else None, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw.startswith(b"{") else {}


def _succeeds(api: str, key: str) -> dict:
    """Submit one request and poll it to its end; its final view."""
    status, view = _http(f"{api}/v1/requests", {"prompt": "Why queue GPU work?", "max_tokens": 16}, key=key)
    assert status == 202, view
    deadline = time.monotonic() + 120
    while view["status"] not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.2)
        view = _http(f"{api}/v1/requests/{view['id']}", key=key)[1]
    return view


@pytest.mark.slow
def test_honcho_runs_the_procfile_on_a_fresh_database(fresh_database_url, scratch_redis_url, tmp_path):
    """`honcho start`, as a new user runs it: every entry migrates the empty database before it
    starts (four at once), a request succeeds, and honcho stops every process it started."""
    web_port, flower_port = _free_ports(2)
    data_dir = tmp_path / "data"
    settings = service_env(fresh_database_url, scratch_redis_url, {
        "SLUICE_DATA_DIR": str(data_dir), "SLUICE_WEB_PORT": str(web_port), "SLUICE_FLOWER_PORT": str(flower_port),
        "SLUICE_WEB_WORKERS": "1", "SLUICE_WORKER_CONCURRENCY": "4", "SLUICE_WEBHOOK_CONCURRENCY": "2",
        "SLUICE_SIM_SPEED": "10"})
    env_file = tmp_path / ".env"  # where a new user puts DATABASE_URL and REDIS_URL
    env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    log_path = tmp_path / "honcho.log"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    with log_path.open("w") as log:
        honcho = subprocess.Popen([str(BIN / "honcho"), "start", "--no-colour", "-f", "Procfile", "-e", str(env_file)],
                                  cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    api = f"http://127.0.0.1:{web_port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert honcho.poll() is None, f"honcho stopped on its own:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no warm worker:\n{log_path.read_text()[-4000:]}"
            try:
                status, ready = _http(f"{api}/readyz")
            except OSError:
                status = 0  # web not listening yet
            if status == 200 and ready["ready"]:
                break
            time.sleep(0.5)
        key = create_key(Settings(database_url=fresh_database_url).sqlalchemy_url, "honcho")
        view = _succeeds(api, key)
        assert view["status"] == "succeeded", view
        assert view["output"]["text"].startswith("[simulated]")
    finally:
        os.killpg(honcho.pid, signal.SIGINT)
        honcho.wait(60)
    log = log_path.read_text()
    started = re.findall(r"^\S+ system\s+\| (\w+)\.1 started", log, re.M)
    assert set(started) == {"web", "worker", "webhooks", "monitor", "beat", "flower"}, log[-4000:]
    # Every process ran until honcho was told to stop: none ended on its own (as a one-shot
    # migrate entry would, taking all the others down with it).
    before_stop = log.split("SIGINT received", 1)[0]
    assert " stopped (rc=" not in before_stop, log[-4000:]
    assert log.count("database is at the latest revision") == 4, log[-4000:]
    assert _processes_of(data_dir) == []


# ----------------------------------------------------------------- Flower under `sluice up`


@pytest.mark.slow
def test_sluice_up_starts_flower_behind_its_login_showing_workers_and_queues(fresh_database_url, scratch_redis_url,
                                                                               tmp_path):
    """Flower, as `sluice up` starts it with SLUICE_FLOWER_BASIC_AUTH: no answer without the login;
    with it, the worker and the webhooks worker, the queues they consume and their lengths.
    (A database of its own: the sweep `sluice up` runs acts on every row it finds.)"""
    web_port, flower_port = _free_ports(2)
    data_dir = tmp_path / "data"
    login = "ops:flower-" + uuid.uuid4().hex[:8]
    env = {**os.environ, **service_env(fresh_database_url, scratch_redis_url, {
        "SLUICE_DATA_DIR": str(data_dir), "SLUICE_WEB_PORT": str(web_port), "SLUICE_FLOWER_PORT": str(flower_port),
        "SLUICE_WEB_WORKERS": "1", "SLUICE_WORKER_CONCURRENCY": "4", "SLUICE_WEBHOOK_CONCURRENCY": "2",
        "SLUICE_SIM_SPEED": "10", "SLUICE_FLOWER_BASIC_AUTH": login, "SLUICE_ENGINE": "simulated"})}
    log_path = tmp_path / "up.log"
    with log_path.open("w") as log:
        up = subprocess.Popen([*SLUICE, "up"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    flower = f"http://127.0.0.1:{flower_port}"
    try:
        wait_until_running(up, log_path)
        password = login.split(":")[1]  # in Flower's environment only: never on a command line or in a log
        assert password not in log_path.read_text() + (data_dir / "logs" / "flower.log").read_text()
        assert _http(f"{flower}/api/workers")[0] == 401
        assert _http(f"{flower}/api/workers", auth="ops:wrong")[0] == 401
        status, workers = _http(f"{flower}/api/workers?refresh=1", auth=login)
        assert status == 200, workers
        by_role = {name.split("@")[0]: info for name, info in workers.items()}
        assert {"all", "webhooks"} <= set(by_role), workers.keys()
        consumed = {q["name"] for q in by_role["all"]["active_queues"]}
        assert {"realtime.small", "batch.small", "maintenance"} <= consumed
        status, lengths = _http(f"{flower}/api/queues/length", auth=login)
        assert status == 200, lengths
        queues = {q["name"]: q["messages"] for q in lengths["active_queues"]}
        assert {"realtime.small", "realtime.large", "batch.small", "batch.large", "webhooks"} <= set(queues)
        assert all(isinstance(n, int) and n >= 0 for n in queues.values())
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(240)
    assert up.returncode == 0, log_path.read_text()[-4000:]
    assert _processes_of(data_dir) == []
