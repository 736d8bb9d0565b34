"""``sluice jobs``: bulk jobs over the HTTP API: submit a JSONL file, follow it, fetch its results.

A client of a running Sluice (``--url``, SLUICE_URL) holding a tenant's key (``--key``,
SLUICE_API_KEY, else the demo key ``sluice up`` saved in its data folder). The file goes from
disk into the request body and results go from the response onto disk, a block at a time:
neither is ever held whole. The key is sent, never printed.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any
from urllib.parse import SplitResult, urlencode, urlsplit

import click

from launcher.options import load_settings, read_platform_file
from models.job import JobStatus

DEFAULT_URL = "http://127.0.0.1:8000"
TERMINAL = frozenset(status.value for status in JobStatus if status.terminal)
TIMEOUT_S = 30.0
# The reply to an upload comes once every line is read, checked and committed: a big file takes a while.
SUBMIT_TIMEOUT_S = 600.0
BLOCK = 1 << 16
REFRESH_S = 1.0
UNREACHABLE_GRACE_S = 120.0  # --wait rides out a web restart this long
SHOWN_LINES = 10  # bad lines a refusal prints

# The job's query parameters and the submit flags that set them, for error messages.
FLAGS = {"model": "--model", "summary_tokens": "--summary-tokens", "instruction": "--instruction",
         "priority": "--priority", "service_tier": "--service-tier", "completion_window": "--window",
         "on_invalid": "--skip-invalid"}


class Unreachable(click.ClickException):
    def __init__(self, url: str, exc: OSError | http.client.HTTPException) -> None:
        reason = "connection refused" if isinstance(exc, ConnectionRefusedError) else (
            getattr(exc, "strerror", None) or f"{type(exc).__name__} {exc}".strip())
        super().__init__(f"cannot reach Sluice at {url}: {reason}. Is it running? Start it with `sluice up`, "
                         "or point --url (SLUICE_URL) at it.")


class Api:
    """The jobs API at ``url`` as the tenant of ``key`` sees it; ``key_from`` says where the key came from."""

    def __init__(self, url: str, key: str, key_from: str) -> None:
        self.parts: SplitResult = urlsplit(url)
        if self.parts.scheme not in ("http", "https") or not self.parts.hostname:
            raise click.BadParameter(f"{url!r} is not an http(s) URL", param_hint="--url")
        self.url = url.rstrip("/")
        self.key, self.key_from = key, key_from

    def open(self, method: str, path: str, body: IO[bytes] | None = None, headers: dict[str, str] | None = None,
             timeout: float = TIMEOUT_S) -> http.client.HTTPResponse:
        """The reply to one call, its body unread; an error reply raises its message."""
        kind = http.client.HTTPSConnection if self.parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(self.parts.hostname, self.parts.port, timeout=timeout, blocksize=BLOCK)
        try:
            try:
                conn.request(method, self.parts.path.rstrip("/") + path, body=body,
                             headers={"Authorization": f"Bearer {self.key}", **(headers or {})})
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered before it read the whole body (a refusal): read that answer
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise Unreachable(self.url, exc) from None
        if response.status >= 400:
            raise self._refusal(response)
        return response

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        with self.open(method, path, **kwargs) as response:
            return json.loads(response.read())

    def _refusal(self, response: http.client.HTTPResponse) -> click.ClickException:
        """The error envelope's message, with what its details show (bad lines, bad parameters)."""
        with response:
            try:
                error = json.loads(response.read())["error"]
                message, details = error["message"], error.get("details")
            except (ValueError, KeyError, TypeError, OSError, http.client.HTTPException):
                message, details = f"HTTP {response.status} {response.reason}", None
        if response.status == 401:
            message = f"the API key was refused: {message} (the key came from {self.key_from})"
        return click.ClickException("\n".join([message, *_detail_lines(details)]))

    def download(self, path: str, dest: Path | None) -> int:
        """Stream a JSONL reply into ``dest`` (stdout when None); the number of lines. A file is
        written beside ``dest`` and renamed into place, so a broken download leaves no half file."""
        part = dest.with_name(dest.name + ".part") if dest else None
        lines, whole = 0, False
        with self.open("GET", path, timeout=60) as response:
            out = part.open("wb") if part else sys.stdout.buffer
            try:
                while block := response.read(BLOCK):
                    out.write(block)
                    lines += block.count(b"\n")
                whole = True
            except BrokenPipeError:  # only stdout's pipe breaks
                # stdout's reader went away (`| head`): stop quietly, and keep Python's own flush at exit quiet too.
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                raise click.exceptions.Exit(0) from None
            except (OSError, http.client.HTTPException) as exc:
                raise click.ClickException(f"the download from {self.url}{path} broke off: {exc}") from None
            finally:
                if part:
                    out.close()
                    if not whole:
                        part.unlink(missing_ok=True)
                else:
                    out.flush()
        if part:
            os.replace(part, dest)
        return lines


def _detail_lines(details: Any) -> list[str]:
    """What a refusal's details add to its message: the first bad lines, or each bad parameter."""
    if isinstance(details, dict) and isinstance(details.get("lines"), list):
        shown = [f"  line {e['line']}: {e['code']}: {e['message']}" for e in details["lines"][:SHOWN_LINES]]
        more = details.get("invalid_lines", len(details["lines"])) - len(shown)
        return shown + ([f"  (and {more} more)"] if more > 0 else [])
    if isinstance(details, dict) and all(isinstance(v, list) for v in details.values()):
        return [f"  {FLAGS.get(name, name)}: {' '.join(map(str, problems))}" for name, problems in details.items()]
    return []


def _platform_url(data_dir: Path) -> str:
    """The API address of the `sluice up` running on the data folder (its platform file), else the default."""
    found = read_platform_file(data_dir, warn=False)
    return (found or {}).get("api_url") or DEFAULT_URL


def _key(key: str | None, data_dir: Path) -> tuple[str, str]:
    if key:
        return key, "--key / SLUICE_API_KEY"
    path = data_dir.resolve() / "demo-key"
    try:
        return path.read_text().strip(), str(path)
    except OSError:
        raise click.ClickException(f"no API key: pass --key, set SLUICE_API_KEY, or run `sluice up` here, which saves "
                               f"a demo key in {path}") from None


def api_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Adds --url and --key; the command gets the ``Api`` as its first argument."""

    @click.option("--url", envvar="SLUICE_URL", show_envvar=True,
                  help=f"Where Sluice's API listens (default: the API of the `sluice up` running on the data "
                       f"folder, else {DEFAULT_URL}).")
    @click.option("--key", envvar="SLUICE_API_KEY", show_envvar=True,
                  help="API key (default: the demo key `sluice up` saved). Prefer the variable: "
                       "a key on the command line shows in `ps`.")
    @functools.wraps(command)
    def run(url: str | None, key: str | None, **kwargs: Any) -> Any:
        data_dir = Path(load_settings().data_dir)
        return command(Api(url or _platform_url(data_dir), *_key(key, data_dir)), **kwargs)

    return run


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def progress(view: dict[str, Any], width: int = 24) -> str:
    counts, done = view["counts"], view["done"]
    total = counts["total"]
    filled = width * done // total if total else 0
    parts = [f"{view['status']:<11} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}",
             f"{view['rate_items_per_s']:.1f} items/s"]
    if view["eta_s"] is not None:
        parts.append(f"ETA {_duration(view['eta_s'])}")
    if counts["failed"]:
        parts.append(f"{counts['failed']} failed")
    return "  ".join(parts)


def follow(api: Api, job_id: str) -> dict[str, Any]:
    """Draw the job's progress on stderr about once a second until it ends; its last view.
    Ctrl-C stops waiting (the job goes on) and exits 130."""
    tty = sys.stderr.isatty()
    shown: tuple | None = None
    lost_at: float | None = None
    try:
        while True:
            try:
                view = api.json("GET", f"/v1/jobs/{job_id}")
                lost_at, line = None, progress(view)
                key: tuple = (view["status"], view["done"], view["counts"]["failed"])
            except Unreachable:
                lost_at = lost_at or time.monotonic()
                if time.monotonic() - lost_at > UNREACHABLE_GRACE_S:
                    raise
                view, line, key = None, f"cannot reach {api.url}; retrying", ("lost",)
            if tty:
                click.echo("\r\033[K" + line, err=True, nl=False)
            elif key != shown:  # a log gets a line when something moved, not one a second
                click.echo(line, err=True)
            shown = key
            if view is not None and view["status"] in TERMINAL:
                if tty:
                    click.echo(err=True)
                return view
            time.sleep(REFRESH_S)
    except KeyboardInterrupt:
        click.echo(f"\nStopped waiting; job {job_id} goes on. Follow it with `sluice jobs status {job_id} --wait`, "
                   f"fetch its results with `sluice jobs results {job_id}`.", err=True)
        raise click.exceptions.Exit(130) from None


def _ended(view: dict[str, Any]) -> None:
    """Exit non-zero unless the job completed."""
    if view["status"] != JobStatus.COMPLETED:
        error = view["error"]
        click.echo(f"job {view['id']} {view['status']}" + (f": {error['message']}" if error else ""), err=True)
        raise click.exceptions.Exit(1)


@click.group()
def jobs() -> None:
    """Bulk jobs: a JSONL file of documents or requests, run as capacity allows."""


@jobs.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", help="Model to run (default: the server's main model).")
@click.option("--summary-tokens", type=click.IntRange(min=1), help="Length of each document's summary.")
@click.option("--instruction", help="What to do with each document (default: summarise it).")
@click.option("--priority", type=click.Choice(["batch", "realtime"]), help="Queue class (default: batch).")
@click.option("--service-tier", "service_tier", type=click.Choice(["priority", "default", "flex", "batch"]),
              help="Its lines' service tier, their place in line and price (default: the class's plain tier; "
                   "docs/tiers.md).")
@click.option("--window", help="Completion window, e.g. 24h, 90m or 3600 (seconds).")
@click.option("--skip-invalid", is_flag=True, help="Run the valid lines and list the bad ones, instead of "
                                                     "refusing the file.")
@click.option("--wait", is_flag=True, help="Show progress until the job ends, then save its results.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path),
              help="With --wait: where the results go (default: FILE's stem + .results.jsonl, beside it).")
@click.option("--errors", "errors_path", type=click.Path(dir_okay=False, path_type=Path),
              help="With --wait: where bad lines and failed items go (default: FILE's stem + .errors.jsonl).")
@api_options
def submit(api: Api, file: Path, model: str | None, summary_tokens: int | None, instruction: str | None,
           priority: str | None, service_tier: str | None, window: str | None, skip_invalid: bool, wait: bool,
           output: Path | None, errors_path: Path | None) -> None:
    """Submit FILE (JSONL, one document or request per line) as a job and print its id."""
    if (output or errors_path) and not wait:
        raise click.UsageError("--output and --errors go with --wait; without it use `sluice jobs results`")
    params = {"model": model, "summary_tokens": summary_tokens, "instruction": instruction, "priority": priority,
              "service_tier": service_tier, "completion_window": window, "on_invalid": "skip" if skip_invalid else None}
    query = urlencode({name: value for name, value in params.items() if value is not None})
    with file.open("rb") as body:
        size = os.fstat(body.fileno()).st_size
        job = api.json("POST", "/v1/jobs" + (f"?{query}" if query else ""), body=body, timeout=SUBMIT_TIMEOUT_S,
                       headers={"Content-Type": "application/jsonl", "Content-Length": str(size)})
    click.echo(job["id"])
    counts = job["counts"]
    click.echo(f"{counts['total']} items" + (f"; {counts['invalid']} invalid lines skipped (see the errors)"
                                              if counts["invalid"] else "")
               + (f"; estimated to finish by {job['estimated_finish_at'][:19]}" if job.get("estimated_finish_at")
                  else ""), err=True)
    if not wait:
        return
    view = follow(api, job["id"])
    output = output or file.with_name(f"{file.stem}.results.jsonl")
    path = f"/v1/jobs/{job['id']}"
    saved = [f"{api.download(path + '/results', output)} results in {output}"]
    if view["counts"]["invalid"] or view["counts"]["failed"]:
        errors_path = errors_path or file.with_name(f"{file.stem}.errors.jsonl")
        saved.append(f"{api.download(path + '/errors', errors_path)} errors in {errors_path}")
    click.echo(f"{view['status']}: " + "; ".join(saved), err=True)
    _ended(view)


@jobs.command("list")
@click.option("--limit", type=click.IntRange(1, 100), default=20, show_default=True, help="Newest this many.")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@api_options
def list_(api: Api, limit: int, as_json: bool) -> None:
    """List your jobs, newest first."""
    views = api.json("GET", f"/v1/jobs?limit={limit}")["data"]
    if as_json:
        click.echo(json.dumps(views, indent=2))
        return
    for view in views:
        finish = view.get("estimated_finish_at")
        click.echo(f"{view['id']}  {view['status']:<11} {view['done']:>8}/{view['counts']['total']:<8} "
                   f"{view['created_at'][:19]}  {view['model']}"
                   + (f"  finishes ~{finish[:19]}" if finish and view["status"] not in TERMINAL else ""))
    if not views:
        click.echo("no jobs", err=True)


@jobs.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@click.option("--wait", is_flag=True, help="Show progress until the job ends; exit 0 only if it completed.")
@api_options
def status(api: Api, job_id: str, as_json: bool, wait: bool) -> None:
    """Show a job's status, counts, tokens and rate."""
    view = follow(api, job_id) if wait else api.json("GET", f"/v1/jobs/{job_id}")
    if as_json:
        click.echo(json.dumps(view, indent=2))
    else:
        c = view["counts"]
        click.echo(f"{view['id']}  {view['status']}  {view['model']} ({view['priority']})\n"
                   f"  items    {view['done']}/{c['total']} done: {c['succeeded']} succeeded, {c['failed']} failed, "
                   f"{c['cancelled']} cancelled, {c['expired']} expired; {c['running']} running, "
                   f"{c['pending']} pending" + (f"; {c['invalid']} invalid lines" if c["invalid"] else "") + "\n"
                   f"  tokens   {view['tokens']['input']} in, {view['tokens']['output']} out\n"
                   f"  created  {view['created_at']}" + (f", finished {view['finished_at']}"
                                                         if view["finished_at"] else ""))
        if view["status"] not in TERMINAL:
            click.echo(f"  rate     {view['rate_items_per_s']:.1f} items/s"
                       + (f", ETA {_duration(view['eta_s'])}" if view["eta_s"] is not None else ""))
        if view["error"]:
            click.echo(f"  error    {view['error']['code']}: {view['error']['message']}")
    if wait:
        _ended(view)


@jobs.command()
@click.argument("job_id")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), help="Write here (default: stdout).")
@click.option("--errors", is_flag=True, help="The bad lines and failed items instead of the results.")
@api_options
def results(api: Api, job_id: str, output: Path | None, errors: bool) -> None:
    """Fetch a job's results (JSONL, in input order); partial while it runs."""
    view = api.json("GET", f"/v1/jobs/{job_id}")
    lines = api.download(f"/v1/jobs/{job_id}/{'errors' if errors else 'results'}", output)
    if view["status"] not in TERMINAL:
        click.echo(f"job is {view['status']}: these are the {lines} lines so far", err=True)
    elif output:
        click.echo(f"{lines} lines in {output}", err=True)


@jobs.command()
@click.argument("job_id")
@api_options
def cancel(api: Api, job_id: str) -> None:
    """Cancel a job: nothing more runs; what finished is kept."""
    view = api.json("POST", f"/v1/jobs/{job_id}/cancel")
    click.echo(f"{view['id']}  {view['status']}: {view['counts']['succeeded']} results kept, "
               f"{view['counts']['cancelled']} items cancelled")
