"""``sluice reserve``: book, list and cancel peak reservations (``models/reservation.py``)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import click

from core.broker.queues import ROLES
from launcher.options import service_settings
from models import Database
from models.reservation import ReservationError, book, cancel, current_views, now


class _When(click.ParamType):
    """An ISO 8601 time (UTC if it names no zone), ``now``, or ``+DURATION`` from now (``+30m``, ``+2h``)."""

    name = "TIME"
    _UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

    def convert(self, value, param, ctx) -> datetime:
        if isinstance(value, datetime):
            return value
        text = value.strip()
        if text == "now":
            return datetime.now(UTC)
        if text.startswith("+") and text[-1:] in self._UNITS:
            try:
                return datetime.now(UTC) + timedelta(seconds=float(text[1:-1]) * self._UNITS[text[-1]])
            except ValueError:
                self.fail(f"{value!r}: use +N followed by s, m, h or d", param, ctx)
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            self.fail(f"{value!r} is not an ISO 8601 time, 'now' or '+DURATION'", param, ctx)
        return when if when.tzinfo else when.replace(tzinfo=UTC)


@click.command()
@click.option("--from", "starts", type=_When(), help="Start of the window (ISO 8601, 'now', '+1h').")
@click.option("--until", "ends", type=_When(), help="End of the window (ISO 8601, '+2h').")
@click.option("--role", type=click.Choice(sorted(ROLES)), default=None,
              help="Only workers of this role pause their batch queues (default: every worker serving both classes).")
@click.option("--note", default=None, help="Why (shown in the load view).")
@click.option("--list", "listing", is_flag=True, help="List reservations in force or still to come.")
@click.option("--cancel", "cancel_id", default=None, metavar="ID", help="Cancel a reservation.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def reserve(starts, ends, role, note, listing, cancel_id, as_json) -> None:
    """Reserve capacity for realtime traffic ahead of a known peak: during the window, workers
    that serve both realtime and batch stop reading batch queues, and read them again after."""
    settings = service_settings()
    db = Database()
    db.configure(settings.sqlalchemy_url, pool_size=1, max_overflow=0)
    try:
        with db.session() as session:
            at = now(session)  # the database's clock, which the windows are compared with
            if listing:
                views = current_views(session)
            elif cancel_id:
                try:
                    views = [cancel(session, uuid.UUID(cancel_id)).view(at)]
                except ValueError as exc:
                    raise click.ClickException(str(exc) if isinstance(exc, ReservationError)
                                               else f"{cancel_id!r} is not a reservation id") from None
            else:
                if starts is None or ends is None:
                    raise click.UsageError("give --from and --until (or --list, or --cancel ID)")
                try:
                    views = [book(session, starts, ends, role, note, tuple(ROLES)).view(at)]
                except ReservationError as exc:
                    raise click.ClickException(str(exc)) from None
    finally:
        db.dispose()
    if as_json:
        click.echo(json.dumps(views if listing else views[0], indent=2))
        return
    if listing and not views:
        click.echo("no reservations in force or to come")
    for view in views:
        click.echo(f"{view['id']}  {view['state']:9}  {view['from']} → {view['until']}  "
                   f"role {view['role'] or 'all shared'}{'  ' + view['note'] if view['note'] else ''}")
