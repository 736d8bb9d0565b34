"""How much code one submit runs: project functions, files and the deepest call chain.

    .venv/bin/python bench/trace_submit.py [REPO_ROOT]

Traces one warm `POST /v1/requests` (through Flask's test client, so no gunicorn) with
`sys.setprofile`, counting only functions defined under REPO_ROOT (default: this checkout),
outside `tests/` and `.venv/`. To compare the submit path across commits, run the copy of this
script in the other checkout with that checkout's own venv: an editable install maps the
packages to the checkout it was installed from, whatever REPO_ROOT says. Needs the local Postgres
(a scratch database is created and dropped) and Redis database 1 (flushed at exit).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/1")
    parser.add_argument("--list", action="store_true", help="print every function entered")
    args = parser.parse_args()
    root = Path(args.root).resolve()

    import redis

    from launcher.harness import scratch_database

    with scratch_database(args.postgres, "trace") as url:
        sys.path.insert(0, str(root))
        try:
            return trace(root, url.replace("postgresql://", "postgresql+psycopg://", 1), args)
        finally:
            redis.Redis.from_url(args.redis).flushdb()


def trace(root: Path, url: str, args: argparse.Namespace) -> int:
    """Migrate the database at ``url`` with REPO_ROOT's migrations, then trace one submit."""
    from alembic import command
    from alembic.config import Config

    config = Config(str(root / "alembic.ini"))
    config.set_main_option("script_location", str(root / "migrations"))
    config.set_main_option("sqlalchemy.url", url)
    config.attributes["configure_logging"] = False
    command.upgrade(config, "head")

    import web
    from core.settings import Settings
    from core.tenants.manage import add_key
    from models import Database, Tenant

    if not web.__file__.startswith(str(root)):
        raise SystemExit(f"imported web from {web.__file__}, not from {root}")
    app = web.create_app(Settings.from_env({"DATABASE_URL": url, "REDIS_URL": args.redis,
                                            "SLUICE_LOG_LEVEL": "WARNING"}))
    db = Database()
    db.configure(url)
    with db.session() as session:
        tenant = Tenant(name="trace")
        session.add(tenant)
        session.flush()
        key = add_key(session, tenant)
    db.dispose()
    http = app.test_client()
    body, headers = {"prompt": "hello", "max_tokens": 8}, {"Authorization": f"Bearer {key}"}
    http.post("/v1/requests", json=body, headers=headers)  # warm: lazy imports, scripts, tokenizer

    functions, files = set(), set()
    depth = deepest = calls = 0
    prefix = str(root) + os.sep

    def profile(frame, event, _arg) -> None:
        nonlocal depth, deepest, calls
        path = frame.f_code.co_filename
        if not path.startswith(prefix) or f"{os.sep}tests{os.sep}" in path or f"{os.sep}.venv{os.sep}" in path:
            return
        if event == "call":
            depth, calls = depth + 1, calls + 1
            deepest = max(deepest, depth)
            functions.add((path[len(prefix):], frame.f_code.co_name))
            files.add(path[len(prefix):])
        elif event == "return":
            depth -= 1

    sys.setprofile(profile)
    response = http.post("/v1/requests", json=body, headers=headers)
    sys.setprofile(None)
    if response.status_code != 202:
        raise SystemExit(f"submit answered {response.status_code}: {response.get_json()}")
    print(f"{root.name}: {len(functions)} project functions in {len(files)} files, {calls} calls, "
          f"deepest chain {deepest}")
    for path, function in sorted(functions) if args.list else ():
        print(f"  {path}  {function}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
