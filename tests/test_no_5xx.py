"""No query string and no header value gets a 5xx from any GET route.

Every GET route of the app (the public API, the OpenAI front, the admin API, the operator page
and its files, health and metrics), taken from ``app.url_map`` so a route added later is covered
too, with its path filled by random ids or text, asked with arbitrary query strings and header
values: text of any script, numbers past what ``int()`` parses, NUL, and the percent-escapes of
bytes that are no UTF-8 (a lone surrogate's encoding). Whatever the answer, it is not a 5xx: a
bad input is the client's (4xx, the error envelope), and an unexpected exception is a bug.
"""

from __future__ import annotations

import re
import uuid
from urllib.parse import quote

import pytest
from conftest import make_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.settings import Settings
from launcher.database import create_key
from web import create_app
from web.services import services

ADMIN_KEY = "an-admin-key-of-16+chars"
# Values the parsers of this app have tripped on, next to generated ones: digits that are not
# ASCII ("²" passes str.isdigit(), fails int()), numbers past int()'s 4,300 digits or float()'s
# range, NUL, JSON escapes of what Postgres cannot store.
NUMBERS = ["²", "١٠", "9" * 4400, "9" * 400, "0", "-1", "1e999", "nan", " 5 ", "5\n"]
AWKWARD = ["\x00", "a\x00b", "true", "null", "[]", "{}", '{"k": "\\u0000"}', '{"k": "\\ud800"}']
# Percent-escapes sent as they are: a NUL, a lone surrogate's UTF-8 form, bytes that are no UTF-8.
RAW_ESCAPES = ["%00", "%ED%A0%80", "%ED%BF%BF", "%FF%FE", "%C0%80", "%E2%82", "%25", "%"]
QUERY_NAMES = ["limit", "before", "after", "status", "request_id", "job_id", "model", "metadata", "wait", "stream"]
HEADER_NAMES = ["Prefer", "X-Request-Id", "Idempotency-Key", "Accept", "Accept-Encoding", "If-None-Match", "Range",
                "Content-Type", "Cookie", "Origin", "Last-Event-ID", "X-Forwarded-For", "Authorization"]
# Probes whose 503 is their answer (a dependency down, no warm worker yet), not a failure: they
# answer with their own document, never the error envelope.
PROBES = {"health.healthz", "health.readyz"}
# Header values that would not survive as one header line on the wire (werkzeug refuses them too).
_LINE_BREAKS = re.compile(r"[\r\n]")


@pytest.fixture(scope="module")
def served(database_url, redis_dbs):
    """An app with the admin routes and the operator page, and a tenant's key."""
    redis_url = redis_dbs()
    app = create_app(make_settings(database_url, redis_url, admin_key=ADMIN_KEY))
    key = create_key(Settings(database_url=database_url).sqlalchemy_url, f"tenant-{uuid.uuid4().hex[:10]}")
    yield app, key
    services(app).db.dispose()
    redis_dbs.release(redis_url)


def _get_rules(app) -> list:
    return sorted((rule for rule in app.url_map.iter_rules() if "GET" in rule.methods), key=lambda r: r.rule)


def _as_sent(text: str) -> str:
    """``text`` as a real server hands a header on: its UTF-8 bytes read as Latin-1 (WSGI's rule)."""
    return text.encode("utf-8", "surrogatepass").decode("latin-1")


numbers = st.sampled_from(NUMBERS) | st.integers(min_value=0, max_value=5000).map(lambda n: "9" * n)
texts = st.text(max_size=30) | st.sampled_from(AWKWARD)
query_values = ((numbers | texts).map(lambda text: quote(text, safe="")) | st.sampled_from(RAW_ESCAPES)
                | st.tuples(st.sampled_from(RAW_ESCAPES), st.text(max_size=10).map(quote)).map("".join))
query_strings = st.tuples(
    st.fixed_dictionaries({}, optional={name: query_values for name in QUERY_NAMES}),
    st.lists(st.tuples(st.text(min_size=1, max_size=8).map(lambda text: quote(text, safe="")), query_values),
             max_size=2),
).map(lambda drawn: "&".join(f"{name}={value}" for name, value in [*drawn[0].items(), *drawn[1]]))
header_values = (numbers | texts
                 | st.tuples(st.sampled_from(["wait=", "respond-async, wait=", "Bearer "]), numbers | texts).map(
                     "".join)
                 | st.sampled_from(["\ud800", "\udfff", "x\ud800y"])).map(_as_sent)
headers = st.dictionaries(st.sampled_from(HEADER_NAMES), header_values.filter(lambda v: not _LINE_BREAKS.search(v)),
                          max_size=4)
path_values = (st.uuids().map(str) | st.text(min_size=1, max_size=40).map(lambda text: quote(text, safe=""))
               | st.sampled_from([*RAW_ESCAPES, "dashboard.js", "x%00.js", "..", "9" * 4400, "%C2%B2"]))


def _assert_no_5xx(app, rule, path: str, query: str, headers: dict[str, str], key: str) -> None:
    admin = path.startswith(("/admin", "/v1/admin"))
    response = app.test_client().get(path, query_string=query,
                                      headers={"Authorization": f"Bearer {ADMIN_KEY if admin else key}", **headers})
    said = (path, query, headers, response.get_data(as_text=True)[:500])
    if rule.endpoint in PROBES and response.status_code == 503:
        assert "error" not in response.get_json(), said
    else:
        assert response.status_code < 500, said


def _filled(rule, value) -> str:
    """The rule's path with each of its parameters given ``value`` (or what ``value(name)`` says)."""
    path = rule.rule
    for name in sorted(rule.arguments):
        text = value(name) if callable(value) else value
        path = re.sub(rf"<(?:\w+:)?{name}>", lambda _, text=text: text, path)
    return path


@pytest.mark.parametrize("value", [*NUMBERS, *AWKWARD, *RAW_ESCAPES])
def test_every_get_route_meets_each_known_awkward_value(served, value):
    """Each value that tripped a parser once, in every query parameter, path parameter and header
    at once, on every GET route: the cases the random search below might not draw."""
    app, key = served
    escaped = value if value in RAW_ESCAPES else quote(value, safe="")
    query = "&".join(f"{name}={escaped}" for name in QUERY_NAMES)
    sent = {"Prefer": _as_sent(f"wait={value}"), **{name: _as_sent(value) for name in HEADER_NAMES
                                                     if name not in ("Prefer", "Authorization")}}
    sent = {name: text for name, text in sent.items() if not _LINE_BREAKS.search(text)}
    for rule in _get_rules(app):
        _assert_no_5xx(app, rule, _filled(rule, escaped), query, sent, key)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), query=query_strings, sent=headers)
def test_no_get_route_answers_5xx_to_any_query_or_header(served, data, query, sent):
    """Each example asks every GET route, so every route meets every value drawn."""
    app, key = served
    for rule in _get_rules(app):
        path = _filled(rule, lambda name, rule=rule: data.draw(path_values, label=f"{rule.endpoint}: {name}"))
        _assert_no_5xx(app, rule, path, query, sent, key)
