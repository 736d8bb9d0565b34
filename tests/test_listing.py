"""GET /v1/requests: a tenant's requests, newest first, filtered, a page at a time, each query
served by an index (issue 22)."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import event

from core.submit.listing import RequestFilter, list_requests
from core.tenants.scopes import Caller
from models import Priority, Status
from web.services import services

pytestmark = pytest.mark.usefixtures("worker")


def listed(client, **query) -> dict:
    answer = client.http.get("/v1/requests", query_string=query, headers=client.headers)
    assert answer.status_code == 200, answer.get_json()
    return answer.get_json()


def test_requests_are_listed_newest_first_a_page_at_a_time(client, new_client):
    ids = [client.submit(prompt=f"list {i}", max_tokens=2, metadata={"batch": "a" if i % 2 else "b"})
           .get_json()["id"] for i in range(7)]
    other = new_client()
    other.submit(prompt="not yours", max_tokens=2)
    seen, before = [], None
    while True:
        page = listed(client, limit=3, **({"before": before} if before else {}))
        seen += [view["id"] for view in page["data"]]
        assert len(page["data"]) <= 3
        if not page["has_more"]:
            assert page["next_before"] is None
            break
        before = page["next_before"]
    assert seen == ids[::-1]  # newest first, every one once, none of another tenant's
    assert [v["id"] for v in listed(client, **{"metadata[batch]": "a"})["data"]] == ids[1::2][::-1]


def test_filters_narrow_the_list(client):
    began = datetime.now(UTC)
    time.sleep(0.01)
    realtime = client.submit(prompt="rt", max_tokens=2).get_json()["id"]
    batch = client.submit(prompt="bt", max_tokens=2, priority="batch").get_json()["id"]
    client.wait(realtime)
    cancelled = client.submit(prompt="c", max_tokens=2000, priority="batch", deadline_s=600).get_json()["id"]
    client.cancel(cancelled)
    assert [v["id"] for v in listed(client, priority="realtime")["data"]] == [realtime]
    assert {v["id"] for v in listed(client, status="cancelled")["data"]} <= {cancelled}
    assert realtime in {v["id"] for v in listed(client, status="succeeded,cancelled,failed")["data"]}
    assert len(listed(client, since=began.isoformat())["data"]) == 3
    assert listed(client, until=began.isoformat())["data"] == []
    assert len(listed(client, since=str(began.timestamp()), model="simulated-llama-8b")["data"]) == 3
    assert listed(client, model="no-such-model")["data"] == []
    assert batch in {v["id"] for v in listed(client, priority="batch")["data"]}


def test_bad_filters_and_cursors_are_refused_by_name(client, new_client):
    answer = client.http.get("/v1/requests", query_string={"status": "done", "priority": "x", "since": "yesterday",
                                                           "limit": "0"}, headers=client.headers)
    assert answer.status_code == 422
    details = client.http.get("/v1/requests", query_string={"status": "done", "priority": "x", "since": "y"},
                              headers=client.headers).get_json()["error"]["details"]
    assert set(details) == {"status", "priority", "since"}
    theirs = new_client().submit(prompt="p", max_tokens=2).get_json()["id"]
    for cursor in (theirs, str(uuid.uuid4()), "not-an-id"):
        refused = client.http.get("/v1/requests", query_string={"before": cursor}, headers=client.headers)
        assert refused.status_code == 404 and refused.get_json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("where", [
    RequestFilter(), RequestFilter(statuses=(Status.QUEUED, Status.RUNNING)), RequestFilter(metadata={"k": "v"}),
    RequestFilter(priority=Priority.BATCH, model="m"), RequestFilter(since=datetime(2026, 1, 1, tzinfo=UTC)),
])
def test_each_list_query_can_be_served_by_an_index(app, tenant_id, where):
    """With sequential scans priced out (a table of a few thousand test rows is cheaper to read
    whole), the planner finds an index path for every filter: the list never needs a table scan.
    The plan is asked for on the list's own connection, with its own parameters."""
    db, plans = services(app).db, []

    def explain(conn, cursor, statement, parameters, context, executemany):
        if "FROM requests" in statement and statement.lstrip().upper().startswith("SELECT"):
            cursor.execute("SET enable_seqscan = off")
            cursor.execute("EXPLAIN " + statement, parameters)
            plans.append("\n".join(row[0] for row in cursor.fetchall()))
            cursor.execute("RESET enable_seqscan")

    event.listen(db.engine, "before_cursor_execute", explain)
    try:
        list_requests(db, Caller(tenant_id), 21, None, where)
    finally:
        event.remove(db.engine, "before_cursor_execute", explain)
    assert plans and all("Seq Scan" not in plan and "Index" in plan for plan in plans), plans
