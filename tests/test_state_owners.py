"""Every state machine has one owner: no module but its owner writes a status column.

An AST scan of the project's code (core/, web/, workers/, launcher/, models/). Outside a table's
owner it refuses:

* ``update(<Table>)…values(status=…)``, or ``.values(**…)`` / ``.values({…})`` on such an update
  (a status could hide in them), ``<Table>`` being the class or a module-level alias of it;
* assigning ``.status`` on anything but ``self`` in a module that names one of the tables'
  classes (a loaded row is flushed as an unconditional UPDATE), or ``setattr(…, "status", …)``;
* raw SQL ``UPDATE <table> … SET … status = …``.

Inserting a row with its first status (``Job(status=…)``, ``insert(Delivery).values(status=…)``,
the COPY of an upload's items) is allowed: a birth, not a transition. What it cannot see: a
statement built in one expression and given its values in another, or SQL assembled from pieces.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("core", "web", "workers", "launcher", "models")
# The class of each guarded table, and the module that alone writes its status.
OWNERS = {
    "Job": "models/job_lifecycle.py",
    "JobItem": "models/job_lifecycle.py",
    "Delivery": "models/delivery_lifecycle.py",
    "InferenceRequest": "models/lifecycle.py",
}
TABLES = {"jobs": "Job", "job_items": "JobItem", "webhook_deliveries": "Delivery", "requests": "InferenceRequest"}
_SQL = re.compile(r"\bUPDATE\s+(?P<table>\w+)(?:\s+(?:AS\s+)?\w+)?\s+SET\b(?P<set>(?:(?!\bWHERE\b|\bFROM\b|"
                  r"\bRETURNING\b).)*)", re.IGNORECASE | re.DOTALL)
_STATUS_SET = re.compile(r"(?:^|,)\s*status\s*=", re.IGNORECASE)


def writers(source: str, path: str) -> list[str]:
    """``path:line: what`` for each status write in ``source`` that ``path`` does not own."""
    tree = ast.parse(source)
    mine = {cls for cls, owner in OWNERS.items() if owner == path}
    aliases = {name: name for name in OWNERS}
    for node in tree.body:  # module-level aliases: _t = InferenceRequest
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in OWNERS:
            aliases.update({t.id: node.value.id for t in node.targets if isinstance(t, ast.Name)})
    named = {aliases[n.id] for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in aliases}
    named |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names if a.name in OWNERS}
    rows_here = bool(named - mine)
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{path}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "values":
            table = _updated_table(node.func.value, aliases)
            if table is not None and table not in mine:
                if any(k.arg == "status" for k in node.keywords):
                    flag(node, f"update({table}).values(status=…)")
                elif node.args or any(k.arg is None for k in node.keywords):
                    flag(node, f"update({table}).values(…) with values it cannot read (a status may hide in them)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if rows_here and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value == "status":
                flag(node, 'setattr(…, "status", …)')
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign) and rows_here:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for one in target.elts if isinstance(target, ast.Tuple | ast.List) else [target]:
                    if isinstance(one, ast.Attribute) and one.attr == "status" \
                            and not (isinstance(one.value, ast.Name) and one.value.id in ("self", "cls")):
                        flag(node, f"{ast.unparse(one)} = … (a row's status set outside its owner)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in _SQL.finditer(node.value):
                table = TABLES.get(match["table"].lower())
                if table is not None and table not in mine and _STATUS_SET.search(match["set"]):
                    flag(node, f"raw SQL UPDATE {match['table']} SET status")
    return found


def _updated_table(expr: ast.expr, aliases: dict[str, str]) -> str | None:
    """The guarded class an ``update(X).where(…)…`` chain updates, else None."""
    while isinstance(expr, ast.Call | ast.Attribute):
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "update":
            first = expr.args[0] if expr.args else None
            return aliases.get(first.id) if isinstance(first, ast.Name) else None
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return None


def test_no_status_writer_outside_the_owners():
    files = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 50 and all(owner in {str(f.relative_to(ROOT)) for f in files} for owner in OWNERS.values())
    found = [w for f in files for w in writers(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == [], "status written outside its owner module:\n" + "\n".join(found)


def test_the_scan_finds_the_writers_the_owners_replaced():
    """Each status writer core/jobs and the webhook modules had before the owners, re-added."""
    writers_before = {
        "job admitted": "session.execute(update(Job).where(Job.id == job.id).values(\n"
                        "    status=JobStatus.IN_PROGRESS, total_items=n, started_at=func.now()))",
        "job cancelled": "from models.job import Job\n"
                         "job.status, job.cancel_requested_at = JobStatus.CANCELLING, func.now()",
        "job settled in memory": "from models import Job\njob.status = status",
        "items stopped": "session.execute(update(JobItem).where(JobItem.job_id == j, JobItem.status == P)\n"
                         "    .values(status=status, finished_at=func.now()))",
        "item stage": "session.execute(update(JobItem).where(JobItem.line == line).values(**values)).rowcount",
        "job settled": "session.execute(update(Job).where(Job.id == job.id, Job.status == job.status)"
                       ".values(**values))",
        "stale uploads": "text('''\n    UPDATE jobs SET status = 'failed', finished_at = now(), error_code = 'x'\n"
                         "    WHERE status = 'validating' ''')",
        "duplicates": "text('''WITH seen AS (SELECT 1)\n  UPDATE job_items i SET text = NULL, status = 'invalid'\n"
                      "  FROM seen WHERE i.line = seen.line''')",
        "delivery redelivered": "update(Delivery).where(Delivery.id == d, *owned).values(\n"
                                "    status=DeliveryStatus.PENDING, next_attempt_at=func.now())",
        "delivery recorded": "update(Delivery).where(Delivery.id == d).values(last_status_code=c, **values)",
        "an alias": "_d = Delivery\nupdate(_d).where(_d.id == d).values(status='failed')",
        "setattr": "from models import JobItem\nsetattr(item, 'status', 'failed')",
        "a request's status": "text(\"UPDATE requests SET finished_at = now(), status = 'failed' WHERE id = 1\")",
    }
    for what, source in writers_before.items():
        assert writers(source, "core/jobs/feeder.py"), what
    not_writers = {
        "another column": "update(JobItem).where(JobItem.job_id.in_(old)).values(text=None, body=None)",
        "a birth": "insert(Delivery).values(id=i, status=DeliveryStatus.PENDING)",
        "a job's birth": "Job(id=uuid.uuid4(), status=JobStatus.VALIDATING)",
        "a status in WHERE": "text(\"UPDATE job_items SET text = NULL WHERE status = 'pending'\")",
        "self": "from models import Job\nself.status = 413",
    }
    for what, source in not_writers.items():
        assert not writers(source, "core/jobs/feeder.py"), what
    # The owner itself may.
    assert not writers(writers_before["job admitted"], "models/job_lifecycle.py")
