"""``sluice webhooks``: a tenant's webhook deliveries over the HTTP API: list, redeliver, rotate.

Like ``sluice jobs``, a client of a running Sluice (``--url``, SLUICE_URL) holding a tenant's key
(``--key``, SLUICE_API_KEY, else the demo key): a tenant sees and resends only its own
deliveries. The key is sent, never printed; the signing secret is printed once, when made.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

import click

from launcher.jobs_cli import Api, api_options

STATUSES = ("pending", "succeeded", "failed")


@click.group()
def webhooks() -> None:
    """Webhook deliveries of your requests and jobs, and your signing secret."""


def _line(delivery: dict[str, Any]) -> str:
    subject = f"request {delivery['request_id']}" if delivery["request_id"] else f"job {delivery['job_id']}"
    answer = delivery["last_error"] or (f"HTTP {delivery['last_status_code']}" if delivery["last_status_code"]
                                        else "-")
    when = f"next attempt {delivery['next_attempt_at']}" if delivery["next_attempt_at"] else \
        f"finished {delivery['finished_at']}"
    return (f"{delivery['id']}  {delivery['event']:<17} {delivery['status']:<9} attempts {delivery['attempts']:<3} "
            f"{subject}  last: {answer}  {when}")


@webhooks.command("list")
@click.option("--request", "request_id", help="Only this request's deliveries.")
@click.option("--job", "job_id", help="Only this job's deliveries.")
@click.option("--status", type=click.Choice(STATUSES), help="Only deliveries in this status.")
@click.option("--limit", type=click.IntRange(1, 100), default=20, show_default=True, help="Newest this many.")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@api_options
def list_(api: Api, request_id: str | None, job_id: str | None, status: str | None, limit: int,
          as_json: bool) -> None:
    """Your webhook deliveries, newest first: status, attempts, the receiver's last answer."""
    query = {k: v for k, v in (("request_id", request_id), ("job_id", job_id), ("status", status)) if v}
    page = api.json("GET", f"/v1/webhooks/deliveries?{urlencode({**query, 'limit': limit})}")
    if as_json:
        click.echo(json.dumps(page, indent=2))
        return
    for delivery in page["data"]:
        click.echo(_line(delivery))
    if not page["data"]:
        click.echo("no deliveries", err=True)


@webhooks.command()
@click.argument("delivery_id")
@api_options
def redeliver(api: Api, delivery_id: str) -> None:
    """Send a delivery again now (same webhook-id and body), retried as a new one would be."""
    click.echo(_line(api.json("POST", f"/v1/webhooks/deliveries/{delivery_id}/redeliver")))


@webhooks.command("rotate-secret")
@api_options
def rotate_secret(api: Api) -> None:
    """Make a new signing secret (your first, or the next) and print it: it is never shown again."""
    answer = api.json("POST", "/v1/webhooks/secret/rotate")
    click.echo(answer["secret"])
    until = answer["previous_valid_until"]
    click.echo(f"The previous secret also signs until {until}." if until else
               "Verify deliveries with it (Standard Webhooks, e.g. standardwebhooks.Webhook(secret).verify).",
               err=True)
