"""Which package may import which, checked over every Python file in the repository.

The layers, each importing only those below it:

    models  <-  core  <-  web, workers  <-  launcher  <-  tests, bench
                  ^
              migrations

``models`` is the schema and imports none of ours; ``core`` is the domain; ``web`` (HTTP) and
``workers`` (Celery) are its two doors and never import each other; ``launcher`` (the CLI, the
supervisor, the test harness) starts them all. ``tests`` and ``bench`` are the top: they may import
anything. Every import counts: module level, inside a function, under ``if TYPE_CHECKING:``,
relative ones (resolved), and ``importlib.import_module("...")`` with a literal name.

Two more rules: an engine (``workers.engines``, vLLM, torch) is never imported by the domain or the
HTTP tier, and vLLM is imported only by its engine module and that engine's plugin. And, checked on
a real process: a worker builds no Flask app (imports nothing of ``web``, nor Flask).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALL = {"models", "core", "web", "workers", "launcher", "migrations", "tests", "bench"}
# Of our packages, those each top-level package may import (itself always).
ALLOWED: dict[str, set[str]] = {
    "models": set(),
    "core": {"models"},
    "web": {"core", "models"},
    "workers": {"core", "models"},
    "launcher": {"core", "models", "web", "workers"},
    "migrations": {"core", "models"},
    "tests": ALL,
    "bench": ALL,
}
# What a package's files may not import at all, ours or not (prefixes of dotted module names).
ENGINES = ("workers.engines", "vllm", "torch")
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "models": ("flask", *ENGINES),
    "core": ("flask", *ENGINES),
    "web": ENGINES,
    "workers": ("flask",),
}
# The only files that may import vLLM.
VLLM_FILES = {"workers/engines/vllm.py", "workers/engines/vllm_plugin.py"}
# Folders that hold no source of ours.
SKIP_DIRS = {"build", "dist", "node_modules", "__pycache__", "site-packages"}


@dataclass(frozen=True)
class Import:
    file: str  # relative to the repository root, with /
    line: int
    module: str  # dotted, absolute; a helper local to tests/ or bench/ (conftest, users) is <top>.<name>


def source_files(root: Path = ROOT) -> list[Path]:
    """Every .py file under ``root`` outside hidden folders (.venv, .git), build folders and eggs."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS
                         and not d.endswith(".egg-info"))
        found.extend(Path(folder) / f for f in sorted(files) if f.endswith(".py"))
    return found


def _local(path: Path, name: str) -> bool:
    """Whether ``name`` is a module beside ``path`` or at the top of its package's folder: how a
    test (pytest's rootdir-relative path) or a benchmark (``sys.path``) imports its helpers."""
    first = name.split(".")[0]
    top = ROOT / path.relative_to(ROOT).parts[0]
    return any((folder / f"{first}.py").exists() or (folder / first).is_dir() for folder in {path.parent, top})


def imports_of(path: Path, rel: str | None = None) -> list[Import]:
    """Every import in the file at ``path``, which sits at ``rel`` in the repository (default: where it is)."""
    rel = rel or path.relative_to(ROOT).as_posix()
    parts = rel.removesuffix(".py").split("/")
    package = parts[:-1]  # the package a relative import starts from (a package's __init__ is in it too)
    top = parts[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), rel)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            assert node.level <= len(package), f"{rel}:{node.lineno}: relative import beyond the top package"
            base = package[:len(package) - node.level + 1]
            if node.module:
                found.append((node.lineno, ".".join([*base, node.module])))
            else:  # from . import a, b: each name may be a module
                found.extend((node.lineno, ".".join([*base, alias.name])) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (isinstance(node.func, ast.Name) and node.func.id == "__import__"
                   or isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")):
            found.append((node.lineno, node.args[0].value))
    out = []
    for line, name in found:
        if top in ("tests", "bench") and name.split(".")[0] not in ALL and _local(ROOT / rel, name):
            name = f"{top}.{name}"
        out.append(Import(rel, line, name))
    return out


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def broken_rules(top: str, rel: str, module: str) -> list[str]:
    """The rules a file at ``rel`` in package ``top`` breaks by importing ``module``."""
    broken = []
    ours = module.split(".")[0]
    if ours in ALL and ours != top and ours not in ALLOWED[top]:
        broken.append(f"{top} imports {module} ({top} may import {', '.join(sorted(ALLOWED[top])) or 'none of ours'})")
    broken.extend(f"{top} imports {module}, and {top} never imports {banned}"
                  for banned in FORBIDDEN.get(top, ()) if _under(module, banned))
    if _under(module, "vllm") and rel not in VLLM_FILES:
        broken.append(f"imports {module}; only {', '.join(sorted(VLLM_FILES))} import vLLM")
    return broken


def violations(path: Path, rel: str | None = None) -> list[str]:
    rel = rel or path.relative_to(ROOT).as_posix()
    top = rel.split("/")[0]
    if top not in ALLOWED:
        return [f"{rel}: in no package the layer rules know; add {top!r} to ALLOWED"]
    return [f"{imp.file}:{imp.line}: {problem}" for imp in imports_of(path, rel)
            for problem in broken_rules(top, rel, imp.module)]


def test_every_file_keeps_the_layer_rules():
    files = source_files()
    assert ALL <= {f.relative_to(ROOT).parts[0] for f in files}
    assert len(files) > 150, "too few files found: is the walk skipping source?"
    assert [problem for path in files for problem in violations(path)] == []


def test_the_check_sees_every_kind_of_import(tmp_path):
    """A probe file with each kind of import, checked as if it sat in several packages: every
    import is found, relative ones resolved, and each forbidden one reported with its line."""
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\n"
                     "import importlib\n"
                     "if TYPE_CHECKING:\n"
                     "    from workers.tasks import run\n"      # 4: under TYPE_CHECKING
                     "def f():\n"
                     "    import launcher.cli\n"                 # 6: in a function
                     "    from core import errors\n"             # 7
                     "    importlib.import_module('torch')\n"    # 8: by name
                     "from . import bodies, views\n"             # 9: relative, each name a module
                     "from ..errors import NotFound\n")          # 10: relative, up one package
    assert [(i.line, i.module) for i in imports_of(probe, "web/openai/probe.py")] == [
        (1, "typing"), (2, "importlib"), (9, "web.openai.bodies"), (9, "web.openai.views"), (10, "web.errors"),
        (4, "workers.tasks"), (6, "launcher.cli"), (7, "core"), (8, "torch")]

    def lines(rel: str) -> list[int]:
        return sorted(int(problem.split(":")[1]) for problem in violations(probe, rel))

    assert lines("web/openai/probe.py") == [4, 6, 8]  # workers and launcher are no layer of web's; torch an engine
    assert lines("core/sub/probe.py") == [4, 6, 8]
    assert lines("models/sub/probe.py") == [4, 6, 7, 8]
    assert lines("workers/sub/probe.py") == [6]
    assert lines("launcher/sub/probe.py") == []
    assert lines("tests/sub/probe.py") == []


@pytest.mark.parametrize("top, module, ok", [
    ("models", "core.errors", False),
    ("models", "sqlalchemy.orm", True),
    ("core", "models.session", True),
    ("core", "web.errors", False),
    ("core", "workers.tasks", False),
    ("core", "flask", False),
    ("web", "core.errors", True),
    ("web", "workers.engines.base", False),
    ("web", "vllm", False),
    ("web", "torch.nn", False),
    ("web", "launcher.harness", False),
    ("workers", "web.services", False),
    ("workers", "launcher.cli", False),
    ("workers", "flask", False),
    ("launcher", "web", True),
    ("launcher", "workers.entry", True),
    ("migrations", "core.settings", True),
    ("migrations", "web.services", False),
    ("tests", "launcher.harness", True),
    ("tests", "workers.engines.simulated", True),
    ("bench", "web", True),
])
def test_rules_as_written(top, module, ok):
    assert (broken_rules(top, f"{top}/x.py", module) == []) is ok


# Inside core, the request path's packages in their order: each imports only those before it
# (at run time; an annotation under TYPE_CHECKING may name a later one's type). They once formed a
# circle (admission -> usage -> delivery -> admission, submit <-> delivery, usage -> submit).
CORE_ORDER = ("usage", "admission", "submit", "delivery")
# Imported by all of them, so they import none: the domain errors, the webhook rules, the guard.
CORE_LEAVES = ("core.errors", "core.ssrf", "core.hooks", "core.ids")


def runtime_imports(path: Path) -> list[tuple[int, str]]:
    """The absolute ``core`` imports of ``path`` that run (not under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for top in tree.body if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
                   for node in ast.walk(top)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        if node.module == "core":
            found.extend((node.lineno, f"core.{alias.name}") for alias in node.names)
        elif node.module.startswith("core."):
            found.append((node.lineno, node.module))
    return found


def test_the_request_path_inside_core_has_no_circle():
    problems = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        module = rel.removesuffix(".py").replace("/", ".")
        package = rel.split("/")[1] if rel.count("/") > 1 else None
        for line, imported in runtime_imports(path):
            target = imported.split(".")[1] if imported.count(".") else None
            if module in CORE_LEAVES and imported not in CORE_LEAVES and imported != "core.errors":
                problems.append(f"{rel}:{line}: {module} is a leaf of core and imports {imported}")
            if package in CORE_ORDER and target in CORE_ORDER and \
                    CORE_ORDER.index(target) > CORE_ORDER.index(package):
                problems.append(f"{rel}:{line}: core.{package} imports {imported}, which comes after it")
    assert problems == []


PROBE = """
import json, sys
from workers.entry import celery_app
celery_app.loader.import_default_modules()  # what a worker imports as it starts: its task modules
print(json.dumps({
    "flask": sorted(m for m in sys.modules if m == "flask" or m.startswith("flask.")),
    "web": sorted(m for m in sys.modules if m == "web" or m.startswith("web.")),
    "engines": sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch")),
    "services": type(getattr(celery_app, "services", None)).__name__,
    "tasks": sorted(t for t in celery_app.tasks if t.startswith("sluice")),
}))
"""


def test_a_worker_process_builds_no_web_app(database_url, scratch_redis_url):
    env = {**os.environ, "DATABASE_URL": database_url, "REDIS_URL": scratch_redis_url,
           "SLUICE_WORKER_ROLE": "webhooks", "SLUICE_LOG_LEVEL": "WARNING", "SLUICE_WORKER_METRICS_PORT": "0"}
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["flask"] == [] and seen["web"] == [], seen
    assert seen["engines"] == [], seen  # a webhooks worker loads no engine
    assert seen["services"] == "Services", seen
    assert seen["tasks"], seen  # the task modules were imported: the check covered them
