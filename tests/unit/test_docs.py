"""The README and docs/: every relative link lands, the README stays one screenful, the CLI reference is current,
and every page is reachable from the README.

Links are read from the markdown source outside code (fenced blocks and inline code spans are skipped); absolute
``http(s)`` links and ``mailto:`` are not checked (no network). An ``#anchor`` must be the GitHub-style slug of a
heading in the target file.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def links(path: Path) -> list[str]:
    """Every link target in the file's prose, inline code removed."""
    return [m.group(1) for line in prose_lines(path) for m in LINK.finditer(CODE_SPAN.sub("", line))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = CODE_SPAN.sub(lambda m: m.group(2), text).replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a file's headings produce (a repeated slug gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(
                f"{target}: no such file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved}"
            )
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading in {resolved.name} makes the anchor #{anchor}")
        elif anchor and resolved.suffix != ".md":
            broken.append(f"{target}: an anchor into a file that is not markdown")
    return broken


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_lands(path: Path) -> None:
    assert broken_links(path) == []


def test_readme_is_one_screenful_of_purpose() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move the depth into a page under docs/"


def _cli_reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current() -> None:
    generated = _cli_reference().render()
    assert (DOCS / "cli.md").read_text(encoding="utf-8") == generated, (
        "docs/cli.md is stale: run python docs/cli_reference.py"
    )


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    unlinked = [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert unlinked == [], f"docs pages the README does not link to: {unlinked}"


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Prove it: `bigbatch verify`", "prove-it-bigbatch-verify"),
        ("Install, with optional extras", "install-with-optional-extras"),
        ("bigbatch critical-batch", "bigbatch-critical-batch"),
        ("Many processes, many machines", "many-processes-many-machines"),
        ("The `--data` cache (v2)", "the---data-cache-v2"),
    ],
)
def test_slug_follows_github(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_a_dead_link_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](page.md#title) [gone](missing.md) [bad anchor](page.md#nowhere) [web](https://example.com)\n"
        "`[in code](missing.md)`\n\n```\n[fenced](missing.md)\n# not a heading\n```\n",
        encoding="utf-8",
    )
    assert anchors(page) == {"title"}
    assert [target.split(":")[0] for target in broken_links(page)] == ["missing.md", "page.md#nowhere"]


CONFIGURATION = DOCS / "configuration.md"
SHOWN_AS: dict[tuple[str, str], str] = {
    ("--out", "runs/<model>-<settings hash>"): "unset: the run directory is named from the settings when it starts",
    ("--name", "none"): "unset: report labels the run by its directory",
}
"""(flag, the table's default) -> why that words an unset (empty) default rather than spells it."""


def flag_table_rows() -> list[tuple[int, list[str], list[str]]]:
    """configuration.md's flag table: (line, its flags, its defaults), one default per flag (an empty cell: none
    set, for every flag of the row)."""
    rows = []
    in_table = False
    for number, line in enumerate(CONFIGURATION.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("| flag | default |"):
            in_table = True
            continue
        if in_table and not line.startswith("|"):
            break
        if not in_table or line.startswith("|---"):
            continue
        flag_cell, default_cell = re.split(r"(?<!\\)\|", line)[1:3]
        flags = re.findall(r"`(--[a-z][\w-]*)", flag_cell)
        defaults = [d.strip() for d in default_cell.split(",")] if default_cell.strip() else [""] * len(flags)
        rows.append((number, flags, defaults))
    return rows


def shows_default(flag: str, shown: str, default: object, auto: bool) -> bool:
    """Whether the table's ``shown`` default words the config field's ``default`` (``auto`` for an auto field's
    stored 0, on/off for a switch, ``off`` for a count whose 0 disables)."""
    text = shown.strip("`")
    if isinstance(default, bool):
        return text == ("on" if default else "off")
    if auto and default == 0:
        return text == "auto"
    if isinstance(default, (int, float)):
        if text == "off":
            return default == 0
        try:
            return float(text) == default
        except ValueError:
            return False
    if default == "":
        return text == "" or (flag, text) in SHOWN_AS
    return text == default


def test_the_flag_tables_defaults_are_the_configs() -> None:
    """Each default in configuration.md's flag table is what the config field behind the flag defaults to (the table
    is written by hand; this keeps its default column from drifting as a default changes, as the spike thresholds
    did)."""
    from bigbatch.cli import build_parser
    from bigbatch.run.configuration.train_config import SECTIONS, TrainConfig, field_of

    commands = _cli_reference()._commands(build_parser())
    dests = {flag: a.dest for a in commands["train"]._actions for flag in a.option_strings}
    config = TrainConfig()
    rows = flag_table_rows()
    assert len(rows) > 30, "configuration.md's flag table was not found"
    wrong = []
    for line, flags, defaults in rows:
        if len(flags) != len(defaults):
            wrong.append(f"configuration.md:{line}: {len(flags)} flags but {len(defaults)} defaults")
            continue
        for flag, shown in zip(flags, defaults, strict=True):
            if flag not in dests:
                wrong.append(f"configuration.md:{line}: train has no flag {flag}")
                continue
            section, name = dests[flag].split(".")
            default = getattr(getattr(config, section), name)
            auto = bool(field_of(SECTIONS[section], name).metadata.get("auto"))
            if not shows_default(flag, shown, default, auto):
                wrong.append(f"configuration.md:{line}: {flag} default {shown or '(empty)'}, but it is {default!r}")
    assert wrong == []


@pytest.mark.parametrize(
    ("flag", "shown", "default", "auto", "expected"),
    [
        ("--lr", "2e-3", 0.002, False, True),
        ("--loss-spike", "8", 12.0, False, False),
        ("--seq-len", "`auto`", 0, True, True),
        ("--replay-every", "off", 0, False, True),
        ("--overwrite", "off", False, False, True),
        ("--out", "`runs/<model>-<settings hash>`", "", False, True),
        ("--init-from", "", "", False, True),
        ("--data", "`builtin`", "builtin", False, True),
        ("--data", "`auto`", "builtin", False, False),
    ],
)
def test_shows_default_reads_the_tables_words(
    flag: str, shown: str, default: object, auto: bool, expected: bool
) -> None:
    assert shows_default(flag, shown, default, auto) is expected
