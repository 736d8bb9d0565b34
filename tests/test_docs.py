"""The README is the front door and docs/ holds the reference: both must stay true to the code.

Checked here, without any service running: the configuration table matches the settings; the
README is short, has a table of contents, and links every page of docs/; every relative link and
#anchor in the README and docs/ resolves; every `sluice` command, flag and literal choice shown
in a code block (or as a whole inline `sluice …` span) exists in the click CLI; every `make`
target named exists in the Makefile.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from functools import cache
from pathlib import Path

import click
import pytest

from core.settings import Settings
from launcher.cli import main as sluice_cli

ROOT = Path(__file__).resolve().parent.parent
README_PATH = ROOT / "README.md"
README = README_PATH.read_text()
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCS = [README_PATH, *DOC_PAGES]
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split_fences(text: str) -> tuple[list[str], list[list[str]]]:
    """(the lines outside fenced code blocks, the code blocks as lists of lines)."""
    prose, blocks, block = [], [], None
    for line in text.splitlines():
        if FENCE.match(line):
            if block is None:
                block = []
            else:
                blocks.append(block)
                block = None
            continue
        (prose if block is None else block).append(line)
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading.strip())
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = "".join(c for c in text
                   if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file, duplicates numbered as GitHub does (-1, -2, …)."""
    prose, _ = split_fences(path.read_text())
    seen: dict[str, int] = {}
    found = set()
    for line in prose:
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def links(path: Path) -> list[str]:
    """The link targets of a Markdown file, outside code blocks and inline code."""
    prose, _ = split_fences(path.read_text())
    text = INLINE_CODE.sub("", "\n".join(prose))
    return LINK.findall(text)


def relative_links(path: Path) -> list[str]:
    return [t for t in links(path) if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


# --- the configuration table -------------------------------------------------------------------

def test_every_setting_is_documented_with_its_default():
    for env, default, help_text in Settings.describe():
        shown_default = f"`{default}`" if default else "—"
        assert f"| `{env}` | {shown_default} | {help_text} |" in CONFIGURATION, env


def test_the_configuration_table_is_where_make_docs_writes_it():
    assert re.search(r"<!-- config-table[^>]*-->\n.*\n<!-- /config-table -->", CONFIGURATION, re.S)
    recipe = re.search(r"^docs:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe and "docs/configuration.md" in recipe.group(1)


# --- the README as a front door ----------------------------------------------------------------

def test_readme_names_the_two_front_door_commands():
    assert "make up" in README and "make test" in README


def test_readme_is_short():
    lines = len(README.splitlines())
    assert lines <= 250, f"README.md has {lines} lines; move reference to docs/"


def test_readme_has_a_table_of_contents_that_resolves():
    prose, _ = split_fences(README)
    start = next(i for i, line in enumerate(prose) if re.match(r"^##\s+(Contents|Table of contents)\s*$", line))
    entries = []
    for line in prose[start + 1:]:
        if line.startswith("#"):
            break
        entries += re.findall(r"\]\(#([^)]+)\)", line)
    assert entries, "the table of contents lists nothing"
    own = anchors(README_PATH)
    unresolved = [a for a in entries if a not in own]
    assert not unresolved, f"table of contents entries with no heading: {unresolved}"
    sections = [slug(line[3:]) for line in prose if line.startswith("## ")]
    missing = [s for s in sections if s not in entries and s not in ("contents", "table-of-contents")]
    assert not missing, f"sections missing from the table of contents: {missing}"


def test_readme_links_every_docs_page():
    linked = {(README_PATH.parent / t.split("#")[0]).resolve() for t in relative_links(README_PATH)}
    unlinked = [rel(p) for p in DOC_PAGES if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_relative_links_resolve(path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {rel(dest)}")
    assert not broken, "\n".join(broken)


# --- the commands the docs show ----------------------------------------------------------------

ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")
SLUICE = re.compile(r"^(?:\./)?(?:\.venv/bin/|\$\(BIN\)/)?sluice$")


def command_lines(block: list[str]) -> list[str]:
    """A code block's lines, continuations (trailing backslash) joined, prompts stripped."""
    joined, pending = [], ""
    for line in block:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    if pending:
        joined.append(pending)
    return [re.sub(r"^\s*[$>]\s+", "", line).strip() for line in joined]


def sluice_words(line: str) -> list[str] | None:
    """The argv after `sluice` if LINE runs the sluice CLI (env assignments first allowed), else None."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in an example's text
        words = line.split("#")[0].split()
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    return words[1:] if words and SLUICE.match(words[0]) else None


def sluice_invocations() -> list[tuple[str, str, list[str]]]:
    """(file, line, argv after `sluice`) for every code-block line that runs the sluice CLI, and
    every inline code span that is a whole `sluice …` command."""
    found = []
    for path in DOCS:
        prose, blocks = split_fences(path.read_text())
        lines = [line for block in blocks for line in command_lines(block)]
        lines += [code.strip() for _, code in INLINE_CODE.findall("\n".join(prose))
                  if re.match(r"^(?:\.venv/bin/)?sluice\s", code.strip())]
        for line in lines:
            argv = sluice_words(line)
            if argv is not None:
                found.append((rel(path), line, argv))
    return found


def cli_problems(argv: list[str]) -> list[str]:
    """What in `sluice ARGV` the click CLI does not have: an unknown command, option or choice.

    A command word written as alternatives (`tenants create/update/list`) must exist for each. A
    choice is checked only when the value is a literal in lower case (`--role batch`), not a
    placeholder (`--role R`, `<id>`)."""
    command: click.Command = sluice_cli
    path = ["sluice"]
    problems = []
    skip = False  # the word after an option that takes a value is that value
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        if isinstance(command, click.Group) and not word.startswith("-"):
            names = word.split("/")
            unknown = [n for n in names if n not in command.commands]
            if unknown:
                return [f"`{' '.join(path)}` has no command {n!r}" for n in unknown]
            command, path = command.commands[names[0]], [*path, names[0]]
            continue
        if not word.startswith("--"):
            continue
        option, _, value = word.partition("=")
        params = {o: p for p in command.params for o in (*p.opts, *p.secondary_opts)}
        if option == "--help":
            continue
        if option not in params:
            problems.append(f"`{' '.join(path)}` has no option {option}")
            continue
        choices = getattr(params[option].type, "choices", None)
        skip = not value and not params[option].is_flag and not params[option].count
        value = value or (argv[i + 1] if i + 1 < len(argv) else "")
        if choices and re.fullmatch(r"[a-z][a-z0-9_-]*", value) and value not in choices:
            problems.append(f"`{' '.join(path)} {option}` takes {'/'.join(choices)}, not {value!r}")
    if isinstance(command, click.Group) and command is not sluice_cli:
        problems.append(f"`{' '.join(path)}` needs a subcommand")
    return problems


def test_the_docs_show_sluice_commands():
    assert len(sluice_invocations()) >= 10, "the parser finds no sluice command lines: is it broken?"


def test_every_sluice_command_and_flag_shown_exists():
    wrong = [f"{where}: {line!r}: {problem}"
             for where, line, argv in sluice_invocations()
             for problem in cli_problems(argv)]
    assert not wrong, "\n".join(wrong)


def test_the_cli_check_catches_what_does_not_exist():
    assert cli_problems(["diagnose", "--window", "60"]) == []
    assert cli_problems(["tenants", "update", "acme", "--batch-weight=3"]) == []
    assert cli_problems(["diagnose", "--no-such-flag"])
    assert cli_problems(["tenants", "rename", "acme"])
    assert cli_problems(["keys"])
    assert cli_problems(["tenants", "create/rename", "acme"])
    assert cli_problems(["worker", "--role", "gpu"])
    assert cli_problems(["worker", "--role", "R"]) == []
    assert sluice_words("$(BIN)/sluice up --smoke") == ["up", "--smoke"]
    assert sluice_words("SLUICE_SIM_SPEED=0.1 .venv/bin/sluice up  # comment") == ["up"]
    assert sluice_words("curl -s localhost:8000/readyz  # not sluice up") is None


def test_github_anchors():
    assert slug("Why is it slow? `sluice diagnose`") == "why-is-it-slow-sluice-diagnose"
    assert slug("Benchmarks (`bench/`, run by hand, never in CI)") == "benchmarks-bench-run-by-hand-never-in-ci"
    assert slug("Start here: two commands") == "start-here-two-commands"


def make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-/$()% ]+?)\s*::?(?!=)", line)
        if m and not line.startswith("\t"):
            targets.update(m.group(1).split())
    return targets


def test_every_make_target_named_exists():
    named = set()
    for path in DOCS:
        prose, blocks = split_fences(path.read_text())
        for _, code in INLINE_CODE.findall("\n".join(prose)):
            named.update(re.findall(r"^make\s+([A-Za-z0-9_.-]+)", code.strip()))
        for block in blocks:
            for line in command_lines(block):
                named.update(re.findall(r"^make\s+([A-Za-z0-9_.-]+)", line))
    assert {"up", "test"} <= named
    unknown = sorted(named - make_targets())
    assert not unknown, f"make targets the Makefile does not have: {unknown}"
